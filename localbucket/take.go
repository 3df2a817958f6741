package localbucket

import "math/bits"

// State is the per-key state of a limit: two integers. The zero value is a fresh key: a
// full token bucket, empty windows. A State is a plain value; [Limit.Take] never mutates
// it but returns the next one.
type State struct {
	// T is, for a token bucket (GCRA), the theoretical arrival time in ns: the bucket is
	// full from T on. For the windows, the start of the current window in ns.
	T int64
	// N is, for a fixed window, the count in the current window. For a sliding window,
	// the current window's count in the low 32 bits and the previous window's count in the
	// high 32 bits. Unused (0) for a token bucket.
	N uint64
}

// Result is the outcome of one [Limit.Take]. Durations are nanoseconds relative to now,
// instants are absolute nanoseconds since the Unix epoch.
//
// A worked example: a token bucket of 10 requests per second (burst 10) that has just
// admitted 10 requests at now gives, for one more request, Allowed false, Remaining 0,
// RetryAfter 100ms (one token refills every 100ms), Reset 1s (the bucket is full again
// after 1s), Expires = now+1s and LimitedUntil = now+100ms.
type Result struct {
	// Allowed reports whether the cost was admitted (and consumed).
	Allowed bool
	// Impossible reports that the cost exceeds [Limit.Capacity]: it can never pass.
	// Allowed is then false and RetryAfter 0.
	Impossible bool
	// Limit is [Limit.Requests].
	Limit uint64
	// Remaining is what is left after this call: after consuming the cost if allowed,
	// the current remaining otherwise.
	Remaining uint64
	// Reset is the time until the key is back to full (token bucket) or empty (windows),
	// when it would carry no information if nothing else is taken.
	Reset int64
	// RetryAfter is 0 when allowed; otherwise the shortest wait after which the same cost
	// passes (0 too when Impossible).
	RetryAfter int64
	// Expires is the instant from which the resulting state carries no information and
	// can be dropped: taking from it then gives the same results as from a zero State.
	// It is never before now; now itself means "already".
	Expires int64
	// Delay is, for an allowed request of a limit with a delay ([Limit.WithDelay]), how
	// long the caller must hold it before it conforms: 0 when it passes at once.
	Delay int64
	// LimitedUntil is the instant until which a request of cost 1 on the resulting state
	// would be rejected; 0 when such a request would pass at now (any value <= now means
	// the key is not limited).
	LimitedUntil int64
}

// Take decides whether cost may pass at now on state s, and returns the next state and
// the result. It is pure: the caller stores the returned state. A rejected cost consumes
// nothing. Cost 0 is a peek: admission and RetryAfter are judged as for cost 1, nothing
// is consumed and Remaining is the current remaining. A now earlier than the time the
// state last saw is clamped to it, so going back in time never creates capacity.
//
// now must be in [0, 2^62) (until the year 2116).
func (l *Limit) Take(s State, now int64, cost uint64) (State, Result) {
	var r Result
	out := l.takeInto(s, now, cost, &r)
	return out, r
}

// takeInto is Take writing the result through r (every field), so that the store fills
// an op's result where it lives instead of copying it back up through the calls.
func (l *Limit) takeInto(s State, now int64, cost uint64, r *Result) State {
	switch l.alg {
	case SlidingWindow:
		return l.takeSliding(s, now, cost, r)
	case FixedWindow:
		return l.takeFixed(s, now, cost, r)
	}
	if l.emission == 0 {
		panic("BUG: localbucket: Take on a zero Limit; build it with NewLimit")
	}
	return l.takeToken(s, now, cost, r)
}

// takeToken is GCRA: the state is the theoretical arrival time tat; a cost c passes
// when tat + c*emission - now <= tau.
//
// Its first branch is the common case, a cost of at least 1 that passes at once: each
// field of r written once, the rest of the work left to takeTokenAll (which gives the same
// results for it: TestTakeTokenFastPath).
func (l *Limit) takeToken(s State, now int64, cost uint64, r *Result) State {
	if cost-1 < l.burst { // 1 <= cost <= burst
		tat := max(s.T, now) + int64(cost)*l.emission // cost <= burst, so cost*emission <= tau
		if wait := tat - l.tau - now; wait <= 0 {
			r.Allowed, r.Impossible, r.Limit = true, false, l.requests
			r.Remaining = min(l.perToken.div(uint64(-wait)), l.burst) // -wait: what is left
			r.Reset, r.RetryAfter, r.Expires, r.Delay = tat-now, 0, tat, 0
			r.LimitedUntil = 0
			if lu := tat + l.emission - l.tau - l.delay; lu > now {
				r.LimitedUntil = lu
			}
			return State{T: tat}
		}
	}
	return l.takeTokenAll(s, now, cost, r)
}

// takeTokenAll is takeToken for every case.
func (l *Limit) takeTokenAll(s State, now int64, cost uint64, r *Result) State {
	tat := max(s.T, now)
	*r = Result{Limit: l.requests}
	out := s // N: what a cut left out (Limit.Rescale), kept until a request is admitted
	switch {
	case cost > l.burst:
		r.Impossible = true
	default:
		c := max(cost, 1)
		newTat := tat + int64(c)*l.emission // c <= burst, so c*emission <= tau
		if wait := newTat - l.tau - now; wait <= l.delay {
			r.Allowed = true
			r.Delay = max(wait, 0)
			if cost > 0 {
				tat = newTat
				out = State{T: newTat}
			}
		} else {
			r.RetryAfter = wait - l.delay
		}
	}
	if avail := now + l.tau - tat; avail > 0 { // negative after a limit shrank
		r.Remaining = min(l.perToken.div(uint64(avail)), l.burst)
	}
	r.Reset = tat - now
	r.Expires = tat
	if lu := tat + l.emission - l.tau - l.delay; lu > now {
		r.LimitedUntil = lu
	}
	return out
}

