package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/rlsidecar/rlsidecar/rules"
)

// watchConfig calls onChange, debounced, whenever the rules file at path may have
// changed, until ctx ends. It watches directories, not the file: editors and Kubernetes
// ConfigMaps replace files by rename and symlink swap, which a watch on the file itself
// would lose after the first change. The directories are the file's, and those of every
// symlink on the way to what it names (etc/rules.yaml -> /srv/rules/rules.yaml: /srv/rules
// too) and the one holding every link met resolving it, links inside a link's target
// included (etc/rules.yaml -> /srv/app/current/rules.yaml, current -> releases/r1:
// /srv/app), found again after each change, since a change may point a link elsewhere;
// for --config DIR, the directory and the targets of its rules files' links (*.yaml, *.yml).
//
// onChange returns again when the file it read was empty, most likely truncated by a
// writer in place whose bytes are not there yet: it is called again after debounce, up
// to 5 times, the last with final set, when it reads what it finds.
func watchConfig(ctx context.Context, path string, debounce time.Duration, onChange func(final bool) (again bool), onErr func(error)) (kick func(), err error) {
	if abs, err := filepath.Abs(path); err == nil {
		path = abs // events name absolute paths, as configDirs does
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("watching %s: %w", path, err)
	}
	// watched maps each directory watched, by identity (device and inode: a watch
	// follows the directory, not its path), to the path its watch was added by, which
	// names its events. A path that now names another directory (a directory replaced by
	// rename, deleted and made again, reached through a link pointed elsewhere) is
	// watched again. One directory reached by two paths (app/current and
	// app/releases/r1) is watched once: the kernel gives both one watch, and removing it
	// by the path no longer wanted took it from the other too, unseen.
	watched := map[dirID]string{}
	// files maps each rules file watched (the file itself, links followed) by identity
	// to the path its watch was added by. A write in place is told to the watchers of
	// the file and of the directory of the name it was written through, and that name
	// may be in no directory watched here: a file bind-mounted into a container
	// (written on the host, or through the mount) or a hard link. Watched by their
	// directories only, such writes were never seen.
	files := map[dirID]string{}
	var names []string
	// rewatch watches the directories path now depends on, and stops watching the
	// others; it returns the first directory it could not watch.
	rewatch := func() error {
		var want []string
		want, names = configDirs(path)
		var first error
		fail := func(d string, err error) {
			if first == nil {
				first = fmt.Errorf("watching %s: %w", d, err)
			}
		}
		type dir struct {
			path string
			id   dirID
		}
		var dirs []dir // want, each directory once, by the first path to it
		by := map[dirID]string{}
		for _, d := range want {
			id, err := idOf(d)
			if err != nil {
				fail(d, err)
				continue
			}
			if by[id] == "" {
				by[id] = d
				dirs = append(dirs, dir{d, id})
			}
		}
		for id, d := range watched {
			if now, err := idOf(d); by[id] == d && err == nil && now == id {
				continue // wanted by that path, which still names it
			}
			w.Remove(d) // an error if its watch went with the directory
			delete(watched, id)
		}
		for _, d := range dirs {
			if _, in := watched[d.id]; in {
				continue
			}
			if err := w.Add(d.path); err != nil {
				fail(d.path, err)
				continue
			}
			watched[d.id] = d.path
		}
		// The files, as the directories; and one whose watch fsnotify dropped on its
		// own (the file moved away, IN_MOVE_SELF, and back) is watched again.
		live := map[string]bool{}
		for _, p := range w.WatchList() {
			live[p] = true
		}
		var fs []dir
		fby := map[dirID]string{}
		for _, f := range rulesFilesOf(path) {
			if fi, err := os.Stat(f); err != nil || !fi.Mode().IsRegular() {
				continue // missing (the next change finds it), or refused by the reload
			}
			if id, err := idOf(f); err == nil && fby[id] == "" {
				fby[id] = f
				fs = append(fs, dir{f, id})
			}
		}
		for id, f := range files {
			if now, err := idOf(f); fby[id] == f && err == nil && now == id && live[f] {
				continue
			}
			w.Remove(f) // an error if fsnotify dropped it already
			delete(files, id)
		}
		for _, f := range fs {
			if _, in := files[f.id]; in {
				continue
			}
			if err := w.Add(f.path); err != nil {
				fail(f.path, err)
				continue
			}
			files[f.id] = f.path
		}
		return first
	}
	startErr := rewatch()
	if startErr != nil {
		own, _ := configDirs(path)
		if id, err := idOf(own[0]); err != nil || watched[id] == "" {
			w.Close()
			return nil, startErr
		}
		onErr(startErr) // a link's target directory, or a parent: the file's own is watched
	}
	kicks := make(chan struct{}, 1)
	kick = func() {
		select {
		case kicks <- struct{}{}:
		default:
		}
	}
	go func() {
		defer w.Close()
		var timer *time.Timer
		var fire <-chan time.Time
		arm := func() { // onChange after debounce, unless another change comes first
			if timer == nil {
				timer = time.NewTimer(debounce)
			} else {
				timer.Reset(debounce)
			}
			fire = timer.C
		}
		empties := 0 // looks again at an empty file (fire)
		// While a directory on the way to the rules cannot be watched (a deploy deleted
		// the tree above the rules' directory, and makes it again later), no event can
		// say when it is back: rewatch is tried again every rewatchEvery, and the rules
		// are read once it succeeds. Before, the rules in force stayed until a SIGHUP,
		// every later edit unseen. lastErr: the error last reported, not repeated.
		var retry <-chan time.Time
		var lastErr string
		if startErr != nil { // reported above; looked for again as below
			lastErr, retry = startErr.Error(), time.After(rewatchEvery)
		}
		rewatched := func() bool {
			err := rewatch()
			if err == nil {
				lastErr = ""
				return true
			}
			if err.Error() != lastErr {
				lastErr = err.Error()
				onErr(err)
			}
			if retry == nil {
				retry = time.After(rewatchEvery)
			}
			return false
		}
		for {
			select {
			case <-ctx.Done():
				if timer != nil {
					timer.Stop()
				}
				return
			case <-retry:
				retry = nil
				if rewatched() {
					onChange(true) // what changed while nothing watched it
				}
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				// A chmod or chown counts (an attribute event): a file put in place
				// unreadable and then made readable, or a directory on the way opened
				// again, changes what a reload reads, and nothing else says so.
				if !relevant(filepath.Clean(ev.Name), path, names) {
					continue // another file of a watched directory: the daemon's own log, say
				}
				arm()
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				if errors.Is(err, syscall.EINVAL) {
					// fsnotify drops the watch of a directory moved away (IN_MOVE_SELF)
					// with inotify_rm_watch, which fails so when the kernel dropped it
					// first: the directory was deleted since (a deploy's rename over
					// the rules' directory, the old one removed). Nothing is lost: that
					// directory's name is watched again at the change's read (rewatch).
					// Reported, every such deploy logged a warning "invalid argument".
					continue
				}
				onErr(err)
				if errors.Is(err, fsnotify.ErrEventOverflow) {
					// The kernel's queue was full: events were lost, the rules file's
					// among them maybe. Read it as after a change.
					arm()
				}
			case <-fire:
				fire = nil
				rewatched()
				// An empty file is most likely one being written in place (truncated,
				// its bytes not there yet): looked at again a few times before it is
				// read, and reported broken.
				// The file may also be truncated between that look and the read:
				// onChange says so (again), and it is looked at again the same way.
				if hasEmpty(path) && empties < 5 || onChange(empties >= 5) {
					empties++
					timer.Reset(debounce)
					fire = timer.C
					continue
				}
				empties = 0
			case <-kicks: // a reload from elsewhere (SIGHUP): the directories again
				rewatched()
			}
		}
	}()
	return kick, nil
}

