package rlclient

import (
	"context"
	"errors"
	"fmt"
	"net"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(int) { removeDaemonBinary() }))
}

func newClient(t testing.TB, o Options) *Client {
	t.Helper()
	c, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// attrList makes attributes from name, value pairs.
func attrList(kv ...string) []proto.Attr {
	var out []proto.Attr
	for i := 0; i+1 < len(kv); i += 2 {
		out = append(out, proto.Attr{Name: kv[i], Value: kv[i+1]})
	}
	return out
}

// eventually polls cond until it holds or 5 s pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	eventuallyWithin(t, what, 5*time.Second, cond)
}

// answering pings c until the sidecar answers one in time: its connection is dialed and
// answering, so that a next call that must be answered within a short Timeout does not
// spend it dialing on a loaded machine.
func answering(t *testing.T, c *Client) {
	t.Helper()
	eventually(t, "the sidecar to answer a ping", func() bool {
		_, err := c.Ping(context.Background())
		return err == nil
	})
}

// eventuallyWithin is eventually, waiting up to bound.
func eventuallyWithin(t *testing.T, what string, bound time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(bound); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestNewValidates(t *testing.T) {
	for _, o := range []Options{
		{},
		{Socket: "/x", Conns: -1},
		{Socket: "/x", Timeout: -time.Second},
		{Socket: "/x", DialTimeout: -time.Second},
		{Socket: "/x", Policy: 7},
		{Socket: "/x", Conns: 5000},
	} {
		if c, err := New(o); err == nil {
			c.Close()
			t.Errorf("New(%+v) succeeded", o)
		}
	}
	c, err := New(Options{Socket: "/x"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.opts.Conns != DefaultConns || c.opts.Timeout != DefaultTimeout || c.opts.DialTimeout != DefaultDialTimeout || c.opts.Policy != FailOpen {
		t.Errorf("defaults not applied: %+v", c.opts)
	}
}

func TestCheckDecodesDecision(t *testing.T) {
	path := socketPath(t)
	var mu sync.Mutex
	var seen []proto.Request
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		// Keep a copy: req's strings alias the decoder's buffer.
		cp := proto.Request{ID: req.ID, Op: strings.Clone(req.Op), Cost: req.Cost}
		for _, a := range req.Attrs {
			cp.Attrs = append(cp.Attrs, proto.Attr{Name: strings.Clone(a.Name), Value: strings.Clone(a.Value)})
		}
		for _, l := range req.Limits {
			l.Key, l.Name, l.Algorithm, l.Mode = strings.Clone(l.Key), strings.Clone(l.Name), strings.Clone(l.Algorithm), strings.Clone(l.Mode)
			cp.Limits = append(cp.Limits, l)
		}
		mu.Lock()
		seen = append(seen, cp)
		mu.Unlock()
		*resp = proto.Response{ID: req.ID, Allowed: false, Rule: "per-user", Limit: 5, Remaining: 0, ResetMs: 59001,
			RetryAfterMs: 1001, Degraded: true, Reason: "",
			Rules: []proto.RuleResult{
				{Name: "per-ip", Limit: 100, WindowMs: 1000, Remaining: 100, Allowed: true},
				{Name: "per-user", Limit: 5, WindowMs: 60000, Remaining: 0, ResetMs: 59001, RetryAfterMs: 1001},
				{Name: "shadow", Limit: 1, WindowMs: 1000, Shadow: true, Reason: proto.ReasonCostExceedsCapacity},
			}}
	})
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second})
	ctx := context.Background()

	d, err := c.Check(ctx, map[string]string{"user": "alice", "method": "GET", "path": "/a", "ip": "::1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := Decision{Allowed: false, Rule: "per-user", Limit: 5, Remaining: 0, Reset: 59001 * time.Millisecond,
		RetryAfter: 1001 * time.Millisecond, Degraded: true,
		Rules: []RuleDecision{
			{Name: "per-ip", Limit: 100, Window: time.Second, Remaining: 100, Allowed: true},
			{Name: "per-user", Limit: 5, Window: time.Minute, Remaining: 0, Reset: 59001 * time.Millisecond, RetryAfter: 1001 * time.Millisecond},
			{Name: "shadow", Limit: 1, Window: time.Second, Shadow: true, Reason: proto.ReasonCostExceedsCapacity},
		}}
	if !reflect.DeepEqual(d, want) {
		t.Fatalf("decision\n got %+v\nwant %+v", d, want)
	}

	lim := []proto.InlineLimit{{Key: "tenant:acme", Limit: 100, WindowMs: 60000, Burst: 20, Algorithm: "token_bucket", Mode: "local", Name: "acme"}}
	for _, o := range []*CheckOptions{{Cost: 3}, {Peek: true, Cost: 9}, {Limits: lim}, {}} {
		if _, err := c.CheckAttrs(ctx, attrList("z", "1", "a", "2"), o); err != nil {
			t.Fatal(err)
		}
	}

	mu.Lock()
	defer mu.Unlock()
	wantReqs := []proto.Request{
		{ID: 1, Op: "check", Cost: 1, Attrs: attrList("ip", "::1", "method", "GET", "path", "/a", "user", "alice")}, // sorted
		{ID: 2, Op: "check", Cost: 3, Attrs: attrList("z", "1", "a", "2")},                                          // as given
		{ID: 3, Op: "check", Cost: 0, Attrs: attrList("z", "1", "a", "2")},
		{ID: 4, Op: "check", Cost: 1, Attrs: attrList("z", "1", "a", "2"), Limits: lim},
		{ID: 5, Op: "check", Cost: 1, Attrs: attrList("z", "1", "a", "2")},
	}
	if !reflect.DeepEqual(seen, wantReqs) {
		t.Fatalf("requests\n got %+v\nwant %+v", seen, wantReqs)
	}
}

