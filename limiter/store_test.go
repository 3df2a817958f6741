package limiter

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// unreachable returns a client of a Redis nobody listens on: every call fails at once.
func unreachable(t *testing.T) redis.UniversalClient {
	t.Helper()
	rdb, err := rlsync.Open(rlsync.Config{URL: "redis://127.0.0.1:1", Timeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// realRedis starts a real redis-server and returns a client of it.
func realRedis(t testing.TB) redis.UniversalClient {
	t.Helper()
	_, rdb := realRedisServer(t, time.Second)
	return rdb
}

// realRedisServer starts a real redis-server (to stop or freeze) and returns it and a
// client of it whose calls time out after timeout.
func realRedisServer(t testing.TB, timeout time.Duration) (*redistest.Server, redis.UniversalClient) {
	t.Helper()
	srv := redistest.StartStandalone(t)
	rdb, err := rlsync.Open(rlsync.Config{URL: "redis://" + srv.Addr, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	return srv, rdb
}

// When the store a rule needs cannot decide (hybrid allowances gone stale, global Redis
// refusing connections), the rule's failure policy decides, in one step, marked degraded:
// open allows at full capacity, closed refuses for a second (a shadow rule only reports
// it), local decides on a local bucket under the Redis key. The local rule beside it is
// charged only when the request passes.
func TestFailurePolicies(t *testing.T) {
	type want struct {
		allowed   []bool // per request, of four
		ruleOK    bool   // the Redis rule's last result
		remaining uint64 // the Redis rule's last result
		retry     time.Duration
		here      uint64 // the local rule's remaining after the four
	}
	cases := []struct {
		policy string
		shadow bool
		want   want
	}{
		{"open", false, want{[]bool{true, true, true, true}, true, 3, 0, 6}},
		{"closed", false, want{[]bool{false, false, false, false}, false, 0, time.Second, 10}},
		{"closed", true, want{[]bool{true, true, true, true}, false, 0, time.Second, 6}},
		{"local", false, want{[]bool{true, true, true, false}, false, 0, 20 * time.Minute, 7}},
	}
	for _, mode := range []string{"hybrid", "global"} {
		for _, tc := range cases {
			t.Run(fmt.Sprintf("%s/%s/shadow=%v", mode, tc.policy, tc.shadow), func(t *testing.T) {
				set := mustRules(t, fmt.Sprintf(`
rules:
  - name: remote
    key: user
    limit: { requests: 3, per: 1h }
    mode: %s
    on_store_failure: %s
    shadow: %v
  - name: here
    key: ip
    limit: { requests: 10, per: 1h }
    mode: local
`, mode, tc.policy, tc.shadow))
				rdb := unreachable(t)
				l := New(set, localbucket.NewStore(localbucket.Options{})).
					WithHybrid(rlsync.NewHybrid(rdb, rlsync.HybridOptions{})).
					WithGlobal(rlsync.NewGlobal(rdb), 50*time.Millisecond)
				if err := l.SetRedisPrefix("t1:"); err != nil {
					t.Fatal(err)
				}
				// Past StaleAfter with no answer from Redis: the allowances are stale.
				now := time.Now().Add(time.Minute).UnixNano()
				var d Decision
				in := Input{Attrs: attrs("user=u", "ip=i"), Cost: 1}
				for i, allowed := range tc.want.allowed {
					if err := l.Check(now, &in, &d); err != nil {
						t.Fatal(err)
					}
					if d.Allowed != allowed || !d.Degraded {
						t.Fatalf("request %d: allowed %v degraded %v, want allowed %v degraded", i+1, d.Allowed, d.Degraded, allowed)
					}
				}
				r, here := d.Results[0], d.Results[1]
				if r.Name != "remote" || !r.Degraded || r.Allowed != tc.want.ruleOK || r.Remaining != tc.want.remaining ||
					r.RetryAfter != tc.want.retry || r.Limit != 3 || r.Window != time.Hour {
					t.Errorf("remote: %+v, want allowed %v remaining %d retry %v", r, tc.want.ruleOK, tc.want.remaining, tc.want.retry)
				}
				if !r.Allowed && r.Reset < r.RetryAfter { // a closed refusal said reset 0: "full again now"
					t.Errorf("remote: reset %v before its retry-after %v", r.Reset, r.RetryAfter)
				}
				if string(r.Key) != "t1:remote~tb1h:{user=u}" {
					t.Errorf("remote key %q", r.Key)
				}
				if here.Name != "here" || here.Degraded || here.Remaining != tc.want.here || string(here.Key) != "here:{ip=i}" {
					t.Errorf("here: %+v, want remaining %d", here, tc.want.here)
				}
			})
		}
	}
}

// An inline limit in a Redis mode falls back to a local bucket of its own limit.
func TestInlineFallsBackLocally(t *testing.T) {
	rdb := unreachable(t)
	l := New(mustRules(t, "rules: []\n"), localbucket.NewStore(localbucket.Options{})).
		WithHybrid(rlsync.NewHybrid(rdb, rlsync.HybridOptions{})).
		WithGlobal(rlsync.NewGlobal(rdb), 50*time.Millisecond)
	now := time.Now().Add(time.Minute).UnixNano()
	for _, mode := range []string{"", "hybrid", "global"} {
		in := Input{Limits: []Inline{{Key: "k-" + mode, Mode: mode, Limit: 2, WindowMs: 3_600_000}}, Cost: 1}
		var d Decision
		var got []bool
		for range 3 {
			if err := l.Check(now, &in, &d); err != nil {
				t.Fatal(err)
			}
			got = append(got, d.Allowed)
		}
		r := d.Results[0]
		if fmt.Sprint(got) != "[true true false]" || !d.Degraded || !r.Degraded || r.RetryAfter != 30*time.Minute {
			t.Errorf("mode %q: admitted %v, last %+v", mode, got, r)
		}
		if !strings.HasPrefix(string(r.Key), "rl:~inline/token_bucket/2/3600000/2:{k-") {
			t.Errorf("mode %q: key %q", mode, r.Key)
		}
	}
}

// The stores are applied all-or-nothing in order: a store that rejects makes the earlier
// ones give back what they took and the later ones take nothing. All real: the local
// buckets, the hybrid allowances, a real Redis for the global checks.
func TestStoresAllOrNothing(t *testing.T) {
	rdb := realRedis(t)
	set := mustRules(t, `
rules:
  - name: shared
    key: user
    limit: { requests: 4, per: 1h }
    mode: hybrid
  - name: exact
    key: api_key
    limit: { requests: 1, per: 1h }
    mode: global
  - name: exact-user
    key: account
    limit: { requests: 5, per: 1h }
    mode: global
  - name: tight
    key: ip
    limit: { requests: 1, per: 1h }
    mode: local
`)
	// A FetchWait a loaded machine's exact sync fits in: with the default 25 ms, a -race
	// run at load average 11 decided a new hybrid key without Redis ("degraded with
	// Redis up").
	l := New(set, localbucket.NewStore(localbucket.Options{})).
		WithHybrid(rlsync.NewHybrid(rdb, rlsync.HybridOptions{FetchWait: 5 * time.Second})).
		WithGlobal(rlsync.NewGlobal(rdb), time.Second)
	var d Decision
	check := func(cost uint64, kv ...string) *Decision {
		t.Helper()
		if err := l.Check(time.Now().UnixNano(), &Input{Attrs: attrs(kv...), Cost: cost}, &d); err != nil {
			t.Fatal(err)
		}
		if d.Degraded {
			t.Fatalf("degraded with Redis up: %+v", d.Results)
		}
		return &d
	}
	byName := func(name string) Result {
		for _, r := range d.Results {
			if r.Name == name {
				return r
			}
		}
		t.Fatalf("no result for %s in %+v", name, d.Results)
		return Result{}
	}

	// A global rejection gives back the hybrid allowance: each new hybrid key has one
	// request on credit before its first sync; v2's is taken, then refused by exact, and
	// must be there for v2's next request.
	if !check(1, "user=v1", "api_key=k").Allowed {
		t.Fatalf("first request: %+v", d.Results)
	}
	if check(1, "user=v2", "api_key=k").Allowed || d.DecidingResult().Name != "exact" {
		t.Fatalf("second request on k: %+v", d.Results)
	}
	if !check(1, "user=v2").Allowed {
		t.Fatalf("v2 lost its credit to a request exact rejected: %+v", d.Results)
	}

	// A local rejection refunds the global check: account a is charged once, not twice.
	if !check(1, "account=a", "ip=i").Allowed {
		t.Fatalf("first request on i: %+v", d.Results)
	}
	if check(1, "account=a", "ip=i").Allowed || d.DecidingResult().Name != "tight" {
		t.Fatalf("second request on i: %+v", d.Results)
	}
	if check(0, "account=a"); byName("exact-user").Remaining != 4 {
		t.Fatalf("exact-user after a local rejection: %+v (want 4 left: refunded)", d.Results)
	}

	// A hybrid rejection asks nothing of the later stores: the global check is not
	// taken (reported unasked: allowed, its figures not read), the local bucket only
	// reports.
	if !check(1, "user=w", "account=b", "ip=j").Allowed {
		t.Fatalf("w's first request: %+v", d.Results)
	}
	// Use up w's shared budget (the hybrid store may sync to grant more first).
	for i := 0; i < 10 && check(1, "user=w").Allowed; i++ {
	}
	if check(1, "user=w", "account=b", "ip=j2").Allowed || d.DecidingResult().Name != "shared" {
		t.Fatalf("w past its budget: %+v", d.Results)
	}
	if r := byName("exact-user"); !r.Allowed || !r.Unasked || r.Remaining != 0 || r.RetryAfter != 0 || r.Limit != 5 || r.Window != time.Hour {
		t.Fatalf("global result after a hybrid rejection: %+v (want unasked: allowed, 5 per hour, nothing read)", r)
	}
	if r := byName("tight"); r.Remaining != 1 || !r.Allowed {
		t.Fatalf("local result after a hybrid rejection: %+v (want a peek: 1 left)", r)
	}
	if check(0, "account=b", "ip=j2"); byName("exact-user").Remaining != 4 || byName("tight").Remaining != 1 {
		t.Fatalf("after a hybrid rejection: %+v (want b charged once, j2 never)", d.Results)
	}
}

// Every Redis key the limiter builds starts with the configured prefix; local keys have
// none. A bad prefix is refused and changes nothing.
func TestRedisPrefix(t *testing.T) {
	rdb := unreachable(t)
	l := New(mustRules(t, `
rules:
  - name: h
    key: user
    limit: { requests: 5, per: 1s }
    mode: hybrid
  - name: g
    key: user
    limit: { requests: 5, per: 1s }
    mode: global
    on_store_failure: open
  - name: loc
    key: user
    limit: { requests: 5, per: 1s }
    mode: local
`), localbucket.NewStore(localbucket.Options{})).
		WithHybrid(rlsync.NewHybrid(rdb, rlsync.HybridOptions{})).
		WithGlobal(rlsync.NewGlobal(rdb), 10*time.Millisecond)
	if l.RedisPrefix() != "rl:" {
		t.Fatalf("default prefix %q", l.RedisPrefix())
	}
	for _, bad := range []string{"", "x", "{x}:", "a b:"} {
		if err := l.SetRedisPrefix(bad); err == nil || l.RedisPrefix() != "rl:" {
			t.Fatalf("SetRedisPrefix(%q) = %v, prefix now %q", bad, err, l.RedisPrefix())
		}
	}
	if err := l.SetRedisPrefix("tenant-b:"); err != nil {
		t.Fatal(err)
	}
	var d Decision
	in := Input{Attrs: attrs("user=u"), Cost: 1, Limits: []Inline{{Key: "k", Limit: 2, WindowMs: 1000}, {Key: "k", Limit: 2, WindowMs: 1000, Mode: "local"}}}
	if err := l.Check(time.Now().UnixNano(), &in, &d); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, r := range d.Results {
		keys = append(keys, string(r.Key))
	}
	want := "[tenant-b:h~tb1s:{user=u} tenant-b:g~tb1s:{user=u} loc:{user=u} tenant-b:~inline/token_bucket/2/1000/2:{k} ~inline/token_bucket/2/1000/2:{k}]"
	if fmt.Sprint(keys) != want {
		t.Fatalf("keys %v\nwant %s", keys, want)
	}
}

// mixedLimiter has a hybrid rule beside a local one, its Hybrid never synced (Redis
// unreachable): fresh, its allowances stand; a minute later they are stale.
func mixedLimiter(tb testing.TB) *Limiter {
	rdb, err := rlsync.Open(rlsync.Config{URL: "redis://127.0.0.1:1", Timeout: 50 * time.Millisecond})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { rdb.Close() })
	return mixedLimiterOn(tb, rdb)
}

// mixedLimiterOn is mixedLimiter on rdb.
func mixedLimiterOn(tb testing.TB, rdb redis.UniversalClient) *Limiter {
	h := rlsync.NewHybrid(rdb, rlsync.HybridOptions{FetchWait: 5 * time.Second}) // a loaded machine is slow, not down
	return New(mustRules(tb, `
rules:
  - name: per-user
    key: user
    limit: { requests: 1000000000, per: 1h }
    mode: hybrid
  - name: per-ip
    key: ip
    limit: { requests: 1000000000, per: 1h }
    mode: local
`), localbucket.NewStore(localbucket.Options{})).WithHybrid(h)
}

// Checks through the hybrid store and the failure-policy step allocate nothing once the
// keys exist: the adapters keep their batches in the Decision. Each path is measured
// with nothing left to ask Redis: the hybrid key's view in hand from a live Redis, and
// a view a minute stale from a Redis that never answered (no call is made). Before,
// the first path ran against that Redis too: degraded from its second check on (the
// second path again), its checks' dials, about 160 mallocs each, passed unseen while
// fewer than 200 fell among the 200 checks measured (AllocsPerRun counts whole
// allocations a check), and more under load failed it ("2 allocs per check").
func TestStorePathsAllocate0(t *testing.T) {
	in := Input{Attrs: attrs("user=u-1", "ip=203.0.113.9"), Cost: 1}
	_, live := realRedisServer(t, 5*time.Second)
	refusing, err := rlsync.Open(rlsync.Config{URL: "redis://127.0.0.1:1", Timeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { refusing.Close() })
	for _, tc := range []struct {
		name     string
		l        *Limiter
		now      int64
		degraded bool
	}{
		{"hybrid+local", mixedLimiterOn(t, live), time.Now().UnixNano(), false},
		{"stale: local fallback", mixedLimiterOn(t, refusing), time.Now().Add(time.Minute).UnixNano(), true},
	} {
		var d Decision
		// The first check on credit, the next by an exact sync (its view), then local.
		for range 3 {
			_ = tc.l.Check(tc.now, &in, &d)
		}
		if d.Degraded != tc.degraded || len(d.Results) != 2 || !d.Allowed {
			t.Fatalf("%s: %+v", tc.name, d)
		}
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		before := ms.Mallocs
		const n = 1000
		for range n {
			_ = tc.l.Check(tc.now, &in, &d)
		}
		runtime.ReadMemStats(&ms)
		// Counted for the whole process: a few from another goroutine (an earlier
		// test's, winding down) are not the checks'. One in ten checks allocating, or
		// one dial (about 160), is.
		if m := ms.Mallocs - before; m >= n/10 {
			t.Errorf("%s: %d mallocs in %d checks", tc.name, m, n)
		}
		if d.Degraded != tc.degraded || !d.Allowed {
			t.Fatalf("%s, after %d checks: %+v", tc.name, n, d)
		}
	}
}

// BenchmarkCheckHybridLocal is BenchmarkCheck2Rules with one rule in hybrid mode: the
// hybrid store deciding on its view (a live Redis gave it at the key's second check),
// then the local one. Against a Redis that refuses connections, as it ran before, every
// check after the first was decided by the failure policy: BenchmarkCheckDegraded's path.
func BenchmarkCheckHybridLocal(b *testing.B) {
	_, rdb := realRedisServer(b, 5*time.Second)
	l := mixedLimiterOn(b, rdb)
	in := Input{Attrs: attrs("user=u-12345", "ip=203.0.113.9"), Cost: 1}
	now := time.Now().UnixNano()
	var d Decision
	b.ReportAllocs()
	for b.Loop() {
		if err := l.Check(now, &in, &d); err != nil || len(d.Results) != 2 || d.Degraded {
			b.Fatal(err, d)
		}
	}
}

// BenchmarkCheckDegraded: the hybrid allowances are stale, so every check goes through
// the failure-policy step (local fallback) and then the local store.
func BenchmarkCheckDegraded(b *testing.B) {
	l := mixedLimiter(b)
	in := Input{Attrs: attrs("user=u-12345", "ip=203.0.113.9"), Cost: 1}
	now := time.Now().Add(time.Minute).UnixNano()
	var d Decision
	b.ReportAllocs()
	for b.Loop() {
		if err := l.Check(now, &in, &d); err != nil || !d.Degraded || !d.Allowed {
			b.Fatal(err, d)
		}
	}
}
