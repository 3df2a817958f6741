package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A rules path that names no regular file is refused as a broken file is: serve does not
// start with it; on reload the rules in force stay, and the error is logged and counted.
// A named pipe used to block the reload until something wrote to it, and every reload
// after it, SIGHUP's too; a link to /dev/zero, to be read until memory ran out.
func TestE2EReloadRefusesNonRegularFile(t *testing.T) {
	dir := shortTempDir(t)
	pipe := filepath.Join(dir, "pipe.yaml")
	if err := syscall.Mkfifo(pipe, 0o644); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	// Bounded: a daemon that waits on the pipe would never exit.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	outb, err := exec.CommandContext(ctx, binary, "serve", "--config", pipe, "--socket", filepath.Join(dir, "s.sock")).CombinedOutput()
	if out := string(outb); err == nil || !strings.Contains(out, "pipe.yaml: not a regular file (a named pipe)") {
		t.Fatalf("serve --config a named pipe: err=%v out=%s", err, out)
	}

	cfg := writeFile(t, dir, "rules.yaml", rulesWithLimit(1))
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	v := rulesVersion(t, base)
	reloadErrors := func() float64 {
		_, samples := scrape(t, base)
		return samples[`rlsidecar_config_reloads_total{result="error"}`]
	}
	waitErrors := func(what string, n float64) {
		t.Helper()
		for deadline := time.Now().Add(3 * time.Second); reloadErrors() < n; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %v reload errors counted, want %v\n%s", what, reloadErrors(), n, d.stderr.String())
			}
		}
	}

	// A named pipe renamed over the file, then SIGHUP: both reloads fail, neither waits.
	tmp := filepath.Join(dir, ".rules.pipe")
	must(t, syscall.Mkfifo(tmp, 0o644))
	must(t, syscall.Rename(tmp, cfg))
	waitErrors("a named pipe", 1)
	n := reloadErrors()
	must(t, d.cmd.Process.Signal(syscall.SIGHUP))
	waitErrors("SIGHUP after a named pipe", n+1)

	// A link to /dev/zero swapped in.
	n = reloadErrors()
	must(t, syscall.Symlink("/dev/zero", filepath.Join(dir, ".rules.link")))
	must(t, syscall.Rename(filepath.Join(dir, ".rules.link"), cfg))
	waitErrors("a link to /dev/zero", n+1)
	if l := limitOf(t, c, 1); l != 1 || rulesVersion(t, base) != v {
		t.Fatalf("a refused file replaced the rules: limit %d", l)
	}
	_, samples := scrape(t, base)
	okAt := samples["rlsidecar_config_last_reload_success_timestamp_seconds"]
	if ok := samples["rlsidecar_config_last_reload_successful"]; ok != 0 || okAt < float64(time.Now().Add(-time.Minute).Unix()) {
		t.Fatalf("after a refused file: last_reload_successful %v (want 0), last success at %v", ok, okAt)
	}
	for _, want := range []string{"not a regular file (a named pipe)", "not a regular file (/dev/zero, a character device)"} {
		if !strings.Contains(d.stderr.String(), want) {
			t.Errorf("the log does not say %q:\n%s", want, d.stderr.String())
		}
	}

	// A rules file again: reloaded.
	must(t, syscall.Rename(writeFile(t, dir, ".rules.new", rulesWithLimit(2)), cfg))
	waitReload(t, base, v)
	if l := limitOf(t, c, 2); l != 2 {
		t.Fatalf("after the refused files: limit %d", l)
	}
	// The gauge says the file in place loaded: an alert on it stops at the fix.
	if _, samples := scrape(t, base); samples["rlsidecar_config_last_reload_successful"] != 1 ||
		samples["rlsidecar_config_last_reload_success_timestamp_seconds"] < okAt {
		t.Fatalf("after a good file: last_reload_successful %v (want 1), last success at %v (before: %v)",
			samples["rlsidecar_config_last_reload_successful"], samples["rlsidecar_config_last_reload_success_timestamp_seconds"], okAt)
	}
}

