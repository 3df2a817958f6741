package sync

import (
	"context"
	gosync "sync"
	"sync/atomic"
	"time"
)

// giveBackCap is the most give-backs a Global holds at once, queued, on the wire, or
// waiting for a later round; past it a new one is dropped (and counted). A give-back is
// only needed for an acquire that failed unanswered, and the breaker stops sending
// checks after a few of those, so in an outage the queue holds about the checks that
// were in flight when Redis froze: 4096 is four times the daemon's default --max-conns
// (1024), each with a check on its way. It also bounds what a Redis that is slow but not
// down (timeouts among answers, the breaker closed) receives: a give-back keeps its
// place until its last round has gone. That is its second, giveBackDelay after its
// first; when the second fails, a third, 2 giveBackDelays later; when that fails too, a
// fourth, 4 later (giveBackRetries). So one is held 1, 3 or 7 giveBackDelays after its
// first round ended, plus the later rounds' own time (each at most the refund timeout)
// and any wait behind an open breaker, and at most giveBackCap are taken in per
// giveBackDelay (fewer while retries hold places), each sent in two to four rounds
// merged into a few calls (see sendGiveBacks). It bounds memory too: a few hundred
// bytes each, about 1 MB.
const giveBackCap = 4096

// giveBackBatch is the most give-backs one round trip carries, and so the most on the
// wire at once: the worker sends one batch and waits for its answer (at most the refund
// timeout) before the next. On a standalone Redis a batch is one pipeline of refund.lua
// calls of at most giveBackKeys keys each (sendGiveBacks): a batch of 512 one-key
// give-backs is two calls. A give-back's keys are never split between calls, so
// give-backs of several keys can take more calls than their keys ÷ giveBackKeys (512 of
// three keys: seven), and one of more than giveBackKeys keys gets a call of its own.
const giveBackBatch = 512

// giveBackDelay is how long after its first give-back the slots of a lease whose
// acquire failed unanswered are given back again (see giveBackUnsure). A variable for
// tests, set before the Global they use gives anything back.
var giveBackDelay = time.Second

// giveBackRetries is how many more rounds a give-back gets whose second round failed (a
// Redis slow enough to time it out, its breaker still closed), each giveBackDelay times
// 2, then 4, after the last: before, a failed second round was the end of it, and the
// slots its acquire may have taken stayed held until their lease ended (up to an hour).
// Each retry holds its place in giveBackCap longer: the last round is due 7
// giveBackDelays after the first ended (plus the rounds' own time; see giveBackCap).
const giveBackRetries = 2

// giveBackPoll is how often the worker looks again at give-backs held by an open
// breaker: about the first wait of a breaker (an eighth of its default cooldown).
const giveBackPoll = 100 * time.Millisecond

// giveBacks is a Global's background give-back of lease slots (see
// [Global.giveBackUnsure]): a queue bounded by giveBackCap and one worker goroutine,
// started by the first give-back and ending when none is left, or at
// [Global.Close]. Its zero value is ready. Safe for concurrent use.
type giveBacks struct {
	mu      gosync.Mutex
	first   []giveBack // waiting for their first round, oldest first
	second  []giveBack // sent once or more, waiting for their next round (any order)
	held    int        // give-backs in first, second, or in the worker's batch
	running bool       // the worker is on
	closed  bool       // Close was called: the worker sends what is left and ends
	wake    chan struct{}
	wg      gosync.WaitGroup // the worker, for Close

	dropped atomic.Uint64
}

// giveBack is one failed call's lease slots to give back: its refund.lua keys and args.
type giveBack struct {
	keys []string
	args []any
	due  time.Time // the next round's time; zero while the first is to go
	// retries is the rounds it has had after its second (giveBackRetries)
	retries uint8
	m       *Master // its master in this pass (nextGiveBacks); nil: not gated
	// probe: in this pass it took the probe of its master's open breaker (settle)
	probe bool
	err   error // the last round's error
}

