package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// TestHybridEvictedLimitedKeyGetsNoFirstUnit: more clients over their limit than the
// daemon keeps keys (--max-keys). A key evicted and seen again is a key new to the
// daemon, which used to admit a unit before its first sync: 2,000 clients of a limit of
// 4 an hour, 10 requests each through 640 keys, were admitted 19,169 of 20,000 (Redis
// counted up to 10 a client). Now a shard that forgot a key not yet full gives its new
// keys no such unit until that key would be full again: each is decided by an exact
// sync, as the global mode decides it. What is admitted is the limit, plus the units
// eviction dropped before they reached Redis (counted in Dropped; a separate loss).
func TestHybridEvictedLimitedKeyGetsNoFirstUnit(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	h := NewHybrid(rdb, HybridOptions{MaxKeys: 640})
	const limit, clients, visits = 4, 2000, 10
	lim := mustLimit(t, localbucket.FixedWindow, limit, hourWindow())
	now := time.Now().UnixNano()
	admitted := 0
	for v := 0; v < visits; v++ {
		for k := 0; k < clients; k++ {
			if take(h, now, fmt.Sprintf("rl:evict:{user=%d}", k), lim, 1).Allowed {
				admitted++
			}
			if k%20 == 0 { // a sync every 20 new keys, as Run's early syncs
				if err := h.Flush(ctx, now); err != nil {
					t.Fatal(err)
				}
			}
			now += int64(time.Millisecond)
		}
	}
	if err := h.Flush(ctx, now); err != nil {
		t.Fatal(err)
	}
	if h.Evicted() == 0 {
		t.Fatal("nothing was evicted: the test does not test eviction")
	}
	if bound := clients*limit + int(h.Dropped()); admitted > bound {
		t.Fatalf("%d clients of a limit of %d, %d requests each, through %d keys: admitted %d, at most %d (the limit, plus %d units eviction dropped); %d evictions",
			clients, limit, visits, 640, admitted, bound, h.Dropped(), h.Evicted())
	}
	t.Logf("admitted %d of %d requests (limit %d; %d dropped, %d evicted)", admitted, clients*visits, clients*limit, h.Dropped(), h.Evicted())
}
