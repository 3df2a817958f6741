package daemon

import (
	"sync/atomic"
	"time"
)

// spinner is the busy-poll budget (Config.BusyPoll) the connections share: one of them
// at a time may spin, so that the daemon keeps at most one CPU awake.
type spinner struct {
	budget time.Duration
	busy   atomic.Bool
	spins  atomic.Uint64 // polls begun, for tests
}

func (s *spinner) acquire() bool {
	if s.busy.CompareAndSwap(false, true) {
		s.spins.Add(1)
		return true
	}
	return false
}

func (s *spinner) release() { s.busy.Store(false) }

var epoch = time.Now()

// nanotime is a monotonic clock reading in nanoseconds (the vDSO: no system call).
func nanotime() int64 { return int64(time.Since(epoch)) }
