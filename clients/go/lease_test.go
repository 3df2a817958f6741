package rlclient

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// leaseFake is a sidecar with one concurrency rule of max slots: checks take leases,
// release and renew answer as the daemon does.
type leaseFake struct {
	mu    sync.Mutex
	max   int
	next  int
	held  map[string]bool
	renew uint64 // the last renew's lease_ms
	delay uint64 // delay_ms on allowed checks (a delay rule matched beside the concurrency rule)
}

func (f *leaseFake) answer(req *proto.Request, resp *proto.Response) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch req.Op {
	case proto.OpRelease:
		resp.Released = f.held[req.Lease]
		delete(f.held, req.Lease)
	case proto.OpRenew:
		if f.held[req.Lease] {
			resp.Renewed, resp.ExpiresMs = true, req.LeaseMs
			f.renew = req.LeaseMs
		}
	default:
		if len(f.held) >= f.max {
			resp.Rule, resp.RetryAfterMs = "exports", 1000
			return
		}
		f.next++
		tok := "t." + strconv.Itoa(f.next)
		f.held[tok] = true
		resp.Allowed, resp.Rule, resp.Limit, resp.Remaining, resp.Lease = true, "exports", uint64(f.max), uint64(f.max-len(f.held)), tok
		resp.Rules = []proto.RuleResult{{Name: "exports", Limit: uint64(f.max), WindowMs: 30000, Remaining: resp.Remaining, Allowed: true}}
		resp.DelayMs = f.delay
	}
}

// handedOut returns how many leases the fake's checks took.
func (f *leaseFake) handedOut() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.next
}

func (f *leaseFake) inFlight() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.held)
}

func TestLeaseReleaseRenew(t *testing.T) {
	path := socketPath(t)
	f := &leaseFake{max: 1, held: map[string]bool{}}
	startFake(t, path, f.answer)
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	ctx := context.Background()
	d, err := c.Check(ctx, map[string]string{"user": "ann"}, nil)
	if err != nil || !d.Allowed || d.Lease != "t.1" {
		t.Fatalf("check: %+v %v; want allowed with lease t.1", d, err)
	}
	if d2, _ := c.Check(ctx, map[string]string{"user": "ann"}, nil); d2.Allowed || d2.Lease != "" {
		t.Fatalf("second check: %+v; want refused without a lease", d2)
	}
	if ok, _ := (&Decision{}).Release(ctx); ok {
		t.Fatal("releasing a decision without a lease said true")
	}
	renewed, in, err := c.Renew(ctx, d.Lease, 90*time.Second)
	if err != nil || !renewed || in != 90*time.Second || f.renew != 90000 {
		t.Fatalf("renew: %v %v %v (sent %d ms); want true 90s", renewed, in, err, f.renew)
	}
	if ok, err := d.Release(ctx); !ok || err != nil {
		t.Fatalf("release: %v %v; want true", ok, err)
	}
	if ok, err := d.Release(ctx); ok || err != nil {
		t.Fatalf("second release: %v %v; want false, no error", ok, err)
	}
	if renewed, _, _ := c.Renew(ctx, d.Lease, 0); renewed {
		t.Fatal("renewed a released lease")
	}
	if _, _, err := c.Renew(ctx, d.Lease, -time.Second); err == nil {
		t.Fatal("a negative renew gave no error")
	}
}

// The middleware releases the lease when the handler returns, and when it panics.
func TestMiddlewareReleasesLease(t *testing.T) {
	path := socketPath(t)
	f := &leaseFake{max: 1, held: map[string]bool{}}
	startFake(t, path, f.answer)
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	var during int
	h := Middleware(c, MiddlewareOptions{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		during = f.inFlight()
		if r.URL.Path == "/panic" {
			panic(http.ErrAbortHandler)
		}
	}))
	for i := range 3 {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", "/export", nil))
		if rec.Code != 200 || during != 1 || f.inFlight() != 0 {
			t.Fatalf("request %d: status %d, %d in flight during the handler, %d after; want 200, 1, 0", i, rec.Code, during, f.inFlight())
		}
	}
	func() {
		defer func() { _ = recover() }()
		h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/panic", nil))
	}()
	if f.inFlight() != 0 {
		t.Fatal("a panicking handler kept its lease")
	}
}

// A request holding a lease and a delay whose client goes away while held still frees
// its slot: the middleware arms the release before it waits.
func TestMiddlewareReleasesLeaseWhenDelayEnds(t *testing.T) {
	path := socketPath(t)
	f := &leaseFake{max: 1, held: map[string]bool{}, delay: 5000}
	startFake(t, path, f.answer)
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	called := false
	h := Middleware(c, MiddlewareOptions{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { called = true }))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/export", nil).WithContext(ctx))
	if called || f.inFlight() != 0 {
		t.Fatalf("handler called %v, %d leases in flight after the client left during the delay; want false, 0", called, f.inFlight())
	}
}

// keepLease renews at half of what each answer says is left, stops by itself when a
// renewal answers that the lease is gone, and stop waits for it: no renewal follows stop.
func TestKeepLease(t *testing.T) {
	path := socketPath(t)
	var mu sync.Mutex
	renews := map[string]int{}
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		if req.Op != proto.OpRenew {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		renews[req.Lease]++
		if req.Lease == "live" {
			resp.Renewed, resp.ExpiresMs = true, 40 // the next renewal about 20 ms later
		}
	})
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	count := func(lease string) int {
		mu.Lock()
		defer mu.Unlock()
		return renews[lease]
	}

	stop := keepLease(c, "live", 10*time.Millisecond, 0)
	deadline := time.Now().Add(10 * time.Second)
	for count("live") < 5 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	stop()
	n := count("live")
	if n < 5 {
		t.Fatalf("renewals of a live lease: %d in 10 s", n)
	}
	time.Sleep(100 * time.Millisecond) // about 5 renewals' time
	if got := count("live"); got != n {
		t.Fatalf("renewals after stop: %d, then %d", n, got)
	}

	stop = keepLease(c, "gone", 10*time.Millisecond, 0)
	for count("gone") < 1 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	stop()
	if got := count("gone"); got != 1 {
		t.Fatalf("renewals of a lease the sidecar does not know: %d, want 1 (then it stops)", got)
	}
}

