package limiter

import rlsync "github.com/rlsidecar/rlsidecar/sync"

// hybridStore is the hybrid mode's store: this daemon's allowances, synced to Redis in
// the background by rlsync.Hybrid. Take and give back are in memory; while Redis has not
// answered for a while (Healthy is false) the allowances are stale and take fails, so
// the rules' failure policies decide, unless a key's last view still refuses the request
// (rlsync.Hybrid.RefusedByView). This file is the only one that calls rlsync.Hybrid.
type hybridStore struct{ h *rlsync.Hybrid }

// replicas returns the number of live daemons last counted (at least 1).
func (s hybridStore) replicas() int { return s.h.Replicas() }

// forgetViews drops the views of the keys of the rules named (rlsync.Hybrid.ForgetRuleViews).
func (s hybridStore) forgetViews(prefix string, names map[string]struct{}) {
	if s.h != nil {
		s.h.ForgetRuleViews(prefix, names)
	}
}

func (s hybridStore) take(now int64, d *Decision) (bool, error) {
	healthy := s.h.Healthy(now)
	n := scratchOf[rlsync.HybridOp](d, storeHybrid)
	for i := range d.ops {
		o := &d.ops[i]
		if o.store == storeHybrid {
			n.ops = append(n.ops, rlsync.HybridOp{Key: o.key, Limit: o.lim, Cost: o.cost, Shadow: o.shadow})
			n.at = append(n.at, i)
		}
	}
	if !healthy {
		// Redis away: the failure policies decide, but for a client this daemon's last
		// view of it still refuses (other daemons can only have used more since).
		if s.h.RefusedByView(now, n.ops) {
			s.results(d, n)
			return false, nil
		}
		return false, errStale
	}
	var ok bool
	if d.noWait {
		var wait bool
		if ok, wait = s.h.TryTake(now, n.ops); wait {
			d.wouldWait = true // nothing taken: DecideInline's caller decides elsewhere
			return false, nil
		}
	} else {
		ok = s.h.Take(now, n.ops)
	}
	if !ok && refusedForRedis(n.ops) {
		return false, errStale // nothing taken: the failure policies decide
	}
	s.results(d, n)
	return ok, nil
}

// refusedForRedis reports whether ops were refused only for want of Redis: every refused
// non-shadow op is one the daemon cannot decide without it (rlsync.HybridOp.Unreachable).
// A refusal because a limit is reached is not.
func refusedForRedis(ops []rlsync.HybridOp) bool {
	refused := false
	for i := range ops {
		if o := &ops[i]; !o.Result.Allowed && !o.Shadow {
			if !o.Unreachable {
				return false
			}
			refused = true
		}
	}
	return refused
}

func (s hybridStore) giveBack(now int64, d *Decision) {
	n := lastBatch[rlsync.HybridOp](d, storeHybrid)
	s.h.Undo(now, n.ops)
	s.results(d, n)
}

// skip reports the ops from the local view, for their cost, charging and syncing nothing
// (a check that another store or a ban refused): their rules' entries say what is left,
// not nothing, and whether the cost would pass.
// A key the local view does not hold, whose Peek reports its limit only (refused, yet
// possible and with no retry: a result that decided nothing), is reported unasked
// (Result.Unasked), not refused.
func (s hybridStore) skip(now int64, d *Decision) {
	n := scratchOf[rlsync.HybridOp](d, storeHybrid)
	for i := range d.ops {
		if o := &d.ops[i]; o.store == storeHybrid {
			n.ops = append(n.ops, rlsync.HybridOp{Key: o.key, Limit: o.lim, Cost: o.cost, Shadow: o.shadow, Banned: o.bannedUntil != 0})
			n.at = append(n.at, i)
		}
	}
	s.h.Peek(now, n.ops)
	s.results(d, n)
	for k, i := range n.at {
		if r := &n.ops[k].Result; !r.Allowed && !r.Impossible && r.RetryAfter == 0 {
			d.Results[i].Unasked = true
		}
	}
}

// results reports each op's result; one Take left unasked (rlsync.HybridOp.Unasked: no
// view of its key, and Redis not asked of it) is reported so (Result.Unasked).
func (s hybridStore) results(d *Decision, n *native[rlsync.HybridOp]) {
	for k, i := range n.at {
		d.report(i, &n.ops[k].Result)
		if n.ops[k].Unasked {
			d.Results[i].Unasked = true
		}
	}
}
