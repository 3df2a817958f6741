package sync

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A request refused on a fresh view that has no room for it (one daemon alone on the
// key) is retried at its retry and passes, whatever syncs come between. An audit: 5 per
// 500 ms, a cost of 1, then at once a cost of 5: refused, retry 100 ms; the periodic
// sync in between took the refusal for demand beyond the allowance and asked a share
// grant (2 units, sized for two daemons), which made the key hot: the retry, at ~102 ms,
// was refused again (remaining 4, reset 0, retry 199 ms), and passed at ~305 ms. The
// exact mode admits the whole bucket 100 ms after the first unit.
func TestHybridRetryPassesAfterASyncBetween(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	lim := mustLimit(t, localbucket.TokenBucket, 5, 500*time.Millisecond)
	// Three trials whose cost of 5 came within the refill of the first unit (100 ms): a
	// 2-core machine under load may stop the test for that long between the two (a stall
	// of 110 ms there made by hand: "1 + 5 of 5 admitted at once"), and the exact mode
	// then admits the 5 too. Such a trial proves nothing, and another is run in its place.
	const trials, most = 3, 10
	valid := 0
	for trial := 0; valid < trials; trial++ {
		if trial == most {
			t.Fatalf("in %d trials, %d had the cost of 5 within 100 ms of the first unit; want %d", most, valid, trials)
		}
		key := fmt.Sprintf("rl:retry-sync-between:{%d-%d}", trial, time.Now().UnixNano())
		t0 := time.Now().UnixNano()
		if r := take(h, t0, key, lim, 1); !r.Allowed {
			t.Fatalf("trial %d: the first unit refused: %+v", trial, r)
		}
		syncAll(t, time.Now().UnixNano(), h) // the key's first view (Run's kick)
		now := time.Now().UnixNano()
		r := take(h, now, key, lim, 5)
		if r.Allowed {
			st, _ := lim.Take(localbucket.State{}, t0, 1)
			if _, exact := lim.Take(st, now, 5); exact.Allowed {
				t.Logf("trial %d: the cost of 5 came %v after the first unit, past the refill: another trial", trial, time.Duration(now-t0))
				continue
			}
			t.Fatalf("trial %d: 1 + 5 of 5 admitted at once: %+v", trial, r)
		}
		valid++
		time.Sleep(40 * time.Millisecond)
		syncAll(t, time.Now().UnixNano(), h) // the periodic sync, before the retry
		time.Sleep(time.Duration(r.RetryAfter) - 40*time.Millisecond)
		now = time.Now().UnixNano()
		if again := take(h, now, key, lim, 5); !again.Allowed {
			t.Errorf("trial %d: refused with retry %v; retried %v after the first unit: refused again %+v",
				trial, time.Duration(r.RetryAfter), time.Duration(now-t0), again)
		}
	}
}
