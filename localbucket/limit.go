package localbucket

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"time"
	"unicode/utf8"
)

// Algorithm selects how a [Limit] counts.
type Algorithm uint8

const (
	// TokenBucket refills continuously at requests/window up to burst tokens; a new bucket
	// starts full. It is implemented as GCRA (one timestamp of state). The default.
	TokenBucket Algorithm = iota
	// SlidingWindow is the sliding window counter (the Cloudflare approximation): the
	// count of the current fixed window plus the previous window's count weighted by how
	// much of it still overlaps the sliding window.
	SlidingWindow
	// FixedWindow counts in windows aligned to absolute time (floor(now / window)).
	FixedWindow
)

var algorithmNames = [...]string{
	TokenBucket:   "token_bucket",
	SlidingWindow: "sliding_window",
	FixedWindow:   "fixed_window",
}

// ParseAlgorithm returns the algorithm named s: "token_bucket", "sliding_window" or
// "fixed_window".
func ParseAlgorithm(s string) (Algorithm, error) {
	for a, name := range algorithmNames {
		if s == name {
			return Algorithm(a), nil
		}
	}
	return 0, fmt.Errorf("unknown algorithm %s: valid algorithms are token_bucket, sliding_window and fixed_window", quoteName(s))
}

// quoteName is s quoted as %q quotes it, cut to its first 64 bytes (at a character
// boundary) followed by "…" and its length when it is longer: an inline limit's algorithm
// comes from a request, and may be as long as its frame. (proto.Quote, which the daemon
// uses for the other values a request sends, does the same.)
func quoteName(s string) string {
	const max = 64
	if len(s) <= max {
		return strconv.Quote(s)
	}
	n := max
	for n > max-utf8.UTFMax && !utf8.RuneStart(s[n]) {
		n--
	}
	return strconv.Quote(s[:n]) + "… (" + strconv.Itoa(len(s)) + " bytes)"
}

// String returns the name ParseAlgorithm accepts, or "Algorithm(n)" for an unknown value.
func (a Algorithm) String() string {
	if int(a) < len(algorithmNames) {
		return algorithmNames[a]
	}
	return "Algorithm(" + strconv.Itoa(int(a)) + ")"
}

const (
	maxWindow = 366 * 24 * time.Hour
	// maxTau bounds burst*window/requests (the time a full token bucket takes to refill)
	// so that now + 2*tau never overflows int64 for any now before 2116.
	maxTau = 1 << 60
)

// Limit holds the immutable, precomputed parameters of one limit: requests per window,
// with burst capacity for a token bucket. Build it with [NewLimit]; the zero value is not
// usable (Take panics on it). A Limit is safe for concurrent use; pass it by pointer.
type Limit struct {
	alg      Algorithm
	requests uint64
	burst    uint64    // token bucket capacity; = requests for the windows
	window   int64     // ns, a whole number of milliseconds
	emission int64     // token bucket: ns per token, window/requests rounded down, >= 1
	tau      int64     // token bucket: burst*emission, the time a full bucket takes to refill
	perToken divisor   // token bucket: divides by emission
	delay    int64     // token bucket: how long a request may wait instead of being refused (WithDelay)
	cal      *calendar // fixed window: its calendar unit and zone (NewCalendarLimit); nil otherwise
	kind     uint64    // stateKind, computed once
	// stepBack is how far a stored state's time may lie after the wall time before the
	// store looks at it again (stateFor): max(window, 1 s) for a fixed window, whose
	// state a backward step of the wall clock leaves in the future; never otherwise.
	stepBack int64
}

// maxDelay bounds WithDelay, keeping now + 2*tau + delay far from overflowing.
const maxDelay = int64(24 * time.Hour)

// WithDelay returns l with a delay: a token-bucket request that would be refused now but
// would pass within d is allowed at once with [Result.Delay] set to its wait, its tokens
// reserved now (nginx's limit_req burst without nodelay). d is clamped to [0, 24h]; the
// windows ignore it.
func (l Limit) WithDelay(d time.Duration) Limit {
	if l.alg == TokenBucket {
		l.delay = min(max(int64(d), 0), maxDelay)
	}
	return l
}

// WithRequests returns l with requests per window and burst (0: burst = requests)
// instead of its own, keeping its algorithm, window, calendar and delay: a plan's or a
// split's limit. It fails as NewLimit does.
func (l *Limit) WithRequests(requests, burst uint64) (Limit, error) {
	return l.withRequests(requests, burst, true)
}

