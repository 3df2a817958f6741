package localbucket

import (
	"math"
	"strings"
	"testing"
	"time"
)

// base is an instant aligned to a whole day (2023-11-14 00:00:00 UTC), so windows of
// whole seconds start on it.
const base = int64(1_699_920_000) * int64(time.Second)

const (
	ms = int64(time.Millisecond)
	s1 = int64(time.Second)
)

func mustLimit(t testing.TB, alg Algorithm, requests uint64, window time.Duration, burst uint64) *Limit {
	t.Helper()
	l, err := NewLimit(alg, requests, window, burst)
	if err != nil {
		t.Fatal(err)
	}
	return &l
}

// step is one Take at base+at; want is compared field by field, except Expires and
// LimitedUntil (checked by the property tests).
type step struct {
	at   int64
	cost uint64
	want Result
}

func runSteps(t *testing.T, l *Limit, steps []step) {
	t.Helper()
	var s State
	for i, st := range steps {
		var r Result
		s, r = l.Take(s, base+st.at, st.cost)
		r.Expires, r.LimitedUntil = 0, 0
		st.want.Limit = l.Requests()
		if r != st.want {
			t.Errorf("step %d (t=%v cost %d):\n got %+v\nwant %+v", i, time.Duration(st.at), st.cost, r, st.want)
		}
	}
}

func allow(rem uint64, reset int64) Result {
	return Result{Allowed: true, Remaining: rem, Reset: reset}
}
func reject(rem uint64, reset, retry int64) Result {
	return Result{Remaining: rem, Reset: reset, RetryAfter: retry}
}
func impossible(rem uint64, reset int64) Result {
	return Result{Impossible: true, Remaining: rem, Reset: reset}
}

func TestTokenBucketSteps(t *testing.T) {
	// 10 per second, burst 10: one token every 100ms.
	runSteps(t, mustLimit(t, TokenBucket, 10, time.Second, 0), []step{
		{0, 1, allow(9, 100*ms)},                  // a fresh bucket is full
		{0, 9, allow(0, 1000*ms)},                 // burst
		{0, 1, reject(0, 1000*ms, 100*ms)},        // empty
		{0, 0, reject(0, 1000*ms, 100*ms)},        // peek is judged as cost 1
		{50 * ms, 1, reject(0, 950*ms, 50*ms)},    // half a token
		{100 * ms, 1, allow(0, 1000*ms)},          // refilled one
		{350 * ms, 0, allow(2, 750*ms)},           // peek: 2.5 tokens, nothing consumed
		{200 * ms, 0, allow(1, 900*ms)},           // clock back: fewer tokens, not more
		{200 * ms, 2, reject(1, 900*ms, 100*ms)},  // retry when the 2nd token is there
		{-5 * s1, 1, reject(0, 6100*ms, 5200*ms)}, // far back: clamped, never creates tokens
		{350 * ms, 11, impossible(2, 750*ms)},     // more than the burst: never
		{5 * s1, 0, allow(10, 0)},                 // full again
		{5 * s1, 10, allow(0, 1000*ms)},           // whole burst at once
	})
	// 1 per second with burst 5.
	runSteps(t, mustLimit(t, TokenBucket, 1, time.Second, 5), []step{
		{0, 5, allow(0, 5*s1)},
		{0, 1, reject(0, 5*s1, 1*s1)},
		{2500 * ms, 2, allow(0, 4500*ms)},
		{2500 * ms, 6, impossible(0, 4500*ms)},
		{4000 * ms, 1, allow(1, 4*s1)}, // 9s-8s: one token left
	})
}

func TestFixedWindowSteps(t *testing.T) {
	runSteps(t, mustLimit(t, FixedWindow, 10, time.Second, 0), []step{
		{990 * ms, 0, allow(10, 0)},                // peek on a fresh key
		{990 * ms, 10, allow(0, 10*ms)},            // burst up to the limit
		{990 * ms, 1, reject(0, 10*ms, 10*ms)},     // until the window ends
		{1010 * ms, 10, allow(0, 990*ms)},          // a new window
		{1500 * ms, 0, reject(0, 500*ms, 500*ms)},  // peek judged as cost 1
		{500 * ms, 1, reject(0, 1500*ms, 1500*ms)}, // clock back: stays in the newer window
		{2000 * ms, 3, allow(7, 1000*ms)},          // next window
		{2000 * ms, 11, impossible(7, 1000*ms)},    // more than the limit
		{2999 * ms, 7, allow(0, 1*ms)},
		{3500 * ms, 0, allow(10, 0)}, // empty again
	})
}

