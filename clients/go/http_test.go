package rlclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// headerVector is one entry of clients/testdata/http_headers.json.
type headerVector struct {
	Name     string `json:"name"`
	Meaning  string `json:"meaning"`
	Decision struct {
		Allowed      bool   `json:"allowed"`
		Rule         string `json:"rule"`
		Limit        uint64 `json:"limit"`
		Remaining    uint64 `json:"remaining"`
		ResetMs      uint64 `json:"reset_ms"`
		RetryAfterMs uint64 `json:"retry_after_ms"`
		Reason       string `json:"reason"`
		Warning      bool   `json:"warning"`
		Rules        []struct {
			Name         string `json:"name"`
			Limit        uint64 `json:"limit"`
			WindowMs     uint64 `json:"window_ms"`
			Remaining    uint64 `json:"remaining"`
			ResetMs      uint64 `json:"reset_ms"`
			RetryAfterMs uint64 `json:"retry_after_ms"`
			Allowed      bool   `json:"allowed"`
			Shadow       bool   `json:"shadow"`
			Warning      bool   `json:"warning"`
			Unasked      bool   `json:"unasked"`
			Concurrency  bool   `json:"concurrency"`
		} `json:"rules"`
	} `json:"decision"`
	Headers map[string]string `json:"headers"`
	Status  int               `json:"status"`
}

// response is the vector's decision as the sidecar would send it.
func (v *headerVector) response() proto.Response {
	d := &v.Decision
	r := proto.Response{Allowed: d.Allowed, Rule: d.Rule, Limit: d.Limit, Remaining: d.Remaining,
		ResetMs: d.ResetMs, RetryAfterMs: d.RetryAfterMs, Reason: d.Reason, Warning: d.Warning}
	for _, rr := range d.Rules {
		r.Rules = append(r.Rules, proto.RuleResult{Name: rr.Name, Limit: rr.Limit, WindowMs: rr.WindowMs,
			Remaining: rr.Remaining, ResetMs: rr.ResetMs, RetryAfterMs: rr.RetryAfterMs, Allowed: rr.Allowed, Shadow: rr.Shadow, Warning: rr.Warning,
			Unasked: rr.Unasked, Concurrency: rr.Concurrency})
	}
	return r
}

func loadHeaderVectors(t *testing.T) []headerVector {
	t.Helper()
	b, err := os.ReadFile("../../clients/testdata/http_headers.json")
	if err != nil {
		t.Fatal(err)
	}
	var vs []headerVector
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&vs); err != nil {
		t.Fatalf("http_headers.json: %v", err)
	}
	if len(vs) < 7 {
		t.Fatalf("http_headers.json has %d vectors", len(vs))
	}
	return vs
}

// canonical returns want with canonical header names, to compare with an http.Header.
func canonical(want map[string]string) http.Header {
	h := http.Header{}
	for k, v := range want {
		h.Set(k, v)
	}
	return h
}

func TestHeaderVectors(t *testing.T) {
	for _, v := range loadHeaderVectors(t) {
		t.Run(v.Name, func(t *testing.T) {
			r := v.response()
			d := decision(&r)
			if got, want := Headers(&d), canonical(v.Headers); !reflect.DeepEqual(got, want) {
				t.Errorf("%s\n got %q\nwant %q", v.Meaning, got, want)
			}
			if wantAllowed := v.Status == http.StatusOK; d.Allowed != wantAllowed {
				t.Errorf("status %d for allowed %v", v.Status, d.Allowed)
			}
		})
	}
}

// The vectors again, end to end: the fake sidecar sends each decision, the middleware
// answers the HTTP request.
func TestMiddlewareVectors(t *testing.T) {
	vs := loadHeaderVectors(t)
	byName := map[string]*headerVector{}
	for i := range vs {
		byName[vs[i].Name] = &vs[i]
	}
	path := socketPath(t)
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		id := resp.ID
		*resp = byName[attr(req, "path")[1:]].response()
		resp.ID = id
	})
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	h := Middleware(c, MiddlewareOptions{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Next", "1")
	}))
	for _, v := range vs {
		t.Run(v.Name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest("GET", "/"+v.Name, nil))
			if rec.Code != v.Status {
				t.Fatalf("status %d, want %d", rec.Code, v.Status)
			}
			got := rec.Header()
			for _, k := range []string{"RateLimit-Policy", "RateLimit", "RateLimit-Warning", "Retry-After"} {
				if g, w := got.Get(k), canonical(v.Headers).Get(k); g != w {
					t.Errorf("%s: %q, want %q", k, g, w)
				}
			}
			if (got.Get("X-Next") == "1") != (v.Status == http.StatusOK) {
				t.Errorf("next handler called: %v, status %d", got.Get("X-Next") == "1", v.Status)
			}
			if v.Status == http.StatusTooManyRequests {
				p := parseProblem(t, rec)
				if p.Status != 429 || p.Title != "Too Many Requests" || p.Type != ProblemType || p.Rule != v.Decision.Rule {
					t.Errorf("problem %+v", p)
				}
				if v.Headers["Retry-After"] != fmt.Sprint(p.RetryAfter) && !(p.RetryAfter == 0 && v.Headers["Retry-After"] == "") {
					t.Errorf("retry_after %d, Retry-After %q", p.RetryAfter, v.Headers["Retry-After"])
				}
			}
		})
	}
}

