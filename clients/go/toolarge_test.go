package rlclient

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// bodyLen is the length of r's frame body as the proto encoder writes it.
func bodyLen(r *proto.Request) int {
	enc := proto.NewEncoder()
	enc.EncodeRequest(r)
	return enc.Len() - proto.HeaderSize
}

// requestBound is never below the real length, whatever the id: random requests, with
// strings of the lengths where msgpack headers grow.
func TestRequestBound(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	lens := []int{0, 1, 31, 32, 255, 256}
	str := func() string {
		if rng.IntN(20) == 0 {
			return strings.Repeat("x", 65535+rng.IntN(2))
		}
		return strings.Repeat("x", lens[rng.IntN(len(lens))])
	}
	num := func() uint64 {
		return []uint64{0, 1, 127, 128, 255, 256, 65535, 65536, math.MaxUint32, math.MaxUint64}[rng.IntN(10)]
	}
	for range 200 {
		r := proto.Request{ID: math.MaxUint64, Op: str(), Cost: num(), Lease: str(), LeaseMs: num()}
		for range rng.IntN(18) {
			r.Attrs = append(r.Attrs, proto.Attr{Name: str(), Value: str()})
		}
		for range rng.IntN(18) {
			r.Limits = append(r.Limits, proto.InlineLimit{Key: str(), Limit: num(), WindowMs: num(), Burst: num(),
				Algorithm: str(), Mode: str(), Name: str()})
		}
		if b, n := requestBound(&r), bodyLen(&r); b < n {
			t.Fatalf("requestBound %d < %d, the body's length, for %d attrs, %d limits", b, n, len(r.Attrs), len(r.Limits))
		}
	}
}

func TestUintLen(t *testing.T) {
	for _, v := range []uint64{0, 127, 128, 255, 256, 65535, 65536, math.MaxUint32, math.MaxUint32 + 1, math.MaxUint64} {
		short := proto.Request{Op: "ping", Cost: 1}
		with := short
		with.ID = v
		if got, want := uintLen(v), bodyLen(&with)-bodyLen(&short)+1; got != want {
			t.Errorf("uintLen(%d) = %d, want %d", v, got, want)
		}
	}
}

// A check whose frame would be over MaxFrame is not sent, under either policy: the error
// says so and the Decision rejects (it is no sidecar outage: under FailOpen, long header
// values must not be a way around every limit). The connection stays, and nothing waits.
func TestTooLargeIsNotSent(t *testing.T) {
	for _, p := range []Policy{FailOpen, FailClosed} {
		t.Run(p.String(), func(t *testing.T) {
			path := socketPath(t)
			f := startFake(t, path, nil)
			c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second, Policy: p})
			if d, _ := c.Check(context.Background(), map[string]string{"user": "a"}, nil); d.Rule != "a" {
				t.Fatalf("%+v", d)
			}
			cn := c.slots[0].cn
			d, err := c.Check(context.Background(), map[string]string{"user": "a", "ua": strings.Repeat("x", 70000)}, nil)
			var tl *RequestTooLargeError
			if !errors.Is(err, ErrRequestTooLarge) || !errors.As(err, &tl) || tl.Max != DefaultMaxFrame || tl.Size <= DefaultMaxFrame || tl.Size > 70100 {
				t.Fatalf("err %v (%+v), want a *RequestTooLargeError", err, tl)
			}
			if d.Allowed || d.Unreachable || d.Cause != err {
				t.Fatalf("decision %+v", d)
			}
			if n := f.requests.Load(); n != 1 {
				t.Fatalf("the sidecar read %d requests, want 1: the large one was sent", n)
			}
			if d, _ := c.Check(context.Background(), map[string]string{"user": "b"}, nil); d.Rule != "b" || c.slots[0].cn != cn {
				t.Fatalf("after the large request: %+v, same connection %v", d, c.slots[0].cn == cn)
			}
			if _, err := c.Release(context.Background(), strings.Repeat("l", 70000)); !errors.Is(err, ErrRequestTooLarge) {
				t.Fatalf("release of a huge lease: %v", err)
			}
		})
	}
}

