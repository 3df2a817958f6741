package sync

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

var relimitAlgorithms = []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow, localbucket.SlidingWindow}

// useUp makes used requests on key under lim and refuses extra more (a client at its
// limit), syncing as a daemon's run loop would: once after the key's first request (its
// first view) and once at the end. It returns the daemon clock after them.
func useUp(t *testing.T, h *Hybrid, now int64, key string, lim *localbucket.Limit, used, extra int) int64 {
	t.Helper()
	for i := 0; i < used+extra; i++ {
		now += int64(time.Millisecond)
		r := take(h, now, key, lim, 1)
		if want := i < used; r.Allowed != want {
			t.Fatalf("request %d under %d: allowed %v, want %v", i+1, lim.Requests(), r.Allowed, want)
		}
		if i == 0 {
			syncAll(t, now, h)
		}
	}
	syncAll(t, now, h)
	return now
}

// admitted counts the requests of n on key under lim that h admits at now, one after the
// other, failing the test if one is refused only because Redis did not answer.
func admitted(t *testing.T, h *Hybrid, now int64, key string, lim *localbucket.Limit, n int) int {
	t.Helper()
	got := 0
	for i := 0; i < n; i++ {
		ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}}
		if h.Take(now, ops) {
			got++
		} else if ops[0].Unreachable {
			t.Fatalf("request %d: refused as Redis not answering (degraded): %+v", i+1, ops[0].Result)
		}
	}
	return got
}

// README, "Operating it: reloads": raised from 10 to 20 per hour, a client that used its
// 10 gets 10 more at once, in every mode. In hybrid mode a client that had used its whole
// budget got half the difference (the credit a raise adds to the view, ⌊V ÷ 2N⌋), and
// the rest was refused, not degraded, until the next sync: the key was still "hot" from
// its demand under the old limit, whose share grant had come back empty, so a request the
// raised view had room for waited for a share grant instead of an exact sync. The
// refusals said reset 4,497 s, more than a whole bucket of the new limit (the view's time
// to full, at the old emission interval, plus the new units at the new one).
func TestHybridRaisedLimitGivesTheDifference(t *testing.T) {
	rdb := standalone(t)
	for _, alg := range relimitAlgorithms {
		for _, c := range []struct {
			name           string
			from, to, used int
			idle           time.Duration // between the last use and the raise
		}{
			{"full", 10, 20, 10, 0},
			{"full-stale-view", 10, 20, 10, 1500 * time.Millisecond}, // the audit's wait: the view is past 2 intervals
			{"full-x4", 10, 40, 10, 0},
			{"full-4-to-100", 4, 100, 4, 0},
			{"partial", 10, 20, 8, 0},
		} {
			t.Run(fmt.Sprintf("%v/%s", alg, c.name), func(t *testing.T) {
				h := liveHybrid(t, rdb, 100*time.Millisecond)
				old, raised := mustLimit(t, alg, uint64(c.from), time.Hour), mustLimit(t, alg, uint64(c.to), time.Hour)
				key := fmt.Sprintf("rl:raise:{%v-%s}", alg, c.name)
				extra := 0
				if c.used == c.from {
					extra = 2 // at its limit: refused twice, the key is hot here
				}
				now := useUp(t, h, time.Now().UnixNano(), key, old, c.used, extra)
				if extra > 0 {
					sh := &h.shards[h.shardOf([]byte(key))]
					sh.mu.Lock()
					hot := sh.m[key].lastDemand >= 2
					sh.mu.Unlock()
					if !hot {
						t.Fatal("the key is not hot before the raise: the test shows nothing")
					}
				}
				now += int64(c.idle)
				// The first request under the raised limit, decided locally: a token
				// bucket's reset counts the units used at the new rate (the view's time to
				// full, kept at the old rate, said 75 minutes after 10 of 10 raised to 20).
				r := take(h, now, key, raised, 1)
				if !r.Allowed {
					t.Fatalf("the first request after the raise refused: %+v", r)
				}
				if alg == localbucket.TokenBucket && r.Reset > time.Hour.Nanoseconds() {
					t.Fatalf("the first request after the raise: reset %v, more than a whole bucket (an hour)", time.Duration(r.Reset))
				}
				if got, want := 1+admitted(t, h, now, key, raised, c.to-1), c.to-c.used; got != want {
					t.Fatalf("raised from %d to %d after %d used: %d admitted at once, want %d", c.from, c.to, c.used, got, want)
				}
				// Refused now, as the exact mode refuses it: nothing left, and (a token
				// bucket) full again in at most a whole bucket of the new limit (the old
				// view's time to full, at the old rate, said more).
				r = take(h, now, key, raised, 1)
				if r.Allowed || r.Remaining != 0 {
					t.Fatalf("the next request: %+v; want refused, 0 left", r)
				}
				if alg == localbucket.TokenBucket && r.Reset > time.Hour.Nanoseconds() {
					t.Fatalf("the next request: reset %v, more than a whole bucket (an hour)", time.Duration(r.Reset))
				}
				// Redis counts the limit, no more: another daemon finds nothing left.
				syncAll(t, now, h)
				b := liveHybrid(t, rdb, 100*time.Millisecond)
				if r := take(b, now, key, raised, 0); r.Allowed || r.Remaining != 0 {
					t.Fatalf("another daemon, asking Redis: %+v; want nothing left", r)
				}
			})
		}
	}
}

