package rlclient

import (
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
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
	path, c := frozenSidecar(t)
	ctx := context.Background()
	attrs := map[string]string{"user": "blue"}
	// The old sidecar holds the client's connections; its successor takes the path.
	for range 2 {
		if d, _ := c.Check(ctx, attrs, nil); !d.Unreachable {
			t.Fatalf("the frozen sidecar answered: %+v", d)
		}
	}
	switchSidecar(t, c, path, attrs, "connections")
}

// The same when every check's ctx ends before Options.Timeout (a gateway that gives each
// check a deadline of its own, shorter than the Client's Timeout): those checks time out
// on the stalled connection all the same. Before, only a wait of the whole Timeout counted
// toward a stall, and such a gateway kept the frozen sidecar's connections, every check
// answered by the policy, until that process ended.
func TestStalledConnectionRedialsUnderShorterDeadlines(t *testing.T) {
	path, c := frozenSidecar(t)
	within := c.opts.Timeout / 2
	attrs := map[string]string{"user": "blue"}
	for range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), within)
		d, _ := c.Check(ctx, attrs, nil)
		cancel()
		if !d.Unreachable {
			t.Fatalf("the frozen sidecar answered: %+v", d)
		}
	}
	switchSidecarWithin(t, c, path, attrs, "connections", within)
}

// A sidecar that answers, only later than the callers' deadlines, is no stall: its late
// answers end each quiet spell, and its connection is kept however long every check
// times out on it (here for twice stallFor).
func TestSlowSidecarKeptUnderShorterDeadlines(t *testing.T) {
	path := socketPath(t)
	f := startFake(t, path, nil)
	f.delay.Store(int64(3 * time.Millisecond))
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 20 * time.Millisecond})
	attrs := map[string]string{"user": "slow"}
	var first *conn
	timedOut := 0
	for start := time.Now(); time.Since(start) < 2*c.stallFor(); {
		ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
		d, _ := c.Check(ctx, attrs, nil)
		cancel()
		if d.Unreachable {
			timedOut++
		}
		c.slots[0].mu.Lock()
		cn := c.slots[0].cn
		c.slots[0].mu.Unlock()
		if first == nil {
			first = cn
		} else if cn != first {
			t.Fatalf("the answering sidecar's connection was given up after %d checks timed out on it", timedOut)
		}
		time.Sleep(3 * time.Millisecond) // the sidecar keeps up
	}
	if timedOut == 0 {
		t.Fatal("no check timed out: the test proves nothing")
	}
}

// A stall is timed on the Client's monotonic clock (Client.mono), not the wall clock: a
// step of the wall clock neither gives a connection up early nor keeps a stalled one
// longer (measured in Unix ns, the quiet spell lasted as long as a step back besides: an
// hour's step, an hour's checks decided by the policy). Go cannot be given a faked wall
// clock, so the test stops the Client's clock instead: checks time out on the frozen
// sidecar for twice stallFor in real time, and neither connection is given up; once the
// clock moves stallFor on, the next timeouts give both up.
func TestStallTimedOnTheClientsClock(t *testing.T) {
	_, c := frozenSidecar(t)
	var clock atomic.Int64
	c.mono = func() time.Duration { return time.Duration(clock.Load()) }
	ctx := context.Background()
	attrs := map[string]string{"user": "blue"}
	conns := func() []*conn {
		out := make([]*conn, len(c.slots))
		for i := range c.slots {
			s := &c.slots[i]
			s.mu.Lock()
			out[i] = s.cn
			s.mu.Unlock()
		}
		return out
	}
	check := func() {
		if d, _ := c.Check(ctx, attrs, nil); !d.Unreachable {
			t.Fatalf("the frozen sidecar answered: %+v", d)
		}
	}
	for range 2 {
		check() // dials both
	}
	first := conns()
	if first[0] == nil || first[1] == nil {
		t.Fatalf("connections not dialed: %v", first)
	}
	checks := 0
	for start := time.Now(); time.Since(start) < 2*c.stallFor(); checks++ {
		check()
	}
	if got := conns(); !slices.Equal(got, first) {
		t.Fatalf("a connection was given up after %d timed-out checks while the client's clock stood still: the stall was timed on another clock", checks)
	}
	clock.Store(int64(c.stallFor()))
	for i := 0; ; i++ {
		now := conns()
		if now[0] != first[0] && now[1] != first[1] {
			break
		}
		if i == 100 {
			t.Fatalf("the connections were not given up %d checks after the client's clock passed stallFor", i)
		}
		check()
	}
}

