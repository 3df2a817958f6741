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
	c := dialRaw(t, socket)
	rule := ""
	for id := uint64(1); time.Now().Before(deadline); id++ {
		if rule = c.check(id, 1, "user=u").Rule; rule == "after" {
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
	if rule != "after" {
		t.Fatalf("the daemon still decides by %q, 10 s after the file changed while it started; stderr:\n%s", rule, errs.String())
	}
}
