package sync

import (
	"context"
	"fmt"
	"math/rand"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A refusal's retry is the earliest time a retry can pass (proto/PROTOCOL.md): one daemon
// alone on a key, a client that waits exactly RetryAfter and asks again with the same
// cost is admitted, for every algorithm, costs of 1 and above. Nor is the retry
// needlessly late: at most a sync interval (and a few ms) past the exact mode's (the
// local limiter's answer to the same requests at the same times).
//
// Before: a refusal whose cost the view held, counting the units admitted here beyond
// the grant (not yet in Redis) as free, said the next sync (token bucket 5/s: 3, 1, then
// 3 refused with 200 ms, where 2 tokens take 400; 4 per 2 s windows: 2, 1, then 2 refused
// with 100 ms, where the window's end was due); and a sliding window's refusal of a
// cost of 1 (4 per 300 ms) was refused again at its retry about half the time.
func TestHybridRetryAfterIsEarliestPass(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	runHybrid(t, h, "d")
	const slack = 100*time.Millisecond + 5*time.Millisecond // a sync interval and a few ms
	cases := []struct {
		alg    localbucket.Algorithm
		limit  uint64
		window time.Duration
		costs  []uint64 // the last one is refused; costs of 0: "until refused", cost 1
		trials int
	}{
		{localbucket.TokenBucket, 5, time.Second, []uint64{3, 1, 3}, 4},
		{localbucket.TokenBucket, 4, 2 * time.Second, []uint64{2, 1, 2}, 2},
		{localbucket.TokenBucket, 4, 300 * time.Millisecond, nil, 6},
		{localbucket.FixedWindow, 4, 600 * time.Millisecond, []uint64{2, 1, 2}, 3},
		{localbucket.FixedWindow, 4, 300 * time.Millisecond, nil, 6},
		{localbucket.SlidingWindow, 4, 600 * time.Millisecond, []uint64{2, 1, 2}, 6},
		{localbucket.SlidingWindow, 4, 300 * time.Millisecond, nil, 16},
	}
	rnd := rand.New(rand.NewSource(7))
	bad := 0
	for ci, c := range cases {
		lim := mustLimit(t, c.alg, c.limit, c.window)
		for trial := range c.trials {
			key := fmt.Sprintf("rl:retry-pass:{%d-%d-%d}", ci, trial, time.Now().UnixNano())
			// Any phase of the window.
			time.Sleep(time.Duration(rnd.Int63n(int64(c.window))))
			var st localbucket.State // the exact mode's answer to the same requests
			var r, want localbucket.Result
			var cost uint64
			var first, last int64
			step := func(cost uint64) {
				now := time.Now().UnixNano()
				if first == 0 {
					first = now
				}
				last = now
				r = take(h, now, key, lim, cost)
				st, want = lim.Take(st, now, cost)
			}
			if c.costs == nil {
				cost = 1
				for n := 0; ; n++ {
					if step(1); !r.Allowed {
						break
					}
					if n > 50 {
						t.Fatal("never refused")
					}
				}
			} else {
				skip := false
				for i, x := range c.costs {
					cost = x
					step(x)
					if last := i == len(c.costs)-1; r.Allowed == last || want.Allowed == last {
						skip = true // the window turned between the requests: not this case
						break
					}
				}
				if skip {
					continue
				}
			}
			if r.Allowed || want.Allowed {
				continue // the window turned between the requests: nothing to judge
			}
			if r.RetryAfter <= 0 {
				t.Errorf("%v %d/%v costs %v: refused with no retry: %+v", c.alg, c.limit, c.window, c.costs, r)
				bad++
				continue
			}
			// Units a daemon admitted between two syncs are charged as of the last
			// (docs/accuracy.md): requests over a window's turn may be counted in the
			// later window, and its retry be later than the exact mode's.
			// A token bucket's are charged as of the last admission too: its refill starts
			// up to the requests' spread later (480 ms late once, requests 480 ms apart
			// on a loaded machine, where they are microseconds apart).
			w := int64(c.window)
			oneWindow := c.alg == localbucket.TokenBucket || first/w == last/w
			late := slack
			if c.alg == localbucket.TokenBucket {
				late += time.Duration(last - first)
			}
			if d := time.Duration(r.RetryAfter - want.RetryAfter); oneWindow && d > late {
				t.Errorf("%v %d/%v costs %v: retry %v, the exact mode's %v: %v late", c.alg, c.limit, c.window, c.costs,
					time.Duration(r.RetryAfter), time.Duration(want.RetryAfter), d)
				bad++
			}
			time.Sleep(time.Duration(r.RetryAfter))
			if again := take(h, time.Now().UnixNano(), key, lim, cost); !again.Allowed {
				t.Errorf("%v %d/%v costs %v (trial %d): refused with retry %v (exact mode %v), retried after it: refused again %+v",
					c.alg, c.limit, c.window, c.costs, trial, time.Duration(r.RetryAfter), time.Duration(want.RetryAfter), again)
				bad++
			}
			if bad > 20 {
				t.FailNow()
			}
		}
	}
}

// A reset is never more than the limit allows: a fixed window ends within its length,
// and a token bucket is full within a whole bucket (burst units at the limit's pace).
// Before, the sync's lag counted in the view's times put it beyond: 10,001 ms of 10 s.
func TestHybridResetWithinTheLimit(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d"})
	for _, alg := range []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow} {
		lim := mustLimit(t, alg, 5, 10*time.Second)
		top := int64(10 * time.Second)
		worst := int64(0)
		for i := range 40 {
			key := fmt.Sprintf("rl:reset-within:{%v-%d-%d}", alg, i, time.Now().UnixNano())
			for range 6 { // past the limit: the bucket empty, the window full
				if r := take(h, time.Now().UnixNano(), key, lim, 1); r.Reset > worst {
					worst = r.Reset
				}
			}
			if err := h.Flush(context.Background(), time.Now().UnixNano()); err != nil {
				t.Fatal(err)
			}
			if r := take(h, time.Now().UnixNano(), key, lim, 0); r.Reset > worst {
				worst = r.Reset
			}
		}
		if worst > top {
			t.Errorf("%v 5 per 10 s: a reset of %v, beyond %v", alg, time.Duration(worst), time.Duration(top))
		}
	}
}