// alignDown returns the start of the window of length w that holds t.
func alignDown(t, w int64) int64 {
	m := t % w
	if m < 0 {
		m += w
	}
	return t - m
}

func (l *Limit) takeFixed(s State, now int64, cost uint64, r *Result) State {
	start, end := l.fixedBounds(max(now, s.T))
	count := s.N
	if s.T < start {
		count = 0
	}
	*r = Result{Limit: l.requests}
	switch {
	case cost > l.requests:
		r.Impossible = true
	case count <= l.requests && max(cost, 1) <= l.requests-count:
		r.Allowed = true
		count += cost
	default:
		r.RetryAfter = end - now
	}
	if count < l.requests {
		r.Remaining = l.requests - count
	}
	if count == 0 {
		// Empty, but a later now before start still clamps to start.
		r.Expires = max(start, now)
	} else {
		r.Reset = end - now
		r.Expires = end
		if count >= l.requests {
			r.LimitedUntil = end
		}
	}
	return State{T: start, N: count}
}

const low32 = 1<<32 - 1

// takeSliding is the sliding window counter: estimate = floor(prev*(w-elapsed)/w) + cur,
// where elapsed is the time since the start of the current window.
func (l *Limit) takeSliding(s State, now int64, cost uint64, r *Result) State {
	w := l.window
	nowC := max(now, s.T)
	start := s.T
	prev, cur := s.N>>32, s.N&low32
	if d := nowC - start; d >= w {
		if d < 2*w {
			prev, cur, start = cur, 0, start+w
		} else {
			prev, cur, start = 0, 0, alignDown(nowC, w)
		}
	}
	est := cur
	if prev != 0 {
		est += weighted(prev, uint64(start+w-nowC), uint64(w))
	}
	*r = Result{Limit: l.requests}
	switch {
	case cost > l.requests:
		r.Impossible = true
	case est <= l.requests && max(cost, 1) <= l.requests-est:
		r.Allowed = true
		cur += cost
		est += cost
	default:
		r.RetryAfter = l.slidingEarliest(start, prev, cur, nowC, l.requests-max(cost, 1)) - now
	}
	if est < l.requests {
		r.Remaining = l.requests - est
	}
	// Later takes clamp to start, so the instants are computed from start on; one equal
	// to start means "at any time".
	r.Expires = max(l.slidingEarliest(start, prev, cur, start, 0), now)
	if est > 0 {
		r.Reset = r.Expires - now
	}
	if lu := l.slidingEarliest(start, prev, cur, start, l.requests-1); lu > now && lu != start {
		r.LimitedUntil = lu
	}
	return State{T: start, N: prev<<32 | cur}
}

// weighted returns floor(n*r/w) for n < 2^32 and r <= w.
func weighted(n, r, w uint64) uint64 {
	hi, lo := bits.Mul64(n, r)
	q, _ := bits.Div64(hi, lo, w) // hi < w since n*r/w <= n
	return q
}

// ceilDiv returns ceil(a*w/d) for 1 <= a <= d (the result is at most w).
func ceilDiv(a, w, d uint64) uint64 {
	hi, lo := bits.Mul64(a, w)
	q, rem := bits.Div64(hi, lo, d)
	if rem != 0 {
		q++
	}
	return q
}

// slidingEarliest returns the earliest instant t >= from at which the estimate of the
// sliding window (start, prev, cur), with nothing more taken, is at most x. from is in
// [start, start+w). The estimate never increases with time: in the current window it is
// floor(prev*r/w) + cur with r = start+w-t; in the next one floor(cur*r/w) with
// r = start+2w-t; from start+2w on it is 0.
func (l *Limit) slidingEarliest(start int64, prev, cur uint64, from int64, x uint64) int64 {
	w := uint64(l.window)
	if cur <= x {
		k := x - cur
		if k >= prev {
			return from
		}
		// floor(prev*r/w) <= k  <=>  prev*r < (k+1)*w  <=>  r <= ceil((k+1)*w/prev) - 1
		if rmax := ceilDiv(k+1, w, prev) - 1; rmax > 0 {
			return max(start+int64(w)-int64(rmax), from)
		}
		return start + int64(w) // the estimate is cur right after the roll
	}
	// In the next window: floor(cur*r/w) <= x  <=>  r <= ceil((x+1)*w/cur) - 1.
	rmax := ceilDiv(x+1, w, cur) - 1
	return start + 2*int64(w) - int64(rmax)
}

// GiveBack updates r, the result of a take of cost that was allowed, to what the key
// reads once cost is given back (a later check refused the request): cost more
// remaining, and for a token bucket a reset sooner by cost's refill time; a key that is
// full again (a window empty again) resets now, whatever its algorithm. (A sliding
// window that is not empty again keeps the reset its take gave: the result does not
// hold the counts to work out an earlier one.)
//
// Before, only a fixed window was reset: a sliding window's fresh key, given back,
// answered its whole capacity left with the reset of the units given back (7 left of 7,
// reset_ms 570348 of a 600 s window), and a hybrid token bucket, whose reset counts from
// its view and so holds the sync's lag, the whole burst left with reset_ms 1.
func (l *Limit) GiveBack(r *Result, cost uint64) {
	r.Remaining = min(r.Remaining+cost, l.Capacity())
	switch {
	case r.Remaining == l.Capacity():
		r.Reset = 0
	case l.alg == TokenBucket:
		if cost >= uint64(r.Reset/l.emission)+1 {
			r.Reset = 0
		} else {
			r.Reset = max(0, r.Reset-int64(cost)*l.emission)
		}
	}
}
