package main

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

const globalLeaseYAML = `
rules:
  - name: exports
    match: { path: "/v1/exports/**" }
    key: user
    concurrency: { max: 3, lease: 30s }
    mode: global
    on_store_failure: %s
`

// Two daemon binaries on one real Redis: 3 exports in flight per user across them, the
// 4th refused; a lease released through the OTHER daemon frees a slot; a second release
// is false; a forged token is released: false, never an error; a connection that closes
// frees its global leases for the other daemon too; the metrics count it all.
func TestE2EGlobalLeasesTwoDaemons(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", fmt.Sprintf(globalLeaseYAML, "closed"))
	d1 := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--redis-prefix", "e2e:", "--global-timeout", "2s", "--redis-timeout", "1s", "--admin", "127.0.0.1:0")
	d2 := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--redis-prefix", "e2e:", "--global-timeout", "2s", "--redis-timeout", "1s")
	c1, c2 := dialRaw(t, d1.socket), dialRaw(t, d2.socket)
	exp := []string{"path=/v1/exports/1", "user=ann"}

	var leases []string
	for i, c := range []*rawConn{c1, c2, c1} {
		r := c.check(uint64(1+i), 1, exp...)
		if !r.Allowed || r.Lease == "" || r.Degraded || r.Rules[0].Limit != 3 || r.Rules[0].Remaining != uint64(2-i) || r.Rules[0].WindowMs != 30000 {
			t.Fatalf("check %d: %+v; want allowed with a lease, limit 3, remaining %d", i, r, 2-i)
		}
		leases = append(leases, r.Lease)
	}
	if r := c2.check(4, 1, exp...); r.Allowed || r.Lease != "" || r.Rule != "exports" || r.RetryAfterMs == 0 || r.RetryAfterMs > 1000 {
		t.Fatalf("4th: %+v; want refused by exports with a retry hint in (0, 1000]", r)
	}
	// Taken on d1, released through d2.
	if r := c2.leaseOp(5, proto.OpRelease, leases[0], 0); !r.Released || r.IsError() {
		t.Fatalf("release through the other daemon: %+v", r)
	}
	if r := c1.leaseOp(6, proto.OpRelease, leases[0], 0); r.Released || r.IsError() {
		t.Fatalf("second release: %+v; want false", r)
	}
	forged := "g" + strings.Repeat("A", 40)
	for i, tok := range []string{forged, leases[1] + "x", "g", "~g"} {
		if r := c2.leaseOp(uint64(7+i), proto.OpRelease, tok, 0); r.Released || r.IsError() {
			t.Fatalf("forged %q: %+v; want released false, no error", tok, r)
		}
	}
	// A long client key (a 300-byte user id) makes a long token: still released.
	long := []string{"path=/v1/exports/1", "user=" + strings.Repeat("u", 300)}
	if r := c1.check(15, 1, long...); !r.Allowed || len(r.Lease) < 300 {
		t.Fatalf("long user: %+v", r)
	} else if rr := c2.leaseOp(16, proto.OpRelease, r.Lease, 0); !rr.Released || rr.IsError() {
		t.Fatalf("release of a %d-byte token: %+v", len(r.Lease), rr)
	}
	if r := c1.leaseOp(20, proto.OpRenew, leases[1], 90000); !r.Renewed || r.ExpiresMs != 90000 {
		t.Fatalf("renew through d1 of d2's lease: %+v", r)
	}
	if r := c2.check(21, 1, exp...); !r.Allowed {
		t.Fatalf("after the release: %+v; want allowed", r)
	}
	// c1 holds leases[2]; closing it frees that slot for d2.
	c1.c.Close()
	deadline := time.Now().Add(5 * time.Second)
	var r *proto.Response
	for id := uint64(30); ; id++ {
		if r = c2.check(id, 0, exp...); r.Rules[0].Remaining == 1 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if r.Rules[0].Remaining != 1 {
		t.Fatalf("after d1's connection closed: %+v; want 1 slot free (d2 holds 2)", r)
	}
	_, samples := scrape(t, "http://"+adminAddr(t, d1))
	for series, want := range map[string]float64{
		`rlsidecar_inflight{rule="exports"}`:                     0,
		`rlsidecar_leases_total{rule="exports",result="closed"}`: 1,
	} {
		if got, ok := samples[series]; !ok || got != want {
			t.Errorf("d1 %s = %v (present %v); want %v", series, got, ok, want)
		}
	}
}

// 100 goroutines over two daemons against max 10 never see 11 in flight; each releases
// through the daemon it did not acquire on.
func TestE2EGlobalLeases100Goroutines(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: provider
    key: tenant
    concurrency: { max: 10, lease: 30s }
    mode: global
`)
	ds := []*daemonProc{
		startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--global-timeout", "2s", "--redis-timeout", "1s"),
		startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--global-timeout", "2s", "--redis-timeout", "1s"),
	}
	var inflight, peak, allowed, refused atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan string, 100)
	for g := range 100 {
		acq, rel := dialRaw(t, ds[g%2].socket), dialRaw(t, ds[(g+1)%2].socket)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 20 {
				id := uint64(g*1000 + i + 1)
				acq.send(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "tenant", Value: "acme"}}})
				var r proto.Response
				frame, err := acq.readFrame()
				if err == nil {
					err = acq.dec.DecodeResponse(frame[proto.HeaderSize:], &r)
				}
				if err != nil || r.IsError() || r.Degraded {
					errs <- fmt.Sprintf("check: %v %+v", err, r)
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
				time.Sleep(300 * time.Microsecond)
				inflight.Add(-1)
				rel.send(&proto.Request{ID: id, Op: proto.OpRelease, Lease: r.Lease, Cost: 1})
				frame, err = rel.readFrame()
				if err == nil {
					err = rel.dec.DecodeResponse(frame[proto.HeaderSize:], &r)
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
	for e := range errs {
		t.Error(e)
	}
	t.Logf("allowed %d, refused %d, peak in flight %d", allowed.Load(), refused.Load(), peak.Load())
	if peak.Load() > 10 || peak.Load() < 2 {
		t.Fatalf("saw %d in flight against max 10 across two daemons", peak.Load())
	}
}

// Redis killed: a global concurrency rule follows on_store_failure: open allows,
// degraded, without a lease; closed refuses; local takes a local lease, max per daemon.
func TestE2EGlobalLeasesRedisDown(t *testing.T) {
	for _, tc := range []struct {
		policy   string
		allowed  int // of 4 checks
		withToks bool
	}{{"open", 4, false}, {"closed", 0, false}, {"local", 3, true}} {
		t.Run(tc.policy, func(t *testing.T) {
			srv := redistest.StartStandalone(t)
			dir := shortTempDir(t)
			cfg := writeFile(t, dir, "rules.yaml", fmt.Sprintf(globalLeaseYAML, tc.policy))
			d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--global-timeout", "1s", "--redis-timeout", "500ms")
			c := dialRaw(t, d.socket)
			exp := []string{"path=/v1/exports/1", "user=bo"}
			if r := c.check(1, 1, exp...); !r.Allowed || r.Degraded || !strings.HasPrefix(r.Lease, "g") {
				t.Fatalf("with Redis: %+v", r)
			}
			srv.Stop()
			n := 0
			for i := range 4 {
				r := c.check(uint64(10+i), 1, exp...)
				if !r.Degraded {
					t.Fatalf("check %d with Redis down: %+v; want degraded", i, r)
				}
				if r.Allowed {
					n++
					if (r.Lease != "") != tc.withToks || strings.HasPrefix(r.Lease, "g") {
						t.Fatalf("check %d: lease %q", i, r.Lease)
					}
				}
			}
			if n != tc.allowed {
				t.Fatalf("%d of 4 allowed with Redis down; want %d", n, tc.allowed)
			}
		})
	}
}

// A 3-master Redis Cluster: two daemons share the slots; a lease acquired on one is
// released through the other.
func TestE2EGlobalLeasesCluster(t *testing.T) {
	cl := redistest.StartCluster(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", fmt.Sprintf(globalLeaseYAML, "closed"))
	nodes := strings.Join(cl.Addrs, ",")
	d1 := startDaemon(t, "--config", cfg, "--redis-cluster", nodes, "--global-timeout", "2s", "--redis-timeout", "1s")
	d2 := startDaemon(t, "--config", cfg, "--redis-cluster", nodes, "--global-timeout", "2s", "--redis-timeout", "1s")
	c1, c2 := dialRaw(t, d1.socket), dialRaw(t, d2.socket)
	for _, user := range []string{"ann", "bob", "cy"} { // three keys, spread over the masters
		exp := []string{"path=/v1/exports/1", "user=" + user}
		var toks []string
		for i := range 3 {
			r := []*rawConn{c1, c2}[i%2].check(uint64(i+1), 1, exp...)
			if !r.Allowed || r.Degraded {
				t.Fatalf("%s check %d: %+v", user, i, r)
			}
			toks = append(toks, r.Lease)
		}
		if r := c1.check(9, 1, exp...); r.Allowed {
			t.Fatalf("%s: 4th allowed", user)
		}
		if r := c2.leaseOp(10, proto.OpRelease, toks[0], 0); !r.Released {
			t.Fatalf("%s: release through d2 of d1's lease: %+v", user, r)
		}
		if r := c1.check(11, 1, exp...); !r.Allowed {
			t.Fatalf("%s: refused after a release", user)
		}
	}
}

// A release or renewal of a global lease waits for Redis at least 250 ms (README,
// "Redis down"; proto/PROTOCOL.md), whatever --redis-timeout (50 ms by default) bounds a
// check's calls (20 ms here, leaving the 80 ms pause below 170 ms of headroom on a busy
// host): with Redis paused 80 ms, both answer true. Before, they went on the checks'
// client, whose own timeout cut them: released: false and renewed: false after 20 ms
// (50 ms with the default), though Redis did free or extend the lease once it resumed (so
// the Go middleware, told the lease was gone, stopped renewing a lease still held).
func TestE2EGlobalLeaseReleaseOutlastsRedisTimeout(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", fmt.Sprintf(globalLeaseYAML, "closed"))
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--redis-prefix", "e2e:", "--redis-timeout", "20ms", "--global-timeout", "20ms")
	c := dialRaw(t, d.socket)
	id := uint64(0)
	// acquire takes a lease of user's.
	acquire := func(user string) string {
		exp := []string{"path=/v1/exports/1", "user=" + user}
		for start := id; ; { // a cold start may degrade the first checks
			id++
			if r := c.check(id, 1, exp...); r.Allowed && !r.Degraded && r.Lease != "" {
				return r.Lease
			} else if id > start+250 {
				t.Fatalf("no lease from a live Redis: %+v", r)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// paused sends op with Redis frozen for 80 ms, and returns its answer, how long it
	// took, and how long Redis was frozen: the thaw comes from this process, which a
	// loaded host may wake late, past the 250 ms a release or renewal waits.
	paused := func(op func() *proto.Response) (*proto.Response, time.Duration, time.Duration) {
		thawed := make(chan time.Duration)
		frozen := time.Now()
		srv.Freeze()
		go func() {
			time.Sleep(80 * time.Millisecond)
			srv.Thaw()
			thawed <- time.Since(frozen)
		}()
		start := time.Now()
		r := op()
		took := time.Since(start)
		return r, took, <-thawed // no thaw outlives the test
	}
	// A trial whose freeze lasted past 150 ms (80 ms asked) says nothing: a release or
	// renewal that gives up after 250 ms is right then. With the bug every trial fails
	// after 20 ms.
	const fair = 150 * time.Millisecond
	for trial := 0; ; trial++ {
		lease := acquire(fmt.Sprint("ann-", trial))
		id++
		r, took, frozen := paused(func() *proto.Response { return c.leaseOp(id, proto.OpRenew, lease, 60000) })
		if !r.Renewed || r.ExpiresMs != 60000 || r.IsError() {
			if frozen > fair && trial < 4 {
				t.Logf("trial %d: renew %+v after %v, Redis frozen %v: again", trial, r, took, frozen)
				continue
			}
			t.Fatalf("renew while Redis paused %v: %+v after %v; want renewed, expires_ms 60000", frozen, r, took)
		}
		time.Sleep(50 * time.Millisecond)
		id++
		r, took, frozen = paused(func() *proto.Response { return c.leaseOp(id, proto.OpRelease, lease, 0) })
		if !r.Released || r.IsError() {
			if frozen > fair && trial < 4 {
				t.Logf("trial %d: release %+v after %v, Redis frozen %v: again", trial, r, took, frozen)
				continue
			}
			t.Fatalf("release while Redis paused %v: %+v after %v; want released", frozen, r, took)
		}
		return
	}
}

// A lease holding a global and a local slot (its request matched a global and a local
// concurrency rule), as README and proto/PROTOCOL.md say: released through the other
// daemon, its global slot is freed (released: true) and its local one stays held on
// the daemon that answered; renewed there, renewed: false; released on the daemon that
// answered, its local slot is freed too.
func TestE2EMixedLeaseThroughOtherDaemon(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: shared
    key: user
    concurrency: { max: 1, lease: 30s }
    mode: global
  - name: here
    key: user
    concurrency: { max: 1, lease: 30s }
    mode: local
`)
	args := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--global-timeout", "2s", "--redis-timeout", "1s"}
	d1, d2 := startDaemon(t, args...), startDaemon(t, args...)
	c1, c2 := dialRaw(t, d1.socket), dialRaw(t, d2.socket)
	r := c1.check(1, 1, "user=ann")
	if !r.Allowed || r.Lease == "" {
		t.Fatalf("check: %+v", r)
	}
	if rr := c2.leaseOp(2, proto.OpRenew, r.Lease, 5000); rr.Renewed || rr.IsError() {
		t.Fatalf("renew through the other daemon: %+v; want renewed false, no error", rr)
	}
	if rr := c2.leaseOp(3, proto.OpRelease, r.Lease, 0); !rr.Released || rr.IsError() {
		t.Fatalf("release through the other daemon: %+v; want released (its global slot)", rr)
	}
	if rr := c2.check(4, 0, "user=ann"); !rr.Allowed {
		t.Fatalf("the other daemon after the release: %+v; want its global slot free", rr)
	}
	if rr := c1.check(5, 0, "user=ann"); rr.Allowed || rr.Rule != "here" {
		t.Fatalf("the answering daemon after a release elsewhere: %+v; want refused by its local slot", rr)
	}
	if rr := c1.leaseOp(6, proto.OpRelease, r.Lease, 0); !rr.Released {
		t.Fatalf("release on the answering daemon: %+v; want released (its local slot)", rr)
	}
	if rr := c1.check(7, 0, "user=ann"); !rr.Allowed {
		t.Fatalf("after both releases: %+v", rr)
	}
}
