package sync

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/plural"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

//go:embed scripts/global.lua
var globalSrc string

//go:embed scripts/refund.lua
var refundSrc string

// script is a Lua script with its source, for EVAL after a NOSCRIPT.
type script struct {
	*redis.Script
	src string
}

var (
	globalScript = script{redis.NewScript(globalSrc), globalSrc}
	refundScript = script{redis.NewScript(refundSrc), refundSrc}
)

const (
	globalArgs  = 7 // ARGV values per key of global.lua
	globalReply = 6 // reply integers per key of global.lua
	refundArgs  = 5 // ARGV values per key of refund.lua
)

// rediser is the part of go-redis that Global uses. *redis.Client and
// *redis.ClusterClient both satisfy it.
type rediser interface {
	Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd
	EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd
	Pipeline() redis.Pipeliner
}

// GlobalOp is one check of a request in global mode, given to [Global.Check].
type GlobalOp struct {
	// Key is the full Redis key, with its hash tag: rl:<rule>:{<client>}.
	Key string
	// Limit decides; all ops on one key should share one algorithm.
	Limit *localbucket.Limit
	// Cost is what the op takes; 0 is a peek (see [localbucket.Limit.Take]).
	Cost uint64
	// Shadow marks a dry run: a shadow op never makes the check fail, and if it would
	// reject it consumes nothing. Its Result still says whether it would have passed.
	Shadow bool
	// Result is written by Check, as [localbucket.Limit.Take] would write it at Redis's
	// time: Reset and RetryAfter in ns relative to that time. Expires and LimitedUntil
	// are left 0.
	Result localbucket.Result
	// WindowLeft is, for a calendar limit only, the time left in its current window at
	// the daemon's clock: the daemon computes the window from the limit's zone and names
	// its start in Key, and the key expires this long after its last take (+1 s).
	WindowLeft time.Duration
	// Ban makes the op a ban check, not a limit: Key is a ban key (BanKey, on the slot
	// of the client's other keys), Cost 0, and Limit any non-nil limit (reported, not
	// applied). It is refused, and with it the check, while the ban is in force by Redis
	// TIME (plus BanShift, [Bans.Shift]: 0 but in tests); Check then writes the ban's end
	// (Unix ns by Redis's clock) in BannedUntil, and the time left until it in
	// Result.RetryAfter. See global_policies.go.
	Ban         bool
	BanShift    time.Duration
	BannedUntil int64
	// Lease, set by [LeaseCheck], makes the op a concurrency lease's slot instead of a
	// limit: decided in the script call of its hash slot with the request's other ops,
	// all-or-nothing with them. Limit and Cost are unused.
	Lease *LeaseOp

	window int64  // the window start global.lua counted this op in (for Undo)
	member string // a lease slot's member in Key's sorted set: "<lease id>:<part>"
}

// LeaseCheck returns the op that takes (or with o.Take false asks for) o's slot for
// lease id, as [Global.Acquire] would, for [Global.Check] to decide beside a request's
// rate ops: where they share a hash slot, one script call (global.lua's algorithm 6)
// decides them all-or-nothing, so a refused rate op holds no slot and a full lease takes
// nothing. Check writes o's Allowed, Remaining and RetryAfter, and the op's Result
// (Limit = o.Max). The slot, held under o.Key as lease.lua keeps it, is released or
// renewed by [Global.Release] and [Global.Renew], never by [Global.Undo]. o must stay
// where it is until Check returns.
func LeaseCheck(id string, o *LeaseOp) GlobalOp {
	return GlobalOp{Key: o.Key, Shadow: o.Shadow, Lease: o, member: id + ":" + strconv.Itoa(o.Part)}
}

// limitOf is what op's Result reports as its limit.
func limitOf(op *GlobalOp) uint64 {
	if op.Lease != nil {
		return op.Lease.Max
	}
	return op.Limit.Requests()
}

// Global is the exact global mode: every check is decided in Redis by one atomic script
// (scripts/global.lua) per hash slot, with the same decisions and Result fields as
// [localbucket.Limit.Take], and Redis TIME as the only clock. Build it with [NewGlobal].
// A Global is safe for concurrent use.
type Global struct {
	rdb rediser
	// long, when set, carries the calls bounded by a longer context than a check's (a
	// lease's release, renewal and state query, background refund retries and lease
	// give-backs): a client whose own timeout does not cut them short. nil: rdb.
	long rediser
	// bySlot splits a check into one script call per hash slot. It is needed on a
	// cluster only: on a standalone Redis every key is on the one server, and a single
	// call is atomic with no refund ever needed.
	bySlot       bool
	refundErrors atomic.Uint64
	masters      *Masters // a breaker per master; nil: always call
	observe      Observer // nil: none
	// refundWait bounds a refund; 0 means DefaultRefundTimeout.
	refundWait time.Duration
	// giveBacks gives back, in the background, the lease slots of acquires that failed
	// unanswered (giveback.go).
	giveBacks giveBacks
	// refundRetries counts the background retries of refunds in flight (retryRefunds).
	refundRetries atomic.Int32
	// refundRetryEvery and refundRetryFor pace and bound those retries; 0: the defaults.
	refundRetryEvery, refundRetryFor time.Duration
}

