package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// An op that fit in a check another op refused used nothing, and asks no share grant:
// a daemon whose checks of a hot key are all refused by another rule gives that key's
// grant back at its next sync, for the daemons whose checks it would pass. Counted as
// demand, those refusals kept the grant reserved at every sync: two rules on one key
// (8 and 5 an hour) over 3 daemons, clients honouring retry_after, admitted 4 of 5, each
// daemon holding a unit of the rule the others' checks lacked, its clients told "the
// next sync" for seconds on end.
func TestHybridOpThatFitInARefusedCheckHoldsNoGrant(t *testing.T) {
	// Timeouts a loaded machine cannot miss: the test is of what is reserved, not when.
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	ctx := context.Background()
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow, localbucket.TokenBucket} {
		t.Run(alg.String(), func(t *testing.T) {
			wide := mustLimit(t, alg, 100000, hourWindow())
			tight := mustLimit(t, localbucket.FixedWindow, 1, hourWindow())
			wk := "rl:fit-wide:{" + alg.String() + "}"
			tk := "rl:fit-tight:{" + alg.String() + "}"
			a := NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: 10 * time.Second})
			b := NewHybrid(rdb, HybridOptions{ID: "b", FetchWait: 10 * time.Second})
			a.SetReplicas(2)
			b.SetReplicas(2)
			// b uses the wide key, then a: shared, share grants only. Demand beyond a's
			// allowance then makes it hot on a: a's sync reserves a share grant.
			// (The daemons' clock steps an interval between syncs, as their periodic syncs
			// come: a hot key synced again within half an interval keeps its grant.)
			now := time.Now().UnixNano()
			step := func() int64 { now += int64(a.Interval()); return now }
			for _, h := range []*Hybrid{b, a} {
				if !take(h, now, wk, wide, 1).Allowed {
					t.Fatal("a first request was refused")
				}
				syncAll(t, step(), h)
			}
			for range 3 {
				if !take(a, now, wk, wide, 1).Allowed {
					t.Fatal("a request was refused")
				}
			}
			syncAll(t, step(), a)
			if g := entryOf(a, wk).grant; g == 0 {
				t.Fatal("a holds no share grant of its hot key; the test needs one")
			}
			// The tight key spent: a's checks of both keys are refused by it.
			if !take(a, now, tk, tight, 1).Allowed {
				t.Fatal("the tight key's first unit was refused")
			}
			for range 2 {
				for range 10 {
					ops := []HybridOp{{Key: []byte(wk), Limit: wide, Cost: 1}, {Key: []byte(tk), Limit: tight, Cost: 1}}
					if a.Take(now, ops) || ops[1].Result.Allowed {
						t.Fatalf("a check beyond the tight key's limit: %+v", ops)
					}
					if !ops[0].Result.Allowed {
						t.Fatalf("the wide key's op did not fit: %+v", ops[0].Result)
					}
				}
				syncAll(t, step(), a)
			}
			if g := entryOf(a, wk).grant; g != 0 {
				t.Fatalf("a still holds a grant of %d units of the wide key, whose every check since was refused by another rule", g)
			}
			if g, err := rdb.HGet(ctx, wk, "g").Int64(); err != nil || g != 0 {
				t.Fatalf("Redis holds %d units of the wide key reserved (%v); want none", g, err)
			}
		})
	}
}

// An op that fits in a check another op refuses for good uses nothing, on a key this
// daemon has no allowance of (shared, or left) as on any other: it does not make the
// key short, and nothing is synced for it. Taken for a race lost (the view had room,
// the allowance none), such a check sent the request's keys to an exact sync, which
// reserved the op's unit until the next sync gave it back; and TryTake told the
// connection's loop to wait for Take.
func TestHybridFitInARefusedCheckIsNoShortfall(t *testing.T) {
	rdb := standalone(t)
	window := hourWindow()
	lim := mustLimit(t, localbucket.FixedWindow, 100, window)
	tight := mustLimit(t, localbucket.FixedWindow, 1, window)
	a := NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: 10 * time.Second})
	b := NewHybrid(rdb, HybridOptions{ID: "b", FetchWait: 10 * time.Second})
	seeEachOther(t, "short", a, b)
	key := "rl:fit-short:{user=dave}"
	tk := "rl:fit-short-tight:{user=dave}"
	now := time.Now().UnixNano()
	for _, h := range []*Hybrid{b, a} { // shared: a holds no credit
		if !take(h, now, key, lim, 1).Allowed {
			t.Fatal("a first unit refused")
		}
		syncAll(t, now, h)
	}
	if !take(a, now, tk, tight, 1).Allowed {
		t.Fatal("the tight key's unit refused")
	}
	syncAll(t, now, a)
	if e := entryOf(a, key); e.flags&flagShared == 0 || e.flags&flagDirty != 0 {
		t.Fatalf("the key is not shared and clean on a: flags %b", e.flags)
	}
	for range 10 {
		ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}, {Key: []byte(tk), Limit: tight, Cost: 1}}
		if a.Take(now, ops) || !ops[0].Result.Allowed {
			t.Fatalf("Take: %+v; want refused by the tight key, the key's op fitting", ops)
		}
	}
	sh := &a.shards[a.shardOf([]byte(key))]
	sh.mu.Lock()
	short, flags := sh.m[key].short, sh.m[key].flags
	sh.mu.Unlock()
	if short != 0 || flags&flagDirty != 0 {
		t.Fatalf("10 checks the tight key refused made the key short %d, flags %b: synced for nothing", short, flags)
	}
	// A connection's loop (TryTake) is told the same at once, not to wait for Take.
	ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}, {Key: []byte(tk), Limit: tight, Cost: 1}}
	if ok, wait := a.TryTake(now, ops); ok || wait || !ops[0].Result.Allowed {
		t.Fatalf("TryTake: ok %v, wait %v, %+v; want refused by the tight key at once, the key's op fitting", ok, wait, ops)
	}
}
