package localbucket

import (
	"math"
	"math/big"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// TestTakeDelayProperties runs random takes, the clock going back and forth, on a token
// bucket with a delay (README: "a request that would be refused now but would pass
// within D is allowed with delay_ms > 0, its tokens reserved at once"), checking
// checkTake's properties and these:
//   - a delay is at most D, and 0 exactly when the bucket without a delay admits at once;
//   - a request admitted with a delay is the one the bucket without a delay admits when
//     held that long: at now+Delay it passes there, leaving the same state, and (a delay
//     being the least wait) 1ns earlier it does not;
//   - a request refused is refused there at now+D too: no hold within D would do;
//   - the requests as forwarded, each at now+Delay, conform to the bucket without a
//     delay: any run of them admits at most burst + its span × the rate.
func TestTakeDelayProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		requests := rapid.OneOf(rapid.Uint64Range(1, 20), rapid.Uint64Range(1, math.MaxUint32)).Draw(t, "requests")
		windowMs := rapid.OneOf(rapid.Int64Range(1, 3000), rapid.Int64Range(1, 24*3600*1000)).Draw(t, "window_ms")
		burst := rapid.OneOf(rapid.Just(uint64(0)), rapid.Uint64Range(1, 10)).Draw(t, "burst")
		plain, err := NewLimit(TokenBucket, requests, time.Duration(windowMs)*time.Millisecond, burst)
		if err != nil {
			t.Skip(err)
		}
		delay := rapid.OneOf(rapid.Int64Range(1, 3000), rapid.Int64Range(1, int64(time.Hour)/1e6)).Draw(t, "delay_ms") * int64(time.Millisecond)
		l := plain.WithDelay(time.Duration(delay))
		capacity := l.Capacity()
		now := base + rapid.Int64Range(0, l.window).Draw(t, "start")
		var (
			s       State
			retry   int64
			history []admitted // forwarded: at now+Delay, in order
		)
		for range rapid.IntRange(1, 40).Draw(t, "steps") {
			now += rapid.OneOf(
				rapid.Int64Range(-l.window, 2*l.window),
				rapid.Int64Range(-delay, delay),
				rapid.Just(retry),
			).Draw(t, "dt")
			cost := rapid.OneOf(rapid.Uint64Range(0, 3), rapid.Uint64Range(0, capacity+1)).Draw(t, "cost")
			before := s
			var r Result
			s, r = checkTake(t, &l, s, now, cost)
			retry = r.RetryAfter
			_, p := plain.Take(before, now, cost)
			switch {
			case r.Delay < 0 || r.Delay > delay || (r.Delay > 0) != (r.Allowed && !p.Allowed) || r.Delay > 0 && !r.Allowed:
				t.Fatalf("cost %d: delay %d (allowed %v), limit %d; without a delay allowed %v", cost, r.Delay, r.Allowed, delay, p.Allowed)
			case r.Delay > 0:
				s2, q := plain.Take(before, now+r.Delay, cost)
				if !q.Allowed || cost > 0 && s2 != s {
					t.Fatalf("cost %d held %d: the bucket without a delay says %+v, state %+v, not %+v", cost, r.Delay, q, s2, s)
				}
				if _, q := plain.Take(before, now+r.Delay-1, cost); q.Allowed {
					t.Fatalf("cost %d held %d: passes 1ns earlier", cost, r.Delay)
				}
			case !r.Allowed && !r.Impossible:
				if _, q := plain.Take(before, now+delay, cost); q.Allowed {
					t.Fatalf("cost %d refused (retry %d), yet it passes held %d", cost, r.RetryAfter, delay)
				}
			}
			if !r.Allowed || cost == 0 {
				continue
			}
			history = append(history, admitted{now + r.Delay, cost})
			last := history[len(history)-1].now
			sum := new(big.Int)
			for i := len(history) - 1; i >= 0; i-- {
				sum.Add(sum, new(big.Int).SetUint64(history[i].cost))
				lhs := new(big.Int).Mul(sum, big.NewInt(l.emission))
				rhs := big.NewInt(l.tau + last - history[i].now)
				if lhs.Cmp(rhs) > 0 {
					t.Fatalf("forwarded %v between %d and %d: more than the bucket allows", sum, history[i].now, last)
				}
			}
		}
	})
}
