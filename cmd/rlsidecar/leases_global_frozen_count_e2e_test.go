package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// Global leases given up while Redis is frozen (SIGSTOP), real daemon and redis-server:
// a live lease released, a lease released after it ran out, and a connection holding a
// lease closed. Each release is written to the frozen Redis and times out; Redis runs it
// once thawed, and every slot is free. The daemon's sweep sends each again, finds the
// lease gone, and counted it nowhere in rlsidecar_leases_total (a scratch harness of
// three daemons on one Redis frozen for 100-400 ms now and then lost 1-10 of about
// 550-900 leases from the counts in 4 of 5 runs). Each is now counted as its first
// release would have been.
func TestE2EGlobalLeaseGivenUpWhileRedisFrozenIsCounted(t *testing.T) {
	d, base, rdb, freeze, thaw := frozenLeases(t, `
rules:
  - name: held
    match: { path: /held }
    key: user
    concurrency: { max: 2, lease: 60s }
    on_store_failure: closed
  - name: short
    match: { path: /short }
    key: user
    concurrency: { max: 2, lease: 100ms }
    on_store_failure: closed
`)
	ctx := context.Background()
	members := func(key string) int64 {
		n, err := rdb.ZCard(ctx, key).Result()
		must(t, err)
		return n
	}

	a, b := dialRaw(t, d.socket), dialRaw(t, d.socket)
	id := uint64(0)
	take := func(c *rawConn, attrs ...string) string {
		t.Helper()
		id++
		r := c.check(id, 1, attrs...)
		if !r.Allowed || r.Lease == "" || r.Degraded {
			t.Fatalf("check %v: %+v; want allowed with a lease", attrs, r)
		}
		return r.Lease
	}
	release := func(lease string) bool {
		t.Helper()
		id++
		return a.leaseOp(id, proto.OpRelease, lease, 0).Released
	}
	// warm leaves a connection to Redis idle in the daemon's pool of releases, so that
	// the release under the freeze is written at once (a new connection's handshake
	// would time out before it).
	warm := func() {
		t.Helper()
		if !release(take(a, "path=/held", "user=warm")) {
			t.Fatal("a warm-up release was not answered released: true")
		}
	}
	live := take(a, "path=/held", "user=ann")
	late := take(a, "path=/short", "user=ann")
	take(b, "path=/held", "user=bob") // freed by b's close
	// late runs out in Redis (its member stays, scored by its expiry, for LeaseGrace).
	waitFor(t, 10*time.Second, "the short lease to run out in Redis", func() bool {
		now, err := rdb.Time(ctx).Result()
		must(t, err)
		zs, err := rdb.ZRangeWithScores(ctx, "fz:short:{user=ann}", 0, -1).Result()
		must(t, err)
		return len(zs) == 1 && int64(zs[0].Score) < now.UnixMilli()
	})

	for i, c := range []struct {
		lease, key string
	}{{live, "fz:held:{user=ann}"}, {late, "fz:short:{user=ann}"}} {
		warm()
		freeze()
		if release(c.lease) {
			t.Fatalf("release %d answered released: true while Redis was frozen", i)
		}
		thaw()
		waitFor(t, 10*time.Second, "Redis to run the release it held", func() bool { return members(c.key) == 0 })
	}
	warm()
	freeze()
	b.c.Close()
	// Frozen past the wait of the close's release (a second), which is then given up
	// unanswered too (thawed sooner, it is answered, and counted as it always was).
	time.Sleep(1500 * time.Millisecond)
	thaw()
	waitFor(t, 10*time.Second, "Redis to free bob's slot", func() bool { return members("fz:held:{user=bob}") == 0 })

	// The sweep settles them: nothing in flight.
	waitFor(t, 20*time.Second, "the daemon to hold no lease", func() bool {
		_, s := scrape(t, base)
		return s[`rlsidecar_inflight{rule="held"}`] == 0 && s[`rlsidecar_inflight{rule="short"}`] == 0
	})
	_, s := scrape(t, base)
	want := map[string]float64{
		`rlsidecar_leases_total{rule="held",result="released"}`:  1 + 3, // and the warm-ups
		`rlsidecar_leases_total{rule="held",result="closed"}`:    1,
		`rlsidecar_leases_total{rule="held",result="expired"}`:   0,
		`rlsidecar_leases_total{rule="short",result="released"}`: 0,
		`rlsidecar_leases_total{rule="short",result="closed"}`:   0,
		`rlsidecar_leases_total{rule="short",result="expired"}`:  1,
	}
	var bad []string
	for k, v := range want {
		if s[k] != v {
			bad = append(bad, fmt.Sprintf("%s %v, want %v", k, s[k], v))
		}
	}
	if len(bad) > 0 {
		t.Errorf("lease counts after the thaw:\n%s\n%s", strings.Join(bad, "\n"), d.stderr.String())
	}
}

// frozenLeases starts a redis-server and a daemon with rules (global concurrency rules)
// whose Redis calls time out after 200 ms and whose sweep runs every 3 s, for tests that
// freeze Redis (SIGSTOP) under leases. It returns the daemon, its admin URL, a client of
// the Redis, and freeze and thaw, which t.Cleanup thaws after when a test ends frozen.
func frozenLeases(t *testing.T, rules string) (d *daemonProc, base string, rdb *redis.Client, freeze, thaw func()) {
	t.Helper()
	srv := redistest.StartStandalone(t)
	d = startDaemon(t, "--config", writeFile(t, shortTempDir(t), "rules.yaml", rules), "--admin", "127.0.0.1:0",
		"--redis", "redis://"+srv.Addr, "--redis-prefix", "fz:",
		"--global-timeout", "200ms", "--redis-timeout", "200ms", "--sweep-interval", "3s")
	rdb = redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	frozen := false
	t.Cleanup(func() {
		if frozen {
			srv.Thaw()
		}
	})
	freeze = func() { srv.Freeze(); frozen = true }
	thaw = func() { srv.Thaw(); frozen = false }
	return d, "http://" + adminAddr(t, d), rdb, freeze, thaw
}
