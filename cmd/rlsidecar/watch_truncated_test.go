package main

import (
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// A writer in place truncates the rules file, then writes it: a reload that reads it in
// between reads no bytes. The watcher looked for an empty file before it reloaded, but
// the truncation could come between that look and the read (2 ms writes under checks at
// full speed: one such reload in five runs of 60 writes), and the read was a failed
// reload, logged at error level and counted (the alert fired) for a file good a moment
// later. Now a file read empty is looked at again, as one seen empty is. serve runs in
// this process, so that the truncation lands exactly there (beforeFileRead).
func TestWatchConfigTruncatedBeforeRead(t *testing.T) {
	dir := shortTempDir(t)
	before := "rules:\n  - name: before\n    key: user\n    limit: { requests: 100, per: 1m }\n"
	after := "rules:\n  - name: after\n    key: user\n    limit: { requests: 100, per: 1m }\n"
	cfg := writeFile(t, dir, "rules.yaml", before)
	socket := filepath.Join(dir, "s.sock")
	var reads atomic.Int32
	beforeFileRead = func() {
		switch reads.Add(1) {
		case 1: // the writer truncates, just before the read
			if err := os.Truncate(cfg, 0); err != nil {
				t.Error(err)
			}
		case 2: // and writes its bytes
			if err := os.WriteFile(cfg, []byte(after), 0o644); err != nil {
				t.Error(err)
			}
		}
	}
	defer func() { beforeFileRead = func() {} }()
	rule, stderr := serveUntilRule(t, cfg, socket, func() {
		writeFile(t, dir, "rules.yaml", after) // the change the watcher reloads on
	}, "after")
	if rule != "after" {
		t.Fatalf("the daemon still decides by %q, 10 s after the file was written; stderr:\n%s", rule, stderr)
	}
	if strings.Contains(stderr, "reload failed") {
		t.Fatalf("a file read between its truncation and its bytes was a failed reload:\n%s", stderr)
	}
}
