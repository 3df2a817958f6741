package sync

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A reload that lowers a key's limit moves what this daemon may still admit locally
// with it: its credit and its share grant were sized by the old capacity (relimit). Kept, 100 per hour lowered to 5 after 4 used admitted all 10 asked, not 1
// (limiter:TestReloadResetsRedisState, 10 lowered to 5, saw 2 now and then, as its
// syncs fell).
func TestHybridLoweredLimitMovesAllowance(t *testing.T) {
	rdb := standalone(t)
	for _, alg := range []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow, localbucket.SlidingWindow} {
		t.Run(alg.String(), func(t *testing.T) {
			h := liveHybrid(t, rdb, time.Hour)
			old, lowered := mustLimit(t, alg, 100, time.Hour), mustLimit(t, alg, 5, time.Hour)
			key := fmt.Sprintf("rl:relimit:{%v}", alg)
			now := time.Now().UnixNano()
			used := 0
			for i := 0; i < 4; i++ {
				now += int64(time.Millisecond)
				if !take(h, now, key, old, 1).Allowed {
					t.Fatalf("request %d of 100 refused", i+1)
				}
				used++
				if i == 0 {
					syncAll(t, now, h) // the key's first view: credit
				}
			}
			syncAll(t, now, h)
			sh := &h.shards[h.shardOf([]byte(key))]
			sh.mu.Lock()
			a := h.allowance(sh.m[key], now, project(sh.m[key], now), h.creditShares())
			sh.mu.Unlock()
			if a < 2 {
				t.Fatalf("allowance under the old limit %v: the test shows nothing", a)
			}
			n := 0
			for i := 0; i < 10; i++ {
				if take(h, now, key, lowered, 1).Allowed {
					n++
				}
			}
			if n != 5-used {
				t.Fatalf("after the limit was lowered to 5 with %d used: %d admitted, want %d", used, n, 5-used)
			}
			// Redis counts the 5 the daemon admitted, no more: another daemon finds none left.
			syncAll(t, now, h)
			b := NewHybrid(rdb, HybridOptions{Interval: time.Hour, FetchWait: time.Second})
			if r := take(b, now, key, lowered, 0); r.Allowed || r.Remaining != 0 {
				t.Fatalf("another daemon, asking Redis: %+v; want nothing left", r)
			}
		})
	}
}

// A reload that changes a key's limit while a sync of it is on its way: the sync's
// answer, a view of the old limit, gives no allowance under the new one.
func TestHybridLimitChangedDuringSync(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	h := liveHybrid(t, rdb, time.Hour)
	old, lowered := mustLimit(t, localbucket.TokenBucket, 100, time.Hour), mustLimit(t, localbucket.TokenBucket, 5, time.Hour)
	const key = "rl:relimit:{in-flight}"
	now := time.Now().UnixNano()
	for i := 0; i < 4; i++ {
		now += int64(time.Millisecond)
		if !take(h, now, key, old, 1).Allowed {
			t.Fatalf("request %d of 100 refused", i+1)
		}
		if i == 0 {
			syncAll(t, now, h)
		}
	}
	items := h.collect(now, math.MaxInt) // the sync sets out under the old limit
	if len(items) != 1 {
		t.Fatalf("%d keys to sync, want 1", len(items))
	}
	// The reload's first check of the key finds its sync on the way: it waits.
	if ok, wait := h.TryTake(now, []HybridOp{{Key: []byte(key), Limit: lowered, Cost: 1}}); ok || !wait {
		t.Fatalf("TryTake under the new limit, the key's sync on its way: ok %v, wait %v; want a wait", ok, wait)
	}
	if _, err := h.settle(ctx, items, false); err != nil { // the answer arrives
		t.Fatal(err)
	}
	n := 0
	for i := 0; i < 10; i++ {
		if take(h, now, key, lowered, 1).Allowed {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("after the limit was lowered to 5 with 4 used: %d admitted, want 1", n)
	}
}

// One client key under two limits at once (one IP shared by clients of two plans):
// each request is judged by its own limit against the one count, as the exact mode
// judges it, and a change of limit between requests costs no exact sync.
func TestHybridTwoLimitsOneKey(t *testing.T) {
	rdb := standalone(t)
	for _, alg := range []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow, localbucket.SlidingWindow} {
		t.Run(alg.String(), func(t *testing.T) {
			h := liveHybrid(t, rdb, time.Hour)
			small, large := mustLimit(t, alg, 1000, time.Hour), mustLimit(t, alg, 2000, time.Hour)
			key := fmt.Sprintf("rl:twolimits:{%v}", alg)
			now := time.Now().UnixNano()
			take(h, now, key, small, 1)
			syncAll(t, now, h) // the key's first view
			calls0 := evalCalls(t, rdb)
			var n [2]int
			for i := 0; i < 40; i++ {
				now += int64(time.Millisecond)
				if take(h, now, key, []*localbucket.Limit{small, large}[i%2], 1).Allowed {
					n[i%2]++
				}
			}
			if n != [2]int{20, 20} {
				t.Fatalf("admitted %v under 1000 and 2000 an hour, 1 used: want all 40", n)
			}
			if c := evalCalls(t, rdb) - calls0; c > 0 {
				t.Fatalf("%d script calls for 40 requests alternating between two limits with room: want none (decided locally)", c)
			}
			// Near the limits: the smaller one's requests refused once the count reaches 10,
			// the larger one's admitted up to 20, as one count judged by each.
			small, large = mustLimit(t, alg, 10, time.Hour), mustLimit(t, alg, 20, time.Hour)
			key += "-near"
			count := 0
			for i := 0; i < 40; i++ {
				now += int64(time.Millisecond)
				lim := []*localbucket.Limit{small, large}[i%2]
				want := uint64(count) < lim.Requests()
				if got := take(h, now, key, lim, 1).Allowed; got != want {
					t.Fatalf("request %d (limit %d, %d admitted before): allowed %v, want %v", i, lim.Requests(), count, got, want)
				}
				if want {
					count++
				}
			}
		})
	}
}