func TestPing(t *testing.T) {
	path := socketPath(t)
	startFake(t, path, nil)
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	v, err := c.Ping(context.Background())
	if err != nil || v != "fake-1.0" {
		t.Fatalf("Ping = %q, %v", v, err)
	}

	down := newClient(t, Options{Socket: socketPath(t)})
	if _, err := down.Ping(context.Background()); !errors.Is(err, ErrUnreachable) {
		t.Fatalf("Ping to no sidecar: %v, want ErrUnreachable", err)
	}
}

// 100 goroutines share 2 connections; each must get the answers to its own requests.
func TestConcurrentChecksGetTheirOwnAnswers(t *testing.T) {
	path := socketPath(t)
	f := startFake(t, path, nil)
	c := newClient(t, Options{Socket: path, Conns: 2, Timeout: 5 * time.Second})
	var wg sync.WaitGroup
	var bad atomic.Int64
	for g := 0; g < 100; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				user := fmt.Sprintf("u%d-%d", g, i)
				d, err := c.Check(context.Background(), map[string]string{"user": user}, nil)
				if err != nil || d.Rule != user || d.Unreachable || len(d.Rules) != 1 || d.Rules[0].Name != user {
					if bad.Add(1) < 5 {
						t.Errorf("check for %s: %+v, %v", user, d, err)
					}
				}
			}
		}()
	}
	wg.Wait()
	if n := f.requests.Load(); n != 5000 {
		t.Errorf("fake read %d requests, want 5000", n)
	}
	t.Logf("most requests pipelined in one batch: %d", f.maxBatch.Load())
}

// While the fake sleeps on its first request, the other checks are written on the same
// connection without waiting: the fake then finds them all buffered.
func TestPipelining(t *testing.T) {
	path := socketPath(t)
	f := startFake(t, path, nil)
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 5 * time.Second})
	if _, err := c.Ping(context.Background()); err != nil { // dial first
		t.Fatal(err)
	}
	f.delay.Store(int64(20 * time.Millisecond))
	var wg sync.WaitGroup
	for i := 0; i < 10; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			user := fmt.Sprint("p", i)
			if d, err := c.Check(context.Background(), map[string]string{"user": user}, nil); err != nil || d.Rule != user {
				t.Errorf("check %s: %+v, %v", user, d, err)
			}
		}()
	}
	wg.Wait()
	if n := f.maxBatch.Load(); n < 2 {
		t.Fatalf("the fake never found more than %d request buffered", n)
	}
}

