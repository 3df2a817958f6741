package limiter

import "github.com/rlsidecar/rlsidecar/localbucket"

// leaseStore is the concurrency rules' store (Leases, leases.go). Its take acquires, all
// or nothing, one slot in every concurrency op of the check, as one lease whose id it
// puts in Decision.Lease. The local buckets, the store after it, are decided within its
// take when a check has both (takeThen), so that the slots are held only once they
// passed; giveBack frees the lease for any other later store that rejects. An op's limit is max slots per lease: Requests is max,
// Window the lease. A cost of 0 asks without taking; any other cost holds one slot. A
// shadow op that does not fit is reported refused and holds nothing.
type leaseStore struct{ ls *Leases }

func (s leaseStore) take(now int64, d *Decision) (bool, error) {
	return s.takeThen(now, d, nil), nil
}

// takeThen is take with the rest of the request decided under the leases' lock: once
// every slot d takes is known free, then (when not nil) decides the stores after this
// one, and the slots are held only when it passes. A request that a local rate rule
// refuses then holds no slot, even for a moment. (Taken first and given back after the
// local buckets refused, the slot was held meanwhile, and another client's check of it
// at that moment was refused with the slot free: a concurrency rule of 1 per account,
// a rate rule of 1 an hour per user, one user spent checking the account as a fresh
// user did, 1 or 2 of 300 fresh users refused; TestE2ELeaseNotHeldByRefused.)
func (s leaseStore) takeThen(now int64, d *Decision, then func() bool) bool {
	ls := s.ls
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ok, n := s.peekLocked(now, d, false)
	if ok && n > 0 && ls.fullLocked() {
		// At the bound on live leases: every op that would take a slot is refused as if
		// full (a shadow op too, though it does not refuse the request); nothing is taken.
		ls.capped++
		for i := range d.ops {
			if o := &d.ops[i]; o.store == storeLease && d.Results[i].Allowed && o.cost > 0 {
				d.report(i, &localbucket.Result{Limit: o.lim.Requests(), RetryAfter: int64(maxRetryHint), Reset: int64(maxRetryHint)})
				ok = ok && o.shadow
			}
		}
		n = 0
	}
	if !ok || then != nil && !then() {
		return false
	}
	if n == 0 {
		return true
	}
	l := ls.newLease(d.Owner, n)
	for i := range d.ops {
		o := &d.ops[i]
		if o.store == storeLease && d.Results[i].Allowed && o.cost > 0 {
			ls.hold(l, o.key, d.Results[i].Name, now, int64(o.lim.Window()))
			d.Results[i].Remaining--
		}
	}
	d.Lease = l.id
	return true
}

// peekLocked writes each concurrency op's result from a peek at its slot, taking
// nothing, and reports whether the check fits (every op that is not a shadow has a free
// slot) and how many slots it would take. With first, it stops at the first op that does
// not fit. ls.mu must be held.
func (s leaseStore) peekLocked(now int64, d *Decision, first bool) (ok bool, n int) {
	ls := s.ls
	ok = true
	for i := range d.ops {
		o := &d.ops[i]
		if o.store != storeLease {
			continue
		}
		sl := ls.slots[string(o.key)]
		if sl != nil {
			ls.expireSlot(sl, now)
			sl = ls.slots[string(o.key)] // gone when every part expired
		}
		taking := s.earlier(d, i)
		if sl != nil && !o.shadow && uint64(len(sl.held))+taking >= o.lim.Requests() && ls.reapGoneLocked(sl, d.Owner, now) {
			sl = ls.slots[string(o.key)] // full, but some of it held by closed connections
		}
		if !s.report(d, i, o, sl, now, taking) && !o.shadow {
			ok = false
			if first {
				return false, n
			}
		}
		if d.Results[i].Allowed && o.cost > 0 {
			n++
		}
	}
	return ok, n
}

// wouldPass reports whether take would find a free slot for every concurrency op of the
// check, taking nothing (the results it writes are written again by take or skip): the
// peek apply makes, with localStore.wouldPass, before a store that waits on Redis takes
// for the request.
func (s leaseStore) wouldPass(now int64, d *Decision) bool {
	s.ls.mu.Lock()
	defer s.ls.mu.Unlock()
	ok, _ := s.peekLocked(now, d, true)
	return ok
}

// earlier counts the slots that ops of d before op i, on the same key, are to take in
// this check (two parts of an Envoy call may match one rule with one key).
func (s leaseStore) earlier(d *Decision, i int) uint64 {
	var n uint64
	for j := range i {
		o := &d.ops[j]
		if o.store == storeLease && o.cost > 0 && d.Results[j].Allowed && string(o.key) == string(d.ops[i].key) {
			n++
		}
	}
	return n
}

