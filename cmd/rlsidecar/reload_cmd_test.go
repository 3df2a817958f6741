package main

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// `rlsidecar reload` (the unit's ExecReload=) returns once the file's rules are in force,
// and fails, naming the error, when the file is broken; the rules in force then stay.
// Before, ExecReload= was kill -HUP: `systemctl reload` returned before the reload had
// begun, and succeeded whatever the file held.
func TestE2EReloadCommandWaits(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", rulesWithLimit(1))
	// --watch=false: only the command's SIGHUP reloads, so nothing else could have made
	// the new rules be in force when it returns.
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0", "--watch=false")
	addr := adminAddr(t, d)
	base := "http://" + addr
	c := dialRaw(t, d.socket)
	pid := strconv.Itoa(d.cmd.Process.Pid)
	v1 := rulesVersion(t, base)

	for i, limit := range []uint64{2, 3, 4} {
		writeFile(t, dir, "rules.yaml", rulesWithLimit(int(limit)))
		out, err := runCLI(t, "reload", "--pid", pid, "--admin", addr)
		if err != nil {
			t.Fatalf("reload to a limit of %d: %v\n%s", limit, err, out)
		}
		// At once, no polling: the command returned after the reload ended.
		v := rulesVersion(t, base)
		if v == v1 || !strings.Contains(out, v) {
			t.Fatalf("reload to a limit of %d printed %q; /rules has version %s (was %s)", limit, out, v, v1)
		}
		if l := limitOf(t, c, uint64(10+i)); l != limit {
			t.Fatalf("after reload returned: limit %d, want %d", l, limit)
		}
		v1 = v
	}

	// A broken file: exit 1 with the file's error; the rules in force stay.
	writeFile(t, dir, "rules.yaml", "rules:\n  - name: per-user\n    key: user\n    limit: { requests: many, per: 1h }\n")
	out, err := runCLI(t, "reload", "--pid", pid, "--admin", addr)
	if err == nil || !strings.Contains(out, "reload failed, keeping the rules in force (version "+v1+")") || !strings.Contains(out, "rules.yaml:4") {
		t.Fatalf("reload of a broken file: err=%v\n%s", err, out)
	}
	if v := rulesVersion(t, base); v != v1 {
		t.Fatalf("a broken file replaced the rules: version %s, want %s", v, v1)
	}
	if l := limitOf(t, c, 20); l != 4 {
		t.Fatalf("after a broken file: limit %d, want 4", l)
	}

	// Fixed: $MAINPID, as systemd sets it for ExecReload=, names the daemon.
	writeFile(t, dir, "rules.yaml", rulesWithLimit(5))
	cmd := execCommand(binary, "reload", "--admin", addr)
	cmd.Env = append(os.Environ(), "MAINPID="+pid)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("reload with MAINPID: %v\n%s", err, b)
	}
	if l := limitOf(t, c, 21); l != 5 {
		t.Fatalf("after reload with MAINPID: limit %d, want 5", l)
	}

	// Nothing to read the outcome from: SIGHUP all the same, a note, exit 0.
	writeFile(t, dir, "rules.yaml", rulesWithLimit(6))
	out, err = runCLI(t, "reload", "--pid", pid, "--admin", "")
	if err != nil || !strings.Contains(out, "not waiting for the reload's outcome: no --admin") {
		t.Fatalf("reload --admin '': err=%v\n%s", err, out)
	}
	for deadline := time.Now().Add(5 * time.Second); limitOf(t, c, 22) != 6; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("reload --admin '' sent no SIGHUP: the limit stayed")
		}
	}

	// Another daemon's admin endpoint (blue/green on one address): not waited on.
	other := startDaemon(t, "--admin", "127.0.0.1:0")
	out, err = runCLI(t, "reload", "--pid", pid, "--admin", adminAddr(t, other))
	if err != nil || !strings.Contains(out, "is process "+strconv.Itoa(other.cmd.Process.Pid)+"'s, not "+pid+"'s") {
		t.Fatalf("reload with another daemon's admin endpoint: err=%v\n%s", err, out)
	}

	// Usage errors.
	for _, args := range [][]string{{"reload"}, {"reload", "--pid", pid, "extra"}, {"reload", "--pid", pid, "--timeout", "0s"}} {
		cmd := execCommand(binary, args...)
		cmd.Env = append(os.Environ(), "MAINPID=")
		b, _ := cmd.CombinedOutput()
		if code := cmd.ProcessState.ExitCode(); code != exitUsage {
			t.Fatalf("%q: exit %d, want %d\n%s", args, code, exitUsage, b)
		}
	}
}

// With the file watched (the default), a broken file saved before `rlsidecar reload` has
// already failed to load once; the command's reload fails again and says so.
func TestE2EReloadCommandReportsWatchedBrokenFile(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", rulesWithLimit(1))
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0")
	addr := adminAddr(t, d)
	writeFile(t, dir, "rules.yaml", "rules: [\n")
	time.Sleep(300 * time.Millisecond) // the watcher's reload, failed
	out, err := runCLI(t, "reload", "--pid", strconv.Itoa(d.cmd.Process.Pid), "--admin", addr)
	if err == nil || !strings.Contains(out, "reload failed") {
		t.Fatalf("reload of a broken watched file: err=%v\n%s", err, out)
	}
}