func TestSidecarDownAnswersPolicyFast(t *testing.T) {
	refused := socketPath(t) // a socket file nobody listens on: connection refused
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: refused, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()

	for _, tc := range []struct {
		name   string
		socket string
	}{{"missing socket", socketPath(t)}, {"refused", refused}} {
		for _, p := range []Policy{FailOpen, FailClosed} {
			t.Run(tc.name+"/"+p.String(), func(t *testing.T) {
				c := newClient(t, Options{Socket: tc.socket, Timeout: time.Second, Policy: p})
				for i := 0; i < 20; i++ {
					start := time.Now()
					d, err := c.Check(context.Background(), map[string]string{"user": "a"}, nil)
					if took := time.Since(start); took > 200*time.Millisecond {
						t.Fatalf("check %d took %v with the sidecar down", i, took)
					}
					if err != nil {
						t.Fatal(err)
					}
					if d.Allowed != (p == FailOpen) || !d.Degraded || !d.Unreachable || d.Rule != "" || !errors.Is(d.Cause, ErrUnreachable) {
						t.Fatalf("check %d: %+v", i, d)
					}
				}
			})
		}
	}
}

func TestBackoffDoesNotHammer(t *testing.T) {
	path := socketPath(t)
	c := newClient(t, Options{Socket: path, Conns: 1})
	for i := 0; i < 1000; i++ {
		c.Check(context.Background(), nil, nil)
	}
	s := &c.slots[0]
	s.mu.Lock()
	defer s.mu.Unlock()
	// 1000 immediate checks fit in the first backoffs: a handful of dials, not 1000.
	if s.failures > 10 || s.failures < 1 {
		t.Fatalf("%d failed dials for 1000 checks", s.failures)
	}
	if !strings.Contains(s.backoff.Error(), "failed attempt") {
		t.Fatalf("cause %q", s.backoff.Error())
	}
}

func TestSlowSidecarTimesOutThenRecovers(t *testing.T) {
	path := socketPath(t)
	gate := make(chan struct{})
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		if attr(req, "user") == "slow" {
			<-gate
		}
		echoUser(req, resp)
	})
	const timeout = 200 * time.Millisecond
	for _, p := range []Policy{FailOpen, FailClosed} {
		t.Run(p.String(), func(t *testing.T) {
			c := newClient(t, Options{Socket: path, Conns: 1, Timeout: timeout, Policy: p})
			if _, err := c.Ping(context.Background()); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			d, err := c.Check(context.Background(), map[string]string{"user": "slow"}, nil)
			// Not before its timeout, and by it (the sidecar's answer never comes while the
			// gate is shut): bounded loosely, as a timer on a loaded machine fires late.
			if took := time.Since(start); err != nil || took < timeout || took > timeout+5*time.Second {
				t.Fatalf("slow check: %v after %v", err, took)
			}
			if d.Allowed != (p == FailOpen) || !d.Unreachable || !errors.Is(d.Cause, ErrUnreachable) {
				t.Fatalf("slow check: %+v", d)
			}

			// The abandoned call stays first in line: the answer to "slow", when it
			// comes, must not be taken for the answer to "b".
			done := make(chan Decision)
			go func() {
				d, _ := c.Check(context.Background(), map[string]string{"user": "b"}, nil)
				done <- d
			}()
			c.slots[0].mu.Lock()
			cn := c.slots[0].cn
			c.slots[0].mu.Unlock()
			eventually(t, "two calls pending", func() bool {
				cn.mu.Lock()
				defer cn.mu.Unlock()
				return cn.pending.n == 2
			})
			gate <- struct{}{}
			if d := <-done; d.Rule != "b" || d.Unreachable {
				t.Fatalf("check b after the timeout: %+v", d)
			}
		})
	}
}

func TestCallerContext(t *testing.T) {
	path := socketPath(t)
	gate := make(chan struct{})
	startFake(t, path, func(req *proto.Request, resp *proto.Response) { <-gate })
	t.Cleanup(func() { close(gate) }) // before the fake's stop, which waits for its goroutines
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 10 * time.Second})

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	start := time.Now()
	d, err := c.Check(ctx, nil, nil)
	if err != nil || !d.Unreachable || !d.Allowed || time.Since(start) > 2*time.Second {
		t.Fatalf("deadline: %+v, %v after %v", d, err, time.Since(start))
	}

	ctx, cancel = context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	d, err = c.Check(ctx, nil, nil)
	if err != nil || !d.Unreachable || !errors.Is(d.Cause, context.Canceled) {
		t.Fatalf("canceled: %+v, %v", d, err)
	}
	d, err = c.Check(ctx, nil, nil) // already canceled
	if err != nil || !d.Unreachable || !errors.Is(d.Cause, context.Canceled) {
		t.Fatalf("canceled before: %+v, %v", d, err)
	}
}

