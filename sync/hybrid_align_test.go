package sync

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// TestHybridFixedWindowResetOnRedisWindows: a daemon whose monotonic clock is 200 ms off
// the wall clock (the host's wall clock was off when the daemon started, and NTP stepped
// it since: the daemon's clock does not follow a step) reports a fixed window's reset as
// the time to the end of Redis's window, where every daemon counts, not to the end of a
// window aligned on its own clock. Before, a new key's first answer (and the answers
// right after each turn of Redis's window, until the next sync brought a view of the new
// one) counted to the end of the daemon's own window: 400 ms off, a 1 s window, 124 ms
// where Redis's window ended in 524 ms. Redis runs on this host, so its windows end where
// this test's clock says.
func TestHybridFixedWindowResetOnRedisWindows(t *testing.T) {
	const w = 500 * time.Millisecond
	lim := mustLimit(t, localbucket.FixedWindow, 5, w)
	onSkewedClocks(t, standalone(t), "align", func(t *testing.T, h *Hybrid, clock func() int64, skew time.Duration) {
		key := "rl:align " + t.Name() + ":{u=1}"
		var slowest time.Duration // the longest sync: a view's times count from its end
		start := time.Now()
		for time.Since(start) < 3*time.Second {
			for range 3 {
				before := time.Now()
				r := take(h, before.UnixNano()+int64(skew), key, lim, 1)
				if r.Reset <= 0 {
					continue
				}
				// Redis's window ends in end; the reset may be later by the sync's
				// time (never early), and is taken a little after before.
				end := int64(w) - before.UnixNano()%int64(w)
				d := (r.Reset - end) % int64(w)
				if d > int64(w)/2 {
					d -= int64(w)
				} else if d <= -int64(w)/2 {
					d += int64(w)
				}
				if late := time.Since(before) + slowest + 60*time.Millisecond; d < -int64(60*time.Millisecond) || d > int64(late) {
					t.Fatalf("reset %v, allowed %v; Redis's window ends in %v (off by %v, want within [-60ms, %v])",
						time.Duration(r.Reset), r.Allowed, time.Duration(end), time.Duration(d), late)
				}
			}
			began := time.Now()
			if err := h.Flush(context.Background(), clock()); err != nil {
				t.Fatal(err)
			}
			slowest = max(slowest, time.Since(began))
			time.Sleep(30 * time.Millisecond)
		}
	})
}

// TestHybridSlidingWindowResetWithoutViewOnRedisWindows: a sliding window key with units
// admitted here and no sync yet (a shadow rule's key new here; a degraded one) reports
// its reset from the start of Redis's window (hybrid.lua aligns sliding windows on Redis
// TIME), not from the start of a window aligned on the daemon's monotonic clock, which
// is off the wall clock by as much as the wall clock was off when the daemon started and
// has stepped since. Before, with the clock 200 ms off and 500 ms windows, the reset was
// 200 or 300 ms off the time at which Redis's count of those units would let one more in.
func TestHybridSlidingWindowResetWithoutViewOnRedisWindows(t *testing.T) {
	rdb := standalone(t)
	const w = 500 * time.Millisecond
	lim := mustLimit(t, localbucket.SlidingWindow, 5, w)
	onSkewedClocks(t, rdb, "slide align", func(t *testing.T, h *Hybrid, clock func() int64, skew time.Duration) {
		for i := range 6 {
			// A new key each round, never synced: shadow ops admit here and leave
			// the units for the next sync.
			key := "rl:slide align " + t.Name() + ":{u=" + string(rune('a'+i)) + "}"
			var r localbucket.Result
			var redisNow time.Time
			for range 2 {
				tm, err := rdb.Time(context.Background()).Result()
				if err != nil {
					t.Fatal(err)
				}
				redisNow = tm
				ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1, Shadow: true}}
				h.Take(redisNow.UnixNano()+int64(skew), ops)
				r = ops[0].Result
			}
			// Two units admitted in Redis's window (the second op's reset counts
			// it): the window empties when they weigh less than one unit into the
			// next (emptyAt), counted from Redis's window start.
			rn := redisNow.UnixNano()
			start := rn - rn%int64(w)
			q := 2.0
			want := emptyAt(start, int64(w), q) + slideMargin - rn
			if d := r.Reset - want; d < -int64(60*time.Millisecond) || d > int64(60*time.Millisecond) {
				t.Fatalf("round %d: reset %v, want %v from Redis's window start (off by %v); allowed %v",
					i, time.Duration(r.Reset), time.Duration(want), time.Duration(d), r.Allowed)
			}
			time.Sleep(37 * time.Millisecond)
		}
	})
}

// onSkewedClocks runs f on a hybrid store whose clock is skew off the wall clock (and
// Redis's), ahead and behind, as the daemon has it: the clock h is given (Clock, and
// every now) and the store the limiter keeps told of the wall clock's offset from it
// (Limiter.WithHybrid); the daemon's monotonic clock is off the wall clock by as much as
// the wall clock was off when the daemon started and has stepped since.
func onSkewedClocks(t *testing.T, rdb redis.UniversalClient, name string, f func(t *testing.T, h *Hybrid, clock func() int64, skew time.Duration)) {
	for _, tc := range []struct {
		name string
		skew time.Duration // the daemon's clock, from the wall clock (and Redis's)
	}{
		{"clock ahead", 200 * time.Millisecond},
		{"clock behind", -200 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := func() int64 { return time.Now().UnixNano() + int64(tc.skew) }
			h := NewHybrid(rdb, HybridOptions{Clock: clock})
			wall := localbucket.NewStore(localbucket.Options{})
			wall.SetWallOffset(-int64(tc.skew))
			h.SetWall(wall)
			seeEachOther(t, name+" "+tc.name, h)
			f(t, h, clock, tc.skew)
		})
	}
}
