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
// time its state last saw.
//
// Most callers want [Store.Apply], which looks up the state of each key, decides a batch
// of checks together and commits them atomically.
package localbucket
