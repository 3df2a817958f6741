package rlclient

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// gatedFake is a sidecar that answers nothing until its gate opens: requests pile up in
// flight on the client's connections.
func gatedFake(t *testing.T) (path string, f *fakeSidecar, open func()) {
	path = socketPath(t)
	gate := make(chan struct{})
	var once sync.Once
	open = func() { once.Do(func() { close(gate) }) }
	f = startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		<-gate
		echoUser(req, resp)
	})
	t.Cleanup(open) // before the fake's stop, which waits for its goroutines
	return path, f, open
}

// pendingOn returns the calls in flight on each of c's connections (0 for a slot without one).
func pendingOn(c *Client) []int {
	out := make([]int, len(c.slots))
	for i := range c.slots {
		s := &c.slots[i]
		s.mu.Lock()
		cn := s.cn
		s.mu.Unlock()
		if cn != nil {
			cn.mu.Lock()
			out[i] = cn.pending.n
			cn.mu.Unlock()
		}
	}
	return out
}

// checkAll runs one Check per user at once and returns their decisions and durations.
func checkAll(c *Client, ctx context.Context, users []string) ([]Decision, []time.Duration) {
	ds := make([]Decision, len(users))
	took := make([]time.Duration, len(users))
	var wg sync.WaitGroup
	for i, u := range users {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			ds[i], _ = c.Check(ctx, map[string]string{"user": u}, nil)
			took[i] = time.Since(start)
		}()
	}
	wg.Wait()
	return ds, took
}

func users(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprint(prefix, i)
	}
	return out
}

// More checks at once than the pool may have in flight: those beyond wait for room and
// are answered by the sidecar, not by the Policy. (Before, every check beyond the 2 × 8
// answered by the Policy at once: fail-open let them all through.)
func TestFullConnectionsWaitForRoom(t *testing.T) {
	path, f, open := gatedFake(t)
	c := newClient(t, Options{Socket: path, Conns: 2, Timeout: 10 * time.Second, Policy: FailClosed})
	c.maxPending = 8
	us := users("w", 100)
	var ds []Decision
	done := make(chan struct{})
	go func() {
		ds, _ = checkAll(c, context.Background(), us)
		close(done)
	}()
	eventually(t, "both connections to fill", func() bool {
		p := pendingOn(c)
		return p[0] == 8 && p[1] == 8
	})
	select {
	case <-done:
		t.Fatal("the checks beyond the connections' room returned before the sidecar answered")
	case <-time.After(50 * time.Millisecond):
	}
	if p := pendingOn(c); p[0] > 8 || p[1] > 8 {
		t.Fatalf("in flight %v, more than 8 on a connection", p)
	}
	open()
	<-done
	for i, d := range ds {
		if d.Unreachable || d.Degraded || d.Rule != us[i] {
			t.Fatalf("check %s: %+v", us[i], d)
		}
	}
	if n := f.requests.Load(); n != 100 {
		t.Fatalf("the sidecar read %d requests, want 100", n)
	}
}

// A check that finds no room waits no longer than its own deadline (Options.Timeout, or
// ctx's when earlier), then answers by the Policy; room that frees later serves later checks.
func TestNoRoomUntilTheDeadline(t *testing.T) {
	path, _, open := gatedFake(t)
	const timeout = 150 * time.Millisecond
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: timeout, Policy: FailClosed})
	c.maxPending = 4

	ds, took := checkAll(c, context.Background(), users("n", 10))
	noRoom := 0
	for i, d := range ds {
		if d.Allowed || !d.Unreachable || !errors.Is(d.Cause, ErrUnreachable) {
			t.Fatalf("check %d: %+v", i, d)
		}
		if took[i] < timeout || took[i] > timeout+2*time.Second {
			t.Fatalf("check %d answered by the Policy after %v; its timeout is %v", i, took[i], timeout)
		}
		if d.Cause == errNoRoom {
			noRoom++
		}
	}
	if noRoom != 6 {
		t.Fatalf("%d of 10 checks found no room, want 6 (4 in flight)", noRoom)
	}

	// A ctx deadline earlier than the timeout bounds the wait too.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	start := time.Now()
	d, err := c.Check(ctx, map[string]string{"user": "ctx"}, nil)
	if err != nil || !d.Unreachable || time.Since(start) >= timeout {
		t.Fatalf("with a 30ms ctx: %+v, %v after %v", d, err, time.Since(start))
	}

	// The four abandoned calls hold the room until their answers come; then it frees.
	open()
	eventually(t, "the room to free", func() bool {
		d, _ := c.Check(context.Background(), map[string]string{"user": "later"}, nil)
		return d.Rule == "later"
	})
}

// A connection that breaks while checks wait for its room sends them on (its slot redials).
func TestWaitersMoveOnWhenTheConnectionBreaks(t *testing.T) {
	path, f, open := gatedFake(t)
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 10 * time.Second, Policy: FailClosed})
	c.maxPending = 2
	if _, err := c.Ping(context.Background()); err != nil { // served: no backoff after the drop
		t.Fatal(err)
	}
	answered := 0
	done := make(chan []Decision)
	go func() {
		ds, _ := checkAll(c, context.Background(), users("b", 5))
		done <- ds
	}()
	eventually(t, "the connection to fill", func() bool { return pendingOn(c)[0] == 2 })
	time.Sleep(20 * time.Millisecond) // the other three are waiting for room
	f.dropConns()                     // the two in flight answer by the Policy; the three waiting redial
	open()
	ds := <-done
	for _, d := range ds {
		if d.Rule != "" {
			answered++
		}
	}
	// The 3 that waited; and the second in flight when the drop reset the connection
	// with its frame still unread (the fake had not read it yet: a loaded machine), which
	// is then certainly not decided and sent again (notSent).
	if answered != 3 && answered != 4 {
		t.Fatalf("%d of 5 checks answered by the sidecar after the drop, want the 3 that waited (4 if the last in flight was unread): %+v", answered, ds)
	}
}

// The outside tester's case at the real cap: more concurrent checks than one connection
// may have in flight (4,096), on a sidecar that answers them all.
func TestBurstBeyondMaxPending(t *testing.T) {
	path, f, open := gatedFake(t)
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 20 * time.Second})
	const n = maxPending + 1500
	us := users("m", n)
	var ds []Decision
	done := make(chan struct{})
	go func() {
		ds, _ = checkAll(c, context.Background(), us)
		close(done)
	}()
	// 5,596 goroutines under -race on a loaded machine took more than eventually's 5 s to
	// put 4,096 checks on the connection; each waits 20 s for its answer, so up to 15 s.
	eventuallyWithin(t, "the connection to fill", 15*time.Second, func() bool { return pendingOn(c)[0] == maxPending })
	open()
	<-done
	bad := 0
	for i, d := range ds {
		if d.Unreachable || d.Rule != us[i] {
			if bad++; bad < 5 {
				t.Errorf("check %s: %+v", us[i], d)
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%d of %d checks were not answered by the sidecar", bad, n)
	}
	if got := f.requests.Load(); got != n {
		t.Fatalf("the sidecar read %d requests, want %d", got, n)
	}
}
