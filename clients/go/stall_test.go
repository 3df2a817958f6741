package rlclient

import (
	"context"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// A sidecar that stops answering on its connections (frozen; or an old sidecar stopped
// with SIGSTOP while a new one took its socket, in a blue/green switch) loses them: a
// connection that answers nothing for stallFor (1 s here) while checks wait on it is
// closed, and the next check redials, reaching whoever serves the socket now. Before, the
// client kept sending on the silent connections, every check answered by the policy,
// until the old process ended (systemd's watchdog: 30 s).
func TestStalledConnectionRedials(t *testing.T) {
	path := socketPath(t)
	frozen := make(chan struct{})
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		<-frozen // never answers once frozen
	})
	defer close(frozen)
	c, err := New(Options{Socket: path, Conns: 2, Timeout: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	attrs := map[string]string{"user": "blue"}
	// The old sidecar holds the client's connections; its successor takes the path.
	for range 2 {
		if d, _ := c.Check(ctx, attrs, nil); !d.Unreachable {
			t.Fatalf("the frozen sidecar answered: %+v", d)
		}
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	startFake(t, path, nil)
	switched := time.Now()
	for i := 1; ; i++ {
		d, err := c.Check(ctx, attrs, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !d.Unreachable {
			if d.Rule != "blue" {
				t.Fatalf("answer %+v; want the successor's echo", d)
			}
			t.Logf("the successor answered %s (%d checks) after the switch", time.Since(switched).Round(time.Millisecond), i)
			break
		}
		if time.Since(switched) > 3*c.stallFor() {
			t.Fatalf("%s after the switch still unanswered (%v): the client keeps the frozen sidecar's connections", time.Since(switched).Round(time.Millisecond), d.Cause)
		}
	}
}

// The sidecar frees a lease when the connection that took it closes. A connection given up
// for a stall that holds the leases of requests still running is retired, not closed:
// the next check redials, but the connection stays open until those leases are released
// (through the new connection), so the slots stay held. Before, it was closed, and after
// any stall of stallFor the sidecar freed the slots of the requests still running: with a
// concurrency max of 1, a second request was admitted beside the first (the real daemon,
// SIGSTOPped 2 s under the Go middleware: 3 of 3 admitted after the stall, now 0).
func TestStalledConnectionKeepsLeases(t *testing.T) {
	path := socketPath(t)
	var frozen atomic.Bool
	thaw := make(chan struct{})
	f := startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		if frozen.Load() {
			<-thaw
		}
		switch req.Op {
		case proto.OpRelease:
			resp.Released = req.Lease == "t.1"
		case proto.OpRenew:
		default:
			echoUser(req, resp)
			if attr(req, "user") == "leased" {
				resp.Lease = "t.1"
				resp.Rules[0].WindowMs = 30000
			}
		}
	})
	open := func() int {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.conns)
	}
	c, err := New(Options{Socket: path, Conns: 1, Timeout: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	d, _ := c.Check(ctx, map[string]string{"user": "leased"}, nil)
	if d.Lease != "t.1" {
		t.Fatalf("no lease: %+v", d)
	}
	frozen.Store(true)
	start := time.Now()
	for open() < 2 {
		c.Check(ctx, map[string]string{"user": "x"}, nil)
		if time.Since(start) > 3*c.stallFor() {
			t.Fatal("the client never gave up the stalled connection")
		}
	}
	frozen.Store(false)
	close(thaw)
	time.Sleep(200 * time.Millisecond)
	if n := open(); n != 2 {
		t.Fatalf("%d connections open after the stall; want 2: the one holding the lease was closed, freeing its slot", n)
	}
	if d, _ := c.Check(ctx, map[string]string{"user": "y"}, nil); d.Unreachable {
		t.Fatalf("the new connection does not answer: %v", d.Cause)
	}
	if ok, err := d.Release(ctx); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	eventually(t, "the retired connection to close once its lease is released", func() bool { return open() == 1 })
}
