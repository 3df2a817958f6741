package sync

import (
	"errors"
	gosync "sync"
	"sync/atomic"
	"time"
)

// ErrBreakerOpen is returned instead of calling Redis while the breaker is open.
var ErrBreakerOpen = errors.New("redis circuit breaker open: not calling a store that keeps failing")

// Breaker stops calls to a store that keeps failing: after Failures consecutive failed
// calls it opens, and every call is refused at once (no request waits on a store known
// to be down); after a wait one call at a time is let through as a probe, and the first
// success closes it again. The first wait is an eighth of Cooldown, and each failed probe
// doubles it, up to Cooldown: a store that paused for a moment (a Redis Cluster's
// planned failover pauses its clients) costs an eighth of a second of failure policies,
// not a whole second, and one that is down is probed no more than once a Cooldown after
// a few tries. The zero value is not usable; use NewBreaker. Safe for concurrent use;
// Allow costs one atomic load while closed.
type Breaker struct {
	failures int
	cooldown time.Duration // the longest wait between probes
	wait     time.Duration // while open: the current wait (under mu)

	open   atomic.Bool
	streak atomic.Int32 // consecutive failures
	mu     gosync.Mutex
	until  time.Time // while open: no call before this
	probe  bool      // a probe is out
	opened atomic.Uint64
}

// NewBreaker returns a closed breaker opening after failures consecutive failures for
// cooldown (defaults: 3 failures, 1 s).
func NewBreaker(failures int, cooldown time.Duration) *Breaker {
	if failures <= 0 {
		failures = 3
	}
	if cooldown <= 0 {
		cooldown = time.Second
	}
	return &Breaker{failures: failures, cooldown: cooldown}
}

// Allow reports whether a call may go to the store now. While open it lets one probe
// through per cool-down.
func (b *Breaker) Allow() bool {
	ok, _ := b.allow()
	return ok
}

// allow is Allow, also reporting whether the call let through is the open breaker's
// probe.
func (b *Breaker) allow() (ok, probe bool) {
	if b == nil || !b.open.Load() {
		return true, false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.probe || time.Now().Before(b.until) {
		return false, false
	}
	b.probe = true
	return true, true
}

// unprobe hands back a probe that allow gave and that was not used (the call did not
// go): the next call may be the probe.
func (b *Breaker) unprobe() {
	b.mu.Lock()
	b.probe = false
	b.mu.Unlock()
}

// Success records a call that worked: the breaker closes.
func (b *Breaker) Success() {
	if b == nil {
		return
	}
	if !b.open.Load() {
		if b.streak.Load() != 0 {
			b.streak.Store(0)
		}
		return
	}
	b.mu.Lock()
	b.streak.Store(0)
	b.probe = false
	b.open.Store(false)
	b.mu.Unlock()
}

// Failure records a call that failed (an error or a timeout, not a rejection).
//
// While the breaker is open only its probe doubles the wait: the failure of a call let
// through before it opened (the rest of a batch in flight, the checks of other
// connections, answered after the third failure) says nothing new. Before, each such
// failure doubled the wait too, so a moment's failure under concurrent load (a Cluster's
// CLUSTERDOWN while it promotes a replica, a planned failover's pause) pushed the first
// probe to the whole cool-down at once: a healthy master's global checks followed their
// policy for up to a second after it answered again.
//
// A caller that knows whether its call was the probe (allow's) says so with failed:
// Failure takes any failure while the probe is out for the probe's.
func (b *Breaker) Failure() {
	if b == nil {
		return
	}
	b.failed(true)
}

// failed is Failure for a caller that knows whether its call was the open breaker's
// probe (allow's, gate's). While open, the failure of a call that was not (let through
// before it opened: a check with a longer deadline than the ones that opened it) says
// nothing of the probe still out. Before, it was taken for the probe's: the wait doubled,
// and another probe could go while the first was still out
// (TestGlobalBreakerOldFailureIsNotTheProbes).
func (b *Breaker) failed(probe bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	streak := b.streak.Add(1)
	if b.open.Load() {
		if !b.probe || !probe {
			return // not the probe: a call from before the breaker opened
		}
		// A failed probe: stay open, twice as long as before, at most a cool-down.
		b.probe = false
		b.wait = min(2*b.wait, b.cooldown)
		b.until = time.Now().Add(b.wait)
		return
	}
	if int(streak) >= b.failures {
		b.open.Store(true)
		b.wait = max(b.cooldown/8, min(b.cooldown, time.Millisecond))
		b.until = time.Now().Add(b.wait)
		b.opened.Add(1)
	}
}

// Open reports whether the breaker is open.
func (b *Breaker) Open() bool { return b != nil && b.open.Load() }

// Opened returns how many times the breaker has opened.
func (b *Breaker) Opened() uint64 {
	if b == nil {
		return 0
	}
	return b.opened.Load()
}

// Observer sees every call to Redis: its op (global_check, hybrid_sync, heartbeat), how
// long it took and its error. The daemon turns it into metrics.
type Observer func(op string, d time.Duration, err error)
