package main

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// A global lease its holder released while Redis was frozen (the release written, its
// answer lost), whose connection then closed while Redis was still frozen (the close's
// release unanswered too), is counted released: Redis ran the holder's release first
// once thawed, and the lease is counted as that release would have been (the first that
// may have run, globalLease.sentUnsure). Before, the close's release, which made the
// lease ownerless, decided the count: closed, though the holder had released it (a
// client that reconnects after a release times out does this).
func TestE2EGlobalLeaseReleasedThenClosedWhileRedisFrozenIsCountedReleased(t *testing.T) {
	d, base, rdb, freeze, thaw := frozenLeases(t, `
rules:
  - name: held
    match: { path: /held }
    key: user
    concurrency: { max: 2, lease: 60s }
    on_store_failure: closed
`)
	ctx := context.Background()

	a, h := dialRaw(t, d.socket), dialRaw(t, d.socket)
	id := uint64(0)
	take := func(c *rawConn, user string) string {
		t.Helper()
		id++
		r := c.check(id, 1, "path=/held", "user="+user)
		if !r.Allowed || r.Lease == "" || r.Degraded {
			t.Fatalf("check of %s: %+v; want allowed with a lease", user, r)
		}
		return r.Lease
	}
	release := func(c *rawConn, lease string) bool {
		t.Helper()
		id++
		return c.leaseOp(id, proto.OpRelease, lease, 0).Released
	}
	lease := take(h, "ann")
	// A connection to Redis left idle in the daemon's pool, so that the release under
	// the freeze is written at once.
	if !release(a, take(a, "warm")) {
		t.Fatal("the warm-up release was not answered released: true")
	}
	freeze()
	if release(h, lease) {
		t.Fatal("a release answered released: true while Redis was frozen")
	}
	h.c.Close()
	// Frozen past the wait of the close's release (a second), given up unanswered too.
	time.Sleep(1500 * time.Millisecond)
	thaw()
	waitFor(t, 10*time.Second, "Redis to free ann's slot", func() bool {
		n, err := rdb.ZCard(ctx, "fz:held:{user=ann}").Result()
		must(t, err)
		return n == 0
	})
	waitFor(t, 20*time.Second, "the daemon to hold no lease", func() bool {
		_, s := scrape(t, base)
		return s[`rlsidecar_inflight{rule="held"}`] == 0
	})
	_, s := scrape(t, base)
	if r, c := s[`rlsidecar_leases_total{rule="held",result="released"}`], s[`rlsidecar_leases_total{rule="held",result="closed"}`]; r != 2 || c != 0 {
		t.Errorf("released %v (want 2: ann's and the warm-up), closed %v (want 0)\n%s", r, c, d.stderr.String())
	}
}
