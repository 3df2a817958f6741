package limiter

import (
	"errors"
	"hash/maphash"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// storeID names a store, and orders the stores: apply visits them in this order.
//
// The order is cheapest to give back first: hybrid allowances are given back in memory,
// global checks with one refund round trip, and the local buckets last, because they
// commit only when everything before them passed and because the failure policy "local"
// moves a check there from an earlier store. A new store goes before storeLocal.
type storeID uint8

const (
	storeHybrid      storeID = iota // local allowances synced to Redis (store_hybrid.go)
	storeGlobal                     // one atomic Redis script per check (store_global.go)
	storeGlobalLease                // concurrency rules' slots in Redis (store_lease_global.go)
	storeLease                      // concurrency rules' slots (store_lease.go, leases.go)
	storeLocal                      // this daemon's buckets (store_local.go); always last
	numStores

	// decided marks an op that no store decides: its failure policy wrote its result.
	decided storeID = numStores
)

// store is the one thing a mode is to the limiter: where a check's operations are taken
// from, all-or-nothing, and given back. Each store sees, per check, the Decision's ops
// routed to it (those whose store field is its id) as one batch; an adapter translates
// them to its package's API, keeping that API's scratch types in the Decision
// (scratchOf), and writes each op's res back.
//
// A store is shared by every check and must be safe for concurrent use; what belongs to
// one check lives in its Decision.
type store interface {
	// take decides the batch at now. When every non-shadow op fits, it takes what the ops
	// that fit cost and returns true; otherwise it takes nothing and returns false.
	// Either way it writes every op's res. An error says the store cannot decide now
	// (Redis down, too slow, allowances stale): nothing was taken, and the ops' failure
	// policies decide instead (Decision.fallBack).
	take(now int64, d *Decision) (bool, error)
	// giveBack returns what the batch's last take took (it returned true), because a
	// later store rejected the request, and updates the results to match.
	giveBack(now int64, d *Decision)
	// skip stands in for take when an earlier store has already rejected the request:
	// nothing is taken, but a store may report its ops' results as a peek would.
	skip(now int64, d *Decision)
}

// errStale is a store's error when its state is too old to decide from.
var errStale = errors.New("store state is stale")

// op is one operation of a check: one rule's (or inline limit's) limit on one client key,
// routed to one store. A check is a slice of ops, parallel to Decision.Results, where
// each op's outcome is written (Decision.report).
// matchRules writes every field of a rule's op in place: a new field must be written
// there too.
type op struct {
	key      []byte // the client key (Redis prefix included for a Redis store)
	lim      *localbucket.Limit
	cost     uint64
	fb       fallback // what decides when its store cannot
	shadow   bool
	store    storeID
	degraded bool     // a failure policy decided or rerouted it
	bans     banScope // where the rule's bans live (bans_shared.go)
	flags    uint16   // the rule's infoDeny, infoPenalty, infoWarn (compiled.go); 0 for an inline limit
	// bannedUntil is when the ban of key by the op's rule (its penalty) ends; 0 when not
	// banned (Decide, checkBans).
	bannedUntil int64
	// shared: the local store decided it on its rule's fallback state, shared by the
	// keys it could not store (localbucket.Op.Shared): a refusal of it earns no ban.
	shared bool
	// asked: a concurrency op AskLeases made ask (cost 0) for a protocol with no release:
	// unlike a cost-0 check its client sent, its refusal counts toward its rule's ban.
	asked bool
}

// AppendKeyHashes appends to dst the hash under seed of each key the check prepared in d
// takes from (its rules' and inline limits'), and returns it: the daemon orders a
// connection's pipelined checks that share a key by them (a collision only orders two
// checks that need not be).
//
// A hash's low bit says where the key's state is: 1 in Redis, taken by a global script
// call (KeyInRedis), 0 here.
func (d *Decision) AppendKeyHashes(dst []uint64, seed maphash.Seed) []uint64 {
	for i := range d.ops {
		h := maphash.Bytes(seed, d.ops[i].key) &^ 1
		if s := d.ops[i].store; s == storeGlobal || s == storeGlobalLease {
			h |= 1
		}
		dst = append(dst, h)
	}
	return dst
}

// KeyInRedis reports whether a hash of AppendKeyHashes or Limiter.AppendLeaseKeyHashes is
// of a key whose state is in Redis, taken by a global script call: the calls of two
// checks of such a key are decided by Redis in the order they are queued for it.
func KeyInRedis(h uint64) bool { return h&1 != 0 }

// fallback is what decides a Redis-backed check when Redis cannot: the rule's policy,
// and for policy local the limit of the local bucket (the rule's limit divided among the
// live daemons last counted).
type fallback struct {
	policy rules.FailurePolicy
	// share: local is where to put the op's limit divided among the live daemons
	// (Decision.live), worked out when the fallback is taken (an inline limit's).
	share bool
	local *localbucket.Limit
}

// route sends op i to store id.
func (d *Decision) route(i int, id storeID) {
	d.ops[i].store = id
	d.routed |= 1 << id
	d.localReady = false // Prepare builds the local batch after routing; a reroute rebuilds it
}

// unasked reports whether op i's result is not its store's: the store was skipped (an
// earlier one rejected) and, unlike the local store, reports nothing when skipped.
func (d *Decision) unasked(i int) bool {
	id := d.ops[i].store
	return d.skipped&(1<<id) != 0 && (id == storeHybrid || id == storeGlobal)
}

// markUnasked marks the result of each op routed to id as unasked (Result.Unasked): a
// skipped store that reports nothing of them.
func (d *Decision) markUnasked(id storeID) {
	for i := range d.ops {
		if d.ops[i].store == id {
			d.Results[i].Unasked = true
		}
	}
}

// routes reports whether any op of d is routed to id.
func (d *Decision) routes(id storeID) bool { return d.routed&(1<<id) != 0 }

// report writes a store's outcome for op i into its Result.
func (d *Decision) report(i int, r *localbucket.Result) {
	out := &d.Results[i]
	out.Limit = r.Limit
	out.Remaining = r.Remaining
	out.Reset = time.Duration(r.Reset)
	out.RetryAfter = time.Duration(r.RetryAfter)
	out.Allowed = r.Allowed
	out.Impossible = r.Impossible
	out.Delay = time.Duration(r.Delay)
}

// apply decides the request's ops all-or-nothing across the stores, in storeID order.
// A store that rejects leaves the later ones only reporting (skip), and the earlier ones
// that took give back. A store that cannot decide hands its ops to their failure
// policies (fallBack), which may reroute them to the local store. With ok false the
// request is already refused (a ban): every store only reports.
func (l *Limiter) apply(now int64, d *Decision, ok bool) bool {
	if d.routed == 1<<storeLocal && ok && !d.general {
		// Only local ops (most checks): the local store decides alone, and nothing
		// before it can have taken.
		return localStore{l.buckets}.take1(now, d)
	}
	if ok && !d.noWait && d.routed&(1<<storeLocal|1<<storeLease) != 0 && d.routed&(1<<storeHybrid|1<<storeGlobal|1<<storeGlobalLease) != 0 &&
		!l.localWouldPass(now, d) {
		// A local rule refuses: the request is refused before a store that waits on Redis
		// takes for it. Taken, its Redis charge would be given back only after the local
		// refusal, a round trip later, and held meanwhile: a client retrying a request a
		// local rule refuses would keep a small Redis-backed budget held on every daemon
		// against everyone's requests. (A local bucket emptied, or a local concurrency
		// slot taken, by another request between this peek and the take below still
		// refuses there, and the Redis stores give back, as before: rare.)
		ok = false
	}
	var took [numStores]bool
	localDone := false // decided with the local concurrency rules (leaseStore.takeThen)
	for id := range numStores {
		if !d.routes(id) || id == storeLocal && localDone {
			continue
		}
		s := l.stores[id]
		if !ok {
			s.skip(now, d)
			d.skipped |= 1 << id
			continue
		}
		var passed bool
		var err error
		if id == storeLease && d.routes(storeLocal) {
			// The local buckets are decided while the slots are known free, and the slots
			// held only when they pass: a request they refuse holds none, not for a moment.
			passed = leaseStore{l.leases}.takeThen(now, d, func() bool {
				localDone = true
				return localStore{l.buckets}.take1(now, d)
			})
		} else {
			passed, err = s.take(now, d)
		}
		if d.wouldWait {
			// DecideInline: this store would wait on Redis. Give back what the earlier
			// stores took; the decision is made again where waiting is fine.
			for e := range id {
				if took[e] {
					l.stores[e].giveBack(now, d)
				}
			}
			return false
		}
		if err != nil {
			passed = d.fallBack(id)
		} else {
			took[id] = passed
		}
		if !passed {
			ok = false
			for e := range id {
				if took[e] {
					l.stores[e].giveBack(now, d)
				}
			}
		}
	}
	return ok
}

// localWouldPass reports whether d's local rate rules and local concurrency rules (the
// stores after the Redis ones) would allow it, taking nothing.
func (l *Limiter) localWouldPass(now int64, d *Decision) bool {
	if d.routes(storeLocal) && !(localStore{l.buckets}).wouldPass(now, d) {
		return false
	}
	return !d.routes(storeLease) || (leaseStore{l.leases}).wouldPass(now, d)
}

// fallBack decides the ops routed to id without that store, each by its failure policy:
// open allows, closed rejects (retry, and reset, in a second), local reroutes the op to the local
// store with the rule's limit divided among the live daemons (decided later in apply,
// since storeLocal comes last). Every such op, and the decision, is marked degraded. It
// reports whether the request may still pass: false when closed refused a non-shadow op.
func (d *Decision) fallBack(id storeID) bool {
	d.Degraded = true
	ok := true
	for i := range d.ops {
		o := &d.ops[i]
		if o.store != id {
			continue
		}
		o.degraded = true
		switch o.fb.policy {
		case rules.FailOpen:
			o.store = decided
			d.report(i, &localbucket.Result{Allowed: true, Limit: o.lim.Requests(), Remaining: o.lim.Capacity()})
		case rules.FailClosed:
			o.store = decided
			// Reset as far off as the retry: 0 would say "full again now" beside a
			// retry-after of a second (a gateway's RateLimit t=0 with Retry-After: 1).
			d.report(i, &localbucket.Result{Limit: o.lim.Requests(), RetryAfter: int64(time.Second), Reset: int64(time.Second)})
			ok = ok && o.shadow
		default:
			switch {
			case o.fb.share:
				o.fb.share = false // worked out once: a later fallBack takes local as it is
				share, err := rules.SplitLimit(o.lim, uint64(max(d.live, 1)))
				if err != nil {
					o.fb.local = nil
					break
				}
				*o.fb.local = share
				o.lim = o.fb.local
			case o.fb.local != nil:
				o.lim = o.fb.local
			}
			if r := d.Results[i].Rule; r != nil && r.Concurrency {
				d.route(i, storeLease) // a local lease (storeLease comes after the Redis stores)
			} else {
				d.route(i, storeLocal)
			}
		}
	}
	return ok
}

// native is one store's batch in its own API's types: kept in the Decision between
// checks, so a check allocates nothing once its largest batch has been seen.
type native[T any] struct {
	ops []T
	at  []int // for each of ops, its index in Decision.ops
}

// scratchOf returns store id's scratch in d, emptied, creating it on first use.
func scratchOf[T any](d *Decision, id storeID) *native[T] {
	n, _ := d.scratch[id].(*native[T])
	if n == nil {
		n = new(native[T])
		d.scratch[id] = n
	}
	n.ops, n.at = n.ops[:0], n.at[:0]
	return n
}

// lastBatch returns store id's scratch as its last take left it, for giveBack.
func lastBatch[T any](d *Decision, id storeID) *native[T] {
	n, ok := d.scratch[id].(*native[T])
	if !ok {
		panic("BUG: limiter: giveBack before take")
	}
	return n
}

// push extends s by one element in place and returns it, so a caller fills a large
// struct where it lives instead of building it and copying it in.
func push[T any](s *[]T) *T {
	if len(*s) < cap(*s) {
		*s = (*s)[:len(*s)+1]
	} else {
		var zero T
		*s = append(*s, zero)
	}
	return &(*s)[len(*s)-1]
}