func TestReconnectsAfterRestart(t *testing.T) {
	path := socketPath(t)
	f := startFake(t, path, nil)
	c := newClient(t, Options{Socket: path, Conns: 2, Timeout: time.Second})
	check := func() Decision {
		d, err := c.Check(context.Background(), map[string]string{"user": "r"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	for i := 0; i < 4; i++ {
		if d := check(); d.Rule != "r" {
			t.Fatalf("before the restart: %+v", d)
		}
	}

	f.stop()
	for i := 0; i < 4; i++ {
		if d := check(); !d.Unreachable || !d.Allowed {
			t.Fatalf("while down: %+v", d)
		}
	}

	startFake(t, path, nil)
	// Each slot redials once its backoff (at most 1 s) has passed.
	eventually(t, "both connections to come back", func() bool {
		for i := 0; i < 4; i++ {
			if check().Rule != "r" {
				return false
			}
		}
		return true
	})
}

func TestDroppedConnectionsAreRedialed(t *testing.T) {
	path := socketPath(t)
	f := startFake(t, path, nil)
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second})
	if d, _ := c.Check(context.Background(), map[string]string{"user": "x"}, nil); d.Rule != "x" {
		t.Fatalf("%+v", d)
	}
	f.dropConns()
	// The connection had answered, so there is no backoff: the next check that finds it
	// gone redials at once.
	eventually(t, "the client to redial", func() bool {
		d, _ := c.Check(context.Background(), map[string]string{"user": "x"}, nil)
		return d.Rule == "x"
	})
}

func TestProtocolErrors(t *testing.T) {
	path := socketPath(t)
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		switch attr(req, "user") {
		case "bad-limit":
			resp.Err = proto.Error{Code: proto.CodeInvalidLimit, Message: `limits[0]: "limit" must be at least 1`}
		case "unreadable":
			// An error to a request the server could not read carries id 0.
			resp.ID = 0
			resp.Err = proto.Error{Code: proto.CodeBadRequest, Message: "attrs must be a map"}
		default:
			echoUser(req, resp)
		}
	})
	for _, p := range []Policy{FailOpen, FailClosed} {
		c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second, Policy: p})
		for _, tc := range []struct{ user, code string }{{"bad-limit", proto.CodeInvalidLimit}, {"unreadable", proto.CodeBadRequest}} {
			d, err := c.Check(context.Background(), map[string]string{"user": tc.user}, nil)
			var pe *proto.Error
			if !errors.As(err, &pe) || pe.Code != tc.code {
				t.Fatalf("%s: err %v, want a *proto.Error %s", tc.user, err, tc.code)
			}
			if d.Allowed != (p == FailOpen) || !d.Degraded || d.Unreachable || d.Cause != err {
				t.Fatalf("%s: decision %+v", tc.user, d)
			}
			// The connection stays usable.
			if d, err := c.Check(context.Background(), map[string]string{"user": "ok"}, nil); err != nil || d.Rule != "ok" {
				t.Fatalf("after %s: %+v, %v", tc.user, d, err)
			}
		}
	}
}

// A response that breaks the protocol (wrong id) or a server that is closing the
// connection makes the client answer by its Policy, not return an error.
func TestBrokenResponsesAnswerPolicy(t *testing.T) {
	path := socketPath(t)
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		switch attr(req, "user") {
		case "wrong-id":
			resp.ID = req.ID + 100
			echoUser(req, resp)
		case "shutting-down":
			resp.Err = proto.Error{Code: proto.CodeShuttingDown, Message: "the daemon is stopping"}
		default:
			echoUser(req, resp)
		}
	})
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second, Policy: FailClosed})
	for _, user := range []string{"wrong-id", "shutting-down"} {
		if d, _ := c.Check(context.Background(), map[string]string{"user": "ok"}, nil); d.Rule != "ok" {
			t.Fatalf("before %s: %+v", user, d)
		}
		d, err := c.Check(context.Background(), map[string]string{"user": user}, nil)
		if err != nil || d.Allowed || !d.Unreachable || !errors.Is(d.Cause, ErrUnreachable) {
			t.Fatalf("%s: %+v, %v", user, d, err)
		}
		eventually(t, "the client to redial", func() bool {
			d, _ := c.Check(context.Background(), map[string]string{"user": "ok"}, nil)
			return d.Rule == "ok"
		})
	}
}