// A large request is refused at once, even when every connection is full: it never waits
// for room, so it cannot reach the Policy by timing out.
func TestTooLargeDoesNotWaitForRoom(t *testing.T) {
	path, _, _ := gatedFake(t)
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 5 * time.Second})
	c.maxPending = 1
	go c.Check(context.Background(), map[string]string{"user": "held"}, nil)
	eventually(t, "the connection to fill", func() bool { return pendingOn(c)[0] == 1 })
	start := time.Now()
	d, err := c.Check(context.Background(), map[string]string{"v": strings.Repeat("x", 1<<20)}, nil)
	if !errors.Is(err, ErrRequestTooLarge) || d.Allowed || time.Since(start) > time.Second {
		t.Fatalf("%+v, %v after %v", d, err, time.Since(start))
	}
}

// At the limit, the request's own id decides: a body of exactly MaxFrame bytes is sent;
// one that a longer id makes MaxFrame+1 is not, and its place on the connection is given
// back.
func TestMaxFrameExactly(t *testing.T) {
	path := socketPath(t)
	f := startFake(t, path, nil)
	const max = 300
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second, MaxFrame: max})
	c.maxPending = 1 // a place not given back would make the next check wait, then time out
	attrs := func(n int) []proto.Attr { return attrList("user", "u", "v", strings.Repeat("x", n)) }
	n := 0
	for bodyLen(&proto.Request{Op: "check", Cost: 1, Attrs: attrs(n)}) < max {
		n++
	}
	if got := bodyLen(&proto.Request{Op: "check", Cost: 1, Attrs: attrs(n)}); got != max {
		t.Fatalf("no value gives a body of %d bytes (%d)", max, got)
	}
	if d, err := c.CheckAttrs(context.Background(), attrs(n), nil); err != nil || d.Rule != "u" {
		t.Fatalf("a body of exactly MaxFrame with id 1: %+v, %v", d, err)
	}
	if _, err := c.CheckAttrs(context.Background(), attrs(n+1), nil); !errors.Is(err, ErrRequestTooLarge) {
		t.Fatalf("a body of MaxFrame+1: %v", err)
	}
	cn := c.slots[0].cn
	cn.mu.Lock()
	cn.nextID = 127 // the next id, 128, takes 2 bytes
	cn.mu.Unlock()
	_, err := c.CheckAttrs(context.Background(), attrs(n), nil)
	var tl *RequestTooLargeError
	if !errors.As(err, &tl) || tl.Size != max+1 {
		t.Fatalf("with id 128: %v, want a body of %d bytes refused", err, max+1)
	}
	if d, err := c.Check(context.Background(), map[string]string{"user": "small"}, nil); err != nil || d.Rule != "small" {
		t.Fatalf("the next check: %+v, %v", d, err)
	}
	if got := f.requests.Load(); got != 2 {
		t.Fatalf("the sidecar read %d requests, want 2", got)
	}
	if _, err := New(Options{Socket: path, MaxFrame: -1}); err == nil {
		t.Fatal("New accepted MaxFrame -1")
	}
}