// hasEmpty reports whether path, the rules file, is empty; or, a directory of rules
// files, whether one of them is (one written in place there, its bytes not there yet,
// was reported broken at once and counted as a failed reload).
func hasEmpty(path string) bool {
	fi, err := os.Stat(path)
	if err != nil {
		return false
	}
	if fi.Mode().IsRegular() {
		return fi.Size() == 0
	}
	if !fi.IsDir() {
		return false
	}
	ents, err := os.ReadDir(path)
	if err != nil {
		return false
	}
	for _, e := range ents {
		if !rules.IsRulesFile(e.Name()) {
			continue
		}
		if fi, err := os.Stat(filepath.Join(path, e.Name())); err == nil && fi.Mode().IsRegular() && fi.Size() == 0 {
			return true
		}
	}
	return false
}

// rulesFilesOf returns the rules files at path: path itself, or the rules files of the
// directory path names (--config DIR).
func rulesFilesOf(path string) []string {
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		files, _ := rules.RulesFiles(path)
		return files
	}
	return []string{path}
}

// rewatchEvery is how often watchConfig tries again to watch a directory on the way to
// the rules that is missing.
var rewatchEvery = time.Second

// dirID identifies a directory: its device and inode.
type dirID struct{ dev, ino uint64 }

// idOf returns the identity of the directory d names now (links followed, as a watch
// follows them).
func idOf(d string) (dirID, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(d, &st); err != nil {
		return dirID{}, err
	}
	return dirID{uint64(st.Dev), st.Ino}, nil
}