// The same when the frozen sidecar's connections are full: a burst (or a load of more than
// maxPending checks within stallFor) fills each with checks it never answers, and every
// later check waits for room and times out there, never sent on one. Such a timeout is a
// check the connection left unanswered too: it counts toward the stall. Before, only a
// check that timed out after it was sent counted, so a full connection was never given
// up: every check was answered by the Policy until the old process ended.
func TestStalledFullConnectionRedials(t *testing.T) {
	path, c := frozenSidecar(t)
	c.maxPending = 4
	ctx := context.Background()
	attrs := map[string]string{"user": "blue"}
	// Both connections fill with checks the frozen sidecar never answers: 2 × maxPending
	// of them, and more when one timed out (20 ms) before it was written, as on a loaded
	// machine (then it is not in flight: [4 3] after 8 checks, 1 of 23 runs at load 15).
	full := func() bool {
		got := pendingOn(c)
		return len(got) == 2 && got[0] == c.maxPending && got[1] == c.maxPending
	}
	for i := 0; !full(); i++ {
		if i == 10*c.maxPending {
			t.Fatalf("calls in flight per connection after %d checks: %v, want both full (%d)", i, pendingOn(c), c.maxPending)
		}
		if d, _ := c.Check(ctx, attrs, nil); !d.Unreachable {
			t.Fatalf("the frozen sidecar answered: %+v", d)
		}
	}
	switchSidecar(t, c, path, attrs, "full connections")
}

