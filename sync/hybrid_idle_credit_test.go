package sync

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A daemon that held credit on a key another daemon started using, and whose checks of
// the key since are all refused elsewhere (another rule of the request, another store,
// a ban), used nothing and had nothing to sync: the reservation of its credit (k) that
// the other daemon's sync made lasted the whole minute, and the other daemon was refused
// those units, its clients told to retry at the next sync again and again. Now such a
// check, on a view at least leaveAfter intervals old, has the daemon's next sync leave
// the key: it gives up its credit and Redis drops the reservation. Before, b admitted 9
// of the 14 left (5 reserved for a); now 14, and Redis counts each unit once.
func TestHybridIdleCreditReservationLifted(t *testing.T) {
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.TokenBucket} {
		for _, path := range []string{"fit in a refused check", "another store refused", "given back"} {
			t.Run(fmt.Sprint(alg, "/", path), func(t *testing.T) {
				rdb := standalone(t)
				ctx := context.Background()
				window := hourWindow()
				lim := mustLimit(t, alg, 20, window)
				tight := mustLimit(t, localbucket.FixedWindow, 1, window)
				a := NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: 10 * time.Second})
				b := NewHybrid(rdb, HybridOptions{ID: "b", FetchWait: 10 * time.Second})
				seeEachOther(t, "idle", a, b)
				key := "rl:idle:{user=alice}"
				tk := "rl:idle-tight:{user=alice}"
				now := time.Now().UnixNano()
				// a alone: a first unit, then 4 on credit from its view (⌊19 ÷ 4⌋).
				used := 0
				for i := range 5 {
					if take(a, now, key, lim, 1).Allowed {
						used++
					}
					if i == 0 {
						syncAll(t, now, a)
					}
				}
				if !take(a, now, tk, tight, 1).Allowed {
					t.Fatal("the tight key's only unit refused")
				}
				syncAll(t, now, a)
				if used != 5 {
					t.Fatalf("a admitted %d of 5", used)
				}
				// b starts using the key: its sync reserves a's possible credit.
				if !take(b, now, key, lim, 1).Allowed {
					t.Fatal("b's first unit refused")
				}
				used++
				syncAll(t, now, b)
				if k := rdb.HGet(ctx, key, "k").Val(); !strings.HasPrefix(k, "a ") {
					t.Fatalf("no credit reserved for a when b took the key (k = %q): the test sets up nothing", k)
				}
				// 2 s on, a's checks of the key are refused elsewhere, and a syncs.
				later := now + int64(2*time.Second)
				switch path {
				case "fit in a refused check":
					ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}, {Key: []byte(tk), Limit: tight, Cost: 1}}
					if a.Take(later, ops) || !ops[0].Result.Allowed {
						t.Fatalf("want the key's op to fit in a check the tight key refused: %+v", ops)
					}
				case "another store refused":
					a.Peek(later, []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}})
				case "given back":
					ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}}
					if !a.Take(later, ops) {
						t.Fatalf("a's check refused: %+v", ops[0].Result)
					}
					a.Undo(later, ops)
				}
				syncAll(t, later, a)
				if k := rdb.HGet(ctx, key, "k").Val(); k != "" {
					t.Errorf("a's checks were refused elsewhere and it synced; its credit still reserved: k = %q", k)
				}
				// b takes what is left; a, whose credit is gone, gets nothing more.
				more := takeSyncing(t, b, later, key, lim, 30)
				if take(a, later, key, lim, 1).Allowed {
					more++
				}
				syncAll(t, later, a, b)
				syncAll(t, later, a, b)
				t.Logf("a admitted 5, b 1; then b %d more of the %d left", more, 20-used)
				if more != 20-used {
					t.Errorf("then %d more admitted of the %d left", more, 20-used)
				}
				if alg == localbucket.FixedWindow {
					if n, err := rdb.HGet(ctx, key, "n").Int(); err != nil || n != used+more {
						t.Errorf("Redis counts %d (%v), want the %d admitted", n, err, used+more)
					}
				}
			})
		}
	}
}

