package localbucket

import (
	"math"
	"math/big"
	"testing"
	"time"

	"pgregory.net/rapid"
)

func drawLimit(t *rapid.T) *Limit {
	alg := rapid.SampledFrom([]Algorithm{TokenBucket, SlidingWindow, FixedWindow}).Draw(t, "alg")
	requests := rapid.OneOf(rapid.Uint64Range(1, 50), rapid.Uint64Range(1, math.MaxUint32)).Draw(t, "requests")
	windowMs := rapid.OneOf(rapid.Int64Range(1, 3000), rapid.Int64Range(1, 366*24*3600*1000)).Draw(t, "window_ms")
	var burst uint64
	if alg == TokenBucket {
		burst = rapid.OneOf(rapid.Just(uint64(0)), rapid.Uint64Range(1, 100), rapid.Uint64Range(1, math.MaxUint32)).Draw(t, "burst")
	}
	l, err := NewLimit(alg, requests, time.Duration(windowMs)*time.Millisecond, burst)
	if err != nil {
		t.Skip(err)
	}
	return &l
}

func peek(l *Limit, s State, now int64) Result {
	_, r := l.Take(s, now, 0)
	return r
}

// checkTake checks the properties of one Take that hold whatever came before.
func checkTake(t *rapid.T, l *Limit, s State, now int64, cost uint64) (State, Result) {
	s2, r := l.Take(s, now, cost)
	capacity := l.Capacity()
	if r.Limit != l.Requests() || r.Remaining > capacity {
		t.Fatalf("bad limit or remaining: %+v", r)
	}
	if r.Impossible != (cost > capacity) {
		t.Fatalf("Impossible = %v for cost %d, capacity %d", r.Impossible, cost, capacity)
	}
	switch {
	case r.Allowed && (r.Impossible || r.RetryAfter != 0):
		t.Fatalf("allowed with %+v", r)
	case r.Impossible && r.RetryAfter != 0:
		t.Fatalf("impossible with %+v", r)
	case !r.Allowed && !r.Impossible && r.RetryAfter <= 0:
		t.Fatalf("rejected without RetryAfter: %+v", r)
	}
	if r.Expires < now || r.Reset < 0 || r.Reset > r.Expires-now || r.Reset > 0 && r.Reset != r.Expires-now {
		t.Fatalf("Expires %d, Reset %d at now %d", r.Expires, r.Reset, now)
	}

	// Against a peek on the same state: consuming is exact, rejecting consumes nothing.
	p := peek(l, s, now)
	if r.Delay > 0 { // a delayed request (WithDelay) reserves what was not there yet
		if r.Remaining != 0 || max(cost, 1) <= p.Remaining {
			t.Fatalf("cost %d delayed %d with remaining %d, peek said %d", cost, r.Delay, r.Remaining, p.Remaining)
		}
	} else if r.Allowed && cost > 0 {
		if r.Remaining != p.Remaining-cost {
			t.Fatalf("remaining %d after cost %d, peek said %d", r.Remaining, cost, p.Remaining)
		}
	} else {
		if r.Remaining != p.Remaining {
			t.Fatalf("remaining %d without consuming, peek said %d", r.Remaining, p.Remaining)
		}
		if p2 := peek(l, s2, now); p2 != p {
			t.Fatalf("state changed without consuming: peek %+v, then %+v", p, p2)
		}
	}

	// RetryAfter is tight: the same cost passes then, and not 1ns earlier.
	if !r.Allowed && !r.Impossible {
		at := now + r.RetryAfter
		if _, ra := l.Take(s, at, cost); !ra.Allowed {
			t.Fatalf("cost %d rejected at now+RetryAfter (%d): %+v", cost, r.RetryAfter, ra)
		}
		if _, rb := l.Take(s, at-1, cost); rb.Allowed {
			t.Fatalf("cost %d allowed 1ns before now+RetryAfter (%d)", cost, r.RetryAfter)
		}
	}

	// LimitedUntil on the resulting state.
	if lu := r.LimitedUntil; lu > now {
		if _, ra := l.Take(s2, lu, 1); !ra.Allowed {
			t.Fatalf("cost 1 rejected at LimitedUntil")
		}
		if _, rb := l.Take(s2, lu-1, 1); rb.Allowed {
			t.Fatalf("cost 1 allowed 1ns before LimitedUntil")
		}
	} else if _, ra := l.Take(s2, now, 1); !ra.Allowed {
		t.Fatalf("not limited, yet cost 1 rejected: %+v", ra)
	}

	// From Expires on, the state is as good as fresh.
	for _, d := range []int64{0, rapid.Int64Range(0, 3*l.window).Draw(t, "after_expiry")} {
		c := rapid.Uint64Range(0, capacity+1).Draw(t, "cost_after_expiry")
		at := r.Expires + d
		_, a := l.Take(s2, at, c)
		_, b := l.Take(State{}, at, c)
		if a != b {
			t.Fatalf("at Expires+%d, cost %d: state gives %+v, fresh %+v", d, c, a, b)
		}
	}

	// Remaining never decreases as time goes on, so a backwards clock never creates any.
	d := rapid.Int64Range(0, 2*l.window).Draw(t, "later")
	if a, b := peek(l, s2, now), peek(l, s2, now+d); a.Remaining > b.Remaining {
		t.Fatalf("remaining %d at now, %d at now+%d", a.Remaining, b.Remaining, d)
	}
	return s2, r
}