// A refund Redis refused without running it (CLUSTERDOWN while a Cluster fails over a
// dead master, TRYAGAIN, LOADING, MASTERDOWN, READONLY) is sent again in the background,
// every refundRetryEvery for up to refundRetryFor, at most maxRefundRetries batches at
// once: a refund that did not run is safe to resend (one that may have run is not).
const (
	defaultRefundRetryEvery = 100 * time.Millisecond
	defaultRefundRetryFor   = 30 * time.Second
	maxRefundRetries        = 256
)

// settleRefunds counts the refunds of calls that failed, after handing those Redis did
// not run to a background retry (they count only if that gives up). The lease slots of
// a refund that failed otherwise (not sent in time, or its answer lost) go to the
// background give-back (giveBackUnsure), which removes their members whether it ran or
// not: before, such a slot, taken by a check another of its calls refused, was held by
// no one until its lease ran out (TestRefundNotSentGivesLeaseSlotBack).
func (g *Global) settleRefunds(calls []call) {
	var again, leases []call
	for i := range calls {
		err := calls[i].cmd.Err()
		switch {
		case err == nil:
		case notRun(err):
			again = append(again, call{keys: calls[i].keys, args: calls[i].args})
		default:
			g.refundErrors.Add(1)
			leases = appendLeaseRefunds(leases, &calls[i])
		}
	}
	if len(leases) > 0 {
		g.giveBackUnsure(leases)
	}
	if len(again) == 0 {
		return
	}
	if g.refundRetries.Add(1) > maxRefundRetries {
		g.refundRetries.Add(-1)
		g.refundErrors.Add(uint64(len(again)))
		return
	}
	go g.retryRefunds(again)
}

// retryRefunds resends calls, refunds Redis did not run, until each has run or failed
// otherwise, or refundRetryFor has passed.
func (g *Global) retryRefunds(calls []call) {
	defer g.refundRetries.Add(-1)
	every, total := g.refundRetryEvery, g.refundRetryFor
	if every <= 0 {
		every = defaultRefundRetryEvery
	}
	if total <= 0 {
		total = defaultRefundRetryFor
	}
	end := time.Now().Add(total)
	for len(calls) > 0 && time.Now().Before(end) {
		time.Sleep(every)
		ctx, cancel := g.refundContext(context.Background())
		run(ctx, g.longRdb(), refundScript, calls)
		cancel()
		left := calls[:0]
		for _, c := range calls {
			switch err := c.cmd.Err(); {
			case err == nil:
			case notRun(err):
				left = append(left, call{keys: c.keys, args: c.args})
			default:
				g.refundErrors.Add(1)
			}
		}
		calls = left
	}
	g.refundErrors.Add(uint64(len(calls)))
}

// WithAutoPipeline makes g send the script calls of concurrent checks together: the
// calls that arrive while a batch is on the wire go as the next one, in one pipeline.
// With many checks in flight (a pipelined connection's, or many connections') Redis and
// the daemon then spend a few syscalls per batch rather than per check. Call it before g
// is used.
func (g *Global) WithAutoPipeline() *Global {
	g.rdb = &autoPipe{rediser: g.rdb, merge: !g.bySlot, g: g}
	return g
}

// WithLongClient makes g send the calls bounded by a longer context than a check's
// (see [Global.Release], [Global.Renew], [Global.ReleaseAll], [Global.LeaseStates], and
// the background refund retries and lease give-backs) on c, a client whose own read and
// write timeouts are at least those contexts' (1 s): go-redis takes the sooner of its
// client's timeout and a call's deadline, so on the checks' client (timeout
// --redis-timeout, 50 ms) a release that should wait 250 ms answered false after 50 ms.
// Those calls then skip the checks' auto-pipeline too: a check does not wait on them.
// Call it before g is used.
func (g *Global) WithLongClient(c redis.UniversalClient) *Global {
	g.long = c
	return g
}

// longRdb returns the client of the calls WithLongClient names: the long client, else
// the checks' own.
func (g *Global) longRdb() rediser {
	if g.long != nil {
		return g.long
	}
	return g.rdb
}

