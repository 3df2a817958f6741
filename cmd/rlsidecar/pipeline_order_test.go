package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// Pipelined checks of one key on one connection are decided in request order, in every
// mode: with a limit of 5, ten written at once are allowed, allowed, allowed, allowed,
// allowed, then refused five times. A check that waits on Redis (a global rule, a hybrid
// key new to the daemon) is decided on a goroutine of its own; before, the checks behind
// it that shared its key were decided as their goroutines happened to run (the last one
// spawned first), or inline ahead of it, so some of the first five were refused and later
// ones allowed (AAAArrrrrA, AAArArrrAr), the counts right and the order not.
func TestE2EPipelinedChecksOfOneKeyInOrder(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
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
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--global-timeout", "5s", "--redis-timeout", "5s")
	c := dialRaw(t, d.socket)
	id := uint64(0)
	// pipeline writes the checks of user on paths in one write and returns the
	// decisions in request order: A allowed, r refused.
	pipeline := func(user string, paths ...string) string {
		enc := proto.NewEncoder()
		first := id + 1
		for _, p := range paths {
			id++
			enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1,
				Attrs: []proto.Attr{{Name: "path", Value: p}, {Name: "user", Value: user}}})
		}
		c.write(enc.Bytes())
		var got strings.Builder
		for i := range paths {
			r := c.recv()
			if r.ID != first+uint64(i) || r.IsError() || r.Degraded {
				t.Fatalf("answer %d: %+v, want id %d, a decision, not degraded", i, r, first+uint64(i))
			}
			if r.Allowed {
				got.WriteByte('A')
			} else {
				got.WriteByte('r')
			}
		}
		return got.String()
	}
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
			user := fmt.Sprintf("u%d-%s", trial, strings.ReplaceAll(tc.name, " ", "-"))
			if got := pipeline(user, tc.paths...); got != "AAAAArrrrr" {
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
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: one-at-a-time
    key: user
    concurrency: { max: 1, lease: 1m }
    mode: global
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--global-timeout", "5s", "--redis-timeout", "5s")
	c := dialRaw(t, d.socket)
	id := uint64(0)
	check := func(user string) *proto.Request {
		id++
		return &proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: user}}}
	}
	for trial := range 20 {
		user := fmt.Sprint("u", trial)
		c.send(check(user))
		first := c.recv()
		if !first.Allowed || first.Lease == "" {
			t.Fatalf("trial %d: the first check: %+v, want allowed with a lease", trial, first)
		}
		enc := proto.NewEncoder()
		id++
		enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpRelease, Lease: first.Lease})
		enc.EncodeRequest(check(user))
		c.write(enc.Bytes())
		if r := c.recv(); !r.Released {
			t.Fatalf("trial %d: release: %+v, want released", trial, r)
		}
		if r := c.recv(); !r.Allowed || r.Lease == "" {
			t.Errorf("trial %d: the check pipelined after the release: %+v, want allowed (the slot freed)", trial, r)
		} else {
			c.send(&proto.Request{ID: 1 << 40, Op: proto.OpRelease, Lease: r.Lease})
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
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
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
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--global-timeout", "5s", "--redis-timeout", "5s")
	c := dialRaw(t, d.socket)
	id := uint64(0)
	check := func(user, path string) *proto.Request {
		id++
		return &proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "path", Value: path}, {Name: "user", Value: user}}}
	}
	release := func(lease string) *proto.Request {
		id++
		return &proto.Request{ID: id, Op: proto.OpRelease, Lease: lease}
	}
	pipeline := func(reqs ...*proto.Request) {
		enc := proto.NewEncoder()
		for _, r := range reqs {
			enc.EncodeRequest(r)
		}
		c.write(enc.Bytes())
	}
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
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: slots
    key: user
    concurrency: { max: 100, lease: 1m }
    mode: global
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--global-timeout", "5s", "--redis-timeout", "5s")
	c := dialRaw(t, d.socket)
	id := uint64(0)
	for trial := range 20 {
		id++
		c.send(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "ann"}}})
		r := c.recv()
		if !r.Allowed || r.Lease == "" {
			t.Fatalf("trial %d: check: %+v, want allowed with a lease", trial, r)
		}
		enc := proto.NewEncoder()
		enc.EncodeRequest(&proto.Request{ID: id + 1, Op: proto.OpRenew, Lease: r.Lease, LeaseMs: 60000})
		enc.EncodeRequest(&proto.Request{ID: id + 2, Op: proto.OpRelease, Lease: r.Lease})
		enc.EncodeRequest(&proto.Request{ID: id + 3, Op: proto.OpRenew, Lease: r.Lease, LeaseMs: 60000})
		id += 3
		c.write(enc.Bytes())
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
// 1.2 s or more (an intermediate build of this ordering: a hot client's checks on one
// connection at 7,500/s against 24,000/s).
func TestE2EPipelinedChecksOfOneKeyShareRoundTrips(t *testing.T) {
	const latency = 100 * time.Millisecond
	srv := redistest.StartStandalone(t)
	proxy := startToxiproxy(t, srv.Addr)
	addToxic(t, proxy, "latency", "latency", "downstream", fmt.Sprintf(`{"latency":%d}`, latency.Milliseconds()))
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: global-rate
    key: user
    limit: { requests: 5, per: 1h }
    mode: global
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+proxy.Listen, "--global-timeout", "5s", "--redis-timeout", "5s")
	c := dialRaw(t, d.socket)
	c.check(1000, 1, "user=warm") // opens the pool's connections to Redis
	enc := proto.NewEncoder()
	for i := range uint64(12) {
		enc.EncodeRequest(&proto.Request{ID: i + 1, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "hot"}}})
	}
	start := time.Now()
	c.write(enc.Bytes())
	var got strings.Builder
	for i := range 12 {
		r := c.recv()
		if r.ID != uint64(i+1) || r.IsError() || r.Degraded {
			t.Fatalf("answer %d: %+v", i, r)
		}
		if r.Allowed {
			got.WriteByte('A')
		} else {
			got.WriteByte('r')
		}
	}
	el := time.Since(start)
	if got.String() != "AAAAArrrrrrr" {
		t.Errorf("decided %s, want AAAAArrrrrrr", got.String())
	}
	if el >= 700*time.Millisecond {
		t.Fatalf("12 pipelined checks of one client on a %v Redis took %v: decided one after another", latency, el)
	}
	t.Logf("12 pipelined checks of one client on a %v Redis: %v", latency, el)
}
