package sync

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

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
			h, key, lim := holdingGrant(t, rdb, alg, "room")
			// 7 free in Redis, 2 of them held by this daemon: a cost of 6 fits.
			if r := take(h, time.Now().UnixNano(), key, lim, 6); !r.Allowed || r.Remaining != 1 {
				t.Fatalf("cost 6 with 7 free (2 held by this daemon): %+v (retry %v); want allowed, 1 left",
					r, time.Duration(r.RetryAfter))
			}
		})
	}
}

// A key whose only units out are a grant this daemon holds, unused, is full: a question
// reads its whole capacity left and a reset of 0, as the exact mode reads a fresh key.
// Before, the reset was the view's, which counts the grant as spent: 7 left of 7 and a
// reset of most of the window (the daemon, driven with random inline limits: a sliding
// window of 7 per 600 s, remaining 7, reset_ms 533546).
func TestHybridHeldGrantOnlyIsFull(t *testing.T) {
	rdb := standalone(t)
	for _, alg := range []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow, localbucket.SlidingWindow} {
		t.Run(alg.String(), func(t *testing.T) {
			h, key, lim := holdingGrant(t, rdb, alg, "full")
			if r := take(h, time.Now().UnixNano(), key, lim, 0); !r.Allowed || r.Remaining != 7 || r.Reset != 0 {
				t.Fatalf("a question with nothing used (2 held by this daemon): %+v (reset %v); want 7 left, reset 0",
					r, time.Duration(r.Reset))
			}
		})
	}
}

// holdingGrant returns a daemon holding an unused grant of 2 units on key, a new key of
// 7 (lim, of alg): one exact sync for key and a key another daemon spent reserved them,
// and the request was refused. No periodic sync runs (Run is not started) and the
// interval is long: the view stays fresh, and the grant held, for the whole test.
func holdingGrant(t *testing.T, rdb redis.UniversalClient, alg localbucket.Algorithm, name string) (*Hybrid, string, *localbucket.Limit) {
	t.Helper()
	lim := mustLimit(t, alg, 7, hourWindow())
	one := mustLimit(t, localbucket.FixedWindow, 1, hourWindow())
	key := "rl:held" + name + ":{" + alg.String() + "}"
	full := "rl:held" + name + "-full:{" + alg.String() + "}"
	opts := HybridOptions{Interval: time.Hour, FetchWait: 5 * time.Second}
	if r := take(NewHybrid(rdb, opts), time.Now().UnixNano(), full, one, 1); !r.Allowed {
		t.Fatalf("another daemon's first request on a limit of 1: %+v", r)
	}
	h := NewHybrid(rdb, opts)
	ops := []HybridOp{
		{Key: []byte(key), Limit: lim, Cost: 2},
		{Key: []byte(full), Limit: one, Cost: 1},
	}
	if h.Take(time.Now().UnixNano(), ops) || ops[1].Result.Allowed {
		t.Fatalf("a request on a key another daemon spent: admitted %+v", ops)
	}
	return h, key, lim
}