// A check refused elsewhere on a view younger than leaveAfter intervals leaves the key
// alone: no sync, its credit kept. And a daemon that left a key it is alone on has its
// credit back after its next admission's exact sync, which records it as the key's
// user again.
func TestHybridIdleCreditFreshViewKeptAndResumed(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	lim := mustLimit(t, localbucket.FixedWindow, 20, hourWindow())
	a := NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: 10 * time.Second})
	seeEachOther(t, "fresh", a)
	key := "rl:idle-fresh:{user=bob}"
	now := time.Now().UnixNano()
	take(a, now, key, lim, 1)
	syncAll(t, now, a)
	soon := now + int64(leaveAfter-1)*int64(a.Interval())
	a.Peek(soon, []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}})
	if e := entryOf(a, key); e.flags&(flagIdle|flagDirty) != 0 {
		t.Fatalf("a check refused elsewhere %d intervals after the view marked the key: flags %b", leaveAfter-1, e.flags)
	}
	if !take(a, soon, key, lim, 1).Allowed {
		t.Fatal("a unit on credit refused")
	}
	syncAll(t, soon, a)
	late := soon + int64(leaveAfter)*int64(a.Interval())
	a.Peek(late, []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}})
	if e := entryOf(a, key); e.flags&flagIdle == 0 {
		t.Fatalf("a check refused elsewhere %d intervals after the view left the key unmarked", leaveAfter)
	}
	syncAll(t, late, a)
	if o := rdb.HGet(ctx, key, "o").Val(); o != "" {
		t.Fatalf("a left the key; Redis still names it its last user: o = %q", o)
	}
	if e := entryOf(a, key); e.flags&flagShared == 0 || e.allowance > 0 {
		t.Fatalf("a left the key and holds credit: flags %b, allowance %v", e.flags, e.allowance)
	}
	// Its next admission: an exact sync, then credit again.
	if !take(a, late, key, lim, 1).Allowed {
		t.Fatal("a's request after it left the key refused")
	}
	if o := rdb.HGet(ctx, key, "o").Val(); !strings.HasPrefix(o, "a/") {
		t.Fatalf("a's exact sync did not record it as the key's user: o = %q", o)
	}
	if e := entryOf(a, key); e.flags&flagShared != 0 || e.allowance < 1 {
		t.Fatalf("alone on the key after its exact sync, a holds no credit: flags %b, allowance %v", e.flags, e.allowance)
	}
	syncAll(t, late, a)
	if n, err := rdb.HGet(ctx, key, "n").Int(); err != nil || n != 3 {
		t.Fatalf("Redis counts %d (%v), want the 3 admitted", n, err)
	}
}

// A leave gives up the daemon's credit when it is sent, not when its reply comes: it
// drops the reservation of that credit, and a unit admitted on it meanwhile is one no
// reservation covers. A request while the leave is on its way waits for it, then makes
// an exact sync.
func TestHybridLeaveGivesUpCreditAtOnce(t *testing.T) {
	rdb := standalone(t)
	lim := mustLimit(t, localbucket.TokenBucket, 20, hourWindow())
	a := NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: 10 * time.Second})
	seeEachOther(t, "leave-now", a)
	key := "rl:idle-now:{user=carol}"
	now := time.Now().UnixNano()
	take(a, now, key, lim, 1)
	syncAll(t, now, a)
	later := now + int64(2*time.Second)
	a.Peek(later, []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}})
	items := a.collect(later, math.MaxInt)
	if len(items) != 1 || items[0].mode != modeLeave {
		t.Fatalf("the sync after a check refused elsewhere carries %d items (%+v); want the key's leave", len(items), items)
	}
	ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}}
	if ok, wait := a.TryTake(later, ops); ok || !wait {
		t.Fatalf("while the leave is on its way: ok %v, wait %v; want a wait (no credit)", ok, wait)
	}
	if _, err := a.settle(context.Background(), items, false); err != nil {
		t.Fatal(err)
	}
	if !a.Take(later, ops) {
		t.Fatalf("after the leave, refused: %+v", ops[0].Result)
	}
}

