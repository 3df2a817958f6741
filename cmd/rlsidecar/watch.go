package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
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
	var watched []string
	// rewatch watches the directories path now depends on, and stops watching the
	// others; it returns the first directory it could not watch.
	rewatch := func() error {
		want := configDirs(path)
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
		if own := configDirs(path)[0]; !slices.Contains(watched, own) {
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
				if ev.Op == fsnotify.Chmod {
					continue
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

// configDirs returns the directories the rules at path depend on: path's own (path
// itself for a directory), and the directory of each symlink's target on the way from
// path, or from a directory's *.yaml, to a file; the directory a link chain ends in, its
// parents' links resolved, too. Missing files are skipped: the next change finds them.
func configDirs(path string) []string {
	var dirs []string
	add := func(d string) {
		if d = filepath.Clean(d); !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	follow := func(p string) {
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
			p = t
		}
		if real, err := filepath.EvalSymlinks(p); err == nil {
			add(filepath.Dir(real))
		}
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		add(path) // --config DIR: its files come and go
		files, _ := filepath.Glob(filepath.Join(path, "*.yaml"))
		for _, f := range files {
			follow(f)
		}
		return dirs
	}
	add(filepath.Dir(path))
	follow(path)
	return dirs
}
