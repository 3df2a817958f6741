package main

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	rlclient "github.com/rlsidecar/rlsidecar/clients/go"
	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// serveHeaders returns a function that sends one request through the Go middleware on
// client c, with attrs as its attributes, and returns its status and header.
func serveHeaders(c *rlclient.Client, attrs []proto.Attr) func() (int, http.Header) {
	h := rlclient.Middleware(c, rlclient.MiddlewareOptions{Attrs: func(*http.Request) []proto.Attr { return attrs }})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) }))
	return func() (int, http.Header) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
		return rec.Code, rec.Result().Header
	}
}

// Two rules allowing with 1 left each: the daemon names the first listed, per-second
// (PROTOCOL.md leaves ties to the first in rules), and the middleware's RateLimit fields
// list first the one with the longest reset, per-day, so that a client reading only the
// first item sees the daily limit. Before, per-second came first.
func TestE2EHeadersTieListsLongestResetFirst(t *testing.T) {
	d := startDaemon(t, "--config", writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: per-second
    key: ip
    limit: { requests: 2, per: 1s }
  - name: per-day
    key: ip
    limit: { requests: 2, per: 24h }
`))
	c, err := rlclient.New(rlclient.Options{Socket: d.socket, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	attrs := []proto.Attr{{Name: "ip", Value: "192.0.2.44"}}
	dec, err := c.CheckAttrs(t.Context(), attrs, &rlclient.CheckOptions{})
	if err != nil || !dec.Allowed || dec.Rule != "per-second" || dec.Remaining != 1 || len(dec.Rules) != 2 || dec.Rules[1].Remaining != 1 {
		t.Fatalf("daemon's answer %+v %v, want allowed, per-second deciding, both with 1 left", dec, err)
	}
	h := rlclient.Headers(&dec)
	if p := h.Get("RateLimit-Policy"); p != `"per-day";q=2;w=86400, "per-second";q=2;w=1` {
		t.Errorf("RateLimit-Policy %q, want per-day first", p)
	}
	if r := h.Get("RateLimit"); !strings.HasPrefix(r, `"per-day";r=1;t=`) || !strings.Contains(r, `, "per-second";r=1;t=1`) {
		t.Errorf("RateLimit %q, want per-day first", r)
	}
}

// A refused request's global rule left unasked (the hybrid rule refused first: no Redis
// round trip for a refused request) keeps its RateLimit-Policy item, so the field is
// the same on the 204 and the 429, and has no RateLimit item, its figures not read.
// Before, it dropped out of both, and RateLimit-Policy changed between the responses.
func TestE2EHeadersUnaskedKeptInPolicy(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", unaskedRules)
	// Long timeouts, as TestE2EUnaskedGlobalRuleNotRefused: Redis answers, and the test
	// is not about when.
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--sync-interval", "50ms", "--global-timeout", "2s", "--redis-timeout", "2s")
	c, err := rlclient.New(rlclient.Options{Socket: d.socket, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	get := serveHeaders(c, []proto.Attr{{Name: "account", Value: "a9"}, {Name: "user", Value: "u9"}})
	const policy = `"per-user";q=1;w=3600, "per-account";q=5;w=3600`
	if code, h := get(); code != http.StatusNoContent || h.Get("RateLimit-Policy") != policy ||
		!strings.HasPrefix(h.Get("RateLimit"), `"per-user";r=0;t=`) || !strings.Contains(h.Get("RateLimit"), `, "per-account";r=4;t=`) {
		t.Fatalf("first request: %d %v", code, h)
	}
	code, h := get()
	if code != http.StatusTooManyRequests || h.Get("RateLimit-Policy") != policy {
		t.Errorf("second request: %d, RateLimit-Policy %q, want 429 and %q", code, h.Get("RateLimit-Policy"), policy)
	}
	if r := h.Get("RateLimit"); !strings.HasPrefix(r, `"per-user";r=0;t=`) || strings.Contains(r, "per-account") {
		t.Errorf("second request: RateLimit %q, want per-user's item alone", r)
	}
}
