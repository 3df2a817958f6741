package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// globalLeaseOpsYAML: a global concurrency rule and a local rate rule; kind picks which
// one a request matches.
const globalLeaseOpsYAML = `
rules:
  - name: slots
    match: { kind: lease }
    key: user
    concurrency: { max: 100, lease: 30s }
    mode: global
  - name: plain
    match: { kind: local }
    key: user
    limit: { requests: 1000, per: 1h }
    mode: local
`

// The release and renew of a global lease wait on Redis: pipelined on one connection they
// overlap their round trips as global checks do, instead of stalling the connection's
// loop one after another, and the local checks between them are answered in request
// order. Redis is reached through a 100 ms latency (toxiproxy): 12 releases and 12 renews
// decided inline take at least 2.4 s; the bound asserted, 1.2 s, is half of what the
// inline daemon can physically do.
func TestE2EGlobalLeaseOpsOverlap(t *testing.T) {
	const latency = 100 * time.Millisecond
	srv := redistest.StartStandalone(t)
	proxy := startToxiproxy(t, srv.Addr)
	addToxic(t, proxy, "latency", "latency", "downstream", fmt.Sprintf(`{"latency":%d}`, latency.Milliseconds()))
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", globalLeaseOpsYAML)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+proxy.Listen, "--global-timeout", "5s", "--redis-timeout", "5s")
	c := dialRaw(t, d.socket)

	// 24 leases, acquired pipelined (also opens the pool's connections to Redis).
	const n = 12
	enc := proto.NewEncoder()
	for i := range uint64(2 * n) {
		enc.EncodeRequest(&proto.Request{ID: 1 + i, Op: proto.OpCheck, Cost: 1,
			Attrs: []proto.Attr{{Name: "kind", Value: "lease"}, {Name: "user", Value: "ann"}}})
	}
	c.write(enc.Bytes())
	var leases []string
	for i := range uint64(2 * n) {
		r := c.recv()
		if r.ID != 1+i || r.IsError() || !r.Allowed || r.Degraded || r.Lease == "" || r.Lease[0] != 'g' {
			t.Fatalf("acquire %d: %+v; want id %d allowed with a global lease", i, r, 1+i)
		}
		leases = append(leases, r.Lease)
	}

	// Pipelined: release lease i, renew lease n+i, a local check; n times.
	enc.Reset()
	for i := range uint64(n) {
		id := 100 + 3*i
		enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpRelease, Lease: leases[i], Cost: 1})
		enc.EncodeRequest(&proto.Request{ID: id + 1, Op: proto.OpRenew, Lease: leases[n+i], LeaseMs: 60000, Cost: 1})
		enc.EncodeRequest(&proto.Request{ID: id + 2, Op: proto.OpCheck, Cost: 1,
			Attrs: []proto.Attr{{Name: "kind", Value: "local"}, {Name: "user", Value: "ann"}}})
	}
	start := time.Now()
	c.write(enc.Bytes())
	for i := range uint64(3 * n) {
		r := c.recv()
		if want := 100 + i; r.ID != want {
			t.Fatalf("answer %d has id %d, want %d: answers out of request order", i, r.ID, want)
		}
		if r.IsError() {
			t.Fatalf("answer %d: %+v", i, r)
		}
		switch i % 3 {
		case 0:
			if !r.Released {
				t.Fatalf("release %d: %+v; want released", i/3, r)
			}
		case 1:
			if !r.Renewed || r.ExpiresMs != 60000 {
				t.Fatalf("renew %d: %+v; want renewed for 60000 ms", i/3, r)
			}
		case 2:
			if !r.Allowed || r.Rule != "" && r.Rule != "plain" {
				t.Fatalf("local check %d: %+v; want allowed", i/3, r)
			}
		}
	}
	el := time.Since(start)
	if el >= 1200*time.Millisecond {
		t.Fatalf("%d releases and %d renews pipelined with local checks on a %v Redis took %v: decided one after another", n, n, latency, el)
	}
	t.Logf("%d releases + %d renews + %d local checks pipelined on a %v Redis: %v", n, n, n, latency, el)

	// The releases took effect: 12 of 100 slots held, this check takes a 13th.
	if r := c.check(1000, 1, "kind=lease", "user=ann"); !r.Allowed || r.Rules[0].Remaining != 100-n-1 {
		t.Fatalf("after the releases: %+v; want allowed with %d remaining", r, 100-n-1)
	}
	// A second release of a released lease is false, off the fast path too.
	if r := c.leaseOp(1001, proto.OpRelease, leases[0], 0); r.Released || r.IsError() {
		t.Fatalf("second release: %+v; want released false", r)
	}
}

