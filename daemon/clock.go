package daemon

import "time"

// Clock is the daemon's time source, read once per batch of frames, at the edge.
//
// Token buckets, sliding windows and every expiry are decided on mono, so a step of the
// wall clock (NTP, a VM resumed) neither refills buckets (forward) nor rejects active
// clients (backward). Fixed windows align to wall time: the store is told wall - mono
// and aligns them to mono + that offset.
type Clock interface {
	// Now returns mono, nanoseconds on a clock that never steps (Unix time at some start
	// plus the monotonic time elapsed since), and wall, the Unix time in nanoseconds.
	Now() (mono, wall int64)
}

// SystemClock is the Clock of a running daemon: Go's monotonic clock reading, anchored at
// the Unix time it was created, and the wall clock. The zero value is not usable; call
// NewSystemClock. Safe for concurrent use.
type SystemClock struct {
	start time.Time // carries a monotonic reading
	base  int64     // start's Unix time in ns
}

// NewSystemClock returns a clock whose mono equals the wall clock now.
func NewSystemClock() *SystemClock {
	t := time.Now()
	return &SystemClock{start: t, base: t.UnixNano()}
}

// Now implements Clock.
func (c *SystemClock) Now() (mono, wall int64) {
	t := time.Now()
	return c.base + int64(t.Sub(c.start)), t.UnixNano()
}

// Mono returns mono alone: for the janitor, the hybrid sync, and anything else that
// compares instants with the states the daemon decided.
func (c *SystemClock) Mono() int64 {
	mono, _ := c.Now()
	return mono
}