// A reload that ends a failure (a broken rules file put back as it was) says so, and so
// does a SIGHUP that finds the rules unchanged: before, nothing was logged, and the log's
// last word on the rules was the failure's ERROR.
func TestE2EReloadUnchangedIsLogged(t *testing.T) {
	dir := shortTempDir(t)
	good := rulesWithLimit(5)
	path := writeFile(t, dir, "rules.yaml", good)
	d := startDaemon(t, "--config", path)
	waitStderr := func(what string, n int) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for strings.Count(d.stderr.String(), what) < n {
			if time.Now().After(deadline) {
				t.Fatalf("no %q (%d) in the log:\n%s", what, n, d.stderr.String())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if err := d.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitStderr(`msg="rules unchanged" trigger=SIGHUP`, 1)
	writeFile(t, dir, "rules.yaml", "rules: [")
	waitStderr("reload failed", 1)
	writeFile(t, dir, "rules.yaml", good)
	waitStderr(`msg="rules unchanged"`, 2)
}

// A --config DIR holding a symlink to a missing file (left behind when its file was
// deleted): the daemon starts with the other files and warns, edits of the other files
// reload, and the link's target, when it appears, is read. Before, serve refused to start
// ("open b.yaml: no such file or directory") and, with the link added under a running
// daemon, every reload failed and kept the rules in force.
func TestE2EReloadDanglingLinkInDir(t *testing.T) {
	dir := shortTempDir(t)
	conf := filepath.Join(dir, "rules.d")
	must(t, os.Mkdir(conf, 0o755))
	writeFile(t, conf, "a.yaml", rulesWithLimit(1))
	target := filepath.Join(dir, "elsewhere", "b.yaml")
	must(t, os.Symlink(target, filepath.Join(conf, "b.yaml")))

	if out, errOut, code := runInProcess("validate", "--config", conf); code != exitOK || !strings.Contains(out, "1 rule,") ||
		!strings.Contains(errOut, "warning: "+filepath.Join(conf, "b.yaml")+": a symlink to "+target+", which does not exist: skipped") {
		t.Fatalf("validate: code %d out %q err %q", code, out, errOut)
	}
	d := startDaemon(t, "--config", conf, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	if l := limitOf(t, c, 1); l != 1 {
		t.Fatalf("limit %d", l)
	}
	if !strings.Contains(d.stderr.String(), "which does not exist: skipped") {
		t.Fatalf("no warning of the dangling link:\n%s", d.stderr.String())
	}
	v := rulesVersion(t, base)
	must(t, os.Rename(writeFile(t, conf, ".a.new", rulesWithLimit(2)), filepath.Join(conf, "a.yaml")))
	v = waitReload(t, base, v)
	if l := limitOf(t, c, 2); l != 2 {
		t.Fatalf("after an edit beside a dangling link: limit %d", l)
	}
	// Another dangling link added, nothing else changed: the reload says so.
	must(t, os.Symlink(filepath.Join(dir, "nowhere.yaml"), filepath.Join(conf, "c.yaml")))
	v = waitReload(t, base, v)
	for deadline := time.Now().Add(3 * time.Second); !strings.Contains(d.stderr.String(), "c.yaml: a symlink to "); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("a dangling link added under a running daemon, not said:\n%s", d.stderr.String())
		}
	}
	// The target appears: its rule is read.
	must(t, os.Mkdir(filepath.Dir(target), 0o755))
	writeFile(t, filepath.Dir(target), "b.yaml", "rules:\n  - name: per-ip\n    key: ip\n    limit: { requests: 3, per: 1h }\n")
	waitReload(t, base, v)
	if _, body := httpGet(t, base+"/rules"); !strings.Contains(body, `"per-ip"`) {
		t.Fatalf("the link's target not read:\n%s", body)
	}
	if _, samples := scrape(t, base); samples[`rlsidecar_config_reloads_total{result="error"}`] != 0 || samples["rlsidecar_config_last_reload_successful"] != 1 {
		t.Fatalf("reload errors %v, last_reload_successful %v\n%s", samples[`rlsidecar_config_reloads_total{result="error"}`], samples["rlsidecar_config_last_reload_successful"], d.stderr.String())
	}
}