// The middleware answers 431 to a request whose attributes are too large, under FailOpen,
// with OnError set or not: a long path, or a long header that Attrs sends.
func TestMiddlewareTooLarge(t *testing.T) {
	path := socketPath(t)
	f := startFake(t, path, nil)
	c := newClient(t, Options{Socket: path, Timeout: time.Second, Policy: FailOpen})
	onErrorCalled := false
	for _, o := range []MiddlewareOptions{
		{},
		{OnError: func(w http.ResponseWriter, r *http.Request, err error) { onErrorCalled = true }},
		{Attrs: func(r *http.Request) []proto.Attr {
			return append(DefaultAttrs(r), proto.Attr{Name: "user_agent", Value: r.Header.Get("User-Agent")})
		}},
	} {
		called := false
		h := Middleware(c, o)(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { called = true }))
		req := httptest.NewRequest("GET", "/"+strings.Repeat("a", 70000), nil)
		if o.Attrs != nil {
			req = httptest.NewRequest("GET", "/", nil)
			req.Header.Set("User-Agent", strings.Repeat("b", 1<<20)) // net/http takes 1 MB of headers
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusRequestHeaderFieldsTooLarge || called || onErrorCalled {
			t.Fatalf("status %d, next called %v, OnError called %v", rec.Code, called, onErrorCalled)
		}
		if rec.Body.String() != tooLargeBody || rec.Header().Get("Retry-After") != "" {
			t.Fatalf("body %s, headers %v", rec.Body, rec.Header())
		}
		if p := parseProblem(t, rec); p.Status != 431 || p.Title != "Request Header Fields Too Large" || p.Type != ProblemType {
			t.Fatalf("problem %+v", p)
		}
	}
	if n := f.requests.Load(); n != 0 {
		t.Fatalf("the sidecar read %d requests", n)
	}
}

// When the sidecar's --max-frame is below Options.MaxFrame, its frame_too_large answer is
// treated alike: the Decision rejects and the middleware answers 431, not the Policy.
func TestSidecarFrameTooLarge(t *testing.T) {
	path := socketPath(t)
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		if len(attr(req, "path")) > 1000 {
			resp.ID = 0
			resp.Err = proto.Error{Code: proto.CodeFrameTooLarge, Message: "frame of 2000 bytes exceeds the maximum of 1000"}
			return
		}
		echoUser(req, resp)
	})
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second, Policy: FailOpen})
	d, err := c.Check(context.Background(), map[string]string{"path": strings.Repeat("p", 2000)}, nil)
	var pe *proto.Error
	if !errors.As(err, &pe) || pe.Code != proto.CodeFrameTooLarge || d.Allowed || d.Unreachable {
		t.Fatalf("%+v, %v", d, err)
	}
	rec := httptest.NewRecorder()
	Middleware(c, MiddlewareOptions{})(http.NotFoundHandler()).ServeHTTP(rec, httptest.NewRequest("GET", "/"+strings.Repeat("p", 2000), nil))
	if rec.Code != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("middleware: status %d", rec.Code)
	}
}

// The sidecar answers frame_too_large from a frame's header and closes, with the rest
// unread, while the client is still writing it: the write fails (EPIPE or ECONNRESET),
// though the answer is already in the receive queue. The check gets that answer (a
// rejecting Decision, and a 431 from the middleware), not the Policy. Here a server that
// does just that every time (against the daemon it is a race, which the write often
// lost: 19 of 20 answered by the Policy before).
func TestRefusedWhileStillWriting(t *testing.T) {
	path := socketPath(t)
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	enc := proto.NewEncoder()
	enc.EncodeError(0, proto.CodeFrameTooLarge, "a frame of 4000000 bytes is over 65536")
	answer := append([]byte(nil), enc.Bytes()...)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			var head [proto.HeaderSize]byte
			_, _ = io.ReadFull(c, head[:])
			_, _ = c.Write(answer)
			c.Close()
		}
	}()
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 5 * time.Second, MaxFrame: 1 << 23, Policy: FailOpen})
	big := strings.Repeat("x", 4_000_000)
	for i := 0; i < 10; i++ {
		d, err := c.Check(context.Background(), map[string]string{"ua": big}, nil)
		var pe *proto.Error
		if !errors.As(err, &pe) || pe.Code != proto.CodeFrameTooLarge || d.Allowed || d.Degraded || d.Unreachable {
			t.Fatalf("check %d: %+v, %v; want the sidecar's frame_too_large", i, d, err)
		}
	}
	rec := httptest.NewRecorder()
	Middleware(c, MiddlewareOptions{Attrs: func(*http.Request) []proto.Attr { return []proto.Attr{{Name: "ua", Value: big}} }})(http.NotFoundHandler()).
		ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
	if rec.Code != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("middleware: status %d, want 431", rec.Code)
	}
}