func TestSlidingWindowSteps(t *testing.T) {
	runSteps(t, mustLimit(t, SlidingWindow, 10, time.Second, 0), []step{
		{990 * ms, 0, allow(10, 0)},
		// estimate 10 until 1.9s, 0 from 1.9s+1ns on (floor(10*r/1s) = 0 for r < 100ms).
		{990 * ms, 10, allow(0, 910*ms+1)},
		// At 1s the previous window weighs 10*1s/1s = 10; at 1s+1ns floor(9.99...) = 9.
		{990 * ms, 1, reject(0, 910*ms+1, 10*ms+1)},
		// At 1.01s the estimate is floor(10*0.99) = 9: one more passes.
		{1010 * ms, 1, allow(0, 990*ms+1)},
		// prev 10, cur 1: floor(10*r/1s)+1 <= 9 needs r < 900ms: at 1.1s+1ns.
		{1010 * ms, 1, reject(0, 990*ms+1, 90*ms+1)},
		{1100 * ms, 1, reject(0, 900*ms+1, 1)},
		{1100*ms + 1, 1, allow(0, 1400*ms)}, // cur 2 weighs until floor(2*r/1s) = 0 at 2.5s+1ns
		// clock back into the previous window: clamped to the current one, the estimate
		// there is the highest.
		{500 * ms, 0, reject(0, 2000*ms+1, 700*ms+1)},
		{1500 * ms, 2, allow(1, 1250*ms+1)}, // 10*0.5 + 2 = 7, +2 = 9
		{1500 * ms, 11, impossible(1, 1250*ms+1)},
		{2600 * ms, 0, allow(9, 150*ms+1)}, // prev 4 weighs floor(4*0.4) = 1
		{5 * s1, 0, allow(10, 0)},
	})
}

// TestBoundary is the classic check: 10 per second, 10 requests at 0.99s and 10 more at
// 1.01s.
func TestBoundary(t *testing.T) {
	for _, tc := range []struct {
		alg  Algorithm
		want int
	}{
		{FixedWindow, 20},
		{SlidingWindow, 11},
		{TokenBucket, 10},
	} {
		t.Run(tc.alg.String(), func(t *testing.T) {
			l := mustLimit(t, tc.alg, 10, time.Second, 0)
			var s State
			n := 0
			for _, at := range []int64{990 * ms, 1010 * ms} {
				for range 10 {
					var r Result
					s, r = l.Take(s, base+at, 1)
					if r.Allowed {
						n++
					}
				}
			}
			if n != tc.want {
				t.Errorf("admitted %d, want %d", n, tc.want)
			}
		})
	}
}