// A connection holding global leases closes while Redis is frozen (toxiproxy drops every
// byte): its leases' release waits on Redis, on the closing connection's own goroutine,
// bounded (1 s), while other connections keep being answered and new ones accepted at
// once. The closing connection is still counted while its release waits, and gone once
// the bound has passed.
func TestE2EGlobalLeaseCloseRedisFrozen(t *testing.T) {
	srv := redistest.StartStandalone(t)
	proxy := startToxiproxy(t, srv.Addr)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", globalLeaseOpsYAML)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+proxy.Listen, "--global-timeout", "5s", "--redis-timeout", "5s", "--admin", "127.0.0.1:0")
	admin := "http://" + adminAddr(t, d)
	connections := func() float64 {
		_, samples := scrape(t, admin)
		return samples["rlsidecar_connections"]
	}

	a, b := dialRaw(t, d.socket), dialRaw(t, d.socket)
	for i := range uint64(5) {
		if r := a.check(1+i, 1, "kind=lease", "user=bo"); !r.Allowed || r.Degraded || r.Lease == "" {
			t.Fatalf("acquire %d: %+v", i, r)
		}
	}
	if r := b.check(1, 1, "kind=local", "user=bo"); !r.Allowed {
		t.Fatalf("b: %+v", r)
	}
	if got := connections(); got != 2 {
		t.Fatalf("rlsidecar_connections = %v before the close; want 2", got)
	}

	addToxic(t, proxy, "frozen", "timeout", "upstream", `{"timeout":0}`)
	closed := time.Now()
	a.c.Close()

	// While a's release waits on the frozen Redis: b is answered, a new connection is
	// accepted and answered, each at once.
	const prompt = 500 * time.Millisecond // far below the release's 1 s wait, far above a loaded machine's stalls
	sawWaiting := false
	for id := uint64(10); time.Since(closed) < 700*time.Millisecond; id++ {
		start := time.Now()
		if r := b.check(id, 1, "kind=local", "user=bo"); !r.Allowed {
			t.Fatalf("b while a's release waits: %+v", r)
		}
		if r := b.leaseOp(id+1000, proto.OpPing, "", 0); r.IsError() {
			t.Fatalf("b ping: %+v", r)
		}
		c := dialRaw(t, d.socket)
		if r := c.check(id, 1, "kind=local", "user=cy"); !r.Allowed {
			t.Fatalf("new connection while a's release waits: %+v", r)
		}
		if el := time.Since(start); el > prompt {
			t.Fatalf("a check, a ping and a new connection took %v while a closing connection's release waited on Redis; want each answered at once (< %v)", el, prompt)
		}
		c.c.Close()
		if n := connections(); n >= 2 && time.Since(closed) > 100*time.Millisecond {
			sawWaiting = true // a (releasing) and b; c may still be closing
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !sawWaiting {
		t.Fatalf("the closing connection was not seen waiting on Redis: was its release made?")
	}
	// Bounded: a is gone within the bound (1 s) and some slack.
	deadline := closed.Add(3 * time.Second)
	for connections() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("rlsidecar_connections = %v 3 s after the close with Redis frozen; want 1 (the release bounded at 1 s)", connections())
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("the closing connection's release gave up after %v with Redis frozen", time.Since(closed).Round(10*time.Millisecond))
}
