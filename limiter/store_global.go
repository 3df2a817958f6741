package limiter

import (
	"bytes"
	"context"
	"strconv"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// globalStore is the global mode's store: every check is one atomic script in Redis
// (rlsync.Global), waiting at most wait; past it, or on any error, take fails and the
// rules' failure policies decide. A give back is a refund script within the same bound;
// a refund that fails only leaves capacity used until it refills. This file is the only
// one that calls rlsync.Global.
//
// A penalty rule's op with shared bans (bansGlobal) brings a ban check of its key into
// the same script call: a banned client's check commits nothing, in one round trip. A
// global concurrency rule's too: its check is then routed here (matchRules), with no rate
// op, so that its ban and its lease slots are decided in one call.
//
// A calendar window's key names the window: its start, from the daemon's wall clock and
// the limit's zone, goes before the hash tag (calendarKey), so every daemon counts one
// window in one key and a window's key expires with it.
//
// A check with global concurrency rules too brings their lease slots into the same Check
// (rlsync.LeaseCheck): where they share a hash slot with its rate rules (the same
// client), one script call decides them all-or-nothing; across slots, one pipeline and
// refunds. The lease store (leases) builds the slots and, after this take, keeps the
// lease it holds (globalLeaseStore.take) or reports them (skip).
type globalStore struct {
	g      *rlsync.Global
	wait   time.Duration
	wall   *localbucket.Store // its WallOffset turns the limiter's clock into wall time
	leases *globalLeaseStore
	bans   *rlsync.Bans // the shared bans (WithSharedBans), for their Shift; nil: none
}

func (s globalStore) take(now int64, d *Decision) (bool, error) {
	n := scratchOf[rlsync.GlobalOp](d, storeGlobal)
	for i := range d.ops {
		o := &d.ops[i]
		if o.store == storeGlobal {
			// The key is copied: the global path goes to Redis anyway.
			op := rlsync.GlobalOp{Key: string(o.key), Limit: o.lim, Cost: o.cost, Shadow: o.shadow}
			if start, end, ok := o.lim.CalendarBounds(now + s.wall.WallOffset()); ok {
				op.Key = calendarKey(o.key, start)
				op.WindowLeft = time.Duration(end - now - s.wall.WallOffset())
			}
			n.ops = append(n.ops, op)
			n.at = append(n.at, i)
		}
		if o.bans == bansGlobal && (o.store == storeGlobal || o.store == storeGlobalLease) {
			// The key's shared ban, checked in the same script call (same slot).
			op := rlsync.GlobalOp{Key: rlsync.BanKey(string(o.key)), Limit: o.lim, Shadow: o.shadow, Ban: true}
			if s.bans != nil {
				op.BanShift = s.bans.ShiftOf()
			}
			n.ops = append(n.ops, op)
			n.at = append(n.at, i)
		}
	}
	var lb *leaseBatch
	if d.routes(storeGlobalLease) {
		lb = s.leases.prepare(now, d)
		lb.combined = true
		if lb.err == nil && !lb.capped {
			for k := range lb.ops {
				n.ops = append(n.ops, rlsync.LeaseCheck(lb.id, &lb.ops[k]))
				n.at = append(n.at, lb.at[k])
			}
		}
	}
	ctx, cancel := context.WithTimeout(d.queuedCtx(), s.wait)
	ok, err := s.g.Check(ctx, n.ops)
	cancel()
	if lb != nil && lb.err == nil {
		lb.err = err
	}
	if err != nil {
		return false, err
	}
	s.results(now, d, n)
	return ok, nil
}

func (s globalStore) giveBack(now int64, d *Decision) {
	n := lastBatch[rlsync.GlobalOp](d, storeGlobal)
	// Undo bounds itself (not by wait: the decision is made, only capacity is at stake).
	// A failed refund, counted in RefundErrors, leaves capacity used until it refills.
	_ = s.g.Undo(context.Background(), n.ops)
	s.results(now, d, n)
}

// skip asks Redis nothing (the request is already refused): its ops are reported as
// unasked (Result.Unasked).
func (s globalStore) skip(_ int64, d *Decision) { d.markUnasked(storeGlobal) }

// results reports each op's result; a ban check that found a ban in force marks its op
// banned (Decide reports it as such) instead, until now (the limiter's clock) plus the
// time the ban had left by Redis's clock, which decided it; a lease slot is left to the
// lease store.
func (s globalStore) results(now int64, d *Decision, n *native[rlsync.GlobalOp]) {
	for k, i := range n.at {
		switch g := &n.ops[k]; {
		case g.Lease != nil: // the lease store reports it
		case g.Ban:
			if g.BannedUntil != 0 {
				d.ops[i].bannedUntil = now + max(g.Result.RetryAfter, 1)
			}
		default:
			d.report(i, &g.Result)
		}
	}
}

// calendarKey returns key (<prefix><rule>:{<client>}) with the calendar window's start,
// in Unix seconds, after the rule's name: <prefix><rule>@<start>:{<client>}. Rule names
// and prefixes have no '{', and rule names no '@', so it is another key of the same
// client (same hash tag, same slot), and no rule's key under any prefix.
func calendarKey(key []byte, start int64) string {
	tag := bytes.IndexByte(key, '{') - 1 // the ':' before the tag
	b := make([]byte, 0, len(key)+12)
	b = append(b, key[:tag]...)
	b = append(b, '@')
	b = strconv.AppendInt(b, start/int64(time.Second), 10)
	return string(append(b, key[tag:]...))
}
