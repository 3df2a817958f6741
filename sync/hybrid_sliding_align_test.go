package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

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
	for _, tc := range []struct {
		name string
		skew time.Duration // the daemon's clock, from the wall clock (and Redis's)
	}{
		{"clock ahead", 200 * time.Millisecond},
		{"clock behind", -200 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lim := mustLimit(t, localbucket.SlidingWindow, 5, w)
			clock := func() int64 { return time.Now().UnixNano() + int64(tc.skew) }
			h := NewHybrid(rdb, HybridOptions{Clock: clock})
			wall := localbucket.NewStore(localbucket.Options{})
			wall.SetWallOffset(-int64(tc.skew))
			h.SetWall(wall)
			seeEachOther(t, "slide align "+tc.name, h)
			for i := range 6 {
				// A new key each round, never synced: shadow ops admit here and leave
				// the units for the next sync.
				key := "rl:slide align " + tc.name + ":{u=" + string(rune('a'+i)) + "}"
				var r localbucket.Result
				var redisNow time.Time
				for range 2 {
					tm, err := rdb.Time(context.Background()).Result()
					if err != nil {
						t.Fatal(err)
					}
					redisNow = tm
					ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1, Shadow: true}}
					h.Take(redisNow.UnixNano()+int64(tc.skew), ops)
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
}