// README: lowered from 20 to 10 after 15, the client's bucket is empty and refills at the
// new rate (a token bucket: full again in one hour, not in 1.5, as 15 units at the new
// rate would say); a window counts its 15 against 10 until it ends. So too when the last
// of the 15 were admitted just before the reload and reach Redis after it (pending): they
// were charged at the new rate on top of the bucket cut to a whole one, 4 units of debt,
// 24 minutes more of refusals than the local mode's.
func TestHybridLoweredLimitEmptiesTheBucket(t *testing.T) {
	rdb := standalone(t)
	for _, alg := range relimitAlgorithms {
		for _, pending := range []int{0, 4} {
			if pending > 0 && alg != localbucket.TokenBucket {
				continue // a window's count is never cut: nothing to show
			}
			t.Run(fmt.Sprintf("%v/pending-%d", alg, pending), func(t *testing.T) {
				h := liveHybrid(t, rdb, 100*time.Millisecond)
				old, lowered := mustLimit(t, alg, 20, time.Hour), mustLimit(t, alg, 10, time.Hour)
				key := fmt.Sprintf("rl:lower:{%v-%d}", alg, pending)
				now := useUp(t, h, time.Now().UnixNano(), key, old, 15-pending, 0)
				if got := admitted(t, h, now, key, old, pending); got != pending {
					t.Fatalf("%d of the last %d admitted before the reload", got, pending)
				}
				if got := admitted(t, h, now, key, lowered, 10); got != 0 {
					t.Fatalf("lowered from 20 to 10 after 15 used: %d admitted, want 0", got)
				}
				syncAll(t, now, h)
				b := liveHybrid(t, rdb, 100*time.Millisecond)
				r := take(b, now, key, lowered, 0)
				if r.Allowed || r.Remaining != 0 {
					t.Fatalf("another daemon, asking Redis: %+v; want nothing left", r)
				}
				if alg == localbucket.TokenBucket && (r.Reset > time.Hour.Nanoseconds() || r.Reset < time.Hour.Nanoseconds()-int64(time.Minute)) {
					t.Fatalf("another daemon, asking Redis: reset %v; want an hour (an empty bucket at the new rate)", time.Duration(r.Reset))
				}
			})
		}
	}
}

// Two daemons share a client's key across a raise that reaches their reloads at
// different times. In between, the daemon still on the old limit finds the key over its
// limit (the units the other admitted under the new one) and refuses; its syncs then
// must not forgive those units: every sync of it capped the count at its own (old)
// limit, so the daemon on the new limit found room again, and the client got 30 of 20
// an hour once both had reloaded (10 more per sync of the old daemon while it lagged).
func TestHybridRaiseReachesDaemonsApart(t *testing.T) {
	rdb := standalone(t)
	for _, alg := range relimitAlgorithms {
		t.Run(alg.String(), func(t *testing.T) {
			a := liveHybrid(t, rdb, 100*time.Millisecond)
			b := liveHybrid(t, rdb, 100*time.Millisecond)
			old, raised := mustLimit(t, alg, 10, time.Hour), mustLimit(t, alg, 20, time.Hour)
			key := fmt.Sprintf("rl:apart:{%v}", alg)
			now := time.Now().UnixNano()
			if got := admitted(t, a, now, key, old, 12); got != 10 {
				t.Fatalf("%d of 10 admitted before the raise", got)
			}
			syncAll(t, now, a)
			// b has seen the client too (a question: its view, nothing reserved).
			if r := take(b, now, key, old, 0); r.Allowed {
				t.Fatalf("daemon b, asking, 10 of 10 used: %+v", r)
			}
			// a reloads first: the difference at once.
			if got := admitted(t, a, now, key, raised, 15); got != 10 {
				t.Fatalf("daemon a, raised to 20 after 10 used: %d admitted, want 10", got)
			}
			syncAll(t, now, a)
			// b has not reloaded: the key is over its limit of 10. Its syncs come and go.
			for i := 0; i < 3; i++ {
				now += int64(time.Millisecond)
				if got := admitted(t, b, now, key, old, 3); got != 0 {
					t.Fatalf("daemon b, still at 10, 20 used: %d admitted", got)
				}
				syncAll(t, now, b, a)
				if got := admitted(t, a, now, key, raised, 3); got != 0 {
					t.Fatalf("daemon a, at 20, 20 used, after b's sync %d: %d admitted", i+1, got)
				}
				syncAll(t, now, a)
			}
			// b reloads: nothing left on either.
			if got := admitted(t, b, now, key, raised, 5) + admitted(t, a, now, key, raised, 5); got != 0 {
				t.Fatalf("both at 20, 20 used: %d admitted", got)
			}
			syncAll(t, now, a, b)
			c := liveHybrid(t, rdb, 100*time.Millisecond)
			if r := take(c, now, key, raised, 0); r.Allowed || r.Remaining != 0 {
				t.Fatalf("a third daemon, asking Redis: %+v; want nothing left", r)
			}
		})
	}
}
