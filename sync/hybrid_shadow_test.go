package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A shadow rule's op is judged by its key's room, not by what this daemon holds of it:
// a dry run reports what the rule would do. Judged by the allowance, as an enforcing
// rule is, a shadow rule of 3 per 5 s reported its third request refused (retry 97 ms)
// while the exact mode admits it, and a key with no view was reported unasked in an
// allowed check (found by a cross-mode audit).
func TestHybridShadowJudgedByRoom(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	for _, alg := range []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow, localbucket.SlidingWindow} {
		t.Run(alg.String(), func(t *testing.T) {
			// No Run: the interval sizes the syncs' grants only (a token bucket reserves
			// the refill of the next interval).
			h := NewHybrid(rdb, HybridOptions{Interval: 100 * time.Millisecond, FetchWait: time.Second})
			if _, err := h.Heartbeat(ctx, fmt.Sprintf("d-%p", h), time.Minute); err != nil {
				t.Fatal(err)
			}
			lim := mustLimit(t, alg, 3, 5*time.Second)
			key := fmt.Sprintf("rl:shadow:{%v}", alg)
			shadow := func(now int64, cost uint64) HybridOp {
				ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: cost, Shadow: true}}
				if !h.Take(now, ops) {
					t.Fatal("a check of a shadow rule alone refused")
				}
				if ops[0].Unasked {
					t.Fatalf("a shadow rule's op unasked in an allowed check: %+v", ops[0].Result)
				}
				return ops[0]
			}
			now := time.Now().UnixNano()
			for i := 0; i < 5; i++ {
				now += int64(time.Millisecond)
				if i == 1 {
					syncAll(t, now, h) // a view after the first
				}
				op := shadow(now, 1)
				if want := i < 3; op.Result.Allowed != want {
					t.Fatalf("request %d of a shadow rule of 3: %+v; want allowed %v", i+1, op.Result, want)
				}
			}
			syncAll(t, now, h)
			// Redis counted the three it admitted: another daemon finds none left.
			b := NewHybrid(rdb, HybridOptions{Interval: time.Hour, FetchWait: time.Second})
			if r := take(b, now, key, lim, 0); r.Allowed || r.Remaining != 0 {
				t.Fatalf("another daemon, asking Redis: %+v; want nothing left", r)
			}
			if op := shadow(now, 0); op.Result.Allowed || op.Result.Remaining != 0 {
				t.Fatalf("a question of the shadow rule after 3: %+v; want refused, 0 left", op.Result)
			}
		})
	}
}