// DefaultRefundTimeout bounds a refund (see [Global.WithRefundTimeout]).
const DefaultRefundTimeout = 250 * time.Millisecond

// WithRefundTimeout sets how long a refund may wait for Redis. A refund runs on its own
// context, detached from the check's: the check's deadline is what a caller waits for a
// decision, and it may have passed by the time a refund is known to be needed; a refund
// that is not sent leaves capacity consumed by a request that was rejected.
func (g *Global) WithRefundTimeout(d time.Duration) *Global {
	g.refundWait = d
	return g
}

// refundContext returns the bounded context a refund runs on: parent's values, not its
// cancellation or deadline.
func (g *Global) refundContext(parent context.Context) (context.Context, context.CancelFunc) {
	d := g.refundWait
	if d <= 0 {
		d = DefaultRefundTimeout
	}
	return context.WithTimeout(context.WithoutCancel(parent), d)
}

// NewGlobal returns a Global on c, a *redis.Client (standalone) or a *redis.ClusterClient.
// On a cluster client the ops of a check are grouped by hash slot; on any other client
// they all go in one script call.
func NewGlobal(c redis.UniversalClient) *Global {
	_, cluster := c.(*redis.ClusterClient)
	return &Global{rdb: c, bySlot: cluster}
}

// RefundErrors returns how many refunds failed (see [Global.Check]): each left some
// capacity consumed by a request that was rejected. A lease give-back whose last
// round failed is counted too (see [Global.Acquire]): its slots may stay held.
func (g *Global) RefundErrors() uint64 { return g.refundErrors.Load() }

// Check decides ops together, all-or-nothing, and writes each op's Result. Ops whose keys
// share a hash slot are decided atomically by one script call; the calls of the different
// slots of a cluster go in one pipeline (one round trip, the nodes in parallel).
//
// If every non-shadow op is allowed, Check returns true and everything allowed is
// consumed. Otherwise it returns false and nothing is consumed: a slot group that
// rejected wrote nothing, and the groups that committed are refunded (one more pipelined
// round trip). The Result of each op that was itself allowed then reports its key's
// state as a peek (cost 0) would, Allowed still true; after a refund, Remaining is exact
// and Reset an upper bound for a sliding window. A refund that fails is counted in
// [Global.RefundErrors] and the check still returns false with no error: the decision is
// known, only some capacity stays consumed until it refills.
//
// Errors (a done ctx, timeout, connection, a reply that is not what the script returns)
// are returned with false when no slot group rejected; the caller applies its failure
// policy. Groups that did commit are then refunded, on a context of their own (see
// [Global.WithRefundTimeout]). ctx carries the check's deadline.
func (g *Global) Check(ctx context.Context, ops []GlobalOp) (bool, error) {
	if len(ops) == 0 {
		return true, nil
	}
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("global check: %w", err)
	}
	start := time.Now()
	ok, err := g.check(ctx, ops)
	if g.observe != nil && err != ErrBreakerOpen {
		g.observe("global_check", time.Since(start), err)
	}
	return ok, err
}

// WithObserver makes g report every call to Redis (op "global_check").
func (g *Global) WithObserver(o Observer) *Global {
	g.observe = o
	return g
}

// WithBreaker makes g refuse to call Redis while b is open, and report to b: one
// breaker for every key, whichever master holds it. See WithMasters.
func (g *Global) WithBreaker(b *Breaker) *Global {
	g.masters = mastersOf(b, nil)
	return g
}

// WithMasters gives g a breaker per Redis master: a check (or a lease call) is refused
// with ErrBreakerOpen, at once, only when a master it needs has its breaker open, and
// each master's breaker hears how that master's script calls went. On a Redis Cluster,
// m must be built on g's client (or one on the same cluster), and refreshed (m.Run).
func (g *Global) WithMasters(m *Masters) *Global {
	g.masters = m
	return g
}

// admit finds each call's master and reports whether every one of them lets the calls
// go (gate), and which gave them their probe; ms is scratch for the distinct masters,
// returned.
func (g *Global) admit(calls []call, ms []*Master) ([]*Master, probeSet, bool) {
	if g.masters == nil {
		return ms, 0, true
	}
	for i := range calls {
		x := g.masters.ForKey(calls[i].keys[0])
		calls[i].m = x
		seen := false
		for _, y := range ms {
			seen = seen || y == x
		}
		if !seen {
			ms = append(ms, x)
		}
	}
	ok, probes := gate(ms)
	return ms, probes, ok
}