// runHybrid runs h's syncs (Hybrid.Run, as daemon id, on the wall clock) until the test
// ends.
func runHybrid(t *testing.T, h *Hybrid, id string) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.Run(ctx, id, func() int64 { return time.Now().UnixNano() }, time.Second, func(error) {})
	}()
	t.Cleanup(func() { cancel(); <-done })
}

// A fixed window's refusal whose view is of a window that has ended since (the key was
// synced just before the window turned, and this daemon admitted units in the new one):
// the new window frees nothing before its own end, so that is the retry. Before, the
// view's end being past, the refusal was judged at the limit's pace and told the next
// sync: 7 per 360 ms, one unit 5 ms before the turn, three after it, a cost of 5 refused
// with 82 ms, refused again at it (271 ms to the window's end), every trial.
func TestHybridFixedWindowRetryAfterTheTurn(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	runHybrid(t, h, "d")
	const window = 360 * time.Millisecond
	lim := mustLimit(t, localbucket.FixedWindow, 7, window)
	w := int64(window)
	for trial := range 4 {
		key := fmt.Sprintf("rl:retry-turn:{%d-%d}", trial, time.Now().UnixNano())
		// 5 ms before a window's turn.
		now := time.Now().UnixNano()
		wait := w - now%w - int64(5*time.Millisecond)
		if wait < int64(5*time.Millisecond) {
			wait += w
		}
		time.Sleep(time.Duration(wait))
		if r := take(h, time.Now().UnixNano(), key, lim, 1); !r.Allowed {
			t.Fatalf("trial %d: the key's first unit refused: %+v", trial, r)
		}
		now = time.Now().UnixNano()
		time.Sleep(time.Duration(w - now%w + int64(2*time.Millisecond)))
		start := time.Now().UnixNano()
		if start%w > int64(30*time.Millisecond) {
			continue // the machine slept through the turn: not this case
		}
		for range 3 {
			if r := take(h, time.Now().UnixNano(), key, lim, 1); !r.Allowed {
				t.Fatalf("trial %d: a unit of the new window refused: %+v", trial, r)
			}
		}
		now = time.Now().UnixNano()
		r := take(h, now, key, lim, 5)
		if r.Allowed {
			t.Fatalf("trial %d: 3 + 5 of 7 admitted in one window: %+v", trial, r)
		}
		if end := w - now%w; r.RetryAfter < end-int64(time.Millisecond) {
			t.Errorf("trial %d: a cost of 5 with 3 of 7 used told to retry in %v, before the window's end in %v",
				trial, time.Duration(r.RetryAfter), time.Duration(end))
		}
		time.Sleep(time.Duration(r.RetryAfter))
		if again := take(h, time.Now().UnixNano(), key, lim, 5); !again.Allowed {
			t.Errorf("trial %d: refused with retry %v, retried after it: refused again %+v", trial, time.Duration(r.RetryAfter), again)
		}
	}
}