// The middleware keeps renewing through a sidecar that does not answer for longer than
// the shortest rate window, as long as the lease itself lasts: its expiry is the
// concurrency rule's window (3 s), not twice the first renewal's wait (half the rate
// rule's 1 s window). Before, renewals that failed for a second (a sidecar stalled or
// restarting) stopped for good, and the lease expired under the running request.
func TestMiddlewareRenewsThroughAnOutageShorterThanTheLease(t *testing.T) {
	path := socketPath(t)
	var answering atomic.Bool
	var renewed atomic.Int32
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		switch req.Op {
		case proto.OpRenew:
			if !answering.Load() {
				resp.Err = proto.Error{Code: proto.CodeInternal, Message: "the sidecar is away"}
				return
			}
			renewed.Add(1)
			resp.Renewed, resp.ExpiresMs = true, 3000
		case proto.OpRelease:
			resp.Released = true
		default:
			resp.Allowed, resp.Rule, resp.Limit, resp.Lease = true, "exports", 1, "t.1"
			resp.Rules = []proto.RuleResult{
				{Name: "exports", Limit: 1, WindowMs: 3000, Allowed: true, Concurrency: true},
				{Name: "per-second", Limit: 100, WindowMs: 1000, Remaining: 99, Allowed: true},
			}
		}
	})
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	time.AfterFunc(1500*time.Millisecond, func() { answering.Store(true) })
	h := Middleware(c, MiddlewareOptions{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for deadline := time.Now().Add(5 * time.Second); renewed.Load() == 0 && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
	}))
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/export", nil))
	if renewed.Load() == 0 {
		t.Fatal("no renewal after the sidecar answered again 1.5 s in: the renewals stopped at the rate rule's window, not the lease's")
	}
}

// firstRenewal: half the shortest window among the decision's rules (a concurrency
// rule's window is its lease), at least minRenewal; 1 s without rules.
func TestFirstRenewal(t *testing.T) {
	for _, tc := range []struct {
		windows []time.Duration
		want    time.Duration
	}{
		{nil, time.Second},
		{[]time.Duration{30 * time.Second}, 15 * time.Second},
		{[]time.Duration{30 * time.Second, 0, 4 * time.Second}, 2 * time.Second},
		{[]time.Duration{time.Millisecond}, minRenewal},
	} {
		d := Decision{}
		for _, w := range tc.windows {
			d.Rules = append(d.Rules, RuleDecision{Window: w})
		}
		if got := firstRenewal(&d); got != tc.want {
			t.Errorf("windows %v: %v, want %v", tc.windows, got, tc.want)
		}
	}
}

// A check's answer that comes after the caller stopped waiting, and took a lease: the
// client releases it (the caller decided by its Policy, without the slot), so the slot
// does not stay held for the whole lease.
func TestLateLeaseReleased(t *testing.T) {
	path := socketPath(t)
	f := &leaseFake{max: 1, held: map[string]bool{}}
	fk := startFake(t, path, f.answer)
	c := newClient(t, Options{Socket: path, Timeout: 20 * time.Millisecond})
	ctx := context.Background()
	answering(t, c) // dialed before the fake slows down (one ping in 20 ms failed under load)
	fk.delay.Store(int64(100 * time.Millisecond))
	d, err := c.Check(ctx, map[string]string{"user": "ann"}, nil)
	if err != nil || !d.Unreachable || d.Lease != "" {
		t.Fatalf("slow check: %+v %v; want the policy's decision, without a lease", d, err)
	}
	fk.delay.Store(0)
	deadline := time.Now().Add(5 * time.Second)
	for f.handedOut() == 0 { // the fake sleeps before it answers, and takes the lease then
		if time.Now().After(deadline) {
			t.Fatal("the fake never answered the slow check")
		}
		time.Sleep(5 * time.Millisecond)
	}
	for f.inFlight() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the late answer's lease is still held 5 s after the check timed out")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The slot is free again: the next check takes it.
	if d, err := c.Check(ctx, map[string]string{"user": "ann"}, nil); err != nil || !d.Allowed || d.Lease == "" {
		t.Fatalf("check after the late lease's release: %+v %v; want allowed with a lease", d, err)
	}
}

// A request whose client goes away while it is being checked is not passed on (as when it
// goes during a delay); the lease the late answer takes is released (releaseOrphan).
func TestMiddlewareClientGoneDuringCheck(t *testing.T) {
	path := socketPath(t)
	f := &leaseFake{max: 1, held: map[string]bool{}}
	fk := startFake(t, path, f.answer)
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	if _, err := c.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	served := false
	h := Middleware(c, MiddlewareOptions{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { served = true }))
	fk.delay.Store(int64(100 * time.Millisecond))
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/export", nil).WithContext(ctx))
	fk.delay.Store(0)
	if served {
		t.Fatal("the handler ran for a client that went away during the check")
	}
	deadline := time.Now().Add(5 * time.Second)
	for f.handedOut() == 0 || f.inFlight() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the late answer's lease: handed out %d, in flight %d; want 1, 0", f.handedOut(), f.inFlight())
		}
		time.Sleep(5 * time.Millisecond)
	}
}
