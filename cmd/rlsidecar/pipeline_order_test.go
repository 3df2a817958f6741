package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// orderConn is a connection to a daemon on a real Redis (5 s timeouts: no answer here is
// left to a failure policy), numbering the requests it makes.
type orderConn struct {
	*rawConn
	id uint64
}

// startOrderDaemon starts a daemon on rules with the Redis at addr and connects to it.
func startOrderDaemon(t *testing.T, addr, rules string) *orderConn {
	t.Helper()
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", rules)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+addr, "--global-timeout", "5s", "--redis-timeout", "5s")
	return &orderConn{rawConn: dialRaw(t, d.socket)}
}

// checkOf returns the next check, of cost 1, with the attributes attrs ("name=value").
func (c *orderConn) checkOf(attrs ...string) *proto.Request {
	c.id++
	req := &proto.Request{ID: c.id, Op: proto.OpCheck, Cost: 1}
	for _, a := range attrs {
		k, v, _ := strings.Cut(a, "=")
		req.Attrs = append(req.Attrs, proto.Attr{Name: k, Value: v})
	}
	return req
}

// releaseOf returns the next request: the release of lease.
func (c *orderConn) releaseOf(lease string) *proto.Request {
	c.id++
	return &proto.Request{ID: c.id, Op: proto.OpRelease, Lease: lease}
}

// pipeline writes reqs in one write.
func (c *orderConn) pipeline(reqs ...*proto.Request) {
	enc := proto.NewEncoder()
	for _, r := range reqs {
		enc.EncodeRequest(r)
	}
	c.write(enc.Bytes())
}

// decisions reads n answers to checks and returns them in order, A allowed, r refused;
// each must be one, not degraded.
func (c *orderConn) decisions(t *testing.T, n int) string {
	t.Helper()
	var got strings.Builder
	for i := range n {
		r := c.recv()
		if r.IsError() || r.Degraded {
			t.Fatalf("answer %d: %+v, want a decision, not degraded", i, r)
		}
		if r.Allowed {
			got.WriteByte('A')
		} else {
			got.WriteByte('r')
		}
	}
	return got.String()
}

// Pipelined checks of one key on one connection are decided in request order, in every
// mode: with a limit of 5, ten written at once are allowed, allowed, allowed, allowed,
// allowed, then refused five times. A check that waits on Redis (a global rule, a hybrid
// key new to the daemon) is decided on a goroutine of its own; before, the checks behind
// it that shared its key were decided as their goroutines happened to run (the last one
// spawned first), or inline ahead of it, so some of the first five were refused and later
// ones allowed (AAAArrrrrA, AAArArrrAr), the counts right and the order not.
func TestE2EPipelinedChecksOfOneKeyInOrder(t *testing.T) {
	srv := redistest.StartStandalone(t)
	c := startOrderDaemon(t, srv.Addr, `
rules:
  - name: global-rate
    match: { path: /g }
    key: user
    limit: { requests: 5, per: 1h }
    mode: global
  - name: global-concurrency
    match: { path: /c }
    key: user
    concurrency: { max: 5, lease: 1m }
    mode: global
  - name: hybrid-rate
    match: { path: /h }
    key: user
    limit: { requests: 5, per: 1h }
    mode: hybrid
  - name: wide
    match: { path: /m }
    key: user
    limit: { requests: 1000000, per: 1h }
    mode: global
  - name: tight
    match: { path: "/m*" }
    key: user
    limit: { requests: 5, per: 1h }
    mode: local
`)
	ten := func(p string) []string {
		out := make([]string, 10)
		for i := range out {
			out[i] = p
		}
		return out
	}
	for trial := range 5 {
		for _, tc := range []struct {
			name  string
			paths []string
		}{
			{"global rate", ten("/g")},
			{"global concurrency", ten("/c")},
			{"hybrid rate, a key new to the daemon", ten("/h")},
			// The first waits on Redis for its global rule; the nine behind it take from
			// its local rule's key alone, and are decided after it, not inline before it.
			{"global and local, then local alone", append([]string{"/m"}, ten("/ml")[:9]...)},
		} {
			user := fmt.Sprintf("user=u%d-%s", trial, strings.ReplaceAll(tc.name, " ", "-"))
			var reqs []*proto.Request
			for _, p := range tc.paths {
				reqs = append(reqs, c.checkOf("path="+p, user))
			}
			c.pipeline(reqs...)
			if got := c.decisions(t, len(reqs)); got != "AAAAArrrrr" {
				t.Errorf("trial %d, %s: decided %s, want AAAAArrrrr", trial, tc.name, got)
			}
		}
	}
}