// settle tells each master of ms how its calls went: a failure if one of them got no
// valid answer (an error, a timeout, a reply that is not the script's), a success
// otherwise. Calls the auto-pipeline did not send (errNotSent: their deadline passed in
// its queue) tell nothing of Redis: a master none of whose calls went hears nothing, and
// gets back the probe its open breaker gave them. A call the master refused with
// TRYAGAIN (its keys split by a slot's migration) was answered: it says the master is
// up, and counts as no failure of it. Before, three such calls (one client's checks
// while its slot was resharded) opened the master's breaker, and every global check of
// every client of that master followed its policy, degraded, until a probe closed it.
//
// probes are the masters of ms that gave these calls their probe (gate): only the
// probe's failure keeps an open breaker open longer, and only an unused probe is handed
// back.
func settle(calls []call, ms []*Master, probes probeSet) {
	for i, x := range ms {
		failed, sent := false, false
		for i := range calls {
			c := &calls[i]
			if c.m != x {
				continue
			}
			if c.cmd != nil && errors.Is(c.cmd.Err(), errNotSent) {
				continue
			}
			sent = true
			if c.cmd == nil || (c.cmd.Err() != nil && !redis.HasErrorPrefix(c.cmd.Err(), "TRYAGAIN")) ||
				(c.failed && c.cmd.Err() == nil) {
				failed = true
				break
			}
		}
		switch {
		case failed:
			x.breaker.failed(probes.has(i, x))
		case sent:
			x.breaker.Success()
		case probes.has(i, x):
			x.breaker.unprobe()
		}
	}
}

// runGated is run behind the masters' breakers: ErrBreakerOpen, nothing sent, when a
// master the calls need refuses them; otherwise run, each master told how its calls went.
func (g *Global) runGated(ctx context.Context, s script, calls []call) error {
	var buf [inlineOps]*Master
	ms, probes, ok := g.admit(calls, buf[:0])
	if !ok {
		return ErrBreakerOpen
	}
	run(ctx, g.longRdb(), s, calls)
	settle(calls, ms, probes)
	return nil
}

func (g *Global) check(ctx context.Context, ops []GlobalOp) (bool, error) {
	var cs checkScratch
	cs.init(ops, g.bySlot)

	calls := cs.calls
	for gi := range cs.groups {
		gr := cs.groups[gi]
		keys := cs.keys[gr.lo:gr.lo:gr.hi]
		args := cs.args[gr.lo*globalArgs : gr.lo*globalArgs : gr.hi*globalArgs]
		for _, i := range cs.order[gr.lo:gr.hi] {
			op := &ops[i]
			keys = append(keys, op.Key)
			args = appendScriptArgs(args, op) // global_policies.go
		}
		calls = append(calls, call{keys: keys, args: args})
	}
	cs.calls = calls
	var msBuf [inlineOps]*Master
	ms, probes, admitted := g.admit(calls, msBuf[:0])
	if !admitted {
		return false, ErrBreakerOpen
	}
	run(ctx, g.rdb, globalScript, calls)

	ok := true
	var firstErr error
	var unsure []call // lease slots a failed call may have taken (giveBackUnsure)
	for gi := range cs.groups {
		c, gr := &calls[gi], cs.groups[gi]
		idx := cs.order[gr.lo:gr.hi]
		err := c.cmd.Err()
		if err == nil {
			err = parseReply(c.cmd.Val(), ops, idx, cs.window)
		} else if mayHaveRun(err) { // hybrid_flush.go
			unsure = appendLeaseGiveBack(unsure, ops, idx)
		}
		if err != nil {
			for _, i := range idx {
				ops[i].Result = localbucket.Result{Limit: limitOf(&ops[i])}
				if lo := ops[i].Lease; lo != nil {
					lo.Allowed, lo.Remaining, lo.RetryAfter = false, 0, 0
				}
			}
			if firstErr == nil {
				firstErr = fmt.Errorf("global check of %s in slot %d: %w", plural.Count(len(idx), "key"), Slot(ops[idx[0]].Key), err)
			}
			c.failed = true
			continue
		}
		for _, i := range idx {
			if !ops[i].Result.Allowed && !ops[i].Shadow {
				c.rejected = true
			}
		}
		if c.rejected {
			ok = false
		}
	}
	settle(calls, ms, probes)
	for i := range ops {
		ops[i].window = cs.window[i]
	}
	if len(unsure) > 0 {
		g.giveBackUnsure(unsure) // giveback.go: queued, sent by a worker
	}
	if ok && firstErr == nil {
		return true, nil
	}
	g.refund(ctx, ops, &cs)
	if !ok {
		return false, nil
	}
	return false, firstErr
}