// WithShare is WithRequests for a share of l (a split among daemons): a token bucket's
// interval that rounding down would make refill more than 10% fast is kept, not refused
// (see NewLimit), since refusing the share would leave each daemon the whole limit.
func (l *Limit) WithShare(requests, burst uint64) (Limit, error) {
	return l.withRequests(requests, burst, false)
}

func (l *Limit) withRequests(requests, burst uint64, exact bool) (Limit, error) {
	var out Limit
	var err error
	if l.cal != nil {
		out, err = NewCalendarLimit(requests, l.cal.unit, l.cal.loc)
	} else {
		out, err = newLimit(l.alg, requests, time.Duration(l.window), burst, exact)
	}
	if err != nil {
		return Limit{}, err
	}
	return out.WithDelay(time.Duration(l.delay)), nil
}

// Delay returns the delay of l in ns (see WithDelay); 0 when it has none.
func (l *Limit) Delay() int64 { return l.delay }

// stateKind identifies how a state of this limit is to be read: its algorithm and its
// window; for a token bucket, its requests too (its state, the time it is full from,
// counts the units used in emission intervals, window/requests). A state written under
// another kind is not read but reset (see [Store]): a sliding window's two packed counts
// read as a fixed window's one count would be a huge count; except a token bucket's of
// the same window and other requests (a reload changed the limit), which is rescaled to
// count the same units used ([Limit.Rescale]). Never 0. A token bucket's kind, alone,
// ends in the bits 001; then its requests (32 bits), then 29 bits of a hash of its
// window in ms (tbWindow).
func (l *Limit) stateKind() uint64 { return l.kind } // set by NewLimit, NewCalendarLimit

// computeKind is stateKind, computed.
func (l *Limit) computeKind() uint64 {
	if l.alg == TokenBucket {
		return 1 | l.requests<<3 | tbWindow(l.window)
	}
	if l.cal != nil {
		return l.cal.kind
	}
	return uint64(l.alg) + 1 | uint64(l.window)<<8
}

// NewLimit validates and builds a limit of requests per window. For a token bucket, burst
// is the capacity (0 means burst = requests); the windows have no burst, so burst must be
// 0 for them.
//
// requests must be in [1, 2^32-1], window a whole number of milliseconds in [1ms, 366
// days]. A token bucket's emission interval window/requests (integer nanoseconds, rounded
// down) must be at least 1ns, and that rounding must not raise its rate by more than 10%
// (4,294,967,295 per 8,589ms, 1.9998ns a token kept as 1ns, would refill twice as fast as
// asked); its burst at most 2^32-1, and burst*window/requests at most 2^60ns (about 36
// years).
func NewLimit(alg Algorithm, requests uint64, window time.Duration, burst uint64) (Limit, error) {
	return newLimit(alg, requests, window, burst, true)
}

// newLimit is NewLimit; exact false skips the 10% bound on the token bucket's rounding
// (WithShare).
func newLimit(alg Algorithm, requests uint64, window time.Duration, burst uint64, exact bool) (Limit, error) {
	if int(alg) >= len(algorithmNames) {
		return Limit{}, fmt.Errorf("unknown algorithm %d", alg)
	}
	if requests == 0 {
		return Limit{}, errors.New("requests must be at least 1")
	}
	if requests > math.MaxUint32 {
		return Limit{}, fmt.Errorf("requests %d exceed the maximum of %d", requests, uint64(math.MaxUint32))
	}
	if window < time.Millisecond {
		return Limit{}, fmt.Errorf("window %v is shorter than 1ms", window)
	}
	if window%time.Millisecond != 0 {
		return Limit{}, fmt.Errorf("window %v is not a whole number of milliseconds", window)
	}
	if window > maxWindow {
		return Limit{}, fmt.Errorf("window %v is longer than 366 days", window)
	}
	l := Limit{alg: alg, requests: requests, burst: requests, window: int64(window), stepBack: math.MaxInt64}
	if alg == FixedWindow {
		l.stepBack = max(l.window, wallStepBack)
	}
	if alg != TokenBucket {
		if burst != 0 {
			return Limit{}, fmt.Errorf("burst %d given for %s: burst applies only to token_bucket", burst, alg)
		}
		l.kind = l.computeKind()
		return l, nil
	}
	if burst > math.MaxUint32 {
		return Limit{}, fmt.Errorf("burst %d exceeds the maximum of %d", burst, uint64(math.MaxUint32))
	}
	if burst != 0 {
		l.burst = burst
	}
	l.emission = int64(window) / int64(requests)
	if l.emission < 1 {
		return Limit{}, fmt.Errorf("rate of %d per %v is too high: the interval between two tokens would be under 1ns", requests, window)
	}
	// The interval is kept in whole nanoseconds, rounded down, which raises the rate by
	// (window mod requests) / (emission × requests). Beyond 10% the bucket would not keep
	// its limit (1.9998ns kept as 1ns refills twice as fast as asked): refuse it.
	if rem := uint64(window) % requests; exact && rem != 0 && rem*10 > uint64(l.emission)*requests {
		return Limit{}, fmt.Errorf("rate of %d per %v is too high to keep: a token bucket counts the interval between two tokens in whole nanoseconds, and %.5gns rounded down to %dns would refill it %.3f× as fast as asked (at most 1.1×); use a limit that divides the window's nanoseconds exactly, or a lower rate",
			requests, window, float64(window)/float64(requests), l.emission, float64(window)/float64(l.emission*int64(requests)))
	}
	hi, lo := bits.Mul64(l.burst, uint64(l.emission))
	if hi != 0 || lo > maxTau {
		return Limit{}, fmt.Errorf("burst %d at %d per %v takes more than 2^60ns (about 36 years) to refill", l.burst, requests, window)
	}
	l.tau = int64(lo)
	l.perToken = newDivisor(uint64(l.emission))
	l.kind = l.computeKind()
	return l, nil
}