// Measured through the daemons' own syncs (Hybrid.Run, wall clock), over 5 s: a used 5
// of 20 and then held credit; b takes the key. With a's checks all refused by another
// rule, b is admitted all 15 left (before: 10, the last within 250 ms, then 236
// refusals told about 50 ms each, the reservation still there at the end). With a
// getting no checks at all (its clients moved to b), a's credit stays reserved for the
// minute it may be spent: b gets at least the 10, at most the 15.
func TestHybridIdleCreditOverFiveSeconds(t *testing.T) {
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.TokenBucket} {
		for _, ownerBusy := range []bool{true, false} {
			t.Run(fmt.Sprint(alg, "/owner checked=", ownerBusy), func(t *testing.T) {
				rdb := standalone(t)
				ctx := context.Background()
				window := hourWindow()
				lim := mustLimit(t, alg, 20, window)
				tight := mustLimit(t, localbucket.FixedWindow, 1, window)
				a := NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: 2 * time.Second})
				b := NewHybrid(rdb, HybridOptions{ID: "b", FetchWait: 2 * time.Second})
				runHybrid(t, a, "a")
				runHybrid(t, b, "b")
				for deadline := time.Now().Add(5 * time.Second); a.Replicas() != 2 || b.Replicas() != 2; time.Sleep(20 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatal("the daemons do not see each other")
					}
				}
				key := "rl:idle-5s:{user=alice}"
				tk := "rl:idle-5s-tight:{user=alice}"
				clk := func() int64 { return time.Now().UnixNano() }
				used := 0
				for range 4 {
					if take(a, clk(), key, lim, 1).Allowed {
						used++
					}
					time.Sleep(150 * time.Millisecond)
				}
				ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}, {Key: []byte(tk), Limit: tight, Cost: 1}}
				if !a.Take(clk(), ops) {
					t.Fatalf("a's check of both keys refused: %+v", ops)
				}
				used++
				if used != 5 {
					t.Fatalf("a admitted %d of 5", used)
				}
				time.Sleep(300 * time.Millisecond) // a's syncs: its view holds credit
				var stop atomic.Bool
				done := make(chan int)
				go func() {
					refused := 0
					for !stop.Load() {
						if ownerBusy {
							ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}, {Key: []byte(tk), Limit: tight, Cost: 1}}
							if a.Take(clk(), ops) {
								refused = -1000 // admitted past the tight key's limit
							} else if ops[0].Result.Allowed {
								refused++
							}
						}
						time.Sleep(20 * time.Millisecond)
					}
					done <- refused
				}()
				start := time.Now()
				admitted, refusals := 0, 0
				var retries time.Duration
				var last time.Duration
				for time.Since(start) < 5*time.Second {
					if r := take(b, clk(), key, lim, 1); r.Allowed {
						admitted++
						last = time.Since(start)
					} else {
						refusals++
						retries += time.Duration(r.RetryAfter)
					}
					time.Sleep(20 * time.Millisecond)
				}
				stop.Store(true)
				refusedElsewhere := <-done
				k := rdb.HGet(ctx, key, "k").Val()
				mean := time.Duration(0)
				if refusals > 0 {
					mean = retries / time.Duration(refusals)
				}
				t.Logf("a used %d, then %d checks of it refused by the other rule; b admitted %d of the %d left (the last at %v), refused %d, told %v on average; k = %q",
					used, refusedElsewhere, admitted, 20-used, last.Round(time.Millisecond), refusals, mean.Round(time.Millisecond), k)
				if refusedElsewhere < 0 {
					t.Fatal("a admitted a check past the tight key's limit")
				}
				if ownerBusy {
					if admitted != 20-used {
						t.Errorf("a's checks all refused by another rule: b admitted %d of the %d left in 5 s", admitted, 20-used)
					}
					if k != "" {
						t.Errorf("a's credit still reserved: k = %q", k)
					}
				} else if admitted < 20-used-20/4 || admitted > 20-used {
					t.Errorf("b admitted %d; want %d to %d", admitted, 20-used-20/4, 20-used)
				}
			})
		}
	}
}