// Without --admin, reload waits on the endpoint the daemon itself was given, read from
// its command line (a drop-in's ExecStart= flag, the last one winning) or its
// environment; before, it read the default address, found no daemon there and only
// signalled. A port the daemon picked itself (:0) cannot be read that way: it says so.
func TestE2EReloadCommandFindsTheDaemonsAdmin(t *testing.T) {
	freeAddr := func() string {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		return l.Addr().String()
	}
	// reload runs with no RLSIDECAR_ADMIN of its own, so only the daemon's can name it.
	reloadOf := func(d *daemonProc) (string, error) {
		cmd := execCommand(binary, "reload", "--pid", strconv.Itoa(d.cmd.Process.Pid))
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, "RLSIDECAR_ADMIN=") && !strings.HasPrefix(kv, "MAINPID=") {
				cmd.Env = append(cmd.Env, kv)
			}
		}
		b, err := cmd.CombinedOutput()
		return string(b), err
	}
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", rulesWithLimit(1))

	flagged := startDaemon(t, "--config", cfg, "--watch=false", "-admin", freeAddr()) // after startDaemon's --admin=
	adminAddr(t, flagged)
	writeFile(t, dir, "rules.yaml", rulesWithLimit(2))
	if out, err := reloadOf(flagged); err != nil || !strings.Contains(out, "rules in force") {
		t.Fatalf("reload of a daemon given --admin on its command line: err=%v\n%s", err, out)
	}
	if l := limitOf(t, dialRaw(t, flagged.socket), 1); l != 2 {
		t.Fatalf("after reload: limit %d, want 2", l)
	}

	t.Setenv("RLSIDECAR_ADMIN", freeAddr())
	fromEnv := startServe(t, filepath.Join(shortTempDir(t), "s.sock"), "--config", cfg, "--watch=false")
	adminAddr(t, fromEnv)
	writeFile(t, dir, "rules.yaml", "rules:\n  - name: per-user\n    key: user\n    limit: { requests: many, per: 1h }\n")
	if out, err := reloadOf(fromEnv); err == nil || !strings.Contains(out, "reload failed") || !strings.Contains(out, "rules.yaml:4") {
		t.Fatalf("reload of a broken file, daemon given RLSIDECAR_ADMIN: err=%v\n%s", err, out)
	}

	picked := startDaemon(t, "--admin", "127.0.0.1:0")
	if out, err := reloadOf(picked); err != nil || !strings.Contains(out, "has a port the daemon picked itself") {
		t.Fatalf("reload of a daemon on --admin 127.0.0.1:0: err=%v\n%s", err, out)
	}
}

func TestFlagValue(t *testing.T) {
	for _, c := range []struct {
		args  []string
		value string
		given bool
	}{
		{[]string{"serve", "--config", "x"}, "", false},
		{[]string{"serve", "--admin", "a:1"}, "a:1", true},
		{[]string{"serve", "-admin=a:2", "--config", "x"}, "a:2", true},
		{[]string{"serve", "--admin=", "--admin", "a:3"}, "a:3", true},
		{[]string{"serve", "--admin", "a:4", "--admin="}, "", true},
		{[]string{"serve", "--administrator=x", "--admin"}, "", false},
		{[]string{"serve", "--", "--admin=a:5"}, "", false},
	} {
		if v, given := flagValue(c.args, "admin"); v != c.value || given != c.given {
			t.Errorf("flagValue(%q) = %q, %v; want %q, %v", c.args, v, given, c.value, c.given)
		}
	}
}

// A daemon whose admin endpoint listens on every interface (--admin :PORT, as exporters
// are often bound for a scraper on another host): reload reads it at localhost, and so
// fails on a broken file and names the error. Before, it asked http://:PORT/rules, whose
// Host (":PORT") the endpoint refused (421 Misdirected Request), and only signalled:
// exit 0, so `systemctl reload` succeeded whatever the file held.
func TestE2EReloadCommandAdminOnEveryInterface(t *testing.T) {
	l, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(l.Addr().String())
	l.Close()
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", rulesWithLimit(1))
	d := startDaemon(t, "--config", cfg, "--watch=false", "-admin", ":"+port) // after startDaemon's --admin=
	adminAddr(t, d)
	pid := strconv.Itoa(d.cmd.Process.Pid)
	writeFile(t, dir, "rules.yaml", "rules:\n  - name: per-user\n    key: user\n    limit: { requests: many, per: 1h }\n")
	// As ExecReload= runs it: the daemon's own --admin, read from its command line.
	out, err := runCLI(t, "reload", "--pid", pid)
	if err == nil || !strings.Contains(out, "reload failed") || !strings.Contains(out, "rules.yaml:4") {
		t.Fatalf("reload of a broken file, daemon on --admin :%s: err=%v\n%s", port, err, out)
	}
	writeFile(t, dir, "rules.yaml", rulesWithLimit(2))
	if out, err := runCLI(t, "reload", "--pid", pid, "--admin", ":"+port); err != nil || !strings.Contains(out, "rules in force") {
		t.Fatalf("reload --admin :%s: err=%v\n%s", port, err, out)
	}
	if l := limitOf(t, dialRaw(t, d.socket), 1); l != 2 {
		t.Fatalf("after reload: limit %d, want 2", l)
	}
}
