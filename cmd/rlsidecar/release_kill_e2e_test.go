package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	rlclient "github.com/rlsidecar/rlsidecar/clients/go"
	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// A daemon killed (SIGKILL: the OOM killer, the watchdog) while a gateway's releases of
// global leases were written to it and not yet answered, restarted on the socket systemd
// holds. A release is idempotent, so the Go client sends each such release again on a
// new connection, to the daemon's successor, which frees the slots in Redis. Before, only
// the last call pending on the reset connection was sent again: the other releases
// failed with "connection reset by peer", and their slots stayed held in Redis for the
// whole lease while no request held them (a handover harness, scripts/handover, saw 2 to
// 4 slots of a global concurrency rule of max 4 leaked at a SIGKILL under load).
func TestE2EGoClientReleasesThroughTheSuccessorOfAKilledDaemon(t *testing.T) {
	if _, err := exec.LookPath("ss"); err != nil {
		t.Skip("needs ss (iproute2)")
	}
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	socket := filepath.Join(dir, "s.sock")
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: exports
    key: user
    concurrency: { max: 3, lease: 1h }
    mode: global
`)
	n := listenNotify(t)
	t.Setenv("NOTIFY_SOCKET", n.path)
	// As systemd's Restart=: the next daemon starts on the socket systemd keeps open.
	loop := `for i in 0 1; do (export LISTEN_PID=$BASHPID; exec "$0" serve --admin= --watch=false --config "$1" --redis "$2" --global-timeout 2s --redis-timeout 1s); done`
	activator(t, socket, []string{"NOTIFY_SOCKET"}, "bash", "-c", loop, binary, cfg, "redis://"+srv.Addr)

	c, err := rlclient.New(rlclient.Options{Socket: socket, Conns: 1, Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	attrs := map[string]string{"user": "ann"}
	var leases []string
	for i := range 3 {
		d, err := c.Check(ctx, attrs, nil)
		if err != nil || !d.Allowed || d.Degraded || d.Lease == "" {
			t.Fatalf("check %d: %+v, %v; want allowed with a lease", i+1, d, err)
		}
		leases = append(leases, d.Lease)
	}
	first := n.waitFor(t, "READY", 10*time.Second)

	// The daemon stops reading (frozen); the gateway's requests end and it releases
	// their leases: the frames wait, unread, in the daemon's socket.
	if err := syscall.Kill(first.pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitStopped(t, first.pid)
	type result struct {
		released bool
		err      error
	}
	results := make(chan result, len(leases))
	size := 0
	for i, l := range leases {
		enc := proto.NewEncoder()
		enc.EncodeRequest(&proto.Request{ID: uint64(100 + i), Op: proto.OpRelease, Cost: 1, Lease: l})
		size += enc.Len()
		go func() {
			ok, err := c.Release(ctx, l)
			results <- result{ok, err}
		}()
	}
	deadline := time.Now().Add(30 * time.Second)
	for queued := 0; queued < size; queued = unreadOn(t, socket) {
		if time.Now().After(deadline) {
			t.Fatalf("the releases did not reach the daemon's socket in 30s: %d of %d bytes", queued, size)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := syscall.Kill(first.pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	n.waitFor(t, "READY", 30*time.Second) // the next daemon

	for range leases {
		r := <-results
		if r.err != nil || !r.released {
			t.Errorf("release: %v, %v; want released through the next daemon", r.released, r.err)
		}
	}
	// Every slot is free: three more requests are admitted.
	for i := range 3 {
		d, err := c.Check(ctx, attrs, nil)
		if err != nil || !d.Allowed || d.Degraded {
			t.Fatalf("check %d after the releases: %+v, %v; want allowed (the slots held with no request)", i+1, d, err)
		}
	}
}

// unreadOn returns the bytes the connections accepted on the Unix socket path hold
// unread, as ss reports them (Recv-Q).
func unreadOn(t *testing.T, path string) int {
	t.Helper()
	out, err := exec.Command("ss", "-xHn", "state", "established").Output()
	if err != nil {
		t.Fatalf("ss: %v", err)
	}
	sum := 0
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		// Netid Recv-Q Send-Q Local-Address Port Peer-Address Port (no State column
		// when filtering on one state).
		if len(f) >= 4 && f[3] == path {
			q, _ := strconv.Atoi(f[1])
			sum += q
		}
	}
	return sum
}

// waitStopped waits up to 30 s until every thread of process pid has stopped (SIGSTOP is
// delivered asynchronously: a thread running meanwhile may still read its sockets).
func waitStopped(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		tasks, err := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/task/*/stat")
		if err != nil || len(tasks) == 0 {
			t.Fatalf("threads of %d: %v", pid, err)
		}
		stopped := true
		for _, task := range tasks {
			b, err := os.ReadFile(task)
			// The state follows the command's closing parenthesis.
			if i := strings.LastIndexByte(string(b), ')'); err != nil || i < 0 || i+2 >= len(b) || (b[i+2] != 'T' && b[i+2] != 't') {
				stopped = false
				break
			}
		}
		if stopped {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d not stopped 30s after SIGSTOP", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
