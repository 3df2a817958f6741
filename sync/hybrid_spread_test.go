package sync

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A unit admitted on credit is charged to the key from when it was admitted, not from
// when the next sync carries it. Charging it at the sync lost the refill of the time in
// between on a full bucket: a client whose requests rotate over two daemons at 3× a
// limit of 5 per minute had every refill delayed by up to a sync interval after its
// first (credit) unit, and lost the request that came exactly as the refill did (0.954
// of the exact mode). Here the first unit is admitted on credit, synced 300 ms later:
// the key's theoretical arrival time must be its admission plus one emission interval,
// not the sync's.
func TestHybridCreditChargedWhenAdmitted(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	lim := mustLimit(t, localbucket.TokenBucket, 5, time.Minute) // T = 12 s
	const key = "rl:credit:{user=1}"
	for _, c := range []struct {
		name  string
		fetch bool // the unit travels with an exact sync instead of the periodic one
	}{{"periodic sync", false}, {"exact sync", true}} {
		t.Run(c.name, func(t *testing.T) {
			if err := rdb.Del(ctx, key).Err(); err != nil {
				t.Fatal(err)
			}
			a := NewHybrid(rdb, HybridOptions{ID: "a"})
			a.SetReplicas(2) // C = 5 >= 2N: a first unit on credit
			tm, err := rdb.Time(ctx).Result()
			if err != nil {
				t.Fatal(err)
			}
			admitted := tm.UnixMicro()
			if !take(a, time.Now().UnixNano(), key, lim, 1).Allowed {
				t.Fatal("the first request was refused")
			}
			const delay = 300 * time.Millisecond
			time.Sleep(delay)
			if c.fetch {
				// The next request: the first unit's sync has not run, the allowance is
				// spent, the view stale: an exact sync carries the first unit too.
				if !take(a, time.Now().UnixNano(), key, lim, 1).Allowed {
					t.Fatal("the second request was refused")
				}
			} else if err := a.Flush(ctx, time.Now().UnixNano()); err != nil {
				t.Fatal(err)
			}
			tat, err := rdb.HGet(ctx, key, "t").Float64()
			if err != nil {
				t.Fatal(err)
			}
			if !c.fetch {
				want := float64(admitted) + 12e6 // one unit charged at its admission
				if got := tat - want; got > 100_000 || got < -100_000 {
					t.Fatalf("the key's TAT is %.0f ms off its admission + one unit: a credit unit was charged late", got/1000)
				}
				return
			}
			// The first unit travels with the second request's exact sync: it is dated
			// by its admission (the key's last), the second reserved after it, as the
			// exact mode charges both: the first unit's admission plus two units. Never
			// earlier (refill credited that the exact mode would not give); dated by the
			// second request, it was 300 ms later than the exact mode.
			want := float64(admitted) + 2*12e6
			if got := tat - want; got < -100_000 || got > 100_000 {
				t.Fatalf("the key's TAT is %.0f ms off the first admission + two units, the exact mode's", got/1000)
			}
		})
	}
}

// spreadKey sets key to a sliding window of 10 per day with n counted in the current
// window (by Redis's clock) and nothing in the previous one: within the test nothing
// frees by itself, so whether a unit is free turns only on what the test does.
func spreadKey(t *testing.T, rdb redis.UniversalClient, key string, n int) {
	t.Helper()
	ctx := context.Background()
	tm, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	const day = 24 * time.Hour
	if left := day - time.Duration(tm.UnixNano()%int64(day)); left < 5*time.Second {
		time.Sleep(left + 100*time.Millisecond) // the test runs within one window
		if tm, err = rdb.Time(ctx).Result(); err != nil {
			t.Fatal(err)
		}
	}
	start := tm.UnixMicro() - tm.UnixMicro()%day.Microseconds()
	if err := rdb.Del(ctx, key).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(ctx, key, "t", start, "n", n, "p", 0).Err(); err != nil {
		t.Fatal(err)
	}
}