func TestNewLimitErrors(t *testing.T) {
	for _, tc := range []struct {
		alg      Algorithm
		requests uint64
		window   time.Duration
		burst    uint64
		want     string
	}{
		{TokenBucket, 0, time.Second, 0, "at least 1"},
		{TokenBucket, 1 << 32, time.Second, 0, "exceed the maximum"},
		{TokenBucket, 1, time.Microsecond, 0, "shorter than 1ms"},
		{TokenBucket, 1, 1500 * time.Microsecond, 0, "whole number of milliseconds"},
		{TokenBucket, 1, 367 * 24 * time.Hour, 0, "longer than 366 days"},
		{TokenBucket, 1 << 31, time.Millisecond, 0, "under 1ns"},
		{TokenBucket, 1, time.Second, 1 << 32, "burst"},
		{TokenBucket, 1, 366 * 24 * time.Hour, 1 << 31, "36 years"},
		{FixedWindow, 10, time.Second, 10, "burst applies only to token_bucket"},
		{SlidingWindow, 10, time.Second, 5, "burst applies only to token_bucket"},
		{Algorithm(7), 10, time.Second, 0, "unknown algorithm"},
	} {
		_, err := NewLimit(tc.alg, tc.requests, tc.window, tc.burst)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewLimit(%v, %d, %v, %d) = %v, want an error containing %q", tc.alg, tc.requests, tc.window, tc.burst, err, tc.want)
		}
	}
	l, err := NewLimit(TokenBucket, 1_000_000, time.Millisecond, 0) // 1ns per token
	if err != nil || l.Burst() != 1_000_000 || l.Capacity() != 1_000_000 {
		t.Errorf("NewLimit at 1ns per token: %+v, %v", l, err)
	}
	l, err = NewLimit(TokenBucket, 10, time.Minute, 25)
	if err != nil || l.Requests() != 10 || l.Window() != time.Minute || l.Burst() != 25 || l.Capacity() != 25 || l.Algorithm() != TokenBucket {
		t.Errorf("NewLimit with burst: %+v, %v", l, err)
	}
	l, err = NewLimit(SlidingWindow, 10, time.Minute, 0)
	if err != nil || l.Burst() != 10 || l.Capacity() != 10 {
		t.Errorf("NewLimit sliding: %+v, %v", l, err)
	}
}

func TestParseAlgorithm(t *testing.T) {
	for _, a := range []Algorithm{TokenBucket, SlidingWindow, FixedWindow} {
		got, err := ParseAlgorithm(a.String())
		if err != nil || got != a {
			t.Errorf("ParseAlgorithm(%q) = %v, %v", a.String(), got, err)
		}
	}
	_, err := ParseAlgorithm("leaky_bucket")
	if err == nil || !strings.Contains(err.Error(), "token_bucket, sliding_window and fixed_window") {
		t.Errorf("ParseAlgorithm(leaky_bucket) error = %v", err)
	}
	if s := Algorithm(9).String(); s != "Algorithm(9)" {
		t.Errorf("Algorithm(9).String() = %q", s)
	}
}

// TestLimitChange: a state left by a larger limit must not underflow a smaller one.
func TestLimitChange(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, SlidingWindow, FixedWindow} {
		big, small := mustLimit(t, alg, 100, time.Second, 0), mustLimit(t, alg, 10, time.Second, 0)
		s, _ := big.Take(State{}, base, 100)
		_, r := small.Take(s, base, 1)
		if r.Allowed || r.Remaining != 0 || r.RetryAfter <= 0 {
			t.Errorf("%v: after a limit change got %+v", alg, r)
		}
	}
}

// GiveBack turns the result of an allowed take into what a question (cost 0) asked of
// the state before it answers: what the global and hybrid stores report of a rule they
// gave back (a later check refused the request). Before, only remaining was given back,
// and the reset still counted the units.
func TestGiveBackMatchesPeekBefore(t *testing.T) {
	const now = int64(1_000_000_000_000)
	for _, alg := range []Algorithm{TokenBucket, FixedWindow} {
		l, err := NewLimit(alg, 10, time.Minute, 0)
		if err != nil {
			t.Fatal(err)
		}
		var s State
		for used := uint64(0); used < 7; used += 2 {
			_, before := l.Take(s, now, 0)
			_, took := l.Take(s, now, 3)
			if !took.Allowed {
				t.Fatalf("alg %d: %d used, a cost of 3 refused", alg, used)
			}
			l.GiveBack(&took, 3)
			if took.Remaining != before.Remaining || took.Reset != before.Reset {
				t.Errorf("alg %d, %d used: given back: %d left, reset %v; before the take: %d left, reset %v",
					alg, used, took.Remaining, time.Duration(took.Reset), before.Remaining, time.Duration(before.Reset))
			}
			s, _ = l.Take(s, now, 2)
		}
	}
}

