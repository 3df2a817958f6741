package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/rules"
)

// The rules reached through a file link whose target passes through a directory link
// (etc/rules.yaml -> app/current/rules.yaml, current -> releases/r1), and the same for
// --config DIR (etc/rules.d -> app/current/rules.d). A deploy swapping current was never
// seen: the directory holding current was not watched, since the link is met inside the
// outer link's target, not on the way to the config path as written; the rules stayed
// r1 (and then even edits of the new release went unseen) until a SIGHUP, and the next
// swap was missed again.
func TestWatchConfigDirLinkInsideLinkTarget(t *testing.T) {
	for _, asDir := range []bool{false, true} {
		t.Run(map[bool]string{false: "file", true: "dir"}[asDir], func(t *testing.T) {
			top := t.TempDir()
			etc, app := filepath.Join(top, "etc"), filepath.Join(top, "app")
			write := func(release, name string) {
				t.Helper()
				dir := filepath.Join(app, "releases", release)
				if asDir {
					dir = filepath.Join(dir, "rules.d")
				}
				must(t, os.MkdirAll(dir, 0o755))
				// by rename, as a deploy or an editor writes
				tmp := filepath.Join(dir, ".tmp")
				must(t, os.WriteFile(tmp, fmt.Appendf(nil, "rules:\n  - name: %s\n    key: ip\n    limit: { requests: 100, per: 1m }\n", name), 0o644))
				must(t, os.Rename(tmp, filepath.Join(dir, "rules.yaml")))
			}
			for _, r := range []string{"r1", "r2", "r3"} {
				write(r, r)
			}
			must(t, os.MkdirAll(etc, 0o755))
			must(t, os.Symlink("releases/r1", filepath.Join(app, "current")))
			config := filepath.Join(etc, "rules.yaml")
			must(t, os.Symlink(filepath.Join(app, "current", "rules.yaml"), config))
			if asDir {
				config = filepath.Join(etc, "rules.d")
				must(t, os.Symlink(filepath.Join(app, "current", "rules.d"), config))
			}

			// The name of the rule of each load, as the daemon's reload reads it.
			waitLoaded := watchReads(t, config, func() string {
				set, err := rules.Load(config)
				if err != nil {
					return "error: " + err.Error()
				}
				return set.Rules[0].Name
			})
			swap := func(release string) {
				t.Helper()
				tmp := filepath.Join(app, "current.tmp")
				must(t, os.Symlink(filepath.Join("releases", release), tmp))
				must(t, os.Rename(tmp, filepath.Join(app, "current")))
			}

			swap("r2")
			waitLoaded("r2", "current -> releases/r2")
			swap("r3")
			waitLoaded("r3", "then current -> releases/r3")
			write("r3", "r3b")
			waitLoaded("r3b", "then the new release's file replaced")
			swap("r1")
			waitLoaded("r1", "then current -> releases/r1 again")
		})
	}
}

// watchLoads watches config with a short debounce and returns the contents read at
// each change; wait waits (up to 10 s, a loaded CI machine's time) for want among them.
func watchLoads(t *testing.T, config string) (wait func(want, what string)) {
	t.Helper()
	return watchReads(t, config, func() string {
		b, _ := os.ReadFile(config)
		return string(b)
	})
}

// watchReads is watchLoads with read telling what each change loaded.
func watchReads(t *testing.T, config string, read func() string) (wait func(want, what string)) {
	t.Helper()
	loads := make(chan string, 100)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	_, err := watchConfig(ctx, config, 20*time.Millisecond, func(bool) bool { loads <- read(); return false }, func(err error) { t.Logf("watch: %v", err) })
	must(t, err)
	return awaitLoad(t, loads)
}

// awaitLoad returns a wait for a load of want among loads, failing the test (naming
// what) when none comes within 10 s.
func awaitLoad(t *testing.T, loads <-chan string) (wait func(want, what string)) {
	return func(want, what string) {
		t.Helper()
		deadline := time.After(10 * time.Second)
		var got []string
		for {
			select {
			case s := <-loads:
				if s == want {
					return
				}
				got = append(got, s)
			case <-deadline:
				t.Fatalf("%s: %q never read within 10 s (read: %q)", what, want, got)
			}
		}
	}
}

