package main

import (
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// No READY=1 or RELOADING=1 reaches the service manager after STOPPING=1, even when a
// reload ends as the drain begins (the file watcher runs until the drain ends): the
// check that the daemon is not stopping and the message must be one step. Before, ready
// read the flag, then took the lock to send: a stopping in between was sent first.
func TestNotifierNothingAfterStopping(t *testing.T) {
	path := filepath.Join(shortTempDir(t), "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	t.Setenv("NOTIFY_SOCKET", path)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	buf := make([]byte, 4096)
	late := 0
	const rounds = 200000
	for i := 0; i < rounds; i++ {
		n := newNotifier(log)
		start := make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); <-start; n.ready("serving") }()
		go func() { defer wg.Done(); <-start; n.stopping("draining") }()
		close(start)
		wg.Wait()
		n.send("X=END") // after both: the round's messages end here
		stopped := false
		for {
			m, err := c.Read(buf)
			if err != nil {
				t.Fatal(err)
			}
			msg := string(buf[:m])
			if msg == "X=END" {
				break
			}
			if strings.Contains(msg, "READY=1") && stopped {
				late++
			}
			stopped = stopped || strings.Contains(msg, "STOPPING=1")
		}
	}
	if late > 0 {
		t.Fatalf("READY=1 after STOPPING=1 in %d of %d rounds", late, rounds)
	}
}
