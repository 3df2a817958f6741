package main

import (
	"testing"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// TestE2EInlineDuplicateChargedOnce: through the real daemon on a real Redis, the same
// inline limit listed twice in one check is one limit, in each mode: a limit of 10 sent
// twice leaves 9 after one request and 8 after two (both entries alike), and a limit of 1
// sent twice admits its one request (the old daemon refused it for ever, retry 60 s).
func TestE2EInlineDuplicateChargedOnce(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: unrelated
    match: { path: /never }
    key: ip
    limit: { requests: 1, per: 1s }
`)
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0", "--redis", "redis://"+srv.Addr, "--sync-interval", "50ms", "--global-timeout", "3s", "--redis-timeout", "3s")
	c := dialRaw(t, d.socket)
	id := uint64(0)
	check := func(limits ...proto.InlineLimit) *proto.Response {
		t.Helper()
		id++
		c.send(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Limits: limits})
		r := c.recv()
		if r.ID != id || r.Err.Code != "" || r.Degraded {
			t.Fatalf("check %d: %+v", id, r)
		}
		return r
	}
	for _, mode := range []string{"local", "hybrid", "global"} {
		t.Run(mode, func(t *testing.T) {
			ten := proto.InlineLimit{Key: "dup-" + mode, Limit: 10, WindowMs: 60_000, Mode: mode}
			for i, want := range []uint64{9, 8} {
				r := check(ten, ten)
				if !r.Allowed || len(r.Rules) != 2 || r.Remaining != want || r.Rules[0] != r.Rules[1] || r.Rules[1].Remaining != want {
					t.Fatalf("request %d of limit 10 sent twice: %+v; want allowed, %d remaining in both entries", i+1, r, want)
				}
			}
			one := proto.InlineLimit{Key: "one-" + mode, Limit: 1, WindowMs: 60_000, Mode: mode}
			if r := check(one, one); !r.Allowed || r.Remaining != 0 || r.Rules[0] != r.Rules[1] {
				t.Fatalf("limit 1 sent twice: %+v; want its one request allowed", r)
			}
			if r := check(one, one); r.Allowed || r.Rules[0] != r.Rules[1] || r.RetryAfterMs == 0 {
				t.Fatalf("limit 1 sent twice, again: %+v; want refused, both entries alike", r)
			}
		})
	}
	// Counted once per check, as decided: 3 modes × (2 + 1) allowed, 3 × 1 rejected.
	s := scrapeSamples(t, "http://"+adminAddr(t, d))
	if a, r := s[`rlsidecar_checks_total{rule="~inline",result="allowed"}`], s[`rlsidecar_checks_total{rule="~inline",result="rejected"}`]; a != 9 || r != 3 {
		t.Errorf("rlsidecar_checks_total{~inline}: allowed %v rejected %v, want 9 and 3 (a repeated limit counted once)", a, r)
	}
}