// relevant reports whether a change to name, in a watched directory, may change the
// rules at path: name is on the way from path to the rules (the file, a link, a link's
// target, or a directory on the way, as a ConfigMap's ..data), or, for --config DIR, one
// of its rules files (*.yaml, *.yml). Any other file of those directories (a log the daemon writes beside its
// rules, an editor's swap file) is not: reloading on it wasted a parse, and a log of
// reload errors in the rules' directory reloaded itself forever.
func relevant(name, path string, names []string) bool {
	on := func(name string) bool {
		for _, n := range names {
			if name == n || strings.HasPrefix(n, name+string(filepath.Separator)) {
				return true
			}
		}
		return false
	}
	if on(name) {
		return true
	}
	// An event names the path its directory was watched by, and names hold the paths
	// the resolution met, which may reach that directory another way (config
	// top/L/rules.yaml, L -> app, app/rules.yaml -> /top/app/current/rules.yaml: app is
	// watched as top/L, the link met as top/app/current): the event's directory's real
	// path too.
	if dir, err := filepath.EvalSymlinks(filepath.Dir(name)); err == nil && dir != filepath.Dir(name) && on(filepath.Join(dir, filepath.Base(name))) {
		return true
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return filepath.Dir(name) == filepath.Clean(path) && rules.IsRulesFile(filepath.Base(name))
	}
	return false
}

// configDirs returns the directories the rules at path depend on: path's own (path
// itself for a directory), and the directory of each symlink's target on the way from
// path, or from a directory's rules files, to a file; the directory a link chain ends in, its
// parents' links resolved, too; and the directory holding every link met resolving path,
// or a rules file, component by component (linksOnTheWay). Missing files are skipped:
// the next change finds them.
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
	// The directory the rules are in may itself be replaced (renamed over, deleted and
	// made again, a link to it pointed elsewhere: a deploy's current -> releases/r2):
	// the directory holding it is watched, and so is the one holding each link on the
	// way to it, each with that name on the way.
	above := func(d string) {
		for p := filepath.Clean(d); ; p = filepath.Dir(p) {
			if parent := filepath.Dir(p); parent != p {
				if fi, err := os.Lstat(p); p == filepath.Clean(d) || (err == nil && fi.Mode()&os.ModeSymlink != 0) {
					add(parent)
					name(p)
				}
				continue
			}
			return
		}
	}
	// Every link met resolving a path, component by component, those on the way through
	// a link's target too (etc/rules.yaml -> app/current/rules.yaml, current ->
	// releases/r1): the directory holding each is watched, with the link's name, so
	// pointing any of them elsewhere is seen. follow and above miss a directory link
	// inside a link's target.
	links := func(p string) {
		for _, l := range linksOnTheWay(p) {
			add(filepath.Dir(l))
			name(l)
		}
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		add(path) // --config DIR: its files come and go
		files, _ := rules.RulesFiles(path)
		for _, f := range files {
			follow(f)
			links(f)
		}
		above(path)
		links(path)
		return dirs, names
	}
	add(filepath.Dir(path))
	follow(path)
	above(filepath.Dir(path))
	links(path)
	return dirs, names
}

// linksOnTheWay returns the symlinks met resolving the absolute path p as the kernel
// does, one component at a time, a link's target resolved the same way in its place
// (the links on the way through it included), each link named by the real path of the
// directory holding it. It stops at the first component missing or unreadable, and
// after 40 links (the kernel's own bound).
func linksOnTheWay(p string) []string {
	var links []string
	cur := string(filepath.Separator) // no links in it
	rest := strings.Split(filepath.Clean(p), string(filepath.Separator))
	for hops := 0; len(rest) > 0; {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			cur = filepath.Dir(cur)
			continue
		}
		next := filepath.Join(cur, c)
		fi, err := os.Lstat(next)
		if err != nil {
			return links
		}
		if fi.Mode()&os.ModeSymlink == 0 {
			cur = next
			continue
		}
		if hops++; hops > 40 {
			return links
		}
		if !slices.Contains(links, next) {
			links = append(links, next)
		}
		t, err := os.Readlink(next)
		if err != nil {
			return links
		}
		if filepath.IsAbs(t) {
			cur = string(filepath.Separator)
		}
		rest = append(strings.Split(t, string(filepath.Separator)), rest...)
	}
	return links
}