// A single request refused from a fresh view asks no share grant at the next sync: a
// client whose requests go to a random daemon of many comes back to this one rarely,
// and the grant idled in Redis, reserved, while the client's requests to the other
// daemons were refused. For a window the unit is lost if the window ends meanwhile:
// 8 clients at 3× 20 per second, each request to one of 20 daemons at random, were
// admitted 0.94 of what the exact mode admits (BenchmarkSpreadClients). Here daemon a
// spends the key's last unit, an interval and a half later refuses the client's next
// request from its view (a lone request, not a hot key), a unit frees (the window
// slides: here the count is lowered directly), a syncs (nothing to send: no call), and
// daemon b's request, decided by an exact sync, must get the free unit, as the exact
// mode would give it.
func TestHybridSpreadOneRefusalReservesNothing(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	const key = "rl:spread1:{user=1}"
	lim := mustLimit(t, localbucket.SlidingWindow, 10, 24*time.Hour)
	spreadKey(t, rdb, key, 9)
	a := NewHybrid(rdb, HybridOptions{ID: "a"})
	b := NewHybrid(rdb, HybridOptions{ID: "b"})
	for _, h := range []*Hybrid{a, b} {
		h.SetReplicas(10) // 2N > the capacity: no credit, every first request asks Redis
	}
	now := time.Now().UnixNano()
	if r := take(a, now, key, lim, 1); !r.Allowed {
		t.Fatalf("a: the key's last unit refused: %+v", r)
	}
	if err := a.Flush(ctx, now); err != nil { // its sync: nothing to settle
		t.Fatal(err)
	}
	// The client's next request here, an interval and a half later: the view is fresh.
	now += 3 * int64(a.Interval()) / 2
	if r := take(a, now, key, lim, 1); r.Allowed {
		t.Fatalf("a: an 11th of 10 admitted: %+v", r)
	}
	if err := rdb.HIncrBy(ctx, key, "n", -1).Err(); err != nil {
		t.Fatal(err)
	}
	before := evalCalls(t, rdb)
	if err := a.Flush(ctx, now); err != nil {
		t.Fatal(err)
	}
	if calls := evalCalls(t, rdb) - before; calls != 0 {
		t.Fatalf("a's sync after a lone refusal, nothing to settle, made %d script calls; want none", calls)
	}
	if r := take(b, now, key, lim, 1); !r.Allowed {
		g, _ := rdb.HGet(ctx, key, "s:a").Result()
		t.Fatalf("b: refused with a unit free in Redis (a's sync record %q: its grant holds it): %+v", g, r)
	}
	for _, h := range []*Hybrid{a, b} {
		if err := h.Flush(ctx, now); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := rdb.HGet(ctx, key, "n").Int(); err != nil || n != 10 {
		t.Fatalf("n = %d (%v) after 9 + 2 admitted - 1 freed, want 10", n, err)
	}
}

// A key's hotness lasts as long as its syncs: a daemon whose last share grant asked for
// two units or more, granted none, and whose key then went unsynced for more than two
// intervals (nothing to settle) decides its next request by an exact sync, not by a view
// that stale. Before, it refused it locally, waiting for a share grant, with the unit
// free in Redis.
func TestHybridStaleHotKeyAsksRedis(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	const key = "rl:spread2:{user=1}"
	lim := mustLimit(t, localbucket.SlidingWindow, 10, 24*time.Hour)
	spreadKey(t, rdb, key, 10)
	a := NewHybrid(rdb, HybridOptions{ID: "a"})
	a.SetReplicas(10)
	now := time.Now().UnixNano()
	for i := range 3 { // the first by an exact sync, the others from its view
		if r := take(a, now, key, lim, 1); r.Allowed {
			t.Fatalf("request %d on a full key admitted: %+v", i+1, r)
		}
	}
	if err := a.Flush(ctx, now); err != nil { // a share grant asked for 3: none
		t.Fatal(err)
	}
	if err := rdb.HIncrBy(ctx, key, "n", -1).Err(); err != nil {
		t.Fatal(err)
	}
	later := now + 3*int64(a.Interval())
	if r := take(a, later, key, lim, 1); !r.Allowed {
		t.Fatalf("three intervals later, a unit free in Redis: refused from the old view: %+v", r)
	}
}

// TryTake counts nothing when it reports a wait for a race lost (the view had room, the
// allowance did not: Take then syncs the key): the daemon calls Take next, which counts
// the request. Counted by both, one request was two units of demand and two short, and
// a client spread over many daemons, back at this one once, looked hot to its next sync,
// which asked a share grant for it (TestHybridSpreadOneRefusalReservesNothing).
func TestHybridTryTakeRaceCountsOnce(t *testing.T) {
	rdb := standalone(t)
	const key = "rl:spread3:{user=1}"
	lim := mustLimit(t, localbucket.SlidingWindow, 10, 24*time.Hour)
	spreadKey(t, rdb, key, 0)
	a := NewHybrid(rdb, HybridOptions{ID: "a"})
	a.SetReplicas(10) // no credit: the view has room, the allowance none
	now := time.Now().UnixNano()
	if r := take(a, now, key, lim, 1); !r.Allowed { // an exact sync: its grant, spent
		t.Fatalf("the first request refused: %+v", r)
	}
	ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}}
	if ok, wait := a.TryTake(now, ops); ok || !wait {
		t.Fatalf("TryTake with room in the view and no allowance: ok %v, wait %v; want a wait", ok, wait)
	}
	if !a.Take(now, ops) {
		t.Fatalf("Take after the wait refused: %+v", ops[0].Result)
	}
	sh := &a.shards[a.shardOf([]byte(key))]
	sh.mu.Lock()
	e := sh.m[key]
	demand, short := e.demand, e.short
	sh.mu.Unlock()
	if demand != 2 || short > 1 {
		t.Fatalf("two requests counted as demand %d, short %d; want 2, at most 1", demand, short)
	}
}