// The sidecar frees a lease when the connection that took it closes. A connection given up
// for a stall that holds the leases of requests still running is retired, not closed:
// the next check redials, but the connection stays open until those leases are released
// (through the new connection), so the slots stay held. Before, it was closed, and after
// any stall of stallFor the sidecar freed the slots of the requests still running: with a
// concurrency max of 1, a second request was admitted beside the first (the real daemon,
// SIGSTOPped 2 s under the Go middleware: 3 of 3 admitted after the stall, now 0).
//
// A late answer's lease (its check timed out: releaseOrphan) does not keep the retired
// connection open: no request runs under it, and closing frees it as the release does.
// Before, it was tracked until its release was answered, and the retired connection that
// had taken it stayed open (for the whole lease when that release was not answered in
// time), the other slots it held with it.
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
			if req.Lease == "t.2" {
				time.Sleep(150 * time.Millisecond) // past the release's timeout
			}
			resp.Released = req.Lease == "t.1" || req.Lease == "t.2"
		case proto.OpRenew:
		default:
			echoUser(req, resp)
			if u := attr(req, "user"); u == "leased" || u == "late" {
				resp.Lease = map[string]string{"leased": "t.1", "late": "t.2"}[u]
				resp.Rules[0].WindowMs = 30000
			}
		}
	})
	open := func() int {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.conns)
	}
	// 100 ms, not 20: the lease's check, and after the stall the new connection's check and
	// the release, must be answered in time on a loaded machine. The stall time is the
	// same (stallFor: at least 1 s), and the late lease's release still goes unanswered
	// (the stand-in takes 150 ms).
	c, err := New(Options{Socket: path, Conns: 1, Timeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	answering(t, c)
	d, _ := c.Check(ctx, map[string]string{"user": "leased"}, nil)
	if d.Lease != "t.1" {
		t.Fatalf("no lease: %+v", d)
	}
	frozen.Store(true)
	if late, _ := c.Check(ctx, map[string]string{"user": "late"}, nil); !late.Unreachable {
		t.Fatalf("the stalled check was answered: %+v", late)
	}
	start := time.Now()
	for open() < 2 {
		c.Check(ctx, map[string]string{"user": "x"}, nil)
		if time.Since(start) > 3*c.stallFor() {
			t.Fatal("the client never gave up the stalled connection")
		}
	}
	frozen.Store(false)
	close(thaw) // "late" is answered now, with a lease t.2: released by the client, too late
	time.Sleep(400 * time.Millisecond)
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

// A connection retired for a stall while it holds a lease never released is closed once
// that lease has expired: its lease is the concurrency rule's window, not the longest
// window of the answer's rules. Before, a check that also matched a rule of 1 per day kept
// the retired connection open for a day, for each stall.
func TestRetiredConnectionHeldForTheLeaseNotARateWindow(t *testing.T) {
	_, _, retired := retiredWithLease(t, 3000)
	eventually(t, "the retired connection to close once its lease has expired (not the day rule's window)",
		func() bool { return retired() == 0 })
}

// A release the stalled sidecar does not answer ends the lease all the same: the retired
// connection holding it, holding no other, is closed at once, which frees the lease on the
// sidecar (as soon as it runs again). Before, it stayed open, its descriptor held, until
// the lease expired (30 s here, up to an hour): one per leased request that ended during
// the stall.
func TestUnansweredReleaseClosesTheRetiredConnection(t *testing.T) {
	c, d, retired := retiredWithLease(t, 30000)
	if ok, err := d.Release(context.Background()); ok || !errors.Is(err, ErrUnreachable) {
		t.Fatalf("the frozen sidecar answered the release: %v %v", ok, err)
	}
	eventually(t, "the retired connection to close once its lease's release went unanswered",
		func() bool { return retired() == 0 })
	c.leaseMu.Lock()
	defer c.leaseMu.Unlock()
	if len(c.leases) != 0 {
		t.Fatalf("leases still tracked: %v", c.leases)
	}
}

// retiredWithLease starts a stand-in sidecar and a client of it (one connection, a 250 ms
// timeout), takes a lease of a concurrency rule whose lease is leaseMs (beside a rule of 1
// per day), freezes the sidecar and checks until the connection is retired for the stall.
// It returns the client, the leased decision and the count of retired connections.
func retiredWithLease(t *testing.T, leaseMs uint64) (*Client, Decision, func() int) {
	t.Helper()
	path := socketPath(t)
	var frozen atomic.Bool
	thaw := make(chan struct{})
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		if frozen.Load() {
			<-thaw
		}
		echoUser(req, resp)
		if attr(req, "user") == "leased" {
			resp.Lease = "t.1"
			resp.Rules = []proto.RuleResult{
				{Name: "exports", Limit: 1, WindowMs: leaseMs, Allowed: true, Concurrency: true},
				{Name: "per-day", Limit: 1000, WindowMs: 86_400_000, Remaining: 999, Allowed: true},
			}
		}
	})
	t.Cleanup(func() { close(thaw) }) // before the stand-in stops (cleanups run last first)
	// 250 ms, not 20: the lease's check must be answered in time on a loaded machine ("no
	// lease": its 20 ms passed, 1 of 8 package runs at load 6). The stall time is the same
	// (stallFor: at least 1 s).
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 250 * time.Millisecond})
	ctx := context.Background()
	answering(t, c)
	d, _ := c.Check(ctx, map[string]string{"user": "leased"}, nil)
	if d.Lease != "t.1" {
		t.Fatalf("no lease: %+v", d)
	}
	frozen.Store(true)
	retired := func() int {
		c.leaseMu.Lock()
		defer c.leaseMu.Unlock()
		return len(c.retired)
	}
	start := time.Now()
	for retired() == 0 {
		c.Check(ctx, map[string]string{"user": "x"}, nil)
		if time.Since(start) > 3*c.stallFor() {
			t.Fatal("the client never retired the stalled connection holding a lease")
		}
	}
	return c, d, retired
}

