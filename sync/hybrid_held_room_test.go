package sync

import (
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A key whose room is partly the grant this daemon holds (an exact sync reserved it for
// a request another key refused) admits a request that room covers: decided by an exact
// sync, as the exact mode admits it. Before, the grant held was left out of the room:
// the request was refused from the view, with a retry for the units the view lacked
// (a token bucket: minutes) or the window's end, where the key had them free. Found by
// driving the daemon with random inline limits: 5 per 10 min, burst 7, 4 left, a cost of 3
// refused with retry 120 s; a fixed window of 8 with 2 left, a cost of 2 told its end.
func TestHybridHeldGrantIsRoom(t *testing.T) {
	rdb := standalone(t)
	for _, alg := range []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow, localbucket.SlidingWindow} {
		t.Run(alg.String(), func(t *testing.T) {
			lim := mustLimit(t, alg, 7, hourWindow())
			one := mustLimit(t, localbucket.FixedWindow, 1, hourWindow())
			key := "rl:heldroom:{" + alg.String() + "}"
			full := "rl:heldroom-full:{" + alg.String() + "}"
			// No periodic sync (Run is not started) and a long interval: each view stays
			// fresh, and the grant stays held, for the whole test.
			opts := HybridOptions{Interval: time.Hour, FetchWait: 5 * time.Second}
			other := NewHybrid(rdb, opts)
			if r := take(other, time.Now().UnixNano(), full, one, 1); !r.Allowed {
				t.Fatalf("another daemon's first request on a limit of 1: %+v", r)
			}
			h := NewHybrid(rdb, opts)
			// Both keys new here: one exact sync for both reserves 2 of key for this
			// daemon and finds full spent; the request is refused, the grant held.
			ops := []HybridOp{
				{Key: []byte(key), Limit: lim, Cost: 2},
				{Key: []byte(full), Limit: one, Cost: 1},
			}
			if h.Take(time.Now().UnixNano(), ops) || ops[1].Result.Allowed {
				t.Fatalf("a request on a key another daemon spent: admitted %+v", ops)
			}
			// 7 free in Redis, 2 of them held by this daemon: a cost of 6 fits.
			if r := take(h, time.Now().UnixNano(), key, lim, 6); !r.Allowed || r.Remaining != 1 {
				t.Fatalf("cost 6 with 7 free (2 held by this daemon): %+v (retry %v); want allowed, 1 left",
					r, time.Duration(r.RetryAfter))
			}
		})
	}
}