// One directory reached by two paths on the way (app/current and app/releases/r1) has
// one inotify watch: when the outer link was pointed straight at the release, the watch
// was removed by the path no longer wanted (app/current), which took it from the other
// too, and every later edit of the rules went unseen.
func TestWatchConfigOneDirectoryTwoPaths(t *testing.T) {
	top := t.TempDir()
	etc, r1 := filepath.Join(top, "etc"), filepath.Join(top, "app", "releases", "r1")
	must(t, os.MkdirAll(r1, 0o755))
	must(t, os.MkdirAll(etc, 0o755))
	writeFile(t, r1, "rules.yaml", "a")
	must(t, os.Symlink("releases/r1", filepath.Join(top, "app", "current")))
	config := filepath.Join(etc, "rules.yaml")
	must(t, os.Symlink(filepath.Join(top, "app", "current", "rules.yaml"), config))
	wait := watchLoads(t, config)

	must(t, os.Symlink(filepath.Join(r1, "rules.yaml"), filepath.Join(etc, "l.tmp")))
	must(t, os.Rename(filepath.Join(etc, "l.tmp"), config))
	wait("a", "the link pointed straight at the release")
	must(t, os.Rename(writeFile(t, r1, ".t", "b"), filepath.Join(r1, "rules.yaml")))
	wait("b", "then the release's file replaced")
}

// An event names the path its directory's watch was added by, which may not be the one
// the links were met by: config top/L/rules.yaml with L -> app and app/rules.yaml ->
// an absolute top/app/current/rules.yaml; app is watched as top/L, the swap of current
// comes as top/L/current, and the link was known as top/app/current.
func TestWatchConfigEventNamedAnotherWay(t *testing.T) {
	top := t.TempDir()
	app := filepath.Join(top, "app")
	for _, r := range []string{"r1", "r2"} {
		must(t, os.MkdirAll(filepath.Join(app, "releases", r), 0o755))
		writeFile(t, filepath.Join(app, "releases", r), "rules.yaml", r)
	}
	must(t, os.Symlink("releases/r1", filepath.Join(app, "current")))
	must(t, os.Symlink(filepath.Join(app, "current", "rules.yaml"), filepath.Join(app, "rules.yaml")))
	must(t, os.Symlink("app", filepath.Join(top, "L")))
	wait := watchLoads(t, filepath.Join(top, "L", "rules.yaml"))

	must(t, os.Symlink("releases/r2", filepath.Join(app, "c.tmp")))
	must(t, os.Rename(filepath.Join(app, "c.tmp"), filepath.Join(app, "current")))
	wait("r2", "current -> releases/r2")
}

func TestLinksOnTheWay(t *testing.T) {
	top := t.TempDir()
	if real, err := filepath.EvalSymlinks(top); err == nil {
		top = real // a temp dir reached through a link (macOS /tmp) adds links of its own
	}
	p := func(s ...string) string { return filepath.Join(append([]string{top}, s...)...) }
	must(t, os.MkdirAll(p("app", "releases", "r1", "conf"), 0o755))
	must(t, os.MkdirAll(p("etc"), 0o755))
	writeFile(t, p("app", "releases", "r1", "conf"), "rules.yaml", "x")
	must(t, os.Symlink("releases/r1", p("app", "current")))          // relative directory link
	must(t, os.Symlink("current/conf", p("app", "conf")))            // through another one
	must(t, os.Symlink("../app/conf/rules.yaml", p("etc", "inner"))) // .. and a chain
	must(t, os.Symlink(p("etc", "inner"), p("etc", "rules.yaml")))   // absolute
	must(t, os.Symlink("loop", p("etc", "loop")))

	for _, tt := range []struct {
		path string
		want []string
	}{
		{p("etc", "rules.yaml"), []string{p("etc", "rules.yaml"), p("etc", "inner"), p("app", "conf"), p("app", "current")}},
		{p("app", "current", "conf", "rules.yaml"), []string{p("app", "current")}},
		{p("app", "releases", "r1", "conf", "rules.yaml"), nil},
		{p("etc", "missing", "rules.yaml"), nil},
		{p("etc", "loop"), []string{p("etc", "loop")}},
	} {
		if got := linksOnTheWay(tt.path); !slices.Equal(got, tt.want) {
			t.Errorf("linksOnTheWay(%s):\n got %q\nwant %q", tt.path, got, tt.want)
		}
	}
}

