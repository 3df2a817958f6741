package sync

import (
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// Peek (a check another rule or a ban refused) reports a stale view with no room for the
// op as the refusal it is, with its retry, as Take decides such a view without Redis:
// other daemons can only have used more since. Before, it was reported unasked, and a
// client banned for 3 s by another rule was told 2.9 s, to be refused by this rule's
// hour then (local and global mode said the hour; an outside audit's probe).
func TestHybridPeekStaleViewWithoutRoomRefuses(t *testing.T) {
	rdb := standalone(t)
	w := hourWindow()
	lim := mustLimit(t, localbucket.TokenBucket, 1, w)
	h := NewHybrid(rdb, HybridOptions{Interval: 50 * time.Millisecond, FetchWait: time.Second})
	now := time.Now().UnixNano()
	if r := take(h, now, "rl:user:{x}", lim, 1); !r.Allowed {
		t.Fatalf("the first check refused: %+v", r)
	}
	syncAll(t, now, h)
	later := now + int64(time.Second) // the view is stale
	ops := []HybridOp{{Key: []byte("rl:user:{x}"), Limit: lim, Cost: 1}}
	h.Peek(later, ops)
	if r := ops[0].Result; r.Allowed || r.RetryAfter < int64(w)-int64(2*time.Second) {
		t.Fatalf("a stale view of a spent key of 1 a %v: %+v; want refused with the refill's retry", w, r)
	}
	// One with room is not decided by it: its key may have been spent elsewhere since.
	ops = []HybridOp{{Key: []byte("rl:user:{y}"), Limit: mustLimit(t, localbucket.TokenBucket, 5, w), Cost: 1}}
	if r := take(h, now, "rl:user:{y}", ops[0].Limit, 1); !r.Allowed {
		t.Fatalf("y's first check refused: %+v", r)
	}
	syncAll(t, now, h)
	h.Peek(later, ops)
	if r := ops[0].Result; r.Allowed || r.RetryAfter != 0 || r.Remaining != 0 {
		t.Fatalf("a stale view with room: %+v; want its limit only (unasked)", r)
	}
}
