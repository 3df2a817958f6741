package sync

import (
	"context"
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A client that used its limit, paused, and came back once the limit allows it again is
// admitted as the exact mode admits it (one daemon alone, each answer beside the local
// bucket's to the same requests at the same times). The pause outlasts two sync
// intervals, so the key's view is stale and clean: the key has cooled. Before, the last
// sync's share grant (asked for the burst's demand) kept it hot: the units the growth of
// its view allowed made it dirty, dirty made it hot, and a hot key waits for its next
// periodic sync: 5 per second, 5 used, a second's pause, then 2 admitted (1 for a
// sliding window) and the rest refused, each told to retry in 1 ms (the view a second
// old), in every trial.
func TestHybridBurstAgainAfterAFullWindow(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	runHybrid(t, h, "d")
	rnd := rand.New(rand.NewSource(5))
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.TokenBucket, localbucket.SlidingWindow} {
		{
			const pause = time.Second + 20*time.Millisecond
			lim := mustLimit(t, alg, 5, time.Second)
			for trial := range 2 {
				key := fmt.Sprintf("rl:again:{%d-%d-%d}", alg, trial, time.Now().UnixNano())
				time.Sleep(time.Duration(rnd.Int63n(int64(time.Second)))) // any phase of the window
				var st localbucket.State
				var log strings.Builder
				bad := 0
				step := func() {
					now := time.Now().UnixNano()
					r := take(h, now, key, lim, 1)
					var want localbucket.Result
					st, want = lim.Take(st, now, 1)
					fmt.Fprintf(&log, " %v", r.Allowed)
					if want.Allowed && !r.Allowed {
						fmt.Fprintf(&log, "(exact: admitted; retry %v)", time.Duration(r.RetryAfter))
						bad++
					}
				}
				for range 6 {
					step()
				}
				time.Sleep(pause)
				log.WriteString(" |")
				for range 6 {
					step()
				}
				if bad > 0 {
					t.Errorf("%v, a pause of %v, trial %d: %d refused that the exact mode admits:%s", alg, pause, trial, bad, log.String())
				}
			}
		}
	}
}

// A client that used a fixed window's limit just before the window ended is admitted
// the new window's limit just after it (one daemon alone, each answer beside the local
// bucket's), and the refusal before the turn says the window's end, when a retry
// passes. The key's periodic sync falls between (it asks a share grant for the burst's
// demand, and gets none: the window is used) or after the turn. Before, the burst's
// demand kept the key hot across the turn: 2 or 3 of 5 admitted, the rest refused until
// the key's next sync; and the refusal before the turn said the next sync (100 ms)
// where the window ended 50 ms later.
func TestHybridFixedWindowBurstAfterTheTurn(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	ctx := context.Background()
	const window = time.Second
	w := int64(window)
	lim := mustLimit(t, localbucket.FixedWindow, 5, window)
	ran := 0
	for trial := 0; trial < 8 && ran < 4; trial++ {
		key := fmt.Sprintf("rl:again-turn:{%d-%d}", trial, time.Now().UnixNano())
		sleepUntilBeforeTheEnd(window, 50*time.Millisecond)
		var st localbucket.State
		var log strings.Builder
		bad := 0
		var last localbucket.Result
		step := func() {
			now := time.Now().UnixNano()
			r := take(h, now, key, lim, 1)
			var want localbucket.Result
			st, want = lim.Take(st, now, 1)
			fmt.Fprintf(&log, " %v", r.Allowed)
			if want.Allowed && !r.Allowed {
				fmt.Fprintf(&log, "(exact: admitted; retry %v)", time.Duration(r.RetryAfter))
				bad++
			}
			// Not past the window's end, but for the view's sync's duration (added to
			// every retry, so that none is early by it) and a few ms.
			if lag := lagNs(entryOf(h, key).lag); !r.Allowed && !want.Allowed &&
				r.RetryAfter > want.RetryAfter+lag+int64(5*time.Millisecond) {
				fmt.Fprintf(&log, "(retry %v, the window ends in %v, the sync took up to %v)",
					time.Duration(r.RetryAfter), time.Duration(want.RetryAfter), time.Duration(lag))
				bad++
			}
			last = r
		}
		for range 6 {
			step()
		}
		// The periodic sync: before the turn in odd trials, at it in even ones.
		sync := func() {
			if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
				t.Fatal(err)
			}
			log.WriteString(" (sync)")
		}
		if trial%2 == 1 {
			sync()
		}
		if time.Now().UnixNano()%w < w/2 {
			continue // the machine slept through the turn: not this case
		}
		time.Sleep(time.Duration(last.RetryAfter))
		log.WriteString(" |")
		if trial%2 == 0 {
			sync()
		}
		for range 6 {
			step()
		}
		ran++
		if bad > 0 {
			t.Errorf("trial %d: %d answers unlike the exact mode's:%s", trial, bad, log.String())
		}
	}
	if ran == 0 {
		t.Fatal("no trial ran: the machine slept through every turn")
	}
}

