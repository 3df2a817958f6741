package sync

import (
	"fmt"
	"testing"
	"time"
)

// A key whose last view had no room for a request, and still has none by that view
// projected to now (its refill, or its window's end, not reached), is refused by the
// view when Redis does not answer, not handed to its rule's failure policy: other
// daemons can only have used more since. Before, once the view was two intervals old the
// key was Unreachable, and the policy local decided it from a bucket of its own, fresh:
// a client over its limit of 3 an hour was admitted 3 more times each time Redis went
// away (BenchmarkHostile, RLSIDECAR_HOSTILE_MODE=hybrid: the fourth login admitted,
// degraded). A key the view has room for is admitted from this daemon's allowance or is
// still Unreachable: only Redis knows whether other daemons took that room.
func TestHybridStaleLimitedKeyRefusedWhileRedisAway(t *testing.T) {
	rdb := standalone(t)
	for _, alg := range relimitAlgorithms {
		t.Run(fmt.Sprint(alg), func(t *testing.T) {
			h := liveHybrid(t, rdb, 100*time.Millisecond)
			lim := mustLimit(t, alg, 3, time.Hour)
			limited, roomy := fmt.Sprintf("rl:stale:{%v-limited}", alg), fmt.Sprintf("rl:stale:{%v-roomy}", alg)
			now := useUp(t, h, time.Now().UnixNano(), limited, lim, 3, 2)
			now = useUp(t, h, now, roomy, lim, 1, 0)
			// Redis stops answering: a sync failed after its last answer.
			m := h.masters.List()[0]
			m.syncFailed.Store(m.lastOK.Load() + 1)
			now += int64(time.Second) // both views stale (past two intervals)
			ops := []HybridOp{{Key: []byte(limited), Limit: lim, Cost: 1}}
			if h.Take(now, ops) {
				t.Fatalf("a client over its limit admitted while Redis is away: %+v", ops[0].Result)
			}
			if ops[0].Unreachable || ops[0].Result.RetryAfter <= 0 {
				t.Fatalf("refused as Unreachable (the failure policy decides, from a fresh bucket) or with no retry: unreachable %v, %+v",
					ops[0].Unreachable, ops[0].Result)
			}
			// A key with room is admitted from what this daemon holds of it, or left to the
			// policy: never refused by its view.
			ops = []HybridOp{{Key: []byte(roomy), Limit: lim, Cost: 1}}
			if !h.Take(now, ops) && !ops[0].Unreachable {
				t.Fatalf("a stale key with room refused by its view: %+v", ops[0].Result)
			}
			// Past the hour the view frees the limited key too: only Redis knows the rest.
			ops = []HybridOp{{Key: []byte(limited), Limit: lim, Cost: 1}}
			if h.Take(now+int64(time.Hour), ops) || !ops[0].Unreachable {
				t.Fatalf("an hour later: unreachable %v, want the policy to decide (%+v)", ops[0].Unreachable, ops[0].Result)
			}
		})
	}
}