// A sidecar that stops reading while many checks are sent fills the socket's buffer, and
// a write times out: that connection too is retired, not closed, while it holds leases.
// Before, the write timeout closed it: 200 goroutines checking through a 1.5 s SIGSTOP of
// the real daemon freed the lease of a request still running (max 1: a second admitted).
func TestStalledWriteKeepsLeases(t *testing.T) {
	path := socketPath(t)
	var frozen atomic.Bool
	thaw := make(chan struct{})
	f := startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		if frozen.Load() {
			<-thaw
		}
		switch req.Op {
		case proto.OpRelease:
			if req.Lease == "t.2" {
				time.Sleep(150 * time.Millisecond) // past the release's timeout
			}
			resp.Released = req.Lease == "t.1" || req.Lease == "t.2"
		case proto.OpRenew:
		default:
			echoUser(req, resp)
			if u := attr(req, "user"); u == "leased" || u == "late" {
				resp.Lease = map[string]string{"leased": "t.1", "late": "t.2"}[u]
				resp.Rules[0].WindowMs = 30000
			}
		}
	})
	open := func() int {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.conns)
	}
	var leased net.Conn // the fake's end of the connection that took the lease
	isOpen := func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		_, ok := f.conns[leased]
		return ok
	}
	// A timeout (each answer's, and each write's) of 500 ms, not 20: on a loaded machine
	// the lease's check and its release after the stall were not answered within 20 ms
	// ("no lease", "release: false ... no answer within the timeout"). The writes still
	// time out soon, once the frozen sidecar's socket is full.
	c, err := New(Options{Socket: path, Conns: 1, Timeout: 500 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	answering(t, c)
	d, _ := c.Check(ctx, map[string]string{"user": "leased"}, nil)
	if d.Lease != "t.1" {
		t.Fatalf("no lease: %+v", d)
	}
	f.mu.Lock()
	for nc := range f.conns {
		leased = nc
	}
	f.mu.Unlock()
	frozen.Store(true)
	big := strings.Repeat("x", 2000) // frames that fill the socket's buffer soon
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				c.Check(ctx, map[string]string{"user": "x", "pad": big + strconv.Itoa(i)}, nil)
			}
		}()
	}
	start := time.Now()
	for open() < 2 && time.Since(start) < 3*time.Second {
		time.Sleep(10 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	frozen.Store(false)
	close(thaw)
	time.Sleep(300 * time.Millisecond)
	if !isOpen() {
		t.Fatal("the connection holding the lease was closed after the stall, freeing its slot")
	}
	if ok, err := d.Release(ctx); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	eventually(t, "the retired connection to close once its lease is released", func() bool { return !isOpen() })
}

func TestFrameRest(t *testing.T) {
	frame := func(n int) []byte {
		b := make([]byte, proto.HeaderSize+n)
		binary.BigEndian.PutUint32(b, uint32(n))
		for i := proto.HeaderSize; i < len(b); i++ {
			b[i] = byte(len(b))
		}
		return b
	}
	b := append(frame(3), frame(5)...) // 7 bytes, then 9
	for _, tc := range []struct{ n, want int }{{1, 6}, {6, 1}, {7, 0}, {8, 8}, {15, 1}, {16, 0}} {
		if got := frameRest(b, tc.n); len(got) != tc.want {
			t.Errorf("frameRest after %d bytes: %d bytes; want %d", tc.n, len(got), tc.want)
		}
	}
}

// switchSidecar starts a successor on path in place of the frozen sidecar holding c's
// connections (a blue/green switch), and checks attrs until the successor answers them,
// failing the test when the client still keeps the frozen sidecar's (what) after three
// times its stall time.
// frozenSidecar starts a stand-in sidecar that never answers, and a client of it with
// two connections and a 20 ms timeout; both end with the test.
func frozenSidecar(t *testing.T) (string, *Client) {
	t.Helper()
	path := socketPath(t)
	frozen := make(chan struct{})
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		<-frozen // never answers
	})
	t.Cleanup(func() { close(frozen) })
	c, err := New(Options{Socket: path, Conns: 2, Timeout: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return path, c
}

func switchSidecar(t *testing.T, c *Client, path string, attrs map[string]string, what string) {
	t.Helper()
	switchSidecarWithin(t, c, path, attrs, what, 0)
}

// switchSidecarWithin is switchSidecar with each check's ctx ending after within (0:
// never).
func switchSidecarWithin(t *testing.T, c *Client, path string, attrs map[string]string, what string, within time.Duration) {
	t.Helper()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	startFake(t, path, nil)
	switched := time.Now()
	for i := 1; ; i++ {
		ctx, cancel := context.Background(), context.CancelFunc(func() {})
		if within > 0 {
			ctx, cancel = context.WithTimeout(ctx, within)
		}
		d, err := c.Check(ctx, attrs, nil)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if !d.Unreachable {
			if d.Rule != attrs["user"] {
				t.Fatalf("answer %+v; want the successor's echo", d)
			}
			t.Logf("the successor answered %s (%d checks) after the switch", time.Since(switched).Round(time.Millisecond), i)
			return
		}
		if time.Since(switched) > 3*c.stallFor() {
			t.Fatalf("%s after the switch still unanswered (%v): the client keeps the frozen sidecar's %s", time.Since(switched).Round(time.Millisecond), d.Cause, what)
		}
	}
}

// A connection's quiet spell starts when a check is first sent on it, not when it was
// dialed: a dial can outlive the check that started it (DialTimeout, 100 ms by default,
// is longer than Timeout; the caller's ctx can end), and the connection then waits unused
// in its slot. Timed from the dial, the first check on it that timed out (a caller's
// short deadline, a slow global check) found it quiet for as long as it had been idle,
// over stallFor, and gave it up though the sidecar answered: the other checks pending on
// it got the Policy, and the slot redialed. Here the connection is dialed as a check does
// (slot.get), left idle two stallFor on the Client's clock, then a check times out on it
// (the stand-in holds its answer): it is kept, and answers the next check.
func TestIdleDialedConnectionNotGivenUpAtItsFirstTimeout(t *testing.T) {
	path := socketPath(t)
	hold := make(chan struct{})
	var held sync.Once
	release := func() { held.Do(func() { close(hold) }) }
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		if attr(req, "user") == "late" {
			<-hold
		}
		echoUser(req, resp)
	})
	t.Cleanup(release)
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 50 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler)})
	var clock atomic.Int64
	c.mono = func() time.Duration { return time.Duration(clock.Load()) }
	cl := getCall()
	cn, err := c.slots[0].get(context.Background(), cl)
	cl.release()
	if err != nil {
		t.Fatal(err)
	}
	clock.Store(int64(2 * c.stallFor()))
	if d, _ := c.Check(context.Background(), map[string]string{"user": "late"}, nil); !d.Unreachable || !errors.Is(d.Cause, errTimeout) {
		t.Fatalf("the held check: %+v (want it timed out)", d)
	}
	select {
	case <-cn.dead:
		t.Fatalf("the connection, idle since it was dialed, was given up at its first check's timeout: %v", cn.err)
	default:
	}
	release()
	d, err := c.Check(context.Background(), map[string]string{"user": "next"}, nil)
	if err != nil || d.Unreachable || d.Rule != "next" {
		t.Fatalf("the next check: %+v %v", d, err)
	}
	s := &c.slots[0]
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cn != cn {
		t.Fatal("the next check went on another connection")
	}
}
