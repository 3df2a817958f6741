package limiter

import "github.com/rlsidecar/rlsidecar/localbucket"

// localStore is the local mode's store: this daemon's buckets (localbucket.Store). It is
// last in apply's order, so nothing after it can reject: it commits only when every
// other store passed, and never gives back.
type localStore struct{ s *localbucket.Store }

// batch returns d's local ops as the store's batch: the one Prepare gathered, or, when a
// failure policy has rerouted ops here since, gathered again.
func (s localStore) batch(d *Decision) *native[localbucket.Op] {
	n := &d.local
	if d.localReady {
		return n
	}
	n.ops, n.at = n.ops[:0], n.at[:0]
	for i := range d.ops {
		o := &d.ops[i]
		if o.store == storeLocal {
			addLocal(n, o.key, o.lim, o.cost, o.shadow, i)
		}
	}
	d.localReady = !d.general
	return n
}

func (s localStore) results(d *Decision, n *native[localbucket.Op]) {
	for k, i := range n.at {
		d.report(i, &n.ops[k].Result)
		d.ops[i].shared = n.ops[k].Shared
	}
}

func (s localStore) take(now int64, d *Decision) (bool, error) {
	return s.take1(now, d), nil
}

// take1 is take, which never fails.
func (s localStore) take1(now int64, d *Decision) bool {
	n := s.batch(d)
	ok := applyLocal(s.s, now, n.ops)
	s.results(d, n)
	return ok
}

// wouldPass reports whether the batch's take would pass now, taking nothing: every
// non-shadow op fits its bucket on its own (Reject's report).
func (s localStore) wouldPass(now int64, d *Decision) bool {
	n := s.batch(d)
	s.s.Reject(now, n.ops)
	for k := range n.ops {
		if o := &n.ops[k]; !o.Result.Allowed && !o.Shadow {
			return false
		}
	}
	return true
}

// skip reports the buckets' state without charging them (localbucket.Store.Reject).
func (s localStore) skip(now int64, d *Decision) {
	n := s.batch(d)
	s.s.Reject(now, n.ops)
	s.results(d, n)
}

func (s localStore) giveBack(int64, *Decision) {
	panic("BUG: limiter: the local store is last; nothing after it can reject")
}

// addLocal appends a local op (the op at index i in Decision.ops) to the batch n. Its
// Result is left as it was: Apply and Reject write every one.
func addLocal(n *native[localbucket.Op], key []byte, lim *localbucket.Limit, cost uint64, shadow bool, i int) {
	lo := push(&n.ops)
	lo.Key, lo.Limit, lo.Cost, lo.Shadow = key, lim, cost, shadow
	n.at = append(n.at, i)
}

// Prefetching reports whether Prefetch fetches: the local store is too big for the
// CPU's caches (localbucket.Store.Prefetching).
func (l *Limiter) Prefetching() bool { return l.buckets.Prefetching() }

// Prefetch starts fetching into the CPU's caches the local store's slots of the keys d's
// prepared check takes from (localbucket.Store.Prefetch): a caller deciding a pipelined
// batch calls it a few checks ahead, then PrefetchRecords, and its misses overlap the
// checks before. A hint: it changes nothing that Decide decides.
func (l *Limiter) Prefetch(d *Decision) {
	if !d.localReady {
		return
	}
	for k := range d.local.ops {
		l.buckets.Prefetch(&d.local.ops[k])
	}
}

// PrefetchRecords starts fetching the records of the keys whose slots Prefetch fetched.
func (l *Limiter) PrefetchRecords(d *Decision) {
	if !d.localReady {
		return
	}
	for k := range d.local.ops {
		l.buckets.PrefetchRecord(&d.local.ops[k])
	}
}