func parseProblem(t *testing.T, rec *httptest.ResponseRecorder) problem {
	t.Helper()
	if ct := rec.Header().Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type %q", ct)
	}
	var p problem
	dec := json.NewDecoder(rec.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		t.Fatalf("problem body: %v", err)
	}
	return p
}

func TestMiddlewareAllowedAndRejected(t *testing.T) {
	path := socketPath(t)
	var seen atomic.Value
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		seen.Store(fmt.Sprint(req.Attrs, req.Cost))
		if attr(req, "path") == "/limited" {
			*resp = proto.Response{ID: resp.ID, Allowed: false, Rule: "per-ip", Limit: 2, Remaining: 0, ResetMs: 30000, RetryAfterMs: 14500,
				Rules: []proto.RuleResult{{Name: "per-ip", Limit: 2, WindowMs: 60000, ResetMs: 30000, RetryAfterMs: 14500}}}
			return
		}
		*resp = proto.Response{ID: resp.ID, Allowed: true, Rule: "per-ip", Limit: 2, Remaining: 1, ResetMs: 30000,
			Rules: []proto.RuleResult{{Name: "per-ip", Limit: 2, WindowMs: 60000, Remaining: 1, ResetMs: 30000, Allowed: true}}}
	})
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	var called atomic.Int64
	h := Middleware(c, MiddlewareOptions{Cost: func(r *http.Request) uint64 { return 2 }})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		called.Add(1)
		w.Write([]byte("hello"))
	}))

	rec := httptest.NewRecorder()
	req := httptest.NewRequest("POST", "/ok?q=1", nil)
	req.RemoteAddr = "[2001:db8::1]:4711"
	h.ServeHTTP(rec, req)
	if rec.Code != 200 || rec.Body.String() != "hello" || called.Load() != 1 {
		t.Fatalf("allowed: %d %q", rec.Code, rec.Body)
	}
	if got := seen.Load(); got != "[{ip 2001:db8::1} {method POST} {path /ok}] 2" {
		t.Fatalf("attrs sent: %v", got)
	}
	if rec.Header().Get("RateLimit-Policy") != `"per-ip";q=2;w=60` || rec.Header().Get("RateLimit") != `"per-ip";r=1;t=30` || rec.Header().Get("Retry-After") != "" {
		t.Fatalf("allowed headers: %v", rec.Header())
	}

	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/limited", nil))
	if rec.Code != 429 || called.Load() != 1 {
		t.Fatalf("rejected: status %d, next called %d times", rec.Code, called.Load())
	}
	if rec.Header().Get("Retry-After") != "15" || rec.Header().Get("RateLimit") != `"per-ip";r=0;t=15` {
		t.Fatalf("rejected headers: %v", rec.Header())
	}
	p := parseProblem(t, rec)
	want := problem{Type: ProblemType, Title: "Too Many Requests", Status: 429,
		Detail: `This request exceeds rate limit "per-ip"; retry in 15 seconds.`, Rule: "per-ip", RetryAfter: 15}
	if p != want {
		t.Fatalf("problem\n got %+v\nwant %+v", p, want)
	}
}

func TestMiddlewareSidecarDown(t *testing.T) {
	for _, p := range []Policy{FailOpen, FailClosed} {
		t.Run(p.String(), func(t *testing.T) {
			c := newClient(t, Options{Socket: socketPath(t), Policy: p})
			called := false
			h := Middleware(c, MiddlewareOptions{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { called = true }))
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
			if rec.Header().Get("RateLimit") != "" || rec.Header().Get("RateLimit-Policy") != "" {
				t.Fatalf("rate-limit headers without a decision: %v", rec.Header())
			}
			if p == FailOpen {
				if !called || rec.Code != 200 {
					t.Fatalf("fail-open: status %d, next called %v", rec.Code, called)
				}
				return
			}
			if called || rec.Code != 503 || rec.Header().Get("Retry-After") != "1" {
				t.Fatalf("fail-closed: status %d, next called %v, headers %v", rec.Code, called, rec.Header())
			}
			pr := parseProblem(t, rec)
			if pr.Status != 503 || pr.Title != "Service Unavailable" || pr.RetryAfter != 1 || pr.Rule != "" || !strings.Contains(pr.Detail, "unavailable") {
				t.Fatalf("problem %+v", pr)
			}
		})
	}
}