// A change of permissions (or owner) on the way to the rules is a change: a rules file
// put in place unreadable to the daemon (installed 0600 by root, by rename) failed to
// load, and the chmod that fixed it raised only an attribute event, which the watcher
// dropped: the daemon kept the old rules, rlsidecar_config_last_reload_successful at 0
// and its alert firing, until a SIGHUP or another write; a file or its directory made
// unreadable was not reported until then either. Each chmod here must be followed by a
// read; the read tells the mode it found, so that a read before the chmod does not count.
func TestWatchConfigPermissionsChanged(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "etc")
	must(t, os.Mkdir(dir, 0o755))
	config := writeFile(t, dir, "rules.yaml", "rules: []\n")
	must(t, os.Chmod(config, 0o644))
	wait := watchReads(t, config, func() string {
		f, errF := os.Stat(config)
		d, errD := os.Stat(dir)
		if errF != nil || errD != nil {
			return fmt.Sprint(errF, errD)
		}
		return f.Mode().String() + " in " + d.Mode().String()
	})

	must(t, os.Chmod(config, 0o600))
	wait("-rw------- in drwxr-xr-x", "the file made unreadable to others")
	must(t, os.Chmod(config, 0o644))
	wait("-rw-r--r-- in drwxr-xr-x", "then readable again")
	must(t, os.Chmod(dir, 0o700))
	wait("-rw-r--r-- in drwx------", "then its directory closed to others")
	must(t, os.Chmod(dir, 0o755))
	wait("-rw-r--r-- in drwxr-xr-x", "then opened again")
}

// Events lost to a full inotify queue (IN_Q_OVERFLOW: a busy watched directory, /etc
// above the rules' own, while a reload of a large file ran) may include the rules file's:
// the overflow was only logged, and the rules written meanwhile stayed unread until the
// next change or a SIGHUP. An overflow must be taken as a change. Here the watcher's
// loop is held in a reload while more events than the kernel queues are raised beside
// the rules file, then the rules are written; the write's events are lost.
func TestWatchConfigQueueOverflowReads(t *testing.T) {
	b, err := os.ReadFile("/proc/sys/fs/inotify/max_queued_events")
	if err != nil {
		t.Skipf("no inotify queue limit to fill: %v", err)
	}
	var max int
	if _, err := fmt.Sscan(string(b), &max); err != nil || max > 1<<20 {
		t.Skipf("inotify max_queued_events %q: too many to raise here", b)
	}
	dir := t.TempDir()
	config := writeFile(t, dir, "rules.yaml", "a")
	noise := []string{writeFile(t, dir, "noise1", ""), writeFile(t, dir, "noise2", "")}
	loads, gate := make(chan string, 100), make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	_, err = watchConfig(ctx, config, 20*time.Millisecond, func(bool) bool {
		b, _ := os.ReadFile(config)
		loads <- string(b)
		<-gate // the first reload holds the loop until the queue has overflowed
		return false
	}, func(err error) { t.Logf("watch: %v", err) })
	must(t, err)
	wait := awaitLoad(t, loads)

	must(t, os.Rename(writeFile(t, dir, ".t", "b"), config))
	wait("b", "the first write")
	// fsnotify holds up to 4,096 events read from the queue; the two files alternate, as
	// the kernel merges an event equal to the last queued.
	for i := range max + 4096 + 1000 {
		must(t, os.Chmod(noise[i%2], 0o600))
	}
	must(t, os.Rename(writeFile(t, dir, ".t", "c"), config))
	close(gate)
	wait("c", "the write whose events the full queue lost")
}

// A daemon whose rules watcher cannot start (the inotify instances of its user used up,
// as on a crowded host) serves all the same, says so, and reloads on SIGHUP; before, it
// refused to start. The daemon runs in a user namespace of its own whose inotify limit
// is 0, so no other process is short of them.
func TestE2EServesWithoutAWatcher(t *testing.T) {
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("no unshare (util-linux) to give the daemon a user namespace with no inotify instances")
	}
	if err := exec.Command("unshare", "-U", "-r", "true").Run(); err != nil {
		t.Skipf("user namespaces are not available here: %v", err)
	}
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", rulesWithLimit(1))
	d := startServeVia(t, []string{"unshare", "-U", "-r", "sh", "-c", `echo 0 > /proc/sys/user/max_inotify_instances && exec "$@"`, "sh"},
		filepath.Join(dir, "s.sock"), "--admin=", "--config", cfg)
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(d.stderr.String(), "not watching the rules file"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) { // the log is copied from a pipe: it may come after stdout's line
			t.Fatalf("no word of the watcher that could not start:\n%s", d.stderr.String())
		}
	}
	c := dialRaw(t, d.socket)
	if l := limitOf(t, c, 1); l != 1 {
		t.Fatalf("limit %d, want 1", l)
	}
	writeFile(t, dir, "rules.yaml", rulesWithLimit(2))
	must(t, d.cmd.Process.Signal(syscall.SIGHUP))
	for deadline := time.Now().Add(5 * time.Second); limitOf(t, c, 2) != 2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("SIGHUP did not reload the rules:\n%s", d.stderr.String())
		}
	}
}
