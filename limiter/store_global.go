package limiter

import (
	"context"
	"time"

	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// globalStore is the global mode's store: every check is one atomic script in Redis
// (rlsync.Global), waiting at most wait; past it, or on any error, take fails and the
// rules' failure policies decide. A give back is a refund script within the same bound;
// a refund that fails only leaves capacity used until it refills. This file is the only
// one that calls rlsync.Global.
type globalStore struct {
	g    *rlsync.Global
	wait time.Duration
}

func (s globalStore) take(_ int64, d *Decision) (bool, error) {
	n := scratchOf[rlsync.GlobalOp](d, storeGlobal)
	for i := range d.ops {
		o := &d.ops[i]
		if o.store == storeGlobal {
			// The key is copied: the global path goes to Redis anyway.
			n.ops = append(n.ops, rlsync.GlobalOp{Key: string(o.key), Limit: o.lim, Cost: o.cost, Shadow: o.shadow})
			n.at = append(n.at, i)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.wait)
	ok, err := s.g.Check(ctx, n.ops)
	cancel()
	if err != nil {
		return false, err
	}
	s.results(d, n)
	return ok, nil
}

func (s globalStore) giveBack(_ int64, d *Decision) {
	n := lastBatch[rlsync.GlobalOp](d, storeGlobal)
	// Undo bounds itself (not by wait: the decision is made, only capacity is at stake).
	// A failed refund, counted in RefundErrors, leaves capacity used until it refills.
	_ = s.g.Undo(context.Background(), n.ops)
	s.results(d, n)
}

// skip leaves the results empty: Redis is not asked.
func (s globalStore) skip(int64, *Decision) {}

func (s globalStore) results(d *Decision, n *native[rlsync.GlobalOp]) {
	for k, i := range n.at {
		d.report(i, &n.ops[k].Result)
	}
}