// The sidecar answers frame_too_large from a frame's header and reads nothing more of the
// connection (as the daemon does): the checks pipelined behind that frame were not read,
// not decided, and are sent again on a new connection, each decided once; the oversized
// one gets its error. Before, each got the Policy (40 refusals here, under FailClosed).
// A stand-in that does just that, with the 10 checks before the large one, the large one
// and the 40 after it all written before it answers anything (the real daemon:
// TestE2EGoClientChecksBehindAFrameTooLargeAreSentAgain, cmd/rlsidecar).
func TestChecksBehindAFrameTooLargeAreSentAgain(t *testing.T) {
	path := socketPath(t)
	const maxFrame = 1024
	gate := make(chan struct{}) // the stand-in answers nothing before it is closed
	open := sync.OnceFunc(func() { close(gate) })
	var mu sync.Mutex
	decided := map[string]int{}
	standIn(t, path, func(nc *net.UnixConn, _ int) {
		br := bufio.NewReader(nc)
		enc := proto.NewEncoder()
		for {
			head, err := br.Peek(proto.HeaderSize)
			if err != nil {
				return
			}
			if binary.BigEndian.Uint32(head) > maxFrame {
				<-gate
				enc.Reset()
				enc.EncodeError(0, proto.CodeFrameTooLarge, "a frame over 1024 bytes")
				nc.Write(enc.Bytes())
				nc.CloseWrite()
				io.Copy(io.Discard, br) // reads nothing more of it, as the daemon lingers
				return
			}
			body, err := proto.ReadFrame(br, nil, maxFrame)
			if err != nil {
				return
			}
			var req proto.Request
			if proto.NewDecoder().DecodeRequest(body, &req) != nil {
				return
			}
			<-gate
			mu.Lock()
			decided[attr(&req, "user")]++
			mu.Unlock()
			enc.Reset()
			enc.EncodeCheck(&proto.Response{ID: req.ID, Allowed: true, Rule: attr(&req, "user")})
			if _, err := nc.Write(enc.Bytes()); err != nil {
				return
			}
		}
	})
	t.Cleanup(open)
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 5 * time.Second, Policy: FailClosed})
	var cw sync.WaitGroup
	errs := make(chan string, 50)
	small := func(i int) {
		cw.Add(1)
		go func() {
			defer cw.Done()
			u := fmt.Sprint("u", i)
			d, err := c.Check(context.Background(), map[string]string{"user": u}, nil)
			if err != nil || d.Unreachable || d.Rule != u {
				errs <- fmt.Sprintf("check %d: %+v, %v", i, d, err)
			}
		}()
	}
	for i := range 10 {
		small(i)
	}
	eventually(t, "10 checks pending", func() bool { return pendingOn(c)[0] == 10 })
	bigErr := make(chan error, 1)
	go func() {
		_, err := c.Check(context.Background(), map[string]string{"user": "big", "path": strings.Repeat("x", 2000)}, nil)
		bigErr <- err
	}()
	eventually(t, "the large check pending", func() bool { return pendingOn(c)[0] == 11 })
	for i := 10; i < 50; i++ {
		small(i)
	}
	eventually(t, "51 checks pending", func() bool { return pendingOn(c)[0] == 51 })
	open()
	var pe *proto.Error
	if err := <-bigErr; !errors.As(err, &pe) || pe.Code != proto.CodeFrameTooLarge {
		t.Errorf("the large check: %v, want the sidecar's frame_too_large", err)
	}
	cw.Wait()
	close(errs)
	n := 0
	for e := range errs {
		if n++; n <= 3 {
			t.Error(e)
		}
	}
	if n > 0 {
		t.Errorf("%d of 50 checks not answered by the sidecar", n)
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range 50 {
		if k := decided[fmt.Sprint("u", i)]; k != 1 {
			t.Errorf("u%d decided %d times", i, k)
		}
	}
}
