package main

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A daemon whose open-file limit is below what its connection caps take warns at start:
// past the limit a client is not told too_many_connections, it waits in the listen
// backlog unanswered. One whose caps fit says nothing.
func TestE2EWarnsOfAFileLimitBelowTheCaps(t *testing.T) {
	const warning = "the open-file limit is below what the connection caps take"
	under := []string{"sh", "-c", `ulimit -n 300 && exec "$@"`, "sh"}
	for _, tc := range []struct {
		name string
		args []string
		warn bool
	}{
		{"default caps", nil, true},                              // 1,024 + 64 > 300
		{"max-conns 100", []string{"--max-conns", "100"}, false}, // 100 + 64 < 300
		{"max-conns 160", []string{"--max-conns", "160"}, false}, // 160 + 64 < 300
		// With Redis, its three clients' pools (16 + 10 connections each) count too:
		// 160 + 64 + 78 > 300. Before, 64 stood for them and this said nothing. No
		// Redis answers there: the daemon starts all the same.
		{"max-conns 160 and Redis", []string{"--max-conns", "160", "--redis", "redis://127.0.0.1:1"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startServeVia(t, under, filepath.Join(shortTempDir(t), "s.sock"), append([]string{"--admin="}, tc.args...)...)
			// The log is complete once the daemon has exited.
			must(t, d.cmd.Process.Signal(syscall.SIGTERM))
			select {
			case <-d.done:
			case <-time.After(20 * time.Second):
				t.Fatal("no exit 20 s after SIGTERM")
			}
			if got := strings.Contains(d.stderr.String(), warning); got != tc.warn {
				t.Fatalf("warned %v, want %v; the log:\n%s", got, tc.warn, d.stderr.String())
			}
		})
	}
}