// Undo gives back what a successful Check took, for a request that a later check (local
// or hybrid) rejected: one refund call per hash slot, pipelined. Lease slots are left to
// [Global.Release] (their holder's bookkeeping goes with it). It runs on its own
// context (see [Global.WithRefundTimeout]): ctx gives values only. A refund that fails is
// counted in RefundErrors and returned.
func (g *Global) Undo(ctx context.Context, ops []GlobalOp) error {
	bySlot := map[uint16]*call{}
	var order []uint16
	for i := range ops {
		op := &ops[i]
		if !op.Result.Allowed || op.Cost == 0 || op.Lease != nil {
			continue
		}
		var slot uint16
		if g.bySlot {
			slot = Slot(op.Key)
		}
		c := bySlot[slot]
		if c == nil {
			c = &call{}
			bySlot[slot] = c
			order = append(order, slot)
		}
		l := op.Limit
		var emission int64
		if l.Algorithm() == localbucket.TokenBucket {
			emission = int64(l.Window()) / int64(l.Requests())
		}
		c.keys = append(c.keys, op.Key)
		c.args = append(c.args, int(l.Algorithm()), l.Window().Microseconds(), emission, op.Cost, op.window)
		l.GiveBack(&op.Result, op.Cost)
	}
	if len(order) == 0 {
		return nil
	}
	calls := make([]call, 0, len(order))
	for _, slot := range order {
		calls = append(calls, *bySlot[slot])
	}
	ctx, cancel := g.refundContext(ctx)
	defer cancel()
	run(ctx, g.rdb, refundScript, calls)
	var err error
	for i := range calls {
		if e := calls[i].cmd.Err(); e != nil && err == nil {
			err = fmt.Errorf("global undo: %w", e)
		}
	}
	g.settleRefunds(calls)
	return err
}

// refund gives back what the committed groups of a failed check took, and rewrites the
// Results of their allowed ops as peeks on the refunded state.
func (g *Global) refund(ctx context.Context, ops []GlobalOp, cs *checkScratch) {
	var refunds []call
	for gi := range cs.groups {
		c, gr := &cs.calls[gi], cs.groups[gi]
		if c.failed || c.rejected {
			continue
		}
		var keys []string
		var args []any
		idx := cs.order[gr.lo:gr.hi]
		for k, i := range idx {
			op := &ops[i]
			if !op.Result.Allowed {
				continue
			}
			if lo := op.Lease; lo != nil {
				if lo.Take { // its member goes
					lo.Remaining++
					op.Result.Remaining++
					keys = append(keys, op.Key)
					args = append(args, algLease, op.member, 0, 0, 0)
				}
				continue
			}
			// What this op and the earlier ones on its key took.
			var taken uint64
			for _, j := range idx[:k+1] {
				if ops[j].Key == op.Key && ops[j].Result.Allowed {
					taken += ops[j].Cost
				}
			}
			l := op.Limit
			r := &op.Result
			r.Remaining = min(r.Remaining+taken, l.Capacity())
			switch l.Algorithm() {
			case localbucket.TokenBucket:
				r.Reset = max(r.Reset-int64(taken)*(int64(l.Window())/int64(l.Requests())), 0)
			default:
				if r.Remaining == l.Requests() {
					r.Reset = 0
				}
			}
			if op.Cost == 0 {
				continue
			}
			var emission int64
			if l.Algorithm() == localbucket.TokenBucket {
				emission = int64(l.Window()) / int64(l.Requests())
			}
			keys = append(keys, op.Key)
			args = append(args, int(l.Algorithm()), l.Window().Microseconds(), emission, op.Cost, cs.window[i])
		}
		if len(keys) > 0 {
			refunds = append(refunds, call{keys: keys, args: args})
		}
	}
	if len(refunds) == 0 {
		return
	}
	// Not the check's context: its deadline may be what made a group fail.
	ctx, cancel := g.refundContext(ctx)
	defer cancel()
	run(ctx, g.rdb, refundScript, refunds)
	g.settleRefunds(refunds)
}

// call is one script call: its keys, its ARGV, and after run its reply.
type call struct {
	keys     []string
	args     []any
	cmd      *redis.Cmd
	m        *Master // the master it goes to (Global.admit); nil: not gated
	failed   bool    // the call returned an error
	rejected bool    // a non-shadow op of the call was rejected: nothing was written
}