func TestMiddlewareErrors(t *testing.T) {
	path := socketPath(t)
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		resp.Err = proto.Error{Code: proto.CodeBadRequest, Message: "attrs key must be a string"}
	})
	for _, p := range []Policy{FailOpen, FailClosed} {
		c := newClient(t, Options{Socket: path, Policy: p, Timeout: time.Second})
		called := false
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { called = true })

		rec := httptest.NewRecorder()
		Middleware(c, MiddlewareOptions{})(next).ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
		if called != (p == FailOpen) || (p == FailClosed && rec.Code != 503) {
			t.Fatalf("%v without OnError: status %d, next called %v", p, rec.Code, called)
		}

		var got error
		onError := func(w http.ResponseWriter, r *http.Request, err error) {
			got = err
			w.WriteHeader(500)
		}
		called = false
		rec = httptest.NewRecorder()
		Middleware(c, MiddlewareOptions{OnError: onError})(next).ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
		var pe *proto.Error
		if called || rec.Code != 500 || !errors.As(got, &pe) || pe.Code != proto.CodeBadRequest {
			t.Fatalf("%v with OnError: status %d, next called %v, err %v", p, rec.Code, called, got)
		}
	}
}

func TestWriteRejectionCostExceedsCapacity(t *testing.T) {
	d := Decision{Rule: "per-user", Limit: 5, Remaining: 5, Reason: proto.ReasonCostExceedsCapacity,
		Rules: []RuleDecision{{Name: "per-user", Limit: 5, Window: time.Minute, Remaining: 5, Reason: proto.ReasonCostExceedsCapacity}}}
	rec := httptest.NewRecorder()
	WriteRejection(rec, &d)
	if rec.Code != 429 || rec.Header().Get("Retry-After") != "" {
		t.Fatalf("status %d, headers %v", rec.Code, rec.Header())
	}
	p := parseProblem(t, rec)
	want := problem{Type: ProblemType, Title: "Too Many Requests", Status: 429, Rule: "per-user",
		Detail: `This request costs more than rate limit "per-user" can ever admit: it can never pass under this limit.`}
	if p != want {
		t.Fatalf("problem\n got %+v\nwant %+v", p, want)
	}
}

// A rule the refused request left unasked (its store not asked: its remaining 0 and
// reset 0 were not read) is exposed as such and left out of RateLimit, which would
// otherwise say it has nothing left; its quota stays in RateLimit-Policy.
func TestHeadersLeaveOutUnasked(t *testing.T) {
	r := proto.Response{Allowed: false, Rule: "per-ip", Limit: 2, Remaining: 0, ResetMs: 30000, RetryAfterMs: 14500,
		Rules: []proto.RuleResult{
			{Name: "per-ip", Limit: 2, WindowMs: 60000, ResetMs: 30000, RetryAfterMs: 14500},
			{Name: "per-account", Limit: 5, WindowMs: 3600_000, Allowed: true, Unasked: true},
		}}
	d := decision(&r)
	if d.Rules[0].Unasked || !d.Rules[1].Unasked {
		t.Fatalf("rules %+v, want per-account unasked", d.Rules)
	}
	want := http.Header{"Ratelimit-Policy": {`"per-ip";q=2;w=60, "per-account";q=5;w=3600`}, "Ratelimit": {`"per-ip";r=0;t=15`}, "Retry-After": {"15"}}
	if got := Headers(&d); !reflect.DeepEqual(got, want) {
		t.Fatalf("headers\n got %q\nwant %q", got, want)
	}
}

func TestDefaultAttrs(t *testing.T) {
	// "@" is a Unix socket's unnamed peer as net/http shows it, "@abstract" and
	// "/run/peer.sock" named ones: no address, ip left out (TestDefaultAttrsUnixSocket).
	for remote, ip := range map[string]string{"192.0.2.7:1234": "192.0.2.7", "[::1]:80": "::1", "@": "", "@abstract": "",
		"/run/peer.sock": "", "": ""} {
		r := httptest.NewRequest("DELETE", "http://example.com/a/b%2Fc?x=1", nil)
		r.RemoteAddr = remote
		want := []proto.Attr{{Name: "ip", Value: ip}, {Name: "method", Value: "DELETE"}, {Name: "path", Value: "/a/b/c"}}
		if ip == "" {
			want = want[1:] // no peer address: ip left out, not sent as ""
		}
		if got := DefaultAttrs(r); !reflect.DeepEqual(got, want) {
			t.Errorf("%q: %v", remote, got)
		}
	}
}

