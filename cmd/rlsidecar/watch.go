package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
)

// watchConfig calls onChange, debounced, whenever the rules file at path may have
// changed, until ctx ends. It watches directories, not the file: editors and Kubernetes
// ConfigMaps replace files by rename and symlink swap, which a watch on the file itself
// would lose after the first change. The directories are the file's, and those of every
// symlink on the way to what it names (etc/rules.yaml -> /srv/rules/rules.yaml: /srv/rules
// too), found again after each change, since a change may point a link elsewhere; for
// --config DIR, the directory and the targets of its *.yaml links.
func watchConfig(ctx context.Context, path string, debounce time.Duration, onChange func(), onErr func(error)) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watching %s: %w", path, err)
	}
	var watched, names []string
	// rewatch watches the directories path now depends on, and stops watching the
	// others; it returns the first directory it could not watch.
	rewatch := func() error {
		var want []string
		want, names = configDirs(path)
		for _, d := range watched {
			if !slices.Contains(want, d) {
				w.Remove(d)
			}
		}
		var first error
		next := watched[:0:0]
		for _, d := range want {
			if slices.Contains(watched, d) {
				next = append(next, d)
				continue
			}
			if err := w.Add(d); err != nil {
				if first == nil {
					first = fmt.Errorf("watching %s: %w", d, err)
				}
				continue
			}
			next = append(next, d)
		}
		watched = next
		return first
	}
	if err := rewatch(); err != nil {
		if own, _ := configDirs(path); !slices.Contains(watched, own[0]) {
			w.Close()
			return err
		}
		onErr(err) // a link's target directory: the file's own is watched
	}
	go func() {
		defer w.Close()
		var timer *time.Timer
		var fire <-chan time.Time
		for {
			select {
			case <-ctx.Done():
				if timer != nil {
					timer.Stop()
				}
				return
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				if ev.Op == fsnotify.Chmod || !relevant(filepath.Clean(ev.Name), path, names) {
					continue // another file of a watched directory: the daemon's own log, say
				}
				if timer == nil {
					timer = time.NewTimer(debounce)
				} else {
					timer.Reset(debounce)
				}
				fire = timer.C
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				onErr(err)
			case <-fire:
				fire = nil
				if err := rewatch(); err != nil {
					onErr(err)
				}
				onChange()
			}
		}
	}()
	return nil
}

// relevant reports whether a change to name, in a watched directory, may change the
// rules at path: name is on the way from path to the rules (the file, a link, a link's
// target, or a directory on the way, as a ConfigMap's ..data), or, for --config DIR, one
// of its *.yaml. Any other file of those directories (a log the daemon writes beside its
// rules, an editor's swap file) is not: reloading on it wasted a parse, and a log of
// reload errors in the rules' directory reloaded itself forever.
func relevant(name, path string, names []string) bool {
	for _, n := range names {
		if name == n || strings.HasPrefix(n, name+string(filepath.Separator)) {
			return true
		}
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return filepath.Dir(name) == filepath.Clean(path) && filepath.Ext(name) == ".yaml"
	}
	return false
}

// configDirs returns the directories the rules at path depend on: path's own (path
// itself for a directory), and the directory of each symlink's target on the way from
// path, or from a directory's *.yaml, to a file; the directory a link chain ends in, its
// parents' links resolved, too. Missing files are skipped: the next change finds them.
// names are the paths on the way: path (or each *.yaml), every link and target.
func configDirs(path string) (dirs, names []string) {
	add := func(d string) {
		if d = filepath.Clean(d); !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	name := func(p string) {
		if p = filepath.Clean(p); !slices.Contains(names, p) {
			names = append(names, p)
		}
	}
	follow := func(p string) {
		name(p)
		for range 40 { // the kernel's own bound on a chain of links
			fi, err := os.Lstat(p)
			if err != nil || fi.Mode()&os.ModeSymlink == 0 {
				break
			}
			t, err := os.Readlink(p)
			if err != nil {
				break
			}
			if !filepath.IsAbs(t) {
				t = filepath.Join(filepath.Dir(p), t)
			}
			add(filepath.Dir(t))
			name(t)
			p = t
		}
		if real, err := filepath.EvalSymlinks(p); err == nil {
			add(filepath.Dir(real))
			name(real)
		}
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		add(path) // --config DIR: its files come and go
		files, _ := filepath.Glob(filepath.Join(path, "*.yaml"))
		for _, f := range files {
			follow(f)
		}
		return dirs, names
	}
	add(filepath.Dir(path))
	follow(path)
	return dirs, names
}
