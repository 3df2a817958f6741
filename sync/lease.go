package sync

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

//go:embed scripts/lease.lua
var leaseSrc string

var leaseScript = script{redis.NewScript(leaseSrc), leaseSrc}

// LeaseGrace is how long an expired lease part stays in its Redis sorted set before a
// call drops it: long enough for the daemon that acquired it to see, at its next sweep,
// that it expired rather than was released through another daemon.
const LeaseGrace = time.Minute

// LeaseOp is one slot of a lease in global mode: one concurrency rule's key. See
// [Global.Acquire].
type LeaseOp struct {
	// Key is the full Redis key, with its hash tag: rl:<rule>:{<client>}.
	Key string
	// Part numbers the op within its lease: its member in Key's sorted set is
	// "<lease id>:<part>". Parts of one lease are distinct.
	Part int
	// Max is the number of slots of Key; Lease how long a slot is held (ms resolution).
	Max   uint64
	Lease time.Duration
	// Take: hold a slot when allowed. False asks only (a cost of 0).
	Take bool
	// Shadow: a dry run that never refuses the lease, and holds nothing when refused.
	Shadow bool

	// Written by Acquire: whether a slot was free, the free slots after the call, and
	// when refused how long until the earliest held slot expires (at most 1 s).
	Allowed    bool
	Remaining  uint64
	RetryAfter time.Duration
}

// LeasePart names one slot a lease holds, for [Global.Release], [Global.Renew] and
// [Global.LeaseState].
type LeasePart struct {
	Key   string
	Part  int
	Lease time.Duration // for Renew: the new lease of this part
}

// Acquire takes, all-or-nothing, one slot in each op with Take for the lease id (its
// members "<id>:<part>"): when every non-shadow op has a free slot it holds them and
// returns true; otherwise it holds nothing and returns false. It writes every op's
// result. It is [Global.Check] of the ops' [LeaseCheck]s: ops in one hash slot are one
// atomic script call (global.lua's algorithm 6, on the sorted sets lease.lua releases,
// renews and queries); the calls of several slots go in one pipeline and, when one
// refuses or fails, the others' slots are given back (on a bounded context of their
// own, see [Global.WithRefundTimeout]). An error (ctx done, Redis down, a bad reply)
// holds nothing, apart from a give-back that failed (counted in RefundErrors: those
// slots expire after their lease); a call that failed unanswered (a timeout, a lost
// connection) may have taken its slots all the same, and they are given back, in the
// background, at once and a second later, through a bounded queue behind the masters'
// breakers (giveback.go; dropped past its cap, counted in [Global.GiveBacksDropped]).
// A request with rate rules too gives its LeaseChecks to Check with its rate ops
// instead: one call per slot for both.
func (g *Global) Acquire(ctx context.Context, id string, ops []LeaseOp) (bool, error) {
	if len(ops) == 0 {
		return true, nil
	}
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("lease acquire: %w", err)
	}
	start := time.Now()
	ok, err := g.acquire(ctx, id, ops)
	if g.observe != nil && err != ErrBreakerOpen {
		g.observe("lease_acquire", time.Since(start), err)
	}
	return ok, err
}

func (g *Global) acquire(ctx context.Context, id string, ops []LeaseOp) (bool, error) {
	gops := make([]GlobalOp, len(ops))
	for i := range ops {
		gops[i] = LeaseCheck(id, &ops[i])
	}
	return g.check(ctx, gops)
}

// Release frees the parts of lease id and reports whether it freed any live one: false
// when they are unknown, expired or already released. Parts in several hash slots are
// one pipeline.
func (g *Global) Release(ctx context.Context, id string, parts []LeasePart) (bool, error) {
	if len(parts) == 0 {
		return false, nil
	}
	start := time.Now()
	ok, err := g.release(ctx, id, parts)
	if g.observe != nil && err != ErrBreakerOpen {
		g.observe("lease_release", time.Since(start), err)
	}
	return ok, err
}

