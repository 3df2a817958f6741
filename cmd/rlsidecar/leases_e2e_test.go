package main

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

const leaseRulesYAML = `
rules:
  - name: exports
    match: { path: "/v1/exports/**" }
    key: user
    concurrency: { max: 2, lease: 30s }
  - name: per-user
    key: user
    limit: { requests: 8, per: 1h }
`

func (r *rawConn) leaseOp(id uint64, op, lease string, leaseMs uint64) *proto.Response {
	r.t.Helper()
	r.send(&proto.Request{ID: id, Op: op, Lease: lease, LeaseMs: leaseMs, Cost: 1})
	resp := r.recv()
	if resp.ID != id {
		r.t.Fatalf("answer id %d, want %d", resp.ID, id)
	}
	return resp
}

// The daemon binary: two leases then a refusal; release frees a slot, a second release
// says false; renew; closing the acquiring connection frees its slots; a rate-refused
// check holds nothing; the metrics count it all.
func TestE2ELeases(t *testing.T) {
	dir := shortTempDir(t)
	d := startDaemon(t, "--config", writeFile(t, dir, "rules.yaml", leaseRulesYAML), "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	a, b := dialRaw(t, d.socket), dialRaw(t, d.socket)
	exp := []string{"path=/v1/exports/1", "user=ann"}

	var leases []string
	for i := range 2 {
		r := a.check(uint64(1+i), 1, exp...)
		if !r.Allowed || r.Lease == "" || r.Rules[0].Limit != 2 || r.Rules[0].WindowMs != 30000 || r.Rules[0].Remaining != uint64(1-i) {
			t.Fatalf("check %d: %+v; want allowed with a lease, limit 2, window 30000, remaining %d", i, r, 1-i)
		}
		leases = append(leases, r.Lease)
	}
	if r := a.check(3, 1, exp...); r.Allowed || r.Lease != "" || r.Rule != "exports" || r.RetryAfterMs == 0 || r.RetryAfterMs > 1000 {
		t.Fatalf("third check: %+v; want refused by exports, no lease, retry hint in (0, 1000]", r)
	}
	// Released through another connection of the same daemon: true, then false.
	if r := b.leaseOp(4, proto.OpRelease, leases[0], 0); !r.Released || r.IsError() {
		t.Fatalf("release: %+v; want released", r)
	}
	if r := b.leaseOp(5, proto.OpRelease, leases[0], 0); r.Released || r.IsError() {
		t.Fatalf("second release: %+v; want released false, no error", r)
	}
	for i, tok := range []string{"", "nope", "00000000.1"} {
		if r := b.leaseOp(uint64(6+i), proto.OpRelease, tok, 0); r.Released || r.IsError() {
			t.Fatalf("release of %q: %+v; want released false, no error", tok, r)
		}
	}
	if r := b.leaseOp(10, proto.OpRenew, leases[1], 120000); !r.Renewed || r.ExpiresMs != 120000 {
		t.Fatalf("renew: %+v; want renewed, expires_ms 120000", r)
	}
	if r := b.leaseOp(11, proto.OpRenew, leases[1], 3_600_001); r.Err.Code != proto.CodeBadRequest {
		t.Fatalf("renew past 1h: %+v; want bad_request", r)
	}
	if r := b.leaseOp(12, proto.OpRenew, leases[0], 0); r.Renewed || r.ExpiresMs != 0 {
		t.Fatalf("renew of a released lease: %+v; want renewed false", r)
	}
	if r := a.check(13, 1, exp...); !r.Allowed || r.Lease == "" {
		t.Fatalf("after a release: %+v; want allowed", r)
	}
	if r := b.check(14, 1, exp...); r.Allowed {
		t.Fatalf("both slots held by a: %+v; want refused", r)
	}
	// a closes: its two leases are freed at once, long before 30s.
	a.c.Close()
	deadline := time.Now().Add(5 * time.Second)
	var r *proto.Response
	for id := uint64(15); ; id++ {
		if r = b.check(id, 0, exp...); r.Rules[0].Remaining == 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if r.Rules[0].Remaining != 2 {
		t.Fatalf("after the acquiring connection closed: %+v; want both slots free", r)
	}
	// per-user allows 8 an hour: 3 taken so far (the refused checks took nothing). Take 5
	// more, releasing each; then the ninth is rate-refused and holds nothing.
	for i := range 5 {
		r := b.check(uint64(100+i), 1, exp...)
		if !r.Allowed || !b.leaseOp(uint64(200+i), proto.OpRelease, r.Lease, 0).Released {
			t.Fatalf("check %d within per-user: %+v", i, r)
		}
	}
	if r := b.check(300, 1, exp...); r.Allowed || r.Lease != "" || r.Rule != "per-user" {
		t.Fatalf("rate-refused: %+v; want refused by per-user, no lease", r)
	}
	if r := b.check(301, 0, exp...); r.Rules[0].Remaining != 2 {
		t.Fatalf("after a rate refusal: exports remaining %d; want 2 (it held nothing)", r.Rules[0].Remaining)
	}

	if code, body := httpGet(t, base+"/rules"); code != 200 || !strings.Contains(body, `"concurrency": {
        "max": 2,
        "lease": "30s"
      }`) || !strings.Contains(body, `"mode": "local"`) {
		t.Errorf("/rules: %d\n%s\nwant the exports rule's concurrency {max 2, lease 30s}", code, body)
	}
	types, samples := scrape(t, base)
	for name, typ := range map[string]string{"rlsidecar_inflight": "gauge", "rlsidecar_leases_total": "counter"} {
		if types[name] != typ {
			t.Errorf("%s has type %q; want %s", name, types[name], typ)
		}
	}
	for series, want := range map[string]float64{
		`rlsidecar_inflight{rule="exports"}`:                       0,
		`rlsidecar_leases_total{rule="exports",result="released"}`: 6,
		`rlsidecar_leases_total{rule="exports",result="closed"}`:   2,
		`rlsidecar_leases_total{rule="exports",result="expired"}`:  0,
	} {
		if got, ok := samples[series]; !ok || got != want {
			t.Errorf("%s = %v (present %v); want %v", series, got, ok, want)
		}
	}
}

// 100 goroutines, each on its own connection, against max 10: the clients never see 11
// in flight. Each counts itself in flight from its allowed answer until just before it
// releases, so the count they see is at most what the daemon holds.
func TestE2ELeases100Goroutines(t *testing.T) {
	dir := shortTempDir(t)
	d := startDaemon(t, "--config", writeFile(t, dir, "rules.yaml", `
rules:
  - name: provider
    key: tenant
    concurrency: { max: 10, lease: 30s }
`))
	var inflight, peak, allowed, refused atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan string, 100)
	for g := range 100 {
		c := dialRaw(t, d.socket)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 30 {
				id := uint64(g*1000 + i + 1)
				c.send(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "tenant", Value: "acme"}}})
				frame, err := c.readFrame()
				var r proto.Response
				if err == nil {
					err = c.dec.DecodeResponse(frame[proto.HeaderSize:], &r)
				}
				if err != nil {
					errs <- err.Error()
					return
				}
				if !r.Allowed {
					refused.Add(1)
					continue
				}
				allowed.Add(1)
				n := inflight.Add(1)
				for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
				}
				time.Sleep(200 * time.Microsecond)
				inflight.Add(-1)
				c.send(&proto.Request{ID: id, Op: proto.OpRelease, Lease: r.Lease, Cost: 1})
				frame, err = c.readFrame()
				if err == nil {
					err = c.dec.DecodeResponse(frame[proto.HeaderSize:], &r)
				}
				if err != nil || !r.Released {
					errs <- fmt.Sprintf("release: %v %+v", err, r)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	var msgs []string
	for e := range errs {
		msgs = append(msgs, e)
	}
	if len(msgs) > 0 {
		t.Fatalf("%d goroutines failed: %s", len(msgs), strings.Join(msgs, "; "))
	}
	t.Logf("allowed %d, refused %d, peak in flight %d", allowed.Load(), refused.Load(), peak.Load())
	if peak.Load() > 10 {
		t.Fatalf("saw %d in flight against max 10", peak.Load())
	}
	if allowed.Load() == 0 || refused.Load() == 0 {
		t.Fatalf("allowed %d, refused %d: the test did not contend", allowed.Load(), refused.Load())
	}
}