// giveBackUnsure queues the give-back of the lease slots of acquires that failed
// without an answer (they timed out, or their connection was lost): each request was
// decided by its failure policy and holds no lease, but the script may have run and
// taken them, and then no one would release them before they expire (up to an hour),
// nor see them (the daemon tracks no such lease). Removing a member that is not there
// changes nothing, so giving back is safe either way. Each goes twice, at once and
// again giveBackDelay later, for an acquire still on its way to Redis when the first
// got there; a second round that fails goes again, up to giveBackRetries times.
//
// It never blocks and never spawns a goroutine per call: a Redis slow enough to time
// acquires out is not sent a give-back per acquire at once. The worker sends them in
// batches, one on the wire at a time, behind the masters' breakers; past giveBackCap
// they are dropped and counted in [Global.GiveBacksDropped] (their slots stay held
// until their lease ends).
func (g *Global) giveBackUnsure(calls []call) {
	q := &g.giveBacks
	q.mu.Lock()
	n := 0
	for _, c := range calls {
		if q.closed || q.held >= giveBackCap {
			break
		}
		q.first = append(q.first, giveBack{keys: c.keys, args: c.args})
		q.held++
		n++
	}
	start := n > 0 && !q.running
	if start {
		q.running = true
		if q.wake == nil {
			q.wake = make(chan struct{}, 1)
		}
		q.wg.Add(1)
	}
	q.mu.Unlock()
	if n < len(calls) {
		q.dropped.Add(uint64(len(calls) - n))
	}
	switch {
	case start:
		go g.giveBackWorker()
	case n > 0:
		q.poke()
	}
}

// poke wakes the worker if it waits.
func (q *giveBacks) poke() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// GiveBacksDropped returns how many lease give-backs were dropped: queued when
// giveBackCap were already held, or left unsent by Close. Each leaves the slots of an
// acquire that failed unanswered held, if its script ran, until their lease ends.
func (g *Global) GiveBacksDropped() uint64 { return g.giveBacks.dropped.Load() }

// Close stops the background give-back of lease slots (see [Global.Acquire]): what is
// queued is sent once more, at once, within the refund timeout (see
// [Global.WithRefundTimeout]), and what that leaves is dropped. Close returns when the
// worker has ended. g still checks after Close; the give-backs it would queue are
// dropped. Call it once nothing checks any more, before g's client is closed.
func (g *Global) Close() {
	q := &g.giveBacks
	q.mu.Lock()
	q.closed = true
	running := q.running
	q.mu.Unlock()
	if running {
		q.poke()
	}
	q.wg.Wait()
}

// giveBackWorker sends the queued give-backs until none is left, or until Close.
func (g *Global) giveBackWorker() {
	q := &g.giveBacks
	defer q.wg.Done()
	var buf []giveBack
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		batch, wait, closing := g.nextGiveBacks(buf[:0], time.Now(), false)
		if closing {
			g.flushGiveBacks(buf[:0])
			return
		}
		if len(batch) > 0 {
			ctx, cancel := g.refundContext(context.Background())
			g.sendGiveBacks(ctx, batch)
			cancel()
			g.requeueGiveBacks(batch, time.Now())
			buf = batch
			continue
		}
		if wait < 0 {
			return // nothing left: nextGiveBacks marked the worker off
		}
		t.Reset(wait)
		select {
		case <-q.wake:
		case <-t.C:
		}
	}
}

// nextGiveBacks takes out of the queue, into batch, at most giveBackBatch give-backs
// due at now whose master's breaker lets a call go (one may be the probe of an open
// breaker, as for any gated call; see gate): first rounds first, oldest first. With
// none, it returns how long to wait for one to come due, or -1 when nothing is held
// (the worker is then marked off). closing reports Close; all takes every give-back,
// due or not (Close's last pass).
func (g *Global) nextGiveBacks(batch []giveBack, now time.Time, all bool) (_ []giveBack, wait time.Duration, closing bool) {
	q := &g.giveBacks
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed && !all {
		return batch, 0, true
	}
	var masters [8]struct {
		m  *Master
		ok bool
	}
	decided := masters[:0]
	admit := func(gb *giveBack) bool {
		if g.masters == nil {
			return true
		}
		x := g.masters.ForKey(gb.keys[0])
		gb.m, gb.probe = x, false
		for _, d := range decided {
			if d.m == x {
				return d.ok
			}
		}
		ok, probe := x.breaker.allow() // a probe taken is used: the call goes
		gb.probe = probe
		decided = append(decided, struct {
			m  *Master
			ok bool
		}{x, ok})
		return ok
	}
	wait = -1
	blocked := false
	take := func(list []giveBack, due bool) []giveBack {
		kept := list[:0]
		for i := range list {
			gb := list[i]
			switch {
			case len(batch) >= giveBackBatch:
			case due && !all && gb.due.After(now):
				if d := gb.due.Sub(now); wait < 0 || d < wait {
					wait = d
				}
			case !admit(&gb):
				blocked = true
			default:
				batch = append(batch, gb)
				continue
			}
			kept = append(kept, gb)
		}
		clear(list[len(kept):]) // the keys and args of the entries taken out
		return kept
	}
	q.first = take(q.first, false)
	q.second = take(q.second, true)
	if blocked && (wait < 0 || giveBackPoll < wait) {
		wait = giveBackPoll
	}
	if len(batch) == 0 && q.held == 0 {
		q.running = false
	}
	return batch, wait, false
}