// TestDefaultAttrsUnixSocket: a server listening on a Unix socket (behind a local proxy)
// has no peer address; net/http gives r.RemoteAddr "@". DefaultAttrs leaves ip out, as
// the Python and Node middlewares do behind a Unix socket (gunicorn's REMOTE_ADDR "",
// uvicorn's client None, Node's remoteAddress undefined). Before, it sent ip "@": every
// request one per-ip bucket, so that a per-ip rule limited all clients together.
func TestDefaultAttrsUnixSocket(t *testing.T) {
	path := socketPath(t)
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan []proto.Attr, 1)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- DefaultAttrs(r)
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}}}
	t.Cleanup(hc.CloseIdleConnections)
	resp, err := hc.Get("http://gateway/login")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	want := []proto.Attr{{Name: "method", Value: "GET"}, {Name: "path", Value: "/login"}}
	if a := <-got; !reflect.DeepEqual(a, want) {
		t.Fatalf("DefaultAttrs of a request through a Unix socket: %v, want %v (no ip)", a, want)
	}
}

// TestPeerIP checks PeerIP, and DefaultAttrs's ip, against clients/testdata/ips.json,
// the cases every client is tested against.
func TestPeerIP(t *testing.T) {
	b, err := os.ReadFile("../testdata/ips.json")
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Meaning string `json:"meaning"`
		Cases   []struct {
			Peer string `json:"peer"`
			IP   string `json:"ip"`
		} `json:"cases"`
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil || len(f.Cases) < 10 {
		t.Fatalf("ips.json: %v, %d cases", err, len(f.Cases))
	}
	for _, c := range f.Cases {
		if got := PeerIP(c.Peer); got != c.IP {
			t.Errorf("PeerIP(%q) = %q, want %q", c.Peer, got, c.IP)
		}
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = net.JoinHostPort(c.Peer, "5555")
		if c.Peer == "" {
			if got := DefaultAttrs(r)[0]; got.Name == "ip" {
				t.Errorf("DefaultAttrs with RemoteAddr %q: %v, want ip left out", r.RemoteAddr, got)
			}
			continue
		}
		if got := DefaultAttrs(r)[0]; got != (proto.Attr{Name: "ip", Value: c.IP}) {
			t.Errorf("DefaultAttrs with RemoteAddr %q: %v, want ip %q", r.RemoteAddr, got, c.IP)
		}
	}
}

func ExampleHeaders() {
	d := Decision{
		Allowed: false, Rule: "per-user", Limit: 5, Remaining: 0,
		Reset: 50 * time.Second, RetryAfter: 1500 * time.Millisecond,
		Rules: []RuleDecision{
			{Name: "per-ip", Limit: 100, Window: time.Second, Remaining: 100, Allowed: true},
			{Name: "per-user", Limit: 5, Window: time.Minute, Reset: 50 * time.Second, RetryAfter: 1500 * time.Millisecond},
		},
	}
	h := Headers(&d)
	for _, k := range []string{"RateLimit-Policy", "RateLimit", "Retry-After"} {
		fmt.Printf("%s: %s\n", k, h.Get(k))
	}
	// Output:
	// RateLimit-Policy: "per-user";q=5;w=60, "per-ip";q=100;w=1
	// RateLimit: "per-user";r=0;t=2, "per-ip";r=100;t=0
	// Retry-After: 2
}

// problem is the RFC 9457 problem details body WriteRejection writes (proto's format).
type problem struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Status     int    `json:"status"`
	Detail     string `json:"detail"`
	Rule       string `json:"rule,omitempty"`
	RetryAfter int64  `json:"retry_after,omitempty"`
}

// The cost the middleware sends: its Cost function's, 0 included (it asks without
// consuming, as the protocol's cost 0 and the other clients' middlewares); 1 without one.
func TestMiddlewareCost(t *testing.T) {
	path := socketPath(t)
	var seen atomic.Uint64
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		seen.Store(req.Cost)
		*resp = proto.Response{ID: resp.ID, Allowed: true}
	})
	c := newClient(t, Options{Socket: path, Timeout: time.Second})
	for _, tc := range []struct {
		name string
		cost func(*http.Request) uint64
		want uint64
	}{
		{"no cost function", nil, 1},
		{"cost 0", func(*http.Request) uint64 { return 0 }, 0},
		{"cost 1", func(*http.Request) uint64 { return 1 }, 1},
		{"cost 7", func(*http.Request) uint64 { return 7 }, 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seen.Store(99)
			h := Middleware(c, MiddlewareOptions{Cost: tc.cost})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest("GET", "/x", nil))
			if rec.Code != 200 || seen.Load() != tc.want {
				t.Fatalf("status %d, cost sent %d, want %d", rec.Code, seen.Load(), tc.want)
			}
		})
	}
}
