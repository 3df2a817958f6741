package daemon

import (
	_ "unsafe" // go:linkname
)

// goyield lets the goroutines ready on this P run before the caller goes on: the runtime's
// goyield, which puts the caller at the tail of this P's own run queue. runtime.Gosched,
// used before, puts it on the global queue under the scheduler's lock and then wakes an
// idle P (wakep: a futex wake of a thread, which looks for work, finds at most this
// goroutine, and sleeps again), a few system calls for every pipelined batch. The
// runtime keeps goyield's signature for the programs that link to it (go.dev/issue/67401).
//
//go:linkname goyield runtime.goyield
func goyield()