type admitted struct {
	now  int64
	cost uint64
}

func TestTakeProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := drawLimit(t)
		w := l.window
		capacity := l.Capacity()
		now := base + rapid.Int64Range(0, w).Draw(t, "start")
		hw := int64(math.MinInt64) // the latest time seen
		var (
			s       State
			retry   int64
			history []admitted             // token bucket: every admitted take, in order
			counts  = map[int64]*big.Int{} // windows: admitted per aligned window of hw
		)
		steps := rapid.IntRange(1, 40).Draw(t, "steps")
		for range steps {
			now += rapid.OneOf(
				rapid.Int64Range(-w, 2*w),
				rapid.Int64Range(-1000, 1000),
				rapid.Just(retry),
			).Draw(t, "dt")
			hw = max(hw, now)
			cost := rapid.OneOf(rapid.Uint64Range(0, 3), rapid.Uint64Range(0, capacity+2)).Draw(t, "cost")
			var r Result
			s, r = checkTake(t, l, s, now, cost)
			retry = r.RetryAfter
			if !r.Allowed || cost == 0 {
				continue
			}
			switch l.alg {
			case TokenBucket:
				// Any run of takes i..j admits at most burst + (now_j - now_i)/emission:
				// sum*emission <= tau + now_j - now_i.
				history = append(history, admitted{now, cost})
				sum := new(big.Int)
				for i := len(history) - 1; i >= 0; i-- {
					sum.Add(sum, new(big.Int).SetUint64(history[i].cost))
					lhs := new(big.Int).Mul(sum, big.NewInt(l.emission))
					rhs := big.NewInt(l.tau + now - history[i].now)
					if lhs.Cmp(rhs) > 0 {
						t.Fatalf("admitted %v between %d and %d: more than the bucket allows", sum, history[i].now, now)
					}
				}
			default:
				// Counted in the window of the latest time seen, at most requests per
				// window; the sliding window also counts the previous one, weighted.
				win := alignDown(hw, w)
				c := counts[win]
				if c == nil {
					c = new(big.Int)
					counts[win] = c
				}
				c.Add(c, new(big.Int).SetUint64(cost))
				est := new(big.Int).Set(c)
				if prev := counts[win-w]; prev != nil && l.alg == SlidingWindow {
					wp := new(big.Int).Mul(prev, big.NewInt(win+w-hw))
					est.Add(est, wp.Div(wp, big.NewInt(w)))
				}
				if est.Cmp(new(big.Int).SetUint64(l.requests)) > 0 {
					t.Fatalf("window %d: %v admitted (estimate), limit %d", win, est, l.requests)
				}
			}
		}
	})
}