func TestCloseStopsEverything(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	path := socketPath(t)
	gate := make(chan struct{})
	f := startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		if attr(req, "user") == "held" {
			<-gate
		}
		echoUser(req, resp)
	})
	c, err := New(Options{Socket: path, Conns: 3, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 10; i++ {
		if d, _ := c.Check(context.Background(), map[string]string{"user": "u"}, nil); d.Rule != "u" {
			t.Fatalf("%+v", d)
		}
	}
	// A check in flight when Close comes returns at once with ErrClosed.
	errc := make(chan error)
	go func() {
		_, err := c.Check(context.Background(), map[string]string{"user": "held"}, nil)
		errc <- err
	}()
	eventually(t, "the held request to reach the fake", func() bool { return f.requests.Load() == 11 })
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != ErrClosed {
		t.Fatalf("check in flight at Close: %v, want ErrClosed", err)
	}
	d, err := c.Check(context.Background(), nil, nil)
	if err != ErrClosed || !d.Allowed || d.Unreachable {
		t.Fatalf("check after Close: %+v, %v", d, err)
	}
	if _, err := c.Ping(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("ping after Close: %v", err)
	}
	c.Close() // idempotent
	close(gate)
	f.stop()
	goleak.VerifyNone(t, ignore)
}

func TestCloseWhileDialing(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	c, err := New(Options{Socket: socketPath(t)})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 50; j++ {
				c.Check(context.Background(), nil, nil)
			}
		}()
	}
	c.Close()
	wg.Wait()
	goleak.VerifyNone(t, ignore)
}

func TestCheckDoesNotKeepAttrs(t *testing.T) {
	path := socketPath(t)
	startFake(t, path, nil)
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second})
	attrs := attrList("user", "a")
	if _, err := c.CheckAttrs(context.Background(), attrs, nil); err != nil {
		t.Fatal(err)
	}
	if attrs[0] != (proto.Attr{Name: "user", Value: "a"}) {
		t.Fatalf("attrs changed: %v", attrs)
	}
}

func TestMsSaturates(t *testing.T) {
	if got := ms(1 << 63); got != time.Duration(1<<63-1) {
		t.Fatalf("ms(2^63) = %v", got)
	}
	if got := ms(1500); got != 1500*time.Millisecond {
		t.Fatalf("ms(1500) = %v", got)
	}
}

// A repeated attribute name sends the later value in the earlier one's place: the
// sidecar refuses a repeated name (bad_request), which the Policy decided, so
// DefaultAttrs with an "ip" appended from a proxy's header let every request past every
// limit under FailOpen.
func TestCheckAttrsLaterNameWins(t *testing.T) {
	path := socketPath(t)
	var mu sync.Mutex
	var got []proto.Attr
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		mu.Lock()
		got = append([]proto.Attr(nil), req.Attrs...)
		mu.Unlock()
		echoUser(req, resp)
	})
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second, Policy: FailOpen})
	attrs := []proto.Attr{{Name: "ip", Value: "10.0.0.1"}, {Name: "method", Value: "GET"}, {Name: "ip", Value: "203.0.113.7"}, {Name: "user", Value: "u"}}
	d, err := c.CheckAttrs(context.Background(), attrs, nil)
	if err != nil || !d.Allowed || d.Rule != "u" {
		t.Fatalf("%+v, %v", d, err)
	}
	mu.Lock()
	defer mu.Unlock()
	want := []proto.Attr{{Name: "ip", Value: "203.0.113.7"}, {Name: "method", Value: "GET"}, {Name: "user", Value: "u"}}
	if !slices.Equal(got, want) {
		t.Fatalf("sent %v, want %v", got, want)
	}
	if attrs[0].Value != "10.0.0.1" || len(attrs) != 4 {
		t.Fatalf("CheckAttrs changed its argument: %v", attrs)
	}
}
