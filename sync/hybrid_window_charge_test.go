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
			at := time.Now().UnixNano()            // Redis's clock is this machine's
			if !take(h, at, key, lim, 1).Allowed { // 60 ms before the end, on credit
				t.Fatal("the second request was refused")
			}
			if at >= end-int64(5*time.Millisecond) {
				t.Skip("the machine was too slow: the sleep ran past the window's end")
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

// Units admitted beyond a grant taken in the previous window of a sliding window count
// in the window they were admitted in. Put in the previous window whenever admitted
// (the grant's window), a client at 6 per 3 s with 1 unit before a boundary and 3 just
// after it saw them weigh as the previous window's, and was admitted 8 (a cross-mode
// audit; the exact mode refuses the 3 more at 1.73 s).
func TestHybridSlidingCreditAfterBoundary(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	const window = 3 * time.Second
	lim := mustLimit(t, localbucket.SlidingWindow, 6, window)
	key := "rl:slide-edge:{u1}"
	h := NewHybrid(rdb, HybridOptions{Interval: 100 * time.Millisecond, FetchWait: time.Second})
	tm, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	// The first request 300 ms before a window ends, by Redis's clock; the next 400 ms
	// after it begins.
	next := tm.UnixNano() - tm.UnixNano()%int64(window) + int64(window)
	if next-tm.UnixNano() < int64(400*time.Millisecond) {
		next += int64(window)
	}
	time.Sleep(time.Duration(next-tm.UnixNano()) - 300*time.Millisecond)
	if !take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
		t.Fatal("the first request refused")
	}
	syncAll(t, time.Now().UnixNano(), h)
	time.Sleep(700 * time.Millisecond)
	if !take(h, time.Now().UnixNano(), key, lim, 3).Allowed {
		t.Fatal("3 more of 6, 1 used, refused")
	}
	syncAll(t, time.Now().UnixNano(), h)
	if tm, _ := rdb.Time(ctx).Result(); tm.UnixNano() >= next+int64(window) {
		t.Skip("the machine was too slow: the sync came a window later")
	}
	got, err := rdb.HMGet(ctx, key, "p", "n").Result()
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != "[1 3]" {
		t.Fatalf("previous and current window count %v; want [1 3]: the 3 admitted after the boundary count in the current window", got)
	}
}