// report writes op i's result from a peek at its slot sl, taking nothing, where taking
// more slots of it earlier in this check: allowed when a slot is free, remaining the
// free slots, and for a full one the retry hint. It reports whether a slot is free.
func (s leaseStore) report(d *Decision, i int, o *op, sl *slot, now int64, taking uint64) bool {
	slots := o.lim.Requests()
	held, retry := peekSlot(sl, slots, now)
	held += taking
	fits := held < slots
	if !fits && retry == 0 {
		retry = int64(maxRetryHint) // full only through this check's own parts
	}
	r := localbucket.Result{Allowed: fits, Limit: slots}
	if fits {
		r.Remaining = slots - held
	} else {
		r.RetryAfter, r.Reset = retry, retry
	}
	d.report(i, &r)
	return fits
}

func (s leaseStore) giveBack(now int64, d *Decision) {
	ls := s.ls
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if l := ls.leases[d.Lease]; l != nil {
		ls.freeLease(l, func(*LeaseStats) {})
	}
	for i := range d.ops {
		if o := &d.ops[i]; o.store == storeLease && d.Results[i].Allowed && o.cost > 0 {
			d.Results[i].Remaining++
		}
	}
	d.Lease = 0
}

func (s leaseStore) skip(now int64, d *Decision) {
	ls := s.ls
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for i := range d.ops {
		o := &d.ops[i]
		if o.store != storeLease {
			continue
		}
		s.report(d, i, o, ls.slots[string(o.key)], now, 0)
	}
}

// newLease returns an empty lease of owner with a new id, registered, with room for
// parts parts.
func (ls *Leases) newLease(owner uint64, parts int) *lease {
	var l *lease
	if n := len(ls.free); n > 0 {
		l = ls.free[n-1]
		ls.free = ls.free[:n-1]
	} else {
		l = new(lease)
	}
	if cap(l.parts) < parts {
		l.parts = make([]leasePart, 0, parts)
	}
	ls.next++
	l.id, l.owner = ls.next, owner
	ls.leases[l.id] = l
	if owner != 0 {
		o := ls.owners[owner]
		if o == nil {
			o = new(ownerLeases)
			ls.owners[owner] = o
		}
		o.add(l)
	}
	return l
}

// hold adds to l a part holding one slot of key in rule, expiring after dur.
func (ls *Leases) hold(l *lease, key []byte, rule string, now, dur int64) {
	sl := ls.slots[string(key)]
	if sl == nil {
		if n := len(ls.spare); n > 0 {
			sl = ls.spare[n-1]
			ls.spare = ls.spare[:n-1]
		} else {
			sl = new(slot)
		}
		sl.buf, sl.askedAt = append(sl.buf[:0], key...), 0
		ls.slots[sl.key()] = sl
		ls.keyUnits += slotUnits(len(key))
	}
	st := ls.stats[rule]
	if st == nil {
		st = new(LeaseStats)
		ls.stats[rule] = st
	}
	if len(l.parts) == cap(l.parts) {
		panic("BUG: limiter: a lease holds more parts than newLease made room for")
	}
	l.parts = l.parts[:len(l.parts)+1]
	p := &l.parts[len(l.parts)-1]
	*p = leasePart{l: l, s: sl, stats: st, expires: now + dur, dur: dur, rule: rule}
	sl.held = append(sl.held, p)
	st.InFlight++
	l.live++
}

// AskLeases makes the concurrency rules of d, prepared (Limiter.Prepare) and not yet
// decided, ask whether a slot is free and take none, whatever the cost: for a protocol
// with no release (Envoy's), whose calls would otherwise take a slot and give it back as
// they are answered, holding it meanwhile against every other check. A rule asked so
// answers as a check of cost 0 does: allowed while a slot is free, its free slots as the
// remaining, no lease; but a refusal of one that had a cost counts toward its rule's
// penalty, as the refusal of the client's request it is (a cost-0 check a client sends
// only asks: not counted).
func (d *Decision) AskLeases() {
	for i := range d.ops {
		if o := &d.ops[i]; o.store == storeLease || o.store == storeGlobalLease {
			o.cost, o.asked = 0, o.cost != 0
		}
	}
}

// SkipLeases leaves the concurrency rules of d, prepared (Limiter.Prepare) and not yet
// decided, out of its decision: each is reported allowed with its max, takes and asks
// nothing, and refuses nothing; the rest of d is decided as it would be. For a check
// that charges rate rules alone, such as Envoy's charge of a refused call, which a full
// concurrency rule of the same descriptor would otherwise refuse, charging nothing.
func (d *Decision) SkipLeases() {
	for i := range d.ops {
		if o := &d.ops[i]; o.store == storeLease || o.store == storeGlobalLease {
			o.store, o.cost = decided, 0
			d.report(i, &localbucket.Result{Allowed: true, Limit: o.lim.Requests(), Remaining: o.lim.Requests()})
		}
	}
	d.routed &^= 1<<storeLease | 1<<storeGlobalLease
}
