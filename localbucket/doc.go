// Package localbucket holds the three rate-limiting algorithms of rlsidecar as pure
// functions of (state, now, cost), and the sharded in-memory [Store] that applies several
// checks all-or-nothing.
//
// The model: a [Limit] is an immutable, validated set of parameters (algorithm, requests
// per window, burst). A [State] is the tiny per-key state (two integers); its zero value is
// a fresh key. [Limit.Take] computes the new state and a [Result] from a state, the time
// and a cost, and touches nothing else: no I/O, no clock, no goroutines. Time is always
// passed in as now, nanoseconds since the Unix epoch, read once at the edge; fixed and
// sliding windows are aligned to absolute time so that every daemon agrees on them. A
// clock that goes backwards never creates capacity: every algorithm clamps now to the
// time its state last saw, and the [Store] decides each shard's batches at times that
// never go back (a batch whose clock was read before another's, decided after it, is
// decided at the other's time). One exception, in [Store.Apply] only: a fixed window's state
// that the wall time (now plus [Store.SetWallOffset]) has fallen behind by more than
// max(its window, 1 s), which only a step of the wall clock does, moves to the wall
// time's window with its count, so that it refuses for at most a window rather than for
// as long as the step; when the wall clock reaches the old window again, that window
// starts empty, as a forward step starts a new one.
//
// Most callers want [Store.Apply], which looks up the state of each key, decides a batch
// of checks together and commits them atomically.
package localbucket