// requeueGiveBacks puts the give-backs of batch whose first round went into the
// second-round queue, due giveBackDelay after now, and those whose later round failed
// back into it, later each time, giveBackRetries times at most; it lets go of the
// others: one whose last round failed is counted in RefundErrors (no later round
// removes a slot its acquire may still have taken).
func (g *Global) requeueGiveBacks(batch []giveBack, now time.Time) {
	q := &g.giveBacks
	q.mu.Lock()
	defer q.mu.Unlock()
	for i := range batch {
		gb := &batch[i]
		if gb.due.IsZero() {
			q.second = append(q.second, giveBack{keys: gb.keys, args: gb.args, due: now.Add(giveBackDelay)})
			continue
		}
		if gb.err != nil && gb.retries < giveBackRetries {
			r := gb.retries + 1
			q.second = append(q.second, giveBack{keys: gb.keys, args: gb.args, due: now.Add(giveBackDelay << r), retries: r})
			continue
		}
		q.held--
		if gb.err != nil {
			g.refundErrors.Add(1)
		}
	}
	clear(batch)
}

// flushGiveBacks is Close's last pass: every give-back left is sent once (the first
// round or the second, whichever is next), in batches, all within one refund timeout;
// those that did not go are dropped.
func (g *Global) flushGiveBacks(buf []giveBack) {
	q := &g.giveBacks
	ctx, cancel := g.refundContext(context.Background())
	defer cancel()
	for ctx.Err() == nil {
		batch, _, _ := g.nextGiveBacks(buf[:0], time.Now(), true)
		if len(batch) == 0 {
			break
		}
		g.sendGiveBacks(ctx, batch)
		q.mu.Lock()
		q.held -= len(batch)
		q.mu.Unlock()
		clear(batch)
		buf = batch
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.dropped.Add(uint64(q.held))
	clear(q.first)
	clear(q.second)
	q.first, q.second, q.held, q.running = nil, nil, 0, false
}

// giveBackKeys is the most keys one merged refund.lua call removes (a ZREM each).
const giveBackKeys = 256

// sendGiveBacks sends batch's give-backs as refund.lua calls in one pipeline: those of
// one hash slot (on a standalone Redis: all) merged into one call of at most
// giveBackKeys keys, as refund.lua takes any number of keys. Not through the
// auto-pipeline: its queue is the checks'. Each master hears how its calls went, as
// after any gated call (settle); each give-back gets its call's error.
func (g *Global) sendGiveBacks(ctx context.Context, batch []giveBack) {
	calls := make([]call, 0, 4)
	var slots []uint16            // of each call
	of := make([]int, len(batch)) // the call of each give-back
	for i := range batch {
		gb := &batch[i]
		var slot uint16
		if g.bySlot {
			slot = Slot(gb.keys[0]) // a give-back's keys share one slot: its failed call's
		}
		at := -1
		for j := len(calls) - 1; j >= 0; j-- {
			if calls[j].m == gb.m && slots[j] == slot && len(calls[j].keys)+len(gb.keys) <= giveBackKeys {
				at = j
				break
			}
		}
		if at < 0 {
			at = len(calls)
			calls = append(calls, call{m: gb.m})
			slots = append(slots, slot)
		}
		c := &calls[at]
		c.keys = append(c.keys, gb.keys...)
		c.args = append(c.args, gb.args...)
		of[i] = at
	}
	rdb := g.longRdb()
	if ap, ok := rdb.(*autoPipe); ok {
		rdb = ap.rediser
	}
	run(ctx, rdb, refundScript, calls)
	if g.masters != nil {
		var buf [8]*Master
		ms := buf[:0]
		for i := range calls {
			seen := false
			for _, x := range ms {
				seen = seen || x == calls[i].m
			}
			if !seen {
				ms = append(ms, calls[i].m)
			}
		}
		var probes probeSet // the masters whose probe a give-back of the batch took
		for i := range batch {
			if batch[i].probe {
				for j, x := range ms {
					if x == batch[i].m && j < 64 {
						probes |= 1 << j
					}
				}
			}
		}
		settle(calls, ms, probes)
	}
	for i := range batch {
		batch[i].err = calls[of[i]].cmd.Err()
	}
}