// A token bucket's grants that exact syncs reserved and their requests used at once are
// not reported (no sync follows them), so Redis holds them in g until the holders sync
// the key again or the bucket is full. A second after the key's last reservation they
// no longer count as units other daemons hold: a client whose requests rotate over 3
// daemons at 3 an hour, refused at its 4th, is told when its next unit comes (about 20
// minutes), not the next sync. Before, every such refusal said 100 ms for up to the
// hour the bucket took to fill, and each retry was refused again.
func TestHybridUsedGrantsHeldOnlyAShortWhile(t *testing.T) {
	rdb := standalone(t)
	hs, lim, key := oneEachOfThree(t, rdb, "used")
	time.Sleep(1100 * time.Millisecond)
	r := take(hs[0], time.Now().UnixNano(), key, lim, 1)
	if r.Allowed {
		t.Fatal("a 4th request of 3 an hour admitted")
	}
	if r.RetryAfter < int64(19*time.Minute) {
		t.Errorf("the 4th request refused with retry %v, where the next unit comes in about 20 minutes", time.Duration(r.RetryAfter))
	}
}

// Grants reserved by a daemon whose scripts/hybrid.lua records no reservation time (gt:
// one older than it, in a blue/green upgrade) count as held however long ago they were
// reserved, as before gt: a refusal is told this daemon's next sync, never the refill
// while units held elsewhere may come back sooner.
func TestHybridGrantsWithNoReservationTimeStayHeld(t *testing.T) {
	rdb := standalone(t)
	hs, lim, key := oneEachOfThree(t, rdb, "nogt")
	ctx := context.Background()
	if n, err := rdb.HDel(ctx, key, "gt").Result(); err != nil || n != 1 {
		t.Fatalf("HDEL gt: %d, %v (the key records no reservation time: the test cannot tell)", n, err)
	}
	if g, err := rdb.HGet(ctx, key, "g").Float64(); err != nil || g < 1 {
		t.Fatalf("the key's reserved units g = %v (%v): nothing held, the test cannot tell", g, err)
	}
	time.Sleep(1100 * time.Millisecond)
	r := take(hs[0], time.Now().UnixNano(), key, lim, 1)
	if r.Allowed {
		t.Fatal("a 4th request of 3 an hour admitted")
	}
	if r.RetryAfter > int64(time.Second) {
		t.Errorf("the 4th request refused with retry %v, where units reserved with no time are held elsewhere: the next sync", time.Duration(r.RetryAfter))
	}
}

// oneEachOfThree has three daemons that see each other take one unit each of a token
// bucket of 3 an hour (a key new to each: an exact sync each, which reserves its unit),
// and returns them, the limit and the key.
func oneEachOfThree(t *testing.T, rdb redis.UniversalClient, name string) ([]*Hybrid, *localbucket.Limit, string) {
	t.Helper()
	hs := []*Hybrid{
		NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: time.Second}),
		NewHybrid(rdb, HybridOptions{ID: "b", FetchWait: time.Second}),
		NewHybrid(rdb, HybridOptions{ID: "c", FetchWait: time.Second}),
	}
	seeEachOther(t, name, hs...)
	lim := mustLimit(t, localbucket.TokenBucket, 3, time.Hour)
	key := fmt.Sprintf("rl:%s:{%d}", name, time.Now().UnixNano())
	for i, h := range hs {
		if r := take(h, time.Now().UnixNano(), key, lim, 1); !r.Allowed {
			t.Fatalf("request %d of 3 refused: %+v", i+1, r)
		}
	}
	return hs, lim, key
}