func (g *Global) release(ctx context.Context, id string, parts []LeasePart) (bool, error) {
	calls := g.partCalls("r", id, parts, false)
	if err := g.runGated(ctx, leaseScript, calls); err != nil {
		return false, err
	}
	freed := false
	var firstErr error
	for i := range calls {
		n, err := calls[i].cmd.Int64()
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("lease release: %w", err)
			}
			continue
		}
		freed = freed || n > 0
	}
	return freed, firstErr
}

// ReleaseAll frees the parts of several leases (parts[i] of ids[i]) in one pipeline,
// and reports for each lease what it found (Released), with the first error.
func (g *Global) ReleaseAll(ctx context.Context, ids []string, parts [][]LeasePart) ([]Released, error) {
	out := make([]Released, len(ids))
	var calls []call
	var of []int // lease of each call
	for i, id := range ids {
		for _, c := range g.partCalls("r", id, parts[i], false) {
			calls = append(calls, c)
			of = append(of, i)
		}
	}
	if len(calls) == 0 {
		return out, nil
	}
	if err := g.runGated(ctx, leaseScript, calls); err != nil {
		for i := range out {
			out[i].Failed = len(parts[i]) > 0
		}
		return out, err
	}
	var firstErr error
	for k := range calls {
		r := &out[of[k]]
		n, err := calls[k].cmd.Int64()
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("lease release: %w", err)
			}
			r.Failed = true
			r.Unsure = r.Unsure || MayHaveRun(err)
			continue
		}
		r.Freed = r.Freed || n > 0
		r.Expired = r.Expired || n < 0
	}
	for i := range out {
		out[i].Expired = out[i].Expired && !out[i].Freed
	}
	return out, firstErr
}

// Released is what a release found of one lease in Redis: Freed, a live part of it,
// which it freed; else Expired, a part that had run out (its slot no longer held; the
// lease was never released in time), removed; neither: the lease was gone, released
// already (through another daemon, say) or dropped. Failed: the call of one of its parts
// got no answer (an error, a timeout), and that part may still hold its slot, whatever
// the others' (on a Cluster, parts on another master may have been freed: Freed).
// Unsure: a failed call may have run in Redis all the same (MayHaveRun): sent, its
// answer lost, so that its parts may have been freed, or removed run out, by it.
type Released struct {
	Freed, Expired, Failed, Unsure bool
}

// MayHaveRun reports whether a lease call that failed with err may have run in Redis
// all the same: it was written, and its answer was lost (an i/o timeout, a connection
// lost after the write). Not for an open breaker's refusal, a context that ended before
// the call was written, a reply of Redis (an error it gave, or one saying it did not
// run the command), nor a connection refused or a Redis Unix socket not there.
func MayHaveRun(err error) bool {
	return err != nil && !errors.Is(err, ErrBreakerOpen) && !notWritten(err) && !notRun(err) && mayHaveRun(err)
}

// Renew extends each part of lease id to its Lease from now (Redis time) and reports
// whether it did, and the shortest lease it set: only when every part was live (a lease
// one of whose parts ran out no longer holds its slots; each hash slot's parts are
// renewed all or none, so on a Cluster the parts of other slots may have been).
func (g *Global) Renew(ctx context.Context, id string, parts []LeasePart) (bool, time.Duration, error) {
	if len(parts) == 0 {
		return false, 0, nil
	}
	calls := g.partCalls("n", id, parts, true)
	if err := g.runGated(ctx, leaseScript, calls); err != nil {
		return false, 0, err
	}
	renewed, first := true, int64(-1)
	for i := range calls {
		v, err := calls[i].cmd.Int64Slice()
		if err == nil && (len(v) != 2 || v[0] < 0 || v[1] < 0) {
			err = fmt.Errorf("lease.lua replied %v to a renew, want {parts, ms}", v)
		}
		if err != nil {
			return false, 0, fmt.Errorf("lease renew: %w", err)
		}
		if v[0] != int64(len(calls[i].keys)) {
			renewed = false
		} else if first < 0 || v[1] < first {
			first = v[1]
		}
	}
	if !renewed {
		return false, 0, nil
	}
	return true, time.Duration(max(first, 0)) * time.Millisecond, nil
}

