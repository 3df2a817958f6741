package rlclient

import (
	"context"
	"os"
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
