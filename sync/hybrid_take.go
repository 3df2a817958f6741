package sync

import (
	"bytes"
	"math"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// HybridOp is one hybrid check in an all-or-nothing batch.
type HybridOp struct {
	Key    []byte // the Redis key, hash tag included; copied if stored
	Limit  *localbucket.Limit
	Cost   uint64
	Shadow bool
	Result localbucket.Result // output
	// Unreachable (output): refused only because Redis is not answering (or did not
	// within FetchWait) and the daemon cannot decide the key without it: no fresh view
	// of the key (one new here, or not synced lately), or a view with room and no
	// allowance. Not a limit reached: when every refused op is Unreachable the caller
	// decides by the rules' failure policies.
	Unreachable bool
	// Unasked (output): refused only for want of a view of the key (one new here, or not
	// synced lately), in a check decided without asking Redis of it: a shadow rule's op
	// (it never waits for Redis), or one whose check another rule refused for good. It
	// decided nothing, and its Result's figures were not read.
	Unasked bool
	// Banned (input to Peek): a shared ban refuses the key, so nothing it takes keeps its
	// view fresh, and Peek reads the last view however old, for what it says of the
	// key's reset (the time it is full again). Before, a banned key's view was stale two
	// intervals into the ban, and its answers said reset = the ban's remaining time, not
	// the bucket's, which local and global mode report.
	Banned bool

	shard   uint32 // set by Take
	blind   bool   // refused from no fresh view, without Redis's answer
	fetched bool   // decided by an exact sync, not locally
	room    bool   // refused, though the view had room for it (another request took it)
	// upTo: the cost decided for this op, its own plus that of the ops before it in the
	// batch on the same key (two identical inline limits, or Envoy descriptors): each is
	// decided as if the ones before it were charged, as the exact mode decides them.
	upTo uint64
	sv   slideAt // its key's slide, worked out once for the check by Take (slideAt)
}

// Take decides ops at now, all-or-nothing: if every non-shadow op fits, every fitting op
// is charged and it returns true; otherwise nothing is charged and it returns false.
// Offered cost counts as demand: an admitted op's, and a refused op's (an op that fit
// in a refused check counts none).
//
// Ops are decided from the local view. If the only refusals are of keys this daemon
// cannot decide locally (no fresh view, and no grant or credit to cover the request),
// Take waits for one exact sync of those keys and decides again from what Redis
// granted: the exact mode's answer, for the keys that need it. Exact syncs of concurrent
// requests go together (hybrid_fetch.go): a request waits at most for the batch in
// flight and then its own, each bounded by FetchWait.
//
// A key whose sync is already in flight (another request's exact sync, or the periodic
// one) is not synced twice: Take waits for that sync, within the same FetchWait, and
// decides again. Refusing instead turned a new client's concurrent first requests into
// 429s whatever its limit.
func (h *Hybrid) Take(now int64, ops []HybridOp) bool {
	// The clock is read only once a request has to wait: the common case, decided
	// from the allowance, costs no clock read.
	var deadline time.Time
	expired := func() bool {
		if deadline.IsZero() {
			deadline = time.Now().Add(h.fetchWait)
		}
		return !time.Now().Before(deadline)
	}
	waited := false
	for {
		// After waiting on another request's sync, the view is fresh but that sync
		// granted what its own request needed: this one makes its own exact sync.
		ok, items, busy := h.take(now, ops, true, waited, false, false)
		if items != nil {
			// An exact sync that failed (timed out, not sent in time, its slot moved)
			// decided nothing: the request waited for Redis in vain (gaveUp), and a refusal
			// only Redis could turn around is Unreachable, decided by the rule's failure
			// policy. Decided from the view the sync did not bring, a key new here was
			// refused, not degraded, with nothing left of a billion (BenchmarkCapacityHybrid's
			// refusals far from the limit, under load: a FetchWait of 25 ms passed before
			// the batch was sent).
			answered := h.fetch(items)
			ok, _, _ = h.take(now, ops, false, false, false, !answered)
			if ok || !answered || !lostRace(ops) || expired() {
				return ok
			}
			// Redis had room, but a concurrent request on the key took what this sync
			// granted: sync again (a client over its limit never gets here).
			waited = true
			continue
		}
		if !busy && (ok || waited || !lostRace(ops)) {
			return ok
		}
		if !busy {
			// Refused from a fresh view that had room: a concurrent request took the
			// allowance a sync just brought. Sync this one too (once it is not busy).
			waited = true
			if expired() {
				ok, _, _ = h.take(now, ops, false, false, false, true)
				return ok
			}
			continue
		}
		if expired() {
			ok, _, _ = h.take(now, ops, false, false, false, true)
			return ok
		}
		time.Sleep(busyPoll)
		waited = true
	}
}

// TryTake is Take for a caller that must not wait on Redis (a connection's loop, where a
// wait would stall the requests pipelined behind this one): when Take would wait (an
// exact sync of a key, another request's sync of it in flight, or a race for what a
// sync just brought), it charges nothing, counts no demand, and reports wait; the caller
// then calls Take where waiting is fine. Otherwise it is Take: decided from the local
// view, nothing sent.
func (h *Hybrid) TryTake(now int64, ops []HybridOp) (ok, wait bool) {
	ok, _, busy := h.take(now, ops, true, false, true, false)
	if busy || !ok && lostRace(ops) {
		return false, true
	}
	return ok, false
}

// Peek reports, in each op's Result, what the local view says of its key for a request
// of the op's cost, with the costs of the ops before it on its key (as Take decides
// them), charging, counting and syncing nothing: allowed when the view has room for it
// (the remaining, reset); else refused, with when it would pass, or Impossible when the
// cost is above the key's capacity. Cost 0 asks whether one more would pass. A key this
// daemon does not hold, or holds no fresh view of (stale; except a Banned op's), reports
// its limit only: what Redis would say of it was not asked; unless its stale view,
// projected to now, has no room for it (a refusal, as Take gives without Redis). For a check another store
// refused (or a ban): its hybrid rules are reported, not asked; a key of an op with a
// cost may have its credit given up at its next sync (refusedElsewhere).
//
// Before, every op was judged as a question (cost 0), whatever its cost: a request of
// cost 3 that a local rule refused, on a hybrid key with 1 unit left, was told the
// hybrid rule admitted it, or on a full key retry when one unit frees (330 s where three
// take 990 s), and a cost above the key's capacity was a plain refusal with a retry, not
// cost_exceeds_capacity.
func (h *Hybrid) Peek(now int64, ops []HybridOp) {
	n := h.creditShares()
	for i := range ops {
		op := &ops[i]
		upTo := op.Cost
		for j := range i {
			if bytes.Equal(ops[j].Key, op.Key) {
				upTo += ops[j].Cost
			}
		}
		sh := &h.shards[h.shardOf(op.Key)]
		sh.mu.Lock()
		e := sh.m[string(op.Key)]
		if e != nil && *e.lim == *op.Limit && (op.Banned && e.synced > 0 || !h.stale(e, now)) {
			var sv slideAt
			op.Result, _, _, _ = h.decide(sh, e, &sv, now, 0, n, false, false, false, op.Shadow)
			if upTo > 0 && (!op.Result.Allowed || op.Result.Remaining < upTo) {
				// No room for the cost (or above the capacity): judged as Take judges it
				// from the view, without a sync.
				op.Result, _, _, _ = h.decide(sh, e, &sv, now, upTo, n, false, false, false, op.Shadow)
				if d := upTo - op.Cost; d > 0 && !op.Result.Allowed {
					op.Result.Remaining = subFloor(op.Result.Remaining, d)
				}
			}
		} else {
			op.Result = localbucket.Result{Limit: op.Limit.Requests()}
			if e != nil && e.synced > 0 && *e.lim == *op.Limit && !op.Shadow {
				// A stale view with no room for it, projected to now (its refill, its
				// window's end), refuses it as Take would without Redis: other daemons can
				// only have used more since (RefusedByView). Reported unasked instead, its
				// retry went unsaid, and a client banned by another rule was told the ban's
				// 2.9 s where the exact mode says this rule's hour.
				var sv slideAt
				if r, _, _, unreachable := h.decide(sh, e, &sv, now, upTo, n, false, false, true, false); !r.Allowed && !r.Impossible && !unreachable && r.RetryAfter > 0 {
					op.Result = r
					if d := upTo - op.Cost; d > 0 {
						op.Result.Remaining = subFloor(op.Result.Remaining, d)
					}
				}
			}
		}
		if e != nil && op.Cost > 0 && *e.lim == *op.Limit {
			h.refusedElsewhere(sh, e, now) // the check another store (or a ban) refused used nothing of it
		}
		sh.mu.Unlock()
	}
}

// RefusedByView is for a check while Redis is not answering (Healthy false), before
// the rules' failure policies decide it: it reports whether a non-shadow op's key has a
// view that, projected to now (its refill, or its window's end), has no room for the op.
// Other daemons can only have used more since that view, so the exact mode would refuse
// it too: the check is refused by it, not by a policy (local decided it from a bucket of
// its own, fresh: a client over its limit was admitted again each time Redis went away).
// Each op's Result is then set: the refused ones' by their view, the others reported
// Unasked. Nothing is charged, counted or synced.
func (h *Hybrid) RefusedByView(now int64, ops []HybridOp) bool {
	n := h.creditShares()
	refused := false
	for i := range ops {
		op := &ops[i]
		op.Unasked, op.Unreachable = false, false
		op.Result = localbucket.Result{Limit: op.Limit.Requests()}
		if op.Shadow || op.Cost == 0 {
			continue
		}
		sh := &h.shards[h.shardOf(op.Key)]
		sh.mu.Lock()
		if e := sh.m[string(op.Key)]; e != nil && e.synced > 0 && *e.lim == *op.Limit {
			var sv slideAt
			r, _, _, unreachable := h.decide(sh, e, &sv, now, op.Cost, n, false, false, true, false)
			if !r.Allowed && !r.Impossible && !unreachable && r.RetryAfter > 0 {
				op.Result = r
				refused = true
			}
		}
		sh.mu.Unlock()
	}
	if refused {
		for i := range ops {
			if op := &ops[i]; op.Result.RetryAfter == 0 {
				op.Unasked = true
			}
		}
	}
	return refused
}

// lostRace reports whether a refused op's view had room for it.
func lostRace(ops []HybridOp) bool {
	for i := range ops {
		if op := &ops[i]; !op.Result.Allowed && !op.Shadow && op.room {
			return true
		}
	}
	return false
}

// busyPoll is how often Take looks again at a key whose sync is in flight.
const busyPoll = 200 * time.Microsecond

// take decides ops once. With mayFetch, when every refusal is one an exact sync may turn
// around, it charges nothing and returns the syncs to make (items), or busy when those
// keys' syncs are already in flight. With probe it starts no sync: where it would, or
// where a race was lost (Take would sync again), it returns busy, having charged and
// counted nothing. gaveUp: the request waited FetchWait for Redis
// in vain; a refusal only Redis could have turned around is then Unreachable.
func (h *Hybrid) take(now int64, ops []HybridOp, mayFetch, waited, probe, gaveUp bool) (ok bool, items []syncItem, busy bool) {
	var lockBuf [8]uint32
	var entBuf [8]*hentry
	locks := lockBuf[:0]
	ents := entBuf[:0]
	if len(ops) > len(entBuf) {
		ents = make([]*hentry, 0, len(ops))
	}
	for i := range ops {
		s := h.shardOf(ops[i].Key)
		ops[i].shard = s
		k := len(locks)
		for k > 0 && locks[k-1] > s {
			k--
		}
		if k > 0 && locks[k-1] == s {
			continue
		}
		locks = append(locks, 0)
		copy(locks[k+1:], locks[k:])
		locks[k] = s
	}
	for _, s := range locks {
		h.shards[s].mu.Lock()
	}
	defer func() {
		for _, s := range locks {
			h.shards[s].mu.Unlock()
		}
	}()

	n := h.creditShares()
	ok, fetch, raced := true, false, false // raced: a refusal had room (lostRace may hold)
	blind := false                         // an op was refused for want of a view
	for i := range ops {
		op := &ops[i]
		sh := &h.shards[op.shard]
		e := sh.m[string(op.Key)]
		if e == nil {
			for w := units(len(op.Key), h.perShard); sh.load+w > h.perShard; {
				if !h.evict(sh, now, ents) {
					break // every key sampled has a sync on its way, or is this request's: held past the cap
				}
			}
			// A key new here: before its first sync a daemon may admit one request on
			// credit, if the key's capacity leaves two for every live daemon (a small
			// limit shared by many daemons is decided by exact syncs: a stale view could
			// mistake it for full). What it admits is counted at the next sync; anything
			// more waits for an exact sync.
			lim := h.limits.intern(op.Limit)
			c := float64(lim.Capacity())
			k := string(op.Key)
			e = &hentry{lim: lim, view: c}
			e.setKey(k)
			if h.cluster {
				e.slot = Slot(k)
			}
			// Not in a shard that forgot a key not yet full (evict): this may be that key.
			if c >= n && now >= sh.noFirstUntil && h.redisAnswering(e) { // no credit Redis may never count
				e.allowance = 1
			}
			sh.m[k] = e
			sh.load += units(len(k), h.perShard)
			select { // ask Run for an early sync: the key's first view, within kickEvery
			case h.kick <- struct{}{}:
			default:
			}
		} else if *e.lim != *op.Limit {
			e.relimit(h.limits.intern(op.Limit), n)
		}
		op.upTo = op.Cost
		for j, prev := range ents {
			if prev == e {
				op.upTo += ops[j].Cost
			}
		}
		ents = append(ents, e)
		if e.pending == 0 {
			// The last check, while nothing waits to be synced; then the last admission
			// (below): what the key admitted is charged as of then (syncItem.age). A
			// question or a refusal after an admission moved it before: a unit admitted
			// just before a fixed window ended was charged to the next one.
			e.seen = seenMs(now)
		}
		if e.lastDemand != 0 && e.flags&(flagDirty|flagBusy) == 0 && h.stale(e, now) {
			// The key has cooled: its view went stale with nothing to sync, so the share
			// grant its last sync asked for says nothing of the demand now. Not hot any
			// more (decide), it is decided as a key new here would be: an exact sync when
			// its allowance is spent, until a sync asks a share grant again. Kept, the
			// first units this check admitted made the key dirty, dirty made it hot again,
			// and it waited for the next periodic sync with its view a second old: 5 per
			// second, 5 used, then 5 more a second later: 2 admitted and the rest refused,
			// each told to retry in 1 ms (TestHybridBurstAgainAfterAFullWindow).
			e.lastDemand = 0
		}
		// With a breaker per master (no single one), a key whose master is stale (its
		// breaker open, or no answer for StaleAfter) is decided by its rule's policy, as
		// every key is on a standalone Redis (the caller asks Healthy first).
		op.Unasked, op.blind = false, false
		if h.single == nil && !op.Shadow && !h.masterOf(e).fresh(now, h.staleAfter) {
			op.Result = localbucket.Result{Limit: e.lim.Requests()}
			op.fetched, op.room, op.Unreachable = false, false, true
			ok = false
			continue
		}
		var f bool
		op.sv.lim = nil // worked out at its first use (slideAt.of)
		op.Result, f, op.room, op.Unreachable = h.decide(sh, e, &op.sv, now, op.upTo, n, mayFetch && !op.Shadow, waited, gaveUp, op.Shadow)
		if d := op.upTo - op.Cost; d > 0 && !op.Result.Allowed {
			// Refused: what is left for it is what the ops before it on its key leave,
			// as the exact mode reports it (3 per hour, 1 left, the same descriptor twice:
			// the second is refused with 0 left, not 1).
			op.Result.Remaining = subFloor(op.Result.Remaining, d)
		}
		if !op.Result.Allowed && !op.Result.Impossible && !op.Unreachable && h.stale(e, now) {
			op.blind, blind = true, true
		}
		if mayFetch {
			op.fetched = f
		}
		if !op.Result.Allowed && !op.Shadow {
			ok = false
			fetch = fetch || f
			raced = raced || op.room
		}
	}
	if !ok {
		// An op with a later one on its key (which carries both costs) is not the one to
		// sync for, nor a race lost: its key is decided by the last. If the view had room
		// for it, it is reported as the exact mode reports an op that fit in a refused
		// check: allowed, its key's state as a question (cost 0) sees it.
		for i := range ops {
			if op := &ops[i]; op.room {
				for _, later := range ents[i+1:] {
					if later == ents[i] {
						op.room = false
						if r, _, _, _ := h.decide(&h.shards[op.shard], ents[i], &op.sv, now, 0, n, false, false, false, op.Shadow); r.Allowed {
							op.Result, op.fetched, op.Unreachable = r, false, false
						}
						break
					}
				}
			}
		}
	}
	// Refused for good by an op (a limit reached, a cost no key holds, a hot key waiting
	// for its grant; not one an exact sync may turn around): an op that lost a race for
	// its key's allowance fits in it, and nothing is synced again for it (below).
	forGood := false
	if raced {
		for i := range ops {
			if op := &ops[i]; !op.Result.Allowed && !op.Shadow && !op.room && !op.blind && !op.fetched {
				forGood = true
				break
			}
		}
	}
	if probe && raced && !forGood && lostRace(ops) {
		// TryTake: Take syncs again for a race lost, and counts the request's demand
		// then. Counted here too, one request counted twice, and a client spread over
		// many daemons, back here once, looked hot (two units short): its next sync
		// asked a share grant, reserved for a daemon it rarely comes back to.
		for i := range ops {
			ops[i].fetched = false
		}
		return false, nil, true
	}
	if !ok && fetch {
		// Worth waiting only if every refusal is one an exact sync may turn around.
		all := true
		for i := range ops {
			if op := &ops[i]; !op.Result.Allowed && !op.Shadow && !op.fetched {
				all = false
				break
			}
		}
		if all && probe {
			for i := range ops {
				ops[i].fetched = false
			}
			return false, nil, true
		}
		if all {
			// A key whose sync is on its way is waited for before any other key of the
			// request is synced: decided after the others' exact syncs came back, it had
			// no view yet and nothing to wait with (mayFetch is off then), and a request
			// on a key new here was refused, not degraded, remaining 0 of a billion
			// (BenchmarkCapacityHybrid's refusals far from the limit: a new client's
			// per-IP key in its early sync, its per-user key in an exact sync).
			for i := range ops {
				if op := &ops[i]; op.fetched && !op.Result.Allowed && !op.Shadow && ents[i].flags&flagBusy != 0 {
					for i := range ops {
						ops[i].fetched = false
					}
					return false, nil, true
				}
			}
		ops:
			for i := range ops {
				op, e := &ops[i], ents[i]
				if op.fetched && !op.Result.Allowed && !op.Shadow {
					for _, later := range ents[i+1:] {
						if later == e {
							continue ops // the last op on the key asks for them all
						}
					}
					// The whole cost, not what the allowance lacks: the sync gives back the
					// unused grant and replaces the allowance with what Redis grants now
					// (apply). Asking for the difference left a request for more than its
					// first unit, or for more than half of what was left, refused with
					// the capacity it needed free in Redis.
					need := min(max(op.upTo, 1), math.MaxUint32)
					if op.upTo == 0 {
						need = 0 // a question: the view, no unit reserved here (which others could not use)
					}
					items = append(items, h.snapshot(&h.shards[op.shard], e, now, modeExact, uint32(need)))
				}
			}
			if items != nil {
				// A shadow rule's key with no view goes in the same round trip: it waits
				// for nothing the request does not wait for, and reports what Redis says,
				// not a refusal no one read (a shadow never syncs for itself).
			shadows:
				for i := range ops {
					op, e := &ops[i], ents[i]
					if !op.Shadow || !op.blind || e.flags&flagBusy != 0 {
						continue
					}
					for _, later := range ents[i+1:] {
						if later == e {
							continue shadows
						}
					}
					need := min(op.upTo, math.MaxUint32) // its whole cost, as above; 0 asks
					op.fetched = true
					items = append(items, h.snapshot(&h.shards[op.shard], e, now, modeExact, uint32(need)))
				}
				return false, items, false
			}
		}
		for i := range ops {
			ops[i].fetched = false
		}
	}
	if raced && mayFetch && !waited && !forGood && lostRace(ops) {
		// A race lost on a first pass: Take decides the request again, syncing the key,
		// and counts its demand then. Only the shortfall is counted here, once (two units
		// short in an interval make the key hot: collect). Not in a check another op
		// refuses for good: the op fits in it (below), and uses nothing. Taken for a race
		// lost, such a check on a key with room in its view and no allowance (shared, or
		// left: refusedElsewhere) sent the request's keys to an exact sync, which reserved
		// the op's unit for this daemon until its next sync gave it back, and the next
		// such check did it again: a script call an interval while they came (about 290
		// checks over 3 s on a shared key: 60 script calls, 40 without).
		for i := range ops {
			if op := &ops[i]; op.room && op.Cost > 0 {
				e := ents[i]
				e.short = satAdd8(e.short, op.Cost)
				h.shards[op.shard].markDirty(e)
			}
		}
		return false, nil, false
	}
	// Decided without Redis. An op refused only for want of a view decided nothing when
	// it is a shadow's (a shadow never waits for Redis), or when the check is allowed or
	// refused by another op for good (a limit reached, a cost no key holds): reporting it
	// refused, remaining 0, said what no one read.
	if blind {
		decided := ok
		for i := range ops {
			if op := &ops[i]; !op.Result.Allowed && !op.Shadow && !op.blind {
				decided = true
				break
			}
		}
		for i := range ops {
			if op := &ops[i]; op.blind && !op.Shadow && decided {
				op.Unasked = true
			}
		}
	}
	if !ok {
		// Refused by an op for good (a limit reached, a cost no key holds, a hot key
		// waiting for its grant): an op whose view had room, refused only for want of
		// allowance, fit; it is reported as the exact mode reports an op that fit in a
		// refused check: allowed, its key's state as a question sees it. Before, it said
		// refused with a retry of one interval (a rule that admits, beside an inline
		// limit that refused).
		decider := false
		for i := range ops {
			if op := &ops[i]; !op.Result.Allowed && !op.Shadow && !op.room && !op.blind {
				decider = true
				break
			}
		}
		for i := range ops {
			if op := &ops[i]; decider && op.room && !op.Result.Allowed {
				if r, _, _, _ := h.decide(&h.shards[op.shard], ents[i], &op.sv, now, 0, n, false, false, false, op.Shadow); r.Allowed {
					op.Result, op.room, op.fetched, op.Unreachable = r, false, false, false
				}
			}
		}
	}
	for i := range ops {
		op := &ops[i]
		e := ents[i]
		sh := &h.shards[op.shard]
		// A question (cost 0) counts no demand: no share grant is asked for it. Nor does
		// an op that fit in a check another op refused: it used nothing, and will not
		// while that op refuses. Counted, its key asked share grants for requests it
		// never admitted, and held them against the daemons that could: two rules on one
		// key over 3 daemons, each daemon holding the unit the others' checks lacked,
		// re-reserved at every sync (4 of 5 admitted, the rest told the next sync for
		// seconds on end).
		if cost := op.Cost; cost > 0 && (ok || !op.Result.Allowed) {
			e.demand = satAdd32(e.demand, cost)
			if ok && op.Result.Allowed {
				e.allowance -= float64(cost)
				if e.flags&flagStray == 0 && e.lim.Algorithm() != localbucket.TokenBucket &&
					(e.flags&flagPrev != 0 || e.pending+cost > uint64(e.grant) && !inView(e, now)) {
					e.flags |= flagStray
					e.flags &^= flagPrev
				}
				e.admitted(now)
				e.pending += cost
				sh.markDirty(e)
				op.Result.Remaining = subFloor(op.Result.Remaining, op.upTo)
				op.Result.Reset = h.resetOf(e, now, sh.pendingOf(e), &op.sv)
			}
			if !op.Result.Allowed && !op.Result.Impossible && !op.fetched && !op.Unasked {
				// Demand beyond the allowance: the next sync asks for a share grant.
				e.short = satAdd8(e.short, cost)
				sh.markDirty(e)
			}
		} else if op.Cost > 0 {
			h.refusedElsewhere(sh, e, now) // it fit; another op refused the check
		}
		if !ok && op.Result.Allowed {
			op.Result.RetryAfter = 0
		}
	}
	return ok, nil, false
}

func satAdd8(a uint8, b uint64) uint8 {
	if s := uint64(a) + b; s < math.MaxUint8 {
		return uint8(s)
	}
	return math.MaxUint8
}

func satAdd32(a uint32, b uint64) uint32 {
	if s := uint64(a) + b; s < math.MaxUint32 {
		return uint32(s)
	}
	return math.MaxUint32
}

// redisAnswering reports whether a request may wait for e's master: its breaker is
// closed, and it has answered since a sync to it last failed (a frozen master costs one
// request one FetchWait; then its keys with an allowance are decided from it, and its
// keys only Redis could decide by the rules' policies, as all its keys are past
// StaleAfter).
func (h *Hybrid) redisAnswering(e *hentry) bool {
	return h.masterOf(e).answering()
}

// Undo gives back, at now, what Take charged, for a request a later (local) check
// rejected.
func (h *Hybrid) Undo(now int64, ops []HybridOp) {
	for i := range ops {
		op := &ops[i]
		if !op.Result.Allowed || op.Cost == 0 {
			continue
		}
		sh := &h.shards[op.shard]
		sh.mu.Lock()
		if e := sh.m[string(op.Key)]; e != nil {
			e.allowance += float64(op.Cost)
			if e.pending >= op.Cost {
				e.pending -= op.Cost
			} else {
				// A sync took them since (it is on its way, or Redis counted them): the
				// next one takes them off, or a request another store refused would stay
				// charged here (all-or-nothing).
				e.addOwed(op.Cost - e.pending)
				e.pending = 0
				sh.markDirty(e)
			}
			h.refusedElsewhere(sh, e, now)
		}
		op.Limit.GiveBack(&op.Result, op.Cost)
		sh.mu.Unlock()
	}
}

func subFloor(a, b uint64) uint64 {
	if b > a {
		return 0
	}
	return a - b
}

// project returns what the key can admit at now beyond every reservation, by e's view
// and the refill since (an upper bound for a sliding window).
func project(e *hentry, now int64) float64 {
	var sv slideAt
	return projectAt(e, now, &sv)
}

// projectAt is project with e's slide worked out (sv).
func projectAt(e *hentry, now int64, sv *slideAt) float64 {
	lim := e.lim
	c := float64(lim.Capacity())
	if e.synced == 0 {
		return e.view
	}
	age := now - e.synced
	if age <= 0 {
		return e.view
	}
	v := e.view
	switch lim.Algorithm() {
	case localbucket.TokenBucket:
		v += float64(age) * float64(lim.Requests()) / float64(lim.Window())
	case localbucket.SlidingWindow:
		sv := sv.of(e)
		if r := sv.reset; r > 0 && age >= r {
			return c
		}
		// The previous window's share frees at its own pace (the limit's pace overstated
		// it: one daemon admitted an 11th of 10 when the previous window had been
		// empty), which the view gives: its count and the window's phase (slide). The
		// estimate at now, as the exact mode counts it. Before, the view stood still
		// until Redis's retry for one unit had passed: a cost of 4 that the fallen share
		// made room for was refused (retry 1 ms) until the next sync, and questions said
		// 3 left where the exact mode said 4.
		s, est := &sv.s, 0.0
		switch end := s.start + s.w; {
		case now < end:
			est = math.Floor(s.p*min(1, float64(end-now)/float64(s.w))) + s.q
		case now < end+s.w:
			est = math.Floor(s.q * float64(end+s.w-now) / float64(s.w))
		}
		v = max(v, s.r-est)
	default:
		// A view whose reset is 0 with room short of the limit (nothing counted in its
		// window, units reserved by other daemons' grants) says nothing of when it is
		// full: the window it was read in has ended a window after, counts and
		// reservations with it. Kept as it was, such a key was never swept (an idle
		// daemon held the keys of a soak's hot users for good).
		if r := e.resetNs(); r > 0 && age >= r || age >= int64(lim.Window()) {
			return c
		}
	}
	return min(c, v)
}

// creditShares is what a view is divided by for this daemon's credit on a key no other
// daemon uses: 2N for N live daemons (the most counted within creditPeak: creditCount),
// so what it may admit unseen stays small if another daemon starts using the key
// (docs/accuracy.md).
func (h *Hybrid) creditShares() float64 { return float64(2 * h.counts.most.Load()) }

// growth is the credit the refill since e's view adds to this daemon's share, its
// view projected to now being proj (project).
func (h *Hybrid) growth(e *hentry, proj, n float64) float64 {
	if e.synced == 0 || e.flags&flagShared != 0 {
		return 0
	}
	return math.Floor(max(0, proj)/n) - math.Floor(max(0, e.view)/n)
}

// fixedLeft is the time from now until the end of now's window of e's fixed window
// limit, aligned on wall time (SetWall), as the local mode aligns fixed windows: NTP
// keeps it near Redis's clock, on which Redis's windows turn. Before, it was aligned on
// the clock h is given, the daemon's monotonic one, which is off the wall clock by as
// much as the wall clock was off when the daemon started and has stepped since (NTP
// setting it at boot, after the daemon started): with it 400 ms ahead, a 1 s window's
// reset said 124 ms at a new key's first request, where Redis's window ended in 524 ms,
// and 573 ms right after a turn, where it ended in 973 ms.
func (h *Hybrid) fixedLeft(e *hentry, now int64) int64 {
	w := int64(e.lim.Window())
	return w - mod(h.wallOf(now), w)
}

// mod returns a mod w in [0, w), for w > 0.
func mod(a, w int64) int64 {
	r := a % w
	if r < 0 {
		r += w
	}
	return r
}

// creditLife is how long a view's credit may be spent. When another daemon starts
// using the key, Redis reserves what this daemon may still admit on credit until this
// daemon syncs the key again, or for at most a minute (credit_life in
// scripts/hybrid.lua, longer by a margin for the time the answer took to arrive): past
// creditLife the credit lapses here, so no credit outlives its reservation. A key used
// more rarely than that waits for an exact sync, as a key new here does.
const creditLife = 50 * time.Second

// refusedElsewhere notes a check of e (cost > 0) that charged e nothing because
// something else refused it: another rule of the request (an op that fit in a refused
// check), another store (Peek, Undo), a ban. Such a check uses nothing and is no demand
// (take), so a daemon whose every check of a key is refused so has nothing to sync
// for it: its credit stayed, unspent, and so did a reservation of it (field k) made by
// another daemon that started using the key, for the whole minute it lasts. The other
// daemons were refused those units meanwhile, their clients told to retry at the next
// sync, over and over, though no one used them (TestHybridIdleCreditOverFiveSeconds:
// 10 of the 15 left admitted over 5 s, then 236 refusals told about 50 ms; 15 now).
//
// So, if e may hold credit (a view of its own, not shared) that is at least leaveAfter
// intervals old, e is marked (flagIdle) and its next sync, if the key admitted nothing
// here meanwhile, leaves it (collect): one key in the batch the sync sends anyway, not a
// call per check, and at most one per key per leaveAfter intervals. A daemon that left
// holds no credit (flagShared) until a sync of its own use tells it the key is its own
// again: the next request it would admit is decided by an exact sync. A view younger
// than that is left alone: a key admitted here now and then (a client beside a rule of
// a few a second that refuses the rest) keeps its credit, with no leave and no exact
// sync at its next admission. The shard's lock is held.
func (h *Hybrid) refusedElsewhere(sh *hshard, e *hentry, now int64) {
	if e.flags&(flagShared|flagGone|flagIdle) == 0 && e.synced > 0 && now-e.synced >= leaveAfter*int64(h.interval) {
		e.flags |= flagIdle
		sh.markDirty(e)
	}
}

// leaveAfter is how many sync intervals old a key's view must be before a check of it
// refused elsewhere has its next sync leave it (refusedElsewhere): 1 s at the default
// interval. A reservation of the credit of a daemon whose checks are so refused lasts
// about that long (and the interval, and the time to its next such check), not a
// minute.
const leaveAfter = heldWait

// heldWait is how many sync intervals a refusal's retry must reach (the window's end,
// the bucket's refill) before units other daemons hold reserved shorten it to this
// daemon's next sync: 1 s at the default interval. Waiting for a nearer retry costs a
// client little; asked to come back each interval, clients of a key hot on every daemon
// (whose holders use what they hold) were refused again at every try.
const heldWait = 10

// allowance is what e may admit locally at now: its grant left, plus its credit and the
// credit's growth while the credit has not lapsed (creditLife); proj is its view
// projected to now (project).
func (h *Hybrid) allowance(e *hentry, now int64, proj, n float64) float64 {
	if e.synced > 0 && now-e.synced > int64(creditLife) {
		return min(e.allowance, float64(e.grant)-float64(e.pending))
	}
	return e.allowance + h.growth(e, proj, n)
}

// resetOf is the time until e's key is full again (token bucket) or empty (windows),
// counting what this daemon admitted that Redis has not seen.
//
// The view's times count from when Redis read the key at the latest (the answer's
// arrival), never early; but no fixed window lasts longer than itself, and a token
// bucket Redis had at most a whole bucket from full (burst units at the limit's pace)
// is no further than that: beyond, by no more than the lag and the rounding, the lag
// is dropped. (Kept, a reset right after an exact sync said 10,001 ms of a 10 s window.)
func (h *Hybrid) resetOf(e *hentry, now int64, pending uint64, sv *slideAt) int64 {
	r := h.resetOfView(e, now, pending, sv)
	lim := e.lim
	switch lim.Algorithm() {
	case localbucket.TokenBucket:
		tau := int64(math.Ceil(float64(lim.Window()) * float64(lim.Burst()) / float64(lim.Requests())))
		if r > tau && r-tau <= lagNs(e.lag)+tau>>20+2*int64(time.Microsecond) {
			return tau
		}
	case localbucket.FixedWindow:
		return min(r, int64(lim.Window()))
	}
	return r
}

func (h *Hybrid) resetOfView(e *hentry, now int64, pending uint64, sv *slideAt) int64 {
	var s slideView // a sliding window's view (e.slide)
	sliding := e.synced > 0 && e.lim.Algorithm() == localbucket.SlidingWindow
	if sliding {
		s = sv.of(e).s
	}
	base := int64(0)
	if e.synced > 0 {
		r := int64(e.vt) // e.resetNs()
		if sliding {
			r = sv.reset
		}
		base = max(0, r-(now-e.synced))
	}
	unseen := int64(pending) - int64(e.grant)
	lim := e.lim
	w := int64(lim.Window())
	if unseen < 0 && lim.Algorithm() == localbucket.TokenBucket {
		// The view counts this daemon's grant as spent; what it has not used goes back
		// at the next sync, and the exact mode never counted it: the bucket is full that
		// much sooner. (Counted, a key whose request another rule refused, after the
		// exact sync that reserved its units, said 20 s to full where it was 5.)
		return max(0, base+unseen*w/int64(lim.Requests()))
	}
	if unseen <= 0 {
		return base
	}
	switch lim.Algorithm() {
	case localbucket.TokenBucket:
		return base + unseen*w/int64(lim.Requests())
	case localbucket.FixedWindow:
		if base > 0 {
			return base
		}
		return h.fixedLeft(e, now)
	default:
		// A sliding window empties when this window's count weighs less than one unit
		// into the next (emptyAt). In the view's window, q is its count and the units
		// admitted here since; past it, the units admitted here, as if all in now's
		// window (later: never early), the view's count being base's. Without a view
		// (units admitted here before the key's first sync: a shadow rule's, or a
		// degraded one's), now's window aligned on wall time, as Redis's turn on its
		// TIME (fixedLeft). Before, aligned on the daemon's monotonic clock: 200 ms off
		// the wall clock, 500 ms windows, the reset was 200 or 300 ms off.
		q, start := float64(unseen), now+h.fixedLeft(e, now)-w
		if sliding {
			if now < s.start+w {
				q, start = q+s.q, s.start
			} else {
				start = s.start + (now-s.start)/w*w
			}
		}
		return max(base, emptyAt(start, w, q)+slideMargin-now)
	}
}

// decide judges cost against e without charging it. fetch reports that e cannot decide
// it locally but an exact sync could; unreachable, that e cannot decide it locally and
// Redis is not answering, or did not in time for this request (gaveUp; see
// HybridOp.Unreachable).
//
// waited: the request waited for another's sync of the key; it may make its own exact
// sync although the view is now fresh. A key whose sync is in flight is still a fetch:
// take waits for that sync rather than sending a second.
// stale reports whether e has no fresh view at now: none yet (a key new here), or one
// last synced more than two intervals ago (a client whose requests rotate over the
// daemons). Such a key is decided by Redis, not by its view.
// windowEnd is when (daemon clock) the window of e's view ends, for a fixed or a sliding
// window (ok false for a token bucket, a key with no view, or a fixed window's view that
// counted nothing, whose reset says nothing of its end). A sliding window's count before
// its end is the next window's previous count, weighed as that window goes.
//
// Redis read the key somewhere in the sync's lag after the view's time, so the end is
// known only within that lag: end is its latest (the view's times are stored late, never
// early), earliest its soonest, lag sooner.
func windowEnd(e *hentry) (end, earliest int64, ok bool) {
	if e.synced == 0 {
		return 0, 0, false
	}
	switch e.lim.Algorithm() {
	case localbucket.FixedWindow:
		r := e.resetNs()
		end = e.synced + r
		return end, end - lagNs(e.lag), r > 0
	case localbucket.SlidingWindow:
		earliest = e.synced - int64(e.vt) + int64(e.lim.Window()) // slide's start + w
		return earliest + lagNs(e.lag), earliest, true
	}
	return 0, 0, false
}

// inView reports whether a unit admitted at now lies in the window of e's view for
// certain: after the window's latest start, before its earliest end (windowEnd).
func inView(e *hentry, now int64) bool {
	end, earliest, ok := windowEnd(e)
	return ok && now < earliest && now >= end-int64(e.lim.Window())
}

// fixedEnded reports whether e is a fixed window's whose view's window has ended by now.
// A view of a window that counted nothing (reset 0) says nothing of when it ends.
func (h *Hybrid) fixedEnded(e *hentry, now int64) bool {
	if e.lim.Algorithm() != localbucket.FixedWindow {
		return false
	}
	end, _, ok := windowEnd(e) // by its latest time: ended for certain
	return ok && end <= now
}

func (h *Hybrid) stale(e *hentry, now int64) bool {
	return e.synced == 0 || now-e.synced > 2*int64(h.interval)
}

func (h *Hybrid) decide(sh *hshard, e *hentry, sv *slideAt, now int64, cost uint64, n float64, mayFetch, waited, gaveUp, shadow bool) (r localbucket.Result, fetch, room, unreachable bool) {
	lim := e.lim
	r.Limit = lim.Requests()
	proj := projectAt(e, now, sv)
	pending := sh.pendingOf(e)
	unseen := max(0, float64(pending)-float64(e.grant))
	r.Remaining = uint64(max(0, math.Floor(proj-unseen))) + subFloor(uint64(e.grant), pending)
	r.Reset = h.resetOf(e, now, pending, sv)
	if r.Remaining >= lim.Capacity() {
		// Full: nothing counted, reserved by another daemon or admitted here. The view's
		// reset counts this daemon's grant as spent (and the sync's lag): a question on
		// a key whose only units were a grant held here answered its whole capacity left
		// and a reset of most of a window (or 1 ms).
		r.Reset = 0
	}
	if cost > lim.Capacity() {
		r.Impossible = true
		return r, false, false, false
	}
	need := float64(max(cost, 1))
	// Without a fresh view (a key new here, or last synced more than two intervals ago:
	// a client whose requests rotate over the daemons) the daemon asks Redis. With one, it
	// refuses and asks for a share grant at the next sync.
	stale := h.stale(e, now)
	// A window's view whose window may have ended (by the end's earliest time: the view
	// knows it only within its sync's lag, windowEnd), and units this daemon admitted
	// beyond its grant, not yet in Redis, all in the view's window for certain (no
	// flagStray): the next unit admitted here would lie past the end, and a sync dates
	// the units it carries by the last admission, so it would carry them into the new
	// window, where the client was refused them (10 a second, 4 on credit 30 ms before
	// the end: 7 of 10 admitted after it; TestHybridUnitsBeforeTheTurnStayInTheirWindow),
	// or, on a sliding window, counted them whole in the new window, not as the previous
	// one's, which weighs less as the new one goes (TestHybridSlidingUnitsBeforeTheTurn).
	// The request is decided by an exact sync, which counts them in their window first
	// (modeDated): one a key a window's turn, where the key admitted units on credit in
	// the interval before it, and a few more if the turn comes while Redis reads them (a
	// sync read before the turn brings a view of the same window, its earliest end still
	// to come). So are units that lie in the window before the view's (flagPrev: admitted
	// while the sync that brought the view was on its way over the turn), whatever the
	// grant: the request's unit would lie in the view's window beside them.
	//
	// Judged from the end's latest time, with the last admission before it, a burst sent
	// through a daemon across the turn of 1,000 per 2 s (the view 2 ms late) admitted
	// units in that lag, in the same millisecond, made no exact sync, and synced them all
	// at the next refusal, counted in the new window: 1,003 admitted, the rest told 1,965
	// ms, where the exact mode said 4 ms (TestE2EHybridBurstAcrossTheTurn,
	// TestHybridBurstAcrossTheTurn).
	turned := false
	if cost > 0 && mayFetch && !shadow && e.flags&flagStray == 0 && (unseen > 0 || e.flags&flagPrev != 0) {
		if _, earliest, ok := windowEnd(e); (e.flags&flagPrev != 0 || ok && earliest <= now) && h.redisAnswering(e) {
			turned = true
		}
	}
	switch {
	case shadow:
		// A shadow rule's op decides nothing and never waits for Redis: it is judged by
		// the key's room, whatever this daemon holds of it (what it admits beyond its
		// grant is counted at the next sync, as credit is), by the view it has, or, on a
		// key new here, as a fresh one. By the allowance, as a rule that enforces is, a
		// dry run reported refusals of requests its limit admits (3 per 5 s, its third
		// request, retry 97 ms), and left a key with no view unasked in an allowed check.
		if float64(r.Remaining) >= need {
			r.Allowed = true
			return r, false, false, false
		}
	case cost == 0:
		// A question, not a request: would one pass? By a fresh view, the key's room and
		// what this daemon holds of it (its grant: refused with it held, a question said
		// no where a request passed); without one, Redis (an exact sync that reserves
		// nothing). Not this daemon's credit, a key's first unit on it included: that
		// would answer "room" on a key other daemons have spent.
		if !stale && r.Remaining >= 1 {
			r.Allowed = true
			return r, false, false, false
		}
	case turned:
		// Not from the allowance: by an exact sync (fetch, below).
	case h.allowance(e, now, proj, n) >= need:
		r.Allowed = true
		return r, false, false, false
	}
	// A hot key (its last sync asked a share grant for two units or more) waits for its
	// next share grant, while one is coming: its view is fresh, or a sync of it is due
	// or on its way. A view gone stale with nothing to sync means the key has cooled:
	// before, it stayed hot for good and refused here with units free in Redis.
	hot := e.lastDemand >= 2 && (!stale || e.flags&(flagDirty|flagBusy) != 0)
	// On a key no other daemon uses or holds units of, the share grant is not waited for
	// where it cannot be what the request lacks: the view had room for the request at
	// the key's last sync, beside its grant and what this daemon admitted beyond it (the
	// grant was smaller than the room: a key's first epoch of demand is shared by two,
	// and a grant by the demand of the interval before), or the view is of a fixed window
	// that has ended (the demand that made the key hot was the last window's). The
	// request is decided as a cooled key's is, by an exact sync, which leaves half the
	// view as credit: a few a burst. Waited for, 5 per second used just before a window's
	// end, then 5 more just after it: 3 admitted, 2 refused until the next periodic sync
	// (TestHybridFixedWindowBurstAfterTheTurn); 1,000 a minute sent at once, 973-982
	// admitted and the rest refused until then. A key at its limit keeps waiting: the
	// grant took the view's room, and the refill since is the next grant's. So does a
	// shared key: without credit, each of its requests would be an exact sync.
	if hot && e.flags&(flagShared|flagHeld) == 0 && e.synced > 0 &&
		(e.view-unseen >= need || h.fixedEnded(e, now)) {
		hot = false
	}
	// What this daemon's grant still holds: reserved for it in Redis, and so left out of
	// the view.
	held := max(0, float64(e.grant)-float64(pending))
	// Room for it, on a key not busy here, the grant held counted: the request lost the
	// allowance a sync just brought to a concurrent one, or needs more than the
	// allowance (the grant held and a share of the view) holds; Take then decides it by
	// an exact sync, which gives the grant back and reserves the request's cost. (Without
	// the grant held, a key whose room was partly that grant was refused from the view,
	// told to wait for units that were free: 5 per 10 min, burst 7, 4 left, a cost of 3
	// refused with retry 120 s; a fixed window of 8 with 2 left, a cost of 2 told the
	// window's end. The exact mode admits both.)
	room = e.synced > 0 && !hot && proj-unseen+held >= need
	answering := h.redisAnswering(e)
	// A hot key whose view is over an interval old and that nothing has made dirty since
	// has no share grant coming by itself: its last sync emptied the demand that made it
	// dirty, and a client that waited for the retry this daemon gave it brings none. If
	// the view has room now, Redis can grant it: an exact sync, at most one an interval (it
	// refreshes the view). Refused instead, such a client was told 1 ms, refused again, for
	// the ~100 ms until the next sync brought a grant: 80 refusals, admitted 300 ms after a
	// retry said 199. A key in use is dirty or on its way (its next sync is due): without
	// that condition, 20 hot keys on 2 daemons made 48 times the script calls.
	//
	// So is one no other daemon uses whose view had no room for it at its sync, which
	// the refill or the window's turn made since: that sync granted nothing for want
	// of room, and no other is coming. Refused until the view was an interval old, a
	// client that waited for the retry (the time the view has room) was refused again:
	// a sliding window, 4 per 300 ms, 11 of 25 retries, each told the next sync. (Not
	// on a shared key: there the exact sync may find the units taken, leave the key
	// clean, and the next unit the refill brings make another, many an interval.)
	overdue := hot && e.flags&(flagDirty|flagBusy) == 0 && e.synced > 0 &&
		(now-e.synced > int64(h.interval) || e.flags&flagShared == 0 && e.view-unseen < need) &&
		proj-unseen >= need
	// So is a hot key no other daemon uses whose share grant, still held, is part of the
	// room the request needs: the view leaves the grant out (it is reserved for this
	// daemon), and with it the view has room, which the credit, a share of the view,
	// does not cover. The next share grant cannot do better (sized, on a key's first
	// epoch of demand, for two daemons), and an exact sync gives the grant back and
	// reserves the request's cost. Before, 5 per 500 ms, a cost of 1, then a cost of 5
	// refused with retry 100 ms: the sync between took the refusal for demand and
	// granted 2 units, the key became hot, and the retry was refused again with 4 left
	// and retry 199 ms (the grant left out), where the exact mode admits it. At most
	// one such sync per grant: it leaves the key holding exactly the cost, used at once;
	// a request of one unit is never refused while a grant is held.
	grantRoom := hot && e.flags&flagShared == 0 && e.synced > 0 && held > 0 &&
		proj-unseen < need && proj-unseen+held >= need
	fetch = mayFetch && (waited || !hot && stale || overdue || grantRoom || turned) && answering
	// Without Redis, a key is decided by its rule's policy when only Redis could decide
	// it: one with no view, or whose view (projected to now: its refill, its window's
	// end) has room for it, which other daemons may have taken. A view with no room
	// refuses it, stale or not: other daemons can only have used more since. Before, a
	// stale one went to the policy too, and local decided it from a bucket of its own,
	// fresh: a client over its limit was admitted again each time Redis went away
	// (TestHybridStaleLimitedKeyRefusedWhileRedisAway).
	unreachable = (gaveUp || !answering) && (e.synced == 0 || proj-unseen >= need)
	// Out of allowance: retry when the view says the units free up (a token bucket at
	// the limit's rate, a fixed window at its end, a sliding window as its estimate
	// falls), but not before the next sync brings a new allowance.
	nextView := int64(h.interval)
	if e.synced > 0 {
		nextView = max(int64(time.Millisecond), e.synced+int64(h.interval)-now)
	}
	retry := int64(0)
	turn := false // the retry is a fixed window's end, when the key has room again here
	switch alg := lim.Algorithm(); {
	case proj-unseen+held >= need:
		// The view has room for it (with the grant this daemon holds), beside what this
		// daemon admitted that Redis has not counted yet: refused for want of allowance,
		// which the next sync brings. (Judged
		// by the view alone, a refusal for want of room said the next sync where the
		// units admitted here beyond the grant took the room: 5/s, costs 3, 1 and 3, a
		// retry of 200 ms where 2 tokens take 400; 4 per 2 s, costs 2, 1 and 2, 100 ms
		// where the window had to end, or 500 ms for a token bucket.)
	case alg == localbucket.SlidingWindow && e.synced > 0:
		// When the estimate leaves room for need more units beside those admitted here
		// and not in Redis yet: at the previous window's pace, then at this one's. (The
		// limit's pace, which this took before, is faster: 5 per 1.5 s, 4 taken, a
		// cost of 2 was told 300 ms where the window's end was due.)
		retry = sv.of(e).s.at(need, unseen) - now
	default:
		// The view is Redis's at up to the sync's lag after e.synced (and a token
		// bucket's count is given up to 2 µs of refill for the doubles' rounding,
		// tb_eps in scripts/hybrid.lua): the refill counted from e.synced is that much
		// ahead, and so was the retry.
		retry = int64(math.Ceil((need-(proj-unseen))*float64(lim.Window())/float64(lim.Requests()))) +
			lagNs(e.lag) + 2*int64(time.Microsecond)
		if alg == localbucket.FixedWindow && e.synced > 0 {
			age := now - e.synced
			if end := e.resetNs() - age; end > 0 {
				retry = end // a fixed window frees nothing before it ends
				// On a key no other daemon uses or holds units of, with nothing admitted
				// here that Redis has not counted, the new window has room for the cost
				// at its start, decided here then (not hot: decide's turn): its end is
				// the retry even before the next sync.
				turn = e.flags&(flagShared|flagHeld) == 0 && unseen == 0
			} else {
				// The view's window has ended: the units admitted here since are counted
				// in now's window (as of the sync that carries them), which frees nothing
				// before its own end either (resetOfView's end of it). Judged at the
				// limit's pace, 7 per 360 ms, one unit 5 ms before the turn and three
				// after, a cost of 5 was told the next sync (82 ms) and refused again
				// there, 271 ms before the window's end.
				retry = max(retry, h.fixedLeft(e, now))
			}
			retry = max(retry, e.retryNs()-age)
		}
	}
	// Units of the key are reserved by other daemons (flagHeld), and come back at their
	// next syncs unless used: a retry after this daemon's next sync (nextView) may find
	// them, where the window's end or the bucket's refill is far. Told those, a client
	// spread over 3 daemons waited 39 s for units free again within half a second; one of
	// 8 an hour, 450 s (TestE2EHybridBurstSpreadRetriedGetsTheLimit). Only past heldWait
	// intervals: on a key hot on every daemon the others use what they hold, and a
	// client honouring a retry of one interval was refused again and again (5 per 2 s,
	// 6 clients over 3 daemons: 2.6 times the refusals of the exact mode, and 1.4 times
	// its script calls, for the same admitted), where the refill was 400 ms away.
	if retry > heldWait*int64(h.interval) && e.flags&flagHeld != 0 && e.synced > 0 {
		retry = 0
	}
	// Never past the time the key is full again (r.Reset): the refill of a unit counted
	// from now, on a view whose last unit another daemon admitted 50 ms before, said
	// retry 60,002 ms with reset 59,950 on a limit of 1 per minute.
	if r.Reset > 0 && retry > r.Reset {
		retry = r.Reset
	}
	if r.RetryAfter = max(nextView, retry); turn {
		// Before, such a refusal said the next sync: 5 per second used 50 ms before
		// the window's end, told 100 ms (TestHybridFixedWindowBurstAfterTheTurn).
		r.RetryAfter = retry
	}
	// What is left, as the exact mode reports a refusal: less than the cost (a cost of 2
	// refused with 1 left says 1, not 0), never more than the view holds.
	r.Remaining = min(r.Remaining, uint64(need)-1)
	return r, fetch, room, unreachable
}