// LeaseState reports, for each part of lease id, how long until it expires by Redis's
// clock: negative once expired, and absent (present false) when no member holds it any
// more (released, or expired more than [LeaseGrace] ago). Nothing changes.
func (g *Global) LeaseState(ctx context.Context, id string, parts []LeasePart) (left []time.Duration, present []bool, err error) {
	st, err := g.LeaseStates(ctx, []string{id}, [][]LeasePart{parts})
	if err != nil {
		return nil, nil, err
	}
	return st[0].Left, st[0].Present, st[0].Err
}

// PartsState is one lease's answer to [Global.LeaseStates].
type PartsState struct {
	Left    []time.Duration // per part: until it expires (negative: expired)
	Present []bool          // per part: a member still holds it
	Err     error           // the lease's query failed
}

// LeaseStates is [Global.LeaseState] for several leases (parts[i] of ids[i]) in one
// pipeline. The error is the breaker's; each lease's own is in its PartsState.
func (g *Global) LeaseStates(ctx context.Context, ids []string, parts [][]LeasePart) ([]PartsState, error) {
	var calls []call
	first := make([]int, len(ids)+1) // lease i's calls are calls[first[i]:first[i+1]]
	for i, id := range ids {
		first[i] = len(calls)
		calls = append(calls, g.partCalls("q", id, parts[i], false)...)
	}
	first[len(ids)] = len(calls)
	if len(calls) > 0 {
		if err := g.runGated(ctx, leaseScript, calls); err != nil {
			return nil, err
		}
	}
	out := make([]PartsState, len(ids))
	var firstErr error
	for i := range ids {
		out[i].Left, out[i].Present, out[i].Err = parseStates(calls[first[i]:first[i+1]], g.leaseGroups(len(parts[i]), func(k int) string { return parts[i][k].Key }), len(parts[i]))
		if firstErr == nil {
			firstErr = out[i].Err
		}
	}
	return out, nil
}

// parseStates reads the query replies of one lease's calls (one per group).
func parseStates(calls []call, groups [][]int, n int) (left []time.Duration, present []bool, err error) {
	left, present = make([]time.Duration, n), make([]bool, n)
	for gi, idx := range groups {
		v, err := calls[gi].cmd.Int64Slice()
		if err == nil && len(v) != len(idx)+1 {
			err = fmt.Errorf("lease.lua replied %d values to a query, want %d", len(v), len(idx)+1)
		}
		if err != nil {
			return nil, nil, fmt.Errorf("lease query: %w", err)
		}
		now := v[len(idx)]
		for k, i := range idx {
			if v[k] >= 0 {
				present[i], left[i] = true, time.Duration(v[k]-now)*time.Millisecond
			}
		}
	}
	return left, present, nil
}

// partCalls builds one lease.lua call per hash slot of parts, in the order of
// leaseGroups.
func (g *Global) partCalls(op, id string, parts []LeasePart, withLease bool) []call {
	groups := g.leaseGroups(len(parts), func(i int) string { return parts[i].Key })
	calls := make([]call, len(groups))
	for gi, idx := range groups {
		c := &calls[gi]
		c.args = append(make([]any, 0, 3+2*len(idx)), op, id, LeaseGrace.Milliseconds())
		for _, i := range idx {
			c.keys = append(c.keys, parts[i].Key)
			c.args = append(c.args, parts[i].Part)
			if withLease {
				c.args = append(c.args, max(parts[i].Lease.Milliseconds(), 1))
			}
		}
	}
	return calls
}

// leaseGroups returns the indices 0..n-1 grouped by the hash slot of key(i) (one group
// on a standalone server), each group in index order.
func (g *Global) leaseGroups(n int, key func(int) string) [][]int {
	if !g.bySlot {
		all := make([]int, n)
		for i := range all {
			all[i] = i
		}
		return [][]int{all}
	}
	var groups [][]int
	at := map[uint16]int{}
	for i := range n {
		s := Slot(key(i))
		gi, ok := at[s]
		if !ok {
			gi = len(groups)
			at[s] = gi
			groups = append(groups, nil)
		}
		groups[gi] = append(groups[gi], i)
	}
	return groups
}

func b01(b bool) int {
	if b {
		return 1
	}
	return 0
}
