package sync

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// One daemon alone on a token bucket is not held to the exact mode's pace: a key hot
// here (its demand outran its allowance) gets, at its next sync, a share grant of the
// key's headroom over the next interval, what it can admit now plus the interval's
// refill, which the daemon may spend at once. So alone it admits up to one interval's
// refill ahead (r × I, the bound's term in docs/accuracy.md), never more. An audit
// measured it: 10 per 1 s, the 11th admitted at ~54 ms where the exact mode's comes at
// 100 ms, 30 in 2 s against 29; with a sync interval of 1 s, 10 per 10 s, the 11th at
// 164–664 ms, 13 against 12. Here: 10 per 1 s used at once, three more refused (the key
// hot), one sync: the 11th is admitted within the first interval, and nothing more
// until the refill has paid for it.
func TestHybridAloneShareGrantIsOneIntervalAhead(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second}) // interval 100 ms
	lim := mustLimit(t, localbucket.TokenBucket, 10, time.Second)
	for trial, slow := 0, 0; trial < 3; trial++ {
		key := fmt.Sprintf("rl:alone-ahead:{%d-%d}", trial, time.Now().UnixNano())
		var st localbucket.State // the exact mode's answer to the same requests
		got, want := 0, 0
		t0 := time.Now().UnixNano()
		step := func(now int64) {
			if take(h, now, key, lim, 1).Allowed {
				got++
			}
			var w localbucket.Result
			if st, w = lim.Take(st, now, 1); w.Allowed {
				want++
			}
		}
		// At one instant: on a busy machine 13 requests read from the clock spanned more
		// than the 100 ms in which the bucket refills a unit, and the exact mode admitted 11.
		for range 13 {
			step(t0)
		}
		// Redis decides on its own clock: a burst whose exact syncs spanned 100 ms or more
		// (a -race run on a loaded machine) found a unit refilled there, and the hybrid
		// mode rightly admitted 11 where the exact mode at one instant admits 10. Such a
		// trial shows nothing: it is run again on a new key (a few times at most).
		if span := time.Now().UnixNano() - t0; span >= int64(100*time.Millisecond) && slow < 5 {
			t.Logf("trial %d: the 13 requests took %v, past a unit's refill: again", trial, time.Duration(span))
			slow++
			trial--
			continue
		}
		if got != 10 || want != 10 {
			t.Fatalf("trial %d: 13 requests at once: hybrid admitted %d, exact %d; want 10", trial, got, want)
		}
		syncAll(t, time.Now().UnixNano(), h) // a share grant for the hot key
		for time.Now().UnixNano()-t0 < int64(90*time.Millisecond) {
			step(time.Now().UnixNano())
			time.Sleep(time.Millisecond)
		}
		// One interval's refill (1 unit) ahead at most; the audit's 11th is that unit.
		if got > want+1 {
			t.Errorf("trial %d: in 90 ms alone hybrid admitted %d, the exact mode %d: more than one interval's refill ahead", trial, got, want)
		}
		t.Logf("trial %d: in 90 ms, hybrid %d, exact %d", trial, got, want)
		for time.Now().UnixNano()-t0 < int64(300*time.Millisecond) {
			step(time.Now().UnixNano())
			time.Sleep(time.Millisecond)
		}
		if got > want+1 {
			t.Errorf("trial %d: in 300 ms alone hybrid admitted %d, the exact mode %d", trial, got, want)
		}
	}
}