// run sends calls with EVALSHA, all in one pipeline when there are several, and sends
// those that failed with NOSCRIPT again with EVAL (which also caches the script on that
// node for the next EVALSHA). Each call's cmd holds its reply or error.
//
// No call is sent twice: these scripts are not idempotent (a check's take, a refund's
// give-back, a lease), and one whose connection failed after Redis ran it would count
// twice if sent again. go-redis's cluster client resends a command after a network
// error or a read timeout (MaxRetries does not turn that off there), so each call goes
// as a noRetry command; a MOVED or ASK reply, which says the script did not run, is still
// followed.
//
// A call Redis refused without running the script (CLUSTERDOWN, TRYAGAIN, LOADING,
// MASTERDOWN, READONLY: a Cluster converging, a slot migrating, a replica promoted) is
// sent again, twice at most, 1 then 2 ms later, within ctx: go-redis resent those itself
// before every call went as noRetry.
func run(ctx context.Context, rdb rediser, s script, calls []call) {
	runOnce(ctx, rdb, s, calls)
	for attempt := 1; attempt <= 2; attempt++ {
		var again []int
		for i := range calls {
			if notRun(calls[i].cmd.Err()) {
				again = append(again, i)
			}
		}
		if len(again) == 0 {
			return
		}
		t := time.NewTimer(time.Duration(attempt) * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		sub := make([]call, len(again))
		for j, i := range again {
			sub[j] = calls[i]
		}
		runOnce(ctx, rdb, s, sub)
		for j, i := range again {
			calls[i].cmd = sub[j].cmd
		}
	}
}

// appendLeaseGiveBack appends to calls the give-back (refund.lua's algorithm 6: remove
// the member) of the lease slots the ops idx of one failed call would have taken.
func appendLeaseGiveBack(calls []call, ops []GlobalOp, idx []int) []call {
	var c call
	for _, i := range idx {
		if lo := ops[i].Lease; lo != nil && lo.Take {
			c.keys = append(c.keys, ops[i].Key)
			c.args = append(c.args, algLease, ops[i].member, 0, 0, 0)
		}
	}
	if len(c.keys) == 0 {
		return calls
	}
	return append(calls, c)
}

// appendLeaseRefunds appends to calls a call of the lease slots that the refund call c
// gives back (refund.lua's algLease entries, refundArgs each), if it has any: removing
// a lease's member is safe to send again, unlike a rate refund.
func appendLeaseRefunds(calls []call, c *call) []call {
	var lc call
	for k, key := range c.keys {
		a := c.args[k*refundArgs : (k+1)*refundArgs]
		if alg, ok := a[0].(int); ok && alg == algLease {
			lc.keys = append(lc.keys, key)
			lc.args = append(lc.args, a...)
		}
	}
	if len(lc.keys) == 0 {
		return calls
	}
	return append(calls, lc)
}

// notWritten reports whether err is the call's context ending before go-redis wrote the
// call: cancelled or past its deadline while it waited for a pool turn or a dial. With
// every call sent once (MaxRetries -1, noRetry), go-redis returns the context's own error
// only then: a deadline that passes once the call is written ends its read or write as
// an i/o timeout (os.ErrDeadlineExceeded, not context.DeadlineExceeded), and a
// cancellation does not stop a call under way (TestContextErrorOnlyBeforeWriting).
func notWritten(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// notRun reports whether err is a reply by which Redis says it did not run the command.
func notRun(err error) bool {
	if err == nil {
		return false
	}
	for _, p := range [...]string{"CLUSTERDOWN", "TRYAGAIN", "LOADING", "MASTERDOWN", "READONLY"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// runOnce is run's one pass: every call sent once.
func runOnce(ctx context.Context, rdb rediser, s script, calls []call) {
	if len(calls) == 1 {
		c := &calls[0]
		if ap, ok := rdb.(*autoPipe); ok {
			c.cmd = ap.EvalSha(ctx, s.Hash(), c.keys, c.args...) // sent as noRetry by its batch
		} else {
			c.cmd = sendOnce(ctx, rdb, scriptCmd(ctx, s, false, c.keys, c.args))
		}
		if isNoScript(c.cmd.Err()) {
			c.cmd = sendOnce(ctx, rdb, scriptCmd(ctx, s, true, c.keys, c.args))
		}
		return
	}
	defer func() {
		for i := range calls {
			keepAnswered(calls[i].cmd)
		}
	}()
	pipe := rdb.Pipeline()
	for i := range calls {
		calls[i].cmd = scriptCmd(ctx, s, false, calls[i].keys, calls[i].args)
		_ = pipe.Process(ctx, noRetry{calls[i].cmd})
	}
	_, err := pipe.Exec(ctx) // every cmd carries its own error, or this one
	for i := range calls {
		unanswered(err, calls[i].cmd)
	}
	retry := false
	for i := range calls {
		if isNoScript(calls[i].cmd.Err()) {
			if !retry {
				pipe = rdb.Pipeline()
				retry = true
			}
			calls[i].cmd = scriptCmd(ctx, s, true, calls[i].keys, calls[i].args)
			_ = pipe.Process(ctx, noRetry{calls[i].cmd})
		}
	}
	if retry {
		_, err := pipe.Exec(ctx)
		for i := range calls {
			unanswered(err, calls[i].cmd)
		}
	}
}

// noRetry is a command go-redis must not send again after a network error or a read
// timeout (see run): Redis may have run it, and its reply was lost.
type noRetry struct{ *redis.Cmd }

// NoRetry tells go-redis not to resend the command.
func (noRetry) NoRetry() bool { return true }

// scriptCmd returns the EVALSHA call of s on keys and args, or with eval its EVAL.
func scriptCmd(ctx context.Context, s script, eval bool, keys []string, args []any) *redis.Cmd {
	a := make([]any, 0, 3+len(keys)+len(args))
	if eval {
		a = append(a, "eval", s.src, len(keys))
	} else {
		a = append(a, "evalsha", s.Hash(), len(keys))
	}
	for _, k := range keys {
		a = append(a, k)
	}
	cmd := redis.NewCmd(ctx, append(a, args...)...)
	if len(keys) > 0 {
		cmd.SetFirstKeyPos(3) // the cluster client routes it by its first key
	}
	return cmd
}

// sendOnce sends cmd, once (noRetry), and returns it holding its reply or error.
func sendOnce(ctx context.Context, rdb rediser, cmd *redis.Cmd) *redis.Cmd {
	if p, ok := rdb.(processor); ok {
		_ = p.Process(ctx, noRetry{cmd})
		return cmd
	}
	pipe := rdb.Pipeline()
	_ = pipe.Process(ctx, noRetry{cmd})
	_, err := pipe.Exec(ctx)
	unanswered(err, cmd)
	return cmd
}

func isNoScript(err error) bool {
	return err != nil && redis.HasErrorPrefix(err, "NOSCRIPT")
}

// parseReply writes the Results of ops[idx...] from global.lua's reply v, and each op's
// window start into window. It checks every type: a Redis-compatible server may answer
// integers as floats or strings.
func parseReply(v any, ops []GlobalOp, idx []int, window []int64) error {
	arr, ok := v.([]any)
	if !ok {
		return fmt.Errorf("global.lua replied %T, want an array", v)
	}
	if len(arr) != globalReply*len(idx) {
		return fmt.Errorf("global.lua replied %d values, want %d", len(arr), globalReply*len(idx))
	}
	for k, i := range idx {
		var x [globalReply]int64
		for j := range x {
			n, err := toInt64(arr[k*globalReply+j])
			if err != nil {
				return fmt.Errorf("global.lua reply value %d: %w", k*globalReply+j, err)
			}
			if n < 0 {
				return fmt.Errorf("global.lua reply value %d is negative: %d", k*globalReply+j, n)
			}
			x[j] = n
		}
		if x[0] > 1 || x[1] > 1 {
			return fmt.Errorf("global.lua reply: allowed %d, impossible %d, want 0 or 1", x[0], x[1])
		}
		ops[i].Result = localbucket.Result{
			Allowed:    x[0] == 1,
			Impossible: x[1] == 1,
			Limit:      limitOf(&ops[i]),
			Remaining:  uint64(x[2]),
			Reset:      x[3],
			RetryAfter: x[4],
		}
		window[i] = replyWindow(&ops[i], x[5]) // global_policies.go
	}
	return nil
}

// toInt64 converts a reply value that should be an integer.
func toInt64(v any) (int64, error) {
	switch n := v.(type) {
	case int64:
		return n, nil
	case float64:
		if n != math.Trunc(n) || n < math.MinInt64 || n >= math.MaxInt64 {
			return 0, fmt.Errorf("not an integer: %v", n)
		}
		return int64(n), nil
	case string:
		i, err := strconv.ParseInt(n, 10, 64)
		if err != nil {
			f, ferr := strconv.ParseFloat(n, 64)
			if ferr != nil {
				return 0, fmt.Errorf("not an integer: %q", n)
			}
			return toInt64(f)
		}
		return i, nil
	case nil:
		return 0, errors.New("nil, want an integer")
	default:
		return 0, fmt.Errorf("%T, want an integer", v)
	}
}

// group is a range of checkScratch.order: the ops of one script call.
type group struct{ lo, hi int }

// inlineOps is the number of ops a check handles without allocating its scratch slices.
const inlineOps = 4

// checkScratch is one Check's working state. Its arrays hold small checks without
// further allocation; larger ones get slices.
type checkScratch struct {
	order  []int    // op indices, grouped by slot, in op order within a group
	groups []group  // ranges of order
	keys   []string // keys in order
	args   []any    // global.lua ARGV in order
	window []int64  // per op: the window start global.lua counted in
	calls  []call   // one per group
	slots  []uint16 // per op (cluster only)
	placed []bool   // per op (cluster only)

	orderA  [inlineOps]int
	groupsA [inlineOps]group
	keysA   [inlineOps]string
	argsA   [inlineOps * globalArgs]any
	windowA [inlineOps]int64
	callsA  [inlineOps]call
	slotsA  [inlineOps]uint16
	placedA [inlineOps]bool
}

func (cs *checkScratch) init(ops []GlobalOp, bySlot bool) {
	n := len(ops)
	if n <= inlineOps {
		cs.order, cs.groups, cs.keys = cs.orderA[:n], cs.groupsA[:0], cs.keysA[:n]
		cs.args, cs.window, cs.calls = cs.argsA[:n*globalArgs], cs.windowA[:n], cs.callsA[:0]
		cs.slots, cs.placed = cs.slotsA[:n], cs.placedA[:n]
	} else {
		cs.order, cs.groups, cs.keys = make([]int, n), make([]group, 0, n), make([]string, n)
		cs.args, cs.window, cs.calls = make([]any, n*globalArgs), make([]int64, n), make([]call, 0, n)
		cs.slots, cs.placed = make([]uint16, n), make([]bool, n)
	}
	if !bySlot {
		for i := range cs.order {
			cs.order[i] = i
		}
		cs.groups = append(cs.groups, group{0, n})
		return
	}
	for i := range ops {
		cs.slots[i] = Slot(ops[i].Key)
	}
	k := 0
	for i := range ops {
		if cs.placed[i] {
			continue
		}
		lo := k
		for j := i; j < n; j++ {
			if !cs.placed[j] && cs.slots[j] == cs.slots[i] {
				cs.placed[j] = true
				cs.order[k] = j
				k++
			}
		}
		cs.groups = append(cs.groups, group{lo, k})
	}
}

// ProbeOpen asks each master whose breaker is open, and due for a probe, whether it
// answers (a PING through g's client, at most timeout), and tells its breaker. An open
// breaker otherwise closes only when a check's call goes as its probe, so a daemon whose
// global rules got no traffic after a Redis outage reported the breaker open
// (rlsidecar_breaker_open, and the critical alert on it) for as long as none came,
// Redis long back. The hybrid mode's heartbeats do this for its own breakers. With
// every breaker closed it costs an atomic load per master. The daemon calls it every
// 100 ms.
func (g *Global) ProbeOpen(ctx context.Context, timeout time.Duration) {
	if g.masters == nil {
		return
	}
	rdb := g.rdb
	if ap, ok := rdb.(*autoPipe); ok {
		rdb = ap.rediser // not behind the checks' queue
	}
	t := g.masters.table.Load()
	for i, m := range t.list {
		if !m.breaker.Open() {
			continue
		}
		if ok, probe := m.breaker.allow(); !ok || !probe {
			continue // not due, another call holds the probe, or closed meanwhile
		}
		c, cancel := context.WithTimeout(ctx, timeout)
		start := time.Now()
		err := ping(c, rdb, slotKeys()[t.first[i]])
		cancel()
		if ctx.Err() != nil { // stopping: no verdict on the master
			m.breaker.unprobe()
			return
		}
		if g.observe != nil {
			g.observe("ping", time.Since(start), err)
		}
		if err != nil {
			m.breaker.Failure()
		} else {
			// Back: it may have restarted, its script cache empty. The scripts go before
			// the breaker closes, so that the checks let through then find them
			// (LoadScripts); a failure leaves them to NOSCRIPT and EVAL, as before.
			c, cancel := context.WithTimeout(ctx, timeout)
			_ = loadScriptsFor(c, rdb, slotKeys()[t.first[i]])
			cancel()
			m.breaker.Success()
		}
	}
}

// ping sends a PING to the master holding key: on a cluster that key's master, on a
// standalone Redis the server.
func ping(ctx context.Context, rdb rediser, key string) error {
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		m, err := c.MasterForKey(ctx, key)
		if err != nil {
			return err
		}
		return m.Ping(ctx).Err()
	case interface {
		Ping(context.Context) *redis.StatusCmd
	}:
		return c.Ping(ctx).Err()
	}
	p := rdb.Pipeline()
	cmd := p.Ping(ctx)
	_, _ = p.Exec(ctx)
	return cmd.Err()
}