// A release of a global lease pipelined before a check of its rule's key takes effect
// first: the check finds the freed slot. Before, both went to Redis on goroutines of
// their own, in any order, and the check was refused about one time in two.
func TestE2EPipelinedReleaseThenCheckInOrder(t *testing.T) {
	srv := redistest.StartStandalone(t)
	c := startOrderDaemon(t, srv.Addr, `
rules:
  - name: one-at-a-time
    key: user
    concurrency: { max: 1, lease: 1m }
    mode: global
`)
	for trial := range 20 {
		user := fmt.Sprint("user=u", trial)
		c.send(c.checkOf(user))
		first := c.recv()
		if !first.Allowed || first.Lease == "" {
			t.Fatalf("trial %d: the first check: %+v, want allowed with a lease", trial, first)
		}
		c.pipeline(c.releaseOf(first.Lease), c.checkOf(user))
		if r := c.recv(); !r.Released {
			t.Fatalf("trial %d: release: %+v, want released", trial, r)
		}
		if r := c.recv(); !r.Allowed || r.Lease == "" {
			t.Errorf("trial %d: the check pipelined after the release: %+v, want allowed (the slot freed)", trial, r)
		} else {
			c.send(c.releaseOf(r.Lease))
			c.recv()
		}
	}
}

// A lease's local slots are ordered with the waiting checks of their keys too, both ways:
// a release pipelined before a check of its local rule's key frees the slot first, also
// when the lease has a global part (its release waits on Redis); a release pipelined after
// a check that waits on Redis and takes from its local rule's key frees the slot after
// that check is decided. Before, the release of a lease with a global part was ordered by
// its global keys alone, so a check of its local key alone went inline ahead of it and
// was refused; and the release of a local lease went inline ahead of the waiting check
// before it, which then found the slot free.
func TestE2EPipelinedLocalLeaseSlotsInOrder(t *testing.T) {
	srv := redistest.StartStandalone(t)
	c := startOrderDaemon(t, srv.Addr, `
rules:
  - name: local-one
    key: user
    concurrency: { max: 1, lease: 1m }
    mode: local
  - name: global-many
    match: { path: /g }
    key: user
    concurrency: { max: 100, lease: 1m }
    mode: global
`)
	check := func(user, path string) *proto.Request { return c.checkOf("user="+user, "path="+path) }
	release, pipeline := c.releaseOf, c.pipeline
	for trial := range 10 {
		// A lease with a local and a global part, released, then a check of the local key.
		user := fmt.Sprint("a", trial)
		c.send(check(user, "/g"))
		first := c.recv()
		if !first.Allowed || first.Lease == "" {
			t.Fatalf("trial %d: the first check: %+v, want allowed with a lease", trial, first)
		}
		pipeline(release(first.Lease), check(user, "/l"))
		if r := c.recv(); !r.Released {
			t.Fatalf("trial %d: release: %+v, want released", trial, r)
		}
		if r := c.recv(); !r.Allowed || r.Lease == "" {
			t.Errorf("trial %d: a check of the local key pipelined after the release of a local and global lease: %+v, want allowed (the slot freed)", trial, r)
		} else {
			c.send(release(r.Lease))
			c.recv()
		}

		// A local lease; a check that waits on Redis and takes from its key, then the
		// release: the check finds the slot held.
		user = fmt.Sprint("b", trial)
		c.send(check(user, "/l"))
		local := c.recv()
		if !local.Allowed || local.Lease == "" {
			t.Fatalf("trial %d: the local check: %+v, want allowed with a lease", trial, local)
		}
		pipeline(check(user, "/g"), release(local.Lease))
		r := c.recv()
		if r.Allowed {
			t.Errorf("trial %d: a waiting check pipelined before the release of the local lease of its key: allowed, want refused (the slot still held)", trial)
		}
		if rel := c.recv(); !rel.Released {
			t.Fatalf("trial %d: release: %+v, want released", trial, rel)
		}
		if r.Lease != "" {
			c.send(release(r.Lease))
			c.recv()
		}
	}
}

// The releases and renews of different global leases of one key overlap their Redis round
// trips (TestE2EGlobalLeaseOpsOverlap), but those of one lease stay in request order: a
// renew pipelined after the lease's release finds it released.
func TestE2EPipelinedReleaseAndRenewOfOneLeaseInOrder(t *testing.T) {
	srv := redistest.StartStandalone(t)
	c := startOrderDaemon(t, srv.Addr, `
rules:
  - name: slots
    key: user
    concurrency: { max: 100, lease: 1m }
    mode: global
`)
	renew := func(lease string) *proto.Request {
		c.id++
		return &proto.Request{ID: c.id, Op: proto.OpRenew, Lease: lease, LeaseMs: 60000}
	}
	for trial := range 20 {
		c.send(c.checkOf("user=ann"))
		r := c.recv()
		if !r.Allowed || r.Lease == "" {
			t.Fatalf("trial %d: check: %+v, want allowed with a lease", trial, r)
		}
		c.pipeline(renew(r.Lease), c.releaseOf(r.Lease), renew(r.Lease))
		renewed, released, late := c.recv(), c.recv(), c.recv()
		if !renewed.Renewed || !released.Released || late.Renewed {
			t.Errorf("trial %d: renew, release, renew of one lease pipelined: renewed %v, released %v, renewed %v; want true, true, false",
				trial, renewed.Renewed, released.Released, late.Renewed)
		}
	}
}

