package main

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// A rules file changed between the daemon's first load and its watcher's start raised no
// event the watcher could see: the daemon served the old rules until the next change.
// It reads the file once more when the watches are in place. serve runs in this process,
// so that the change lands exactly in that window (afterFirstLoad).
func TestWatchConfigChangedWhileStarting(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", "rules:\n  - name: before\n    key: user\n    limit: { requests: 100, per: 1m }\n")
	socket := filepath.Join(dir, "s.sock")
	afterFirstLoad = func() {
		tmp := writeFile(t, dir, "rules.yaml.new", "rules:\n  - name: after\n    key: user\n    limit: { requests: 100, per: 1m }\n")
		if err := os.Rename(tmp, cfg); err != nil {
			t.Error(err)
		}
	}
	defer func() { afterFirstLoad = func() {} }()
	rule, stderr := serveUntilRule(t, cfg, socket, nil, "after")
	if rule != "after" {
		t.Fatalf("the daemon still decides by %q, 10 s after the file changed while it started; stderr:\n%s", rule, stderr)
	}
}

// serveUntilRule runs serve in this process on cfg, listening on socket, and once it
// listens runs onListening (nil: nothing), then checks user=u every 20 ms until the rule
// deciding it is want or 10 s have passed since serve began, and drains it (SIGTERM). It
// returns the last rule that decided and serve's standard error.
func serveUntilRule(t *testing.T, cfg, socket string, onListening func(), want string) (rule, stderr string) {
	t.Helper()
	var out, errs syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- serve([]string{"--config", cfg, "--socket", socket, "--admin", ""}, &out, &errs)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(socket); err == nil {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("serve returned %v before listening; stderr:\n%s", err, errs.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no socket after 10 s; stderr:\n%s", errs.String())
		}
	}
	if onListening != nil {
		onListening()
	}
	c := dialRaw(t, socket)
	for id := uint64(1); time.Now().Before(deadline); id++ {
		if rule = c.check(id, 1, "user=u").Rule; rule == want {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil { // serve drains and returns
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Errorf("serve: %v", err)
	}
	return rule, errs.String()
}
