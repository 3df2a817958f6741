package rawio

import (
	"sync/atomic"
	"time"
)

// Spinner is a busy-poll budget that connections share: one of them at a time may spin
// (keep reading its empty socket for up to the budget before it waits in the
// netpoller), so that a server keeps at most one CPU awake. Safe for concurrent use.
type Spinner struct {
	budget time.Duration
	busy   atomic.Bool
	spins  atomic.Uint64 // polls begun
}

// NewSpinner returns a Spinner of the given budget; nil when budget is not above zero
// (no busy-poll).
func NewSpinner(budget time.Duration) *Spinner {
	if budget <= 0 {
		return nil
	}
	return &Spinner{budget: budget}
}

// Spins reports how many polls have begun; Busy whether one is under way.
func (s *Spinner) Spins() uint64 { return s.spins.Load() }
func (s *Spinner) Busy() bool    { return s.busy.Load() }

func (s *Spinner) acquire() bool {
	if s.busy.CompareAndSwap(false, true) {
		s.spins.Add(1)
		return true
	}
	return false
}

func (s *Spinner) release() { s.busy.Store(false) }

var epoch = time.Now()

// nanotime is a monotonic clock reading in nanoseconds (the vDSO: no system call).
func nanotime() int64 { return int64(time.Since(epoch)) }