// Units admitted here just before a fixed window ended, on credit, and not synced by the
// turn are counted in the window they were admitted in, though the client's requests go
// on after the turn: the new window's limit is the client's. The key's periodic sync
// dates what it carries by its last admission; before, the units admitted after the
// turn carried the ones before it into the new window: 10 a second, 4 on credit 30 ms
// before the end, then 7 of 10 admitted after it (and 1,000 per 2 s sent at once from
// 26 ms before the end through a daemon: about 600 in the new window, where the exact
// mode admits 1,000).
func TestHybridUnitsBeforeTheTurnStayInTheirWindow(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	ctx := context.Background()
	const window = time.Second
	w := int64(window)
	lim := mustLimit(t, localbucket.FixedWindow, 10, window)
	ran := 0
	for trial := 0; trial < 6 && ran < 3; trial++ {
		key := fmt.Sprintf("rl:turn-units:{%d-%d}", trial, time.Now().UnixNano())
		sleepUntilBeforeTheEnd(window, 30*time.Millisecond)
		before := 0
		for range 5 {
			if take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
				before++
			}
		}
		if time.Now().UnixNano()%w < w/2 {
			continue // the machine slept through the turn: not this case
		}
		if e := entryOf(h, key); e.pending <= uint64(e.grant) {
			t.Fatalf("trial %d: nothing admitted on credit before the turn (pending %d, grant %d)", trial, e.pending, e.grant)
		}
		now := time.Now().UnixNano()
		time.Sleep(time.Duration(w - now%w + int64(5*time.Millisecond)))
		after := 0
		for range 12 {
			if take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
				after++
			}
		}
		if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
			t.Fatal(err)
		}
		n, _ := rdb.HGet(ctx, key, "n").Int()
		ran++
		if before != 5 || after != 10 || n != 10 {
			t.Errorf("trial %d: %d of 5 admitted before the turn, %d of 12 after it (the exact mode: 5, 10); Redis counts %d in the new window",
				trial, before, after, n)
		}
	}
	if ran == 0 {
		t.Fatal("no trial ran: the machine slept through every turn")
	}
}

// sleepUntilBeforeTheEnd sleeps until d before the end of a window of length w (the
// next one's, if this one's is nearer than d).
func sleepUntilBeforeTheEnd(w, d time.Duration) {
	now := time.Now().UnixNano()
	wait := int64(w) - now%int64(w) - int64(d)
	if wait < 0 {
		wait += int64(w)
	}
	time.Sleep(time.Duration(wait))
}

// The same for a sliding window: units admitted on credit just before its window ended
// count as the previous window's in the next, weighing less as it goes, and the client
// is admitted as the exact mode admits it after the turn (each answer beside the local
// bucket's), then 300 ms later as the previous window's share has fallen. Before, they
// counted whole in the new window: 1,000 per 2 s sent at once through a daemon from 30
// ms before the turn, 1,001 admitted and told 1,960 ms, where the exact mode admitted
// 1,040 and said 1-5 ms.
func TestHybridSlidingUnitsBeforeTheTurn(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	const window = time.Second
	w := int64(window)
	lim := mustLimit(t, localbucket.SlidingWindow, 100, window)
	ran := 0
	for trial := 0; trial < 6 && ran < 3; trial++ {
		key := fmt.Sprintf("rl:slide-turn:{%d-%d}", trial, time.Now().UnixNano())
		sleepUntilBeforeTheEnd(window, 30*time.Millisecond)
		var st localbucket.State
		bad, first := 0, ""
		step := func(phase string) bool {
			now := time.Now().UnixNano()
			r := take(h, now, key, lim, 1)
			var want localbucket.Result
			st, want = lim.Take(st, now, 1)
			if want.Allowed && !r.Allowed {
				if bad++; first == "" {
					first = fmt.Sprintf("%s: refused with retry %v at %v into the window", phase, time.Duration(r.RetryAfter), time.Duration(now%w))
				}
			}
			return want.Allowed
		}
		// A unit by an exact sync (the key new here), then on credit.
		for range 20 {
			step("before the turn")
		}
		if time.Now().UnixNano()%w < w/2 {
			continue // the machine slept through the turn: not this case
		}
		if e := entryOf(h, key); e.pending <= uint64(e.grant) {
			t.Fatalf("trial %d: nothing admitted on credit before the turn (pending %d, grant %d)", trial, e.pending, e.grant)
		}
		now := time.Now().UnixNano()
		time.Sleep(time.Duration(w - now%w + int64(5*time.Millisecond)))
		for n := 0; step("after the turn") && n < 200; n++ {
		}
		time.Sleep(300 * time.Millisecond)
		for range 10 {
			step("300 ms later")
		}
		ran++
		if bad > 0 {
			t.Errorf("trial %d: %d refused that the exact mode admits; the first %s", trial, bad, first)
		}
	}
	if ran == 0 {
		t.Fatal("no trial ran: the machine slept through every turn")
	}
}