// liveHybrid is a hybrid store that has told Redis it is live (one heartbeat, no Run:
// the test syncs it), with interval sizing its grants and views' freshness.
func liveHybrid(t *testing.T, rdb redis.UniversalClient, interval time.Duration) *Hybrid {
	t.Helper()
	h := NewHybrid(rdb, HybridOptions{Interval: interval, FetchWait: time.Second})
	if _, err := h.Heartbeat(context.Background(), fmt.Sprintf("d-%p", h), time.Minute); err != nil {
		t.Fatal(err)
	}
	return h
}

// A client whose requests alternate between two plans of one token-bucket rule (2 and 1
// per hour) moves its key between the two limits at every request, and each move's sync
// is a relimit. Redis cuts the key to a whole burst of the lower limit at most once per
// window and rate (scripts/hybrid.lua, as global.lua): before, a cut at every such sync
// forgave a unit each time: 52 of these 300 admitted (16 of 300 in 3 s through the
// daemon, syncing every 100 ms).
func TestHybridPlanFlappingForgivesOnce(t *testing.T) {
	rdb := standalone(t)
	h := liveHybrid(t, rdb, time.Hour)
	pro, free := mustLimit(t, localbucket.TokenBucket, 2, time.Hour), mustLimit(t, localbucket.TokenBucket, 1, time.Hour)
	const key = "rl:flap:{u}"
	now := time.Now().UnixNano()
	admitted := 0
	for i := range 300 {
		now += int64(time.Millisecond)
		lim := pro
		if i%2 == 0 {
			lim = free
		}
		if take(h, now, key, lim, 1).Allowed {
			admitted++
		}
		if i%3 == 2 { // an odd number of checks per sync: the syncs alternate limits too
			syncAll(t, now, h)
		}
	}
	// 2 under the higher plan, and the one difference of bursts the first cut forgives.
	if admitted > 3 {
		t.Fatalf("%d of 300 admitted alternating plans of 2 and 1 per hour, want at most 3", admitted)
	}
}

// A refusal's retry is never past the key's reset (the time it is full again): a client
// whose requests alternate between two daemons, 1 per minute, was told retry 60,002 ms
// with reset 59,950 by the second, the refill of a unit counted from now on a view whose
// unit the first daemon admitted 50 ms before.
func TestHybridRetryNotPastReset(t *testing.T) {
	rdb := standalone(t)
	a, b := liveHybrid(t, rdb, 100*time.Millisecond), liveHybrid(t, rdb, 100*time.Millisecond)
	lim := mustLimit(t, localbucket.TokenBucket, 1, time.Minute)
	for i := range 4 {
		key := fmt.Sprintf("rl:retry:{u%d}", i)
		if r := take(a, time.Now().UnixNano(), key, lim, 1); !r.Allowed {
			t.Fatalf("the first request: %+v", r)
		}
		syncAll(t, time.Now().UnixNano(), a)
		time.Sleep(50 * time.Millisecond)
		r := take(b, time.Now().UnixNano(), key, lim, 1)
		if r.Allowed {
			t.Fatalf("the second, through the other daemon: allowed")
		}
		if r.RetryAfter > r.Reset || r.RetryAfter > int64(time.Minute) {
			t.Fatalf("the second, through the other daemon: retry %v, reset %v; want retry <= reset <= 1m",
				time.Duration(r.RetryAfter), time.Duration(r.Reset))
		}
	}
}
