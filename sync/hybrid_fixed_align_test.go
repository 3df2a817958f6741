package sync

import (
	"context"
	"testing"
	"time"

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
			lim := mustLimit(t, localbucket.FixedWindow, 5, w)
			// As the daemon has it: the clock h is given (Clock, and every now) and the
			// store the limiter keeps told of the wall clock's offset from it
			// (Limiter.WithHybrid).
			clock := func() int64 { return time.Now().UnixNano() + int64(tc.skew) }
			h := NewHybrid(rdb, HybridOptions{Clock: clock})
			wall := localbucket.NewStore(localbucket.Options{})
			wall.SetWallOffset(-int64(tc.skew))
			h.SetWall(wall)
			seeEachOther(t, "align "+tc.name, h)
			key := "rl:align " + tc.name + ":{u=1}"
			var slowest time.Duration // the longest sync: a view's times count from its end
			start := time.Now()
			for time.Since(start) < 3*time.Second {
				for range 3 {
					before := time.Now()
					r := take(h, before.UnixNano()+int64(tc.skew), key, lim, 1)
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
}
