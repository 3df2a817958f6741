package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A question (cost 0) on a key new to Redis stores nothing there, as the protocol says
// of a question: a client probing random keys must not fill Redis. Before, each one
// left a hash (fields t and er, about 100 bytes) for 11 s: 200 questions, 200 keys. The
// answers are the empty key's, and a request after the questions is counted as before.
func TestHybridQuestionOnANewKeyStoresNothing(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	h := NewHybrid(rdb, HybridOptions{})
	algs := []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow, localbucket.SlidingWindow}
	now := time.Now().UnixNano()
	for i := range 200 {
		lim := mustLimit(t, algs[i%3], 5, hourWindow())
		if r := take(h, now, fmt.Sprintf("rl:ask:{k=%d}", i), lim, 0); !r.Allowed || r.Remaining != 5 {
			t.Fatalf("question %d on a new key: %+v, want allowed with 5 left", i, r)
		}
	}
	if h.Fetches() == 0 {
		t.Fatal("no question asked Redis: the test no longer tests the script")
	}
	syncAll(t, now, h)
	if n, err := rdb.DBSize(ctx).Result(); err != nil || n != 0 {
		t.Fatalf("200 questions on new keys left %d keys in Redis (%v), want 0", n, err)
	}
	// The key asked about is still counted once used, by this daemon and another.
	lim := mustLimit(t, localbucket.FixedWindow, 5, hourWindow())
	if r := take(h, now, "rl:ask:{k=1}", lim, 1); !r.Allowed {
		t.Fatalf("a request after the question: %+v", r)
	}
	syncAll(t, now, h)
	if v, err := rdb.HGet(ctx, "rl:ask:{k=1}", "n").Int(); err != nil || v != 1 {
		t.Fatalf("the key's count after one request: %d (%v), want 1", v, err)
	}
	b := NewHybrid(rdb, HybridOptions{})
	if r := take(b, now, "rl:ask:{k=1}", lim, 0); !r.Allowed || r.Remaining != 4 {
		t.Fatalf("another daemon's question on the used key: %+v, want allowed with 4 left", r)
	}
}