// Checks of one key ordered so still share their round trips: each goes once the one
// before it is queued for Redis (whose calls of a key are decided in the order queued),
// not once it is answered. 12 pipelined global checks of one client behind a Redis 100 ms
// away take about one round trip, and are decided in order; one after another they took
// 1.2 s or more (12 round trips).
func TestE2EPipelinedChecksOfOneKeyShareRoundTrips(t *testing.T) {
	const latency = 100 * time.Millisecond
	srv := redistest.StartStandalone(t)
	proxy := startToxiproxy(t, srv.Addr)
	addToxic(t, proxy, "latency", "latency", "downstream", fmt.Sprintf(`{"latency":%d}`, latency.Milliseconds()))
	c := startOrderDaemon(t, proxy.Listen, `
rules:
  - name: global-rate
    key: user
    limit: { requests: 5, per: 1h }
    mode: global
`)
	c.check(1000, 1, "user=warm") // opens the pool's connections to Redis
	var reqs []*proto.Request
	for range 12 {
		reqs = append(reqs, c.checkOf("user=hot"))
	}
	start := time.Now()
	c.pipeline(reqs...)
	got := c.decisions(t, len(reqs))
	el := time.Since(start)
	if got != "AAAAArrrrrrr" {
		t.Errorf("decided %s, want AAAAArrrrrrr", got)
	}
	if el >= 700*time.Millisecond {
		t.Fatalf("12 pipelined checks of one client on a %v Redis took %v: decided one after another", latency, el)
	}
	t.Logf("12 pipelined checks of one client on a %v Redis: %v", latency, el)
}

// A release pipelined after a check of its lease's key does not overtake that check in
// Redis, also when a check of the same key between them is decided without Redis (a
// local rule refuses it). A check of keys in Redis waits for the one before it to be
// queued, not decided, and a release waits for the latest check of its slots' keys: that
// one, refused locally, was done while the first was still on its way to Redis, and the
// release, sent on another connection to Redis, freed the slot first; the first check
// then took it, allowed where in request order the slot was full (the wire audit,
// TestE2EWireFuzz with real leases, 3 runs of 3 on one seed).
func TestE2EPipelinedReleaseAfterChecksStaysAfter(t *testing.T) {
	srv := redistest.StartStandalone(t)
	c := startOrderDaemon(t, srv.Addr, `
rules:
  - name: one-at-a-time
    key: user
    concurrency: { max: 1, lease: 1m }
    mode: global
  - name: closed
    match: { path: /closed }
    key: user
    limit: deny
    mode: local
`)
	overtaken := 0
	for trial := range 40 {
		user := fmt.Sprint("user=u", trial)
		c.send(c.checkOf(user))
		first := c.recv()
		if !first.Allowed || first.Lease == "" {
			t.Fatalf("trial %d: the first check: %+v, want allowed with a lease", trial, first)
		}
		// Others' global checks ahead, so that the combiner holds this one's call back
		// while the release may go.
		var reqs []*proto.Request
		for i := range 8 {
			reqs = append(reqs, c.checkOf(fmt.Sprint("user=other-", trial, "-", i)))
		}
		reqs = append(reqs, c.checkOf(user), c.checkOf(user, "path=/closed"), c.releaseOf(first.Lease))
		c.pipeline(reqs...)
		var leases []string
		for i := range 8 {
			if r := c.recv(); r.Lease != "" {
				leases = append(leases, r.Lease)
			} else if !r.Allowed {
				t.Fatalf("trial %d: another user's check %d refused: %+v", trial, i, r)
			}
		}
		r := c.recv()
		if r.Allowed {
			overtaken++
			t.Errorf("trial %d: a check pipelined before the release of the lease holding its slot: allowed, want refused (the slot held until the release)", trial)
			leases = append(leases, r.Lease)
		}
		if r := c.recv(); r.Allowed {
			t.Fatalf("trial %d: the check a local rule denies: %+v", trial, r)
		}
		if rel := c.recv(); !rel.Released {
			t.Fatalf("trial %d: release: %+v, want released", trial, rel)
		}
		for _, l := range leases {
			c.send(c.releaseOf(l))
			c.recv()
		}
	}
	t.Logf("%d of 40 checks overtaken by the release after them", overtaken)
}