// Algorithm returns the algorithm of l.
func (l *Limit) Algorithm() Algorithm { return l.alg }

// Requests returns the number of requests per window.
func (l *Limit) Requests() uint64 { return l.requests }

// Window returns the window.
func (l *Limit) Window() time.Duration { return time.Duration(l.window) }

// Burst returns the effective burst: the token bucket's capacity (requests when NewLimit
// was given 0), and Requests() for the windows.
func (l *Limit) Burst() uint64 { return l.burst }

// Capacity returns the largest cost that can ever pass: the burst for a token bucket,
// requests for the windows. A larger cost is [Result.Impossible].
func (l *Limit) Capacity() uint64 { return l.burst }

// tbWindow is the part of a token bucket's stateKind that identifies its window: 29 bits
// of a multiplicative hash of it in ms (two windows sharing them, one chance in 5e8,
// would rescale a state where a reset was due).
func tbWindow(window int64) uint64 {
	return (uint64(window/int64(time.Millisecond)) * 0x9E3779B97F4A7C15) >> 35 << 35
}

// Rescale returns the state s of a token bucket written under the emission interval
// from (ns) as this token bucket (of another rate, after a reload changed its limit, or
// a request of another plan) reads it at now: the same units used, at most a whole burst
// (an empty bucket). So a limit raised from 10 to 20 per hour gives a client that used
// its 10 another 10 at once, as a window's count does, and one lowered from 20 to 10
// after 15 used leaves it an empty bucket refilling at the new rate, not the fraction of
// a bucket it had left (which admitted 12 in the hour of a limit of 10). A full bucket
// (T not after now) stays full. s is returned as it is for a limit that is not a token
// bucket.
//
// What the cut to a whole burst leaves out is kept in the state's N (unused otherwise by
// a token bucket): the time the bucket would be full from uncut, read instead of T by the
// next rescale. Without it, a client whose requests alternate between two plans of one
// rule (2 and 1 per hour) had its 2 units cut to the 1 of the lower plan's burst at each
// refused request, read back as 1 of 2 at the higher plan's: one more admitted, 201 of
// 400 requests in a second. Units are rounded up, never down, by the same token.
func (l *Limit) Rescale(s State, from, now int64) State {
	t := s.T
	if s.N != 0 {
		t = max(t, int64(s.N)) // uncut, at from's rate
	}
	if l.alg != TokenBucket || l.emission == 0 || from <= 0 || from == l.emission || t <= now {
		return s
	}
	hi, lo := bits.Mul64(uint64(t-now), uint64(l.emission))
	d := uint64(1 << 62) // when the quotient passes 2^64: far beyond any bucket
	if hi < uint64(from) {
		var rem uint64
		if d, rem = bits.Div64(hi, lo, uint64(from)); rem != 0 {
			d++
		}
	}
	if d <= uint64(l.tau) {
		return State{T: now + int64(d)}
	}
	return State{T: now + l.tau, N: uint64(now + int64(min(d, 1<<62)))}
}
