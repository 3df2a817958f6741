package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// TestHybridClockSkewRates: two daemons whose clocks are a minute apart (one behind real
// time, one ahead) share a token bucket and a sliding window on one real Redis, in real
// time, syncing every 50 ms: together they admit no more than the limit allows over the
// elapsed real time (no refill from a clock ahead, no refund from one behind), and the
// budget does not stall either.
func TestHybridClockSkewRates(t *testing.T) {
	rdb := standalone(t)
	for _, alg := range []localbucket.Algorithm{localbucket.TokenBucket, localbucket.SlidingWindow, localbucket.FixedWindow} {
		t.Run(fmt.Sprint(alg), func(t *testing.T) {
			lim := mustLimit(t, alg, 20, time.Second)
			a, b := NewHybrid(rdb, HybridOptions{}), NewHybrid(rdb, HybridOptions{})
			for round := 0; round < 2; round++ {
				for i, h := range []*Hybrid{a, b} {
					if _, err := h.Heartbeat(context.Background(), fmt.Sprint("rskew-", alg, i), time.Minute); err != nil {
						t.Fatal(err)
					}
				}
			}
			skew := map[*Hybrid]int64{a: -int64(time.Minute), b: int64(time.Minute)}
			key := fmt.Sprintf("rl:rskew%d:{u=1}", alg)
			start := time.Now()
			admitted := 0
			for time.Since(start) < 2*time.Second {
				for _, h := range []*Hybrid{a, b} {
					now := time.Now().UnixNano() + skew[h]
					for i := 0; i < 5; i++ {
						if take(h, now, key, lim, 1).Allowed {
							admitted++
						}
					}
					if err := h.Flush(context.Background(), now); err != nil {
						t.Fatal(err)
					}
				}
				time.Sleep(50 * time.Millisecond)
			}
			elapsed := time.Since(start)
			// At most a full bucket (window) plus the rate over the elapsed time, and a
			// window more for the fixed window's edges; plus one unit per daemon of
			// rounding.
			most := 20 + int(20*elapsed.Seconds()) + 2
			if alg == localbucket.FixedWindow {
				most += 20
			}
			least := int(20 * (elapsed.Seconds() - 1) / 2)
			t.Logf("%v: admitted %d in %v (at most %d)", alg, admitted, elapsed, most)
			if admitted > most || admitted < least {
				t.Fatalf("%v: skewed daemons admitted %d in %v, want within [%d, %d]", alg, admitted, elapsed, least, most)
			}
		})
	}
}
