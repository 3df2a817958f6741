package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A unit admitted on credit just before a window ends, and synced after it, counts in
// the window it was admitted in, not the next: a question (cost 0) in the next window
// before the sync dated the unit by itself, and the next window started one unit down
// (a cost of the whole limit refused in a fresh window).
func TestHybridCreditCountsInItsWindow(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow} {
		t.Run(alg.String(), func(t *testing.T) {
			const window = time.Second
			lim := mustLimit(t, alg, 20, window)
			key := fmt.Sprintf("rl:edge:{%v}", alg)
			h := NewHybrid(rdb, HybridOptions{Interval: time.Hour, FetchWait: time.Second})
			// Start 100 ms into a window, by Redis's clock.
			tm, err := rdb.Time(ctx).Result()
			if err != nil {
				t.Fatal(err)
			}
			into := time.Duration(tm.UnixNano() % int64(window))
			time.Sleep((window + 100*time.Millisecond - into) % window)
			if !take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
				t.Fatal("the first request was refused")
			}
			syncAll(t, time.Now().UnixNano(), h) // a view: credit
			tm, _ = rdb.Time(ctx).Result()
			end := tm.UnixNano() - tm.UnixNano()%int64(window) + int64(window)
			time.Sleep(time.Duration(end-tm.UnixNano()) - 60*time.Millisecond)
			if !take(h, time.Now().UnixNano(), key, lim, 1).Allowed { // 60 ms before the end, on credit
				t.Fatal("the second request was refused")
			}
			time.Sleep(120 * time.Millisecond)
			take(h, time.Now().UnixNano(), key, lim, 0) // a question, in the next window
			syncAll(t, time.Now().UnixNano(), h)
			if tm, _ := rdb.Time(ctx).Result(); tm.UnixNano() >= end+int64(window) {
				t.Skip("the machine was too slow: the sync came a window later")
			}
			n, err := rdb.HGet(ctx, key, "n").Int()
			if err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				t.Fatalf("the new window counts %d units; want 0: the unit admitted before it began is counted in it", n)
			}
			if alg == localbucket.SlidingWindow {
				if p, _ := rdb.HGet(ctx, key, "p").Int(); p != 2 {
					t.Fatalf("the previous window counts %d units; want both, 2", p)
				}
			}
		})
	}
}