// A give back that leaves the key full again reports it full now: the whole capacity
// left and reset 0, as a question asked of the state before the take answers, for every
// algorithm (a global or hybrid rule whose request a later rule refused). Before, a
// sliding window kept the reset of its take: 10 left of 10, reset of most of two minutes.
func TestGiveBackToFullResetsNow(t *testing.T) {
	const now = int64(1_000_000_000_000)
	for _, alg := range []Algorithm{TokenBucket, SlidingWindow, FixedWindow} {
		l, err := NewLimit(alg, 10, time.Minute, 0)
		if err != nil {
			t.Fatal(err)
		}
		_, took := l.Take(State{}, now, 3)
		if !took.Allowed || took.Reset == 0 {
			t.Fatalf("alg %d: a cost of 3 on a fresh key: %+v", alg, took)
		}
		l.GiveBack(&took, 3)
		if took.Remaining != 10 || took.Reset != 0 {
			t.Errorf("alg %d: given back to full: %d left, reset %v; want 10 left, reset 0",
				alg, took.Remaining, time.Duration(took.Reset))
		}
	}
}

// TestTokenBucketRateNotRaisedByRounding: a token bucket keeps its interval between two
// tokens (window/requests) in whole nanoseconds, rounded down. Where that interval is a
// few nanoseconds the rounding raised the rate itself: 4,294,967,295 per 8,589 ms
// (1.9998 ns a token, kept as 1 ns) refilled twice as fast as asked, and answered a
// reset of 4,295 ms for a window of 8,589 (a limit in bytes, with the request's size as
// its cost, reaches such rates). Every limit NewLimit builds must refill at most 10% above
// its rate; one it cannot keep so is refused. (The bound is 10%, not tighter: a rate that
// valid configurations and inline limits use, 30,000,000 a second or 123,456,789, runs
// 1.01× fast and is kept, not refused after an upgrade.)
func TestTokenBucketRateNotRaisedByRounding(t *testing.T) {
	for _, tc := range []struct {
		requests uint64
		window   time.Duration
		kept     bool
	}{
		{math.MaxUint32, 8589 * time.Millisecond, false}, // 1.9998 ns a token: 2×
		{math.MaxUint32, 6 * time.Second, false},         // 1.397 ns
		{3_000_000_000, 5 * time.Second, false},          // 1.667 ns
		{1_000_000_000, 1500 * time.Millisecond, false},  // 1.5 ns
		{700_000_000, 1 * time.Second, false},            // 1.43 ns
		{30_000_000, 1 * time.Second, true},              // 33.3 ns: 1.010×
		{123_456_789, 1 * time.Second, true},             // 8.1 ns: 1.0125×
		{math.MaxUint32, 4295 * time.Millisecond, true},  // 1.0000076 ns
		{1_000_000_000, time.Second, true},               // 1 ns exactly
		{math.MaxUint32, 10000 * time.Second, true},      // 2328.3 ns
		{3, time.Second, true},
	} {
		l, err := NewLimit(TokenBucket, tc.requests, tc.window, 0)
		if !tc.kept {
			if err == nil || !strings.Contains(err.Error(), "whole nanoseconds") {
				t.Errorf("NewLimit(%d per %v): %v, want an error naming the rounding", tc.requests, tc.window, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("NewLimit(%d per %v): %v, want it kept", tc.requests, tc.window, err)
			continue
		}
		// Empty the bucket, then see what one window refills.
		s, r := l.Take(State{}, base, l.Capacity())
		if !r.Allowed {
			t.Fatalf("%d per %v: a full bucket refused its capacity", tc.requests, tc.window)
		}
		if max := tc.window + tc.window/100; time.Duration(r.Reset) < tc.window-tc.window/10 || time.Duration(r.Reset) > max {
			t.Errorf("%d per %v: reset %v after emptying the bucket, want about the window", tc.requests, tc.window, time.Duration(r.Reset))
		}
		half := int64(tc.window / 2)
		_, r = l.Take(s, base+half, 0)
		want := float64(tc.requests) / 2
		if float64(r.Remaining) > want*1.1+1 {
			t.Errorf("%d per %v: %d refilled in half a window, want at most %.0f (10%% over the rate): the bucket refills %.3f× its rate",
				tc.requests, tc.window, r.Remaining, want*1.1+1, float64(r.Remaining)/want)
		}
	}
}
