package sync

import (
	"cmp"
	"context"
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	gosync "sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/plural"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

//go:embed scripts/hybrid.lua
var hybridLua string

var hybridScript = redis.NewScript(hybridLua)

// The sync: which keys travel, how they are batched into script calls, and how the
// replies are applied.

// Grant modes of scripts/hybrid.lua.
const (
	modeShare uint8 = 0 // a share of the key's headroom, by demand
	modeExact uint8 = 1 // exactly the units asked for, if the key has them now
	modeLeave uint8 = 2 // the last sync before the daemon stops: settles, asks nothing, and leaves the key (no credit reserved for it)
	// Added to a mode: modeRelimit, the key's first sync since a reload changed its
	// limit (flagRelimit); modeFirst, the entry has never synced the key. The syncs that
	// may cut a token bucket's state to a whole burst of the limit (scripts/hybrid.lua).
	modeRelimit = 4
	modeFirst   = 8
	// modeGone: the entry was evicted by the key cap (flagGone), and this sync carries
	// its units once (collect): it writes no sync record, which may be the new entry's
	// of the key (written by that one, whose grant it names).
	modeGone = 16
	// modeDated: a window's units beyond the grant were all admitted before the window of
	// the entry's view ended (syncItem.dated); they count in that window whenever Redis
	// reads them.
	modeDated = 32
	// modePrev, with modeDated: in the window before the view's (flagPrev).
	modePrev = 64
)

// syncItem is one key in a sync: a snapshot of its entry taken under its shard's lock,
// so sending reads only this.
type syncItem struct {
	sh          *hshard
	e           *hentry
	lim         *localbucket.Limit
	used        uint64 // admitted since the last sync
	owed        uint64 // given back after an earlier sync had sent them: taken off used
	grantWindow int64
	prevGrant   uint32
	prevToken   uint32
	token       uint32 // this sync's
	demand      uint32 // what the script sizes the grant by
	offered     uint32 // the entry's demand taken by this sync (given back on failure)
	age         uint32 // ms since the key's last admission: what it admitted beyond its grant is charged from then
	short       uint8  // the entry's shortfall taken by this sync (ditto)
	mode        uint8
	relimit     bool      // the entry's flagRelimit at the snapshot: sent as modeRelimit
	first       bool      // the entry had no view at the snapshot, never synced: sent as modeFirst
	gone        bool      // the entry was evicted (flagGone) at the snapshot: sent as modeGone
	dated       bool      // its units were all admitted before its view's window ended (dated): sent as modeDated
	prev        bool      // with dated: in the window before the view's (flagPrev), sent as modePrev
	now         int64     // the daemon clock when the snapshot was taken: the view's time
	req         *fetchReq // the request waiting for this exact sync (nil: a periodic sync)
	m           *Master   // a periodic sync's: the master whose breaker let it (nil: see masterOf)
	vals        [replyInts]int64
	err         error
}

// snapshot takes e into a sync (its shard's lock held) at now: what it admitted
// travels, and no other sync of it starts until this one is applied.
//
// The units it admitted beyond its grant (credit) are charged in Redis as of the key's
// last admission (age), not as of the sync: on a full token bucket, charging them when
// the sync arrives lost the refill of the time in between, and a client whose requests
// rotate over the daemons lost the request that came just as its refill did; a window
// counts them in the window they were admitted in. The last admission is no earlier
// than any unit's, so the charge is never earlier than the exact mode's: no refill is
// credited that the exact mode would not have.
func (h *Hybrid) snapshot(sh *hshard, e *hentry, now int64, mode uint8, demand uint32) syncItem {
	if e.token == 0 {
		// The entry's first sync: it names a token of its own, never sent, as the one it
		// last confirmed. prev_token 0 would match the record that an earlier entry of the
		// key (forgotten since, or a previous run under this daemon's ID) left after its
		// first sync, and this sync would be taken for a resend of that one: the units
		// that one settled would be taken off the count again. Kept on failure, so a
		// resend of this first sync matches its record as it must.
		e.token = h.newToken()
	}
	it := syncItem{sh: sh, e: e, lim: e.lim, used: e.pending, grantWindow: e.grantWindow,
		prevGrant: e.grant, prevToken: e.token, demand: demand, mode: mode, now: now,
		age: min(e.sinceSeen(now), maxChargeAge), relimit: e.flags&flagRelimit != 0, first: e.synced == 0,
		gone: e.flags&flagGone != 0, dated: dated(e)}
	it.prev = it.dated && e.flags&flagPrev != 0
	e.flags |= flagBusy
	e.flags &^= flagStray | flagPrev // the units go with the sync
	if mode == modeLeave {
		// A daemon leaving the key holds no credit on it from now, not from the reply:
		// the sync drops the reservation of its credit (k), and a unit admitted on that
		// credit while the sync is on its way would be one no reservation covered, which
		// another daemon's exact sync may have taken meanwhile. Its grant goes back too.
		// A request meanwhile waits for the reply and makes an exact sync.
		e.flags |= flagShared
		e.allowance = min(e.allowance, 0)
	}
	if e.pending > 0 {
		if sh.onWay == nil {
			sh.onWay = map[*hentry]uint64{}
		}
		sh.onWay[e] = e.pending
		sh.onWayPeak = max(sh.onWayPeak, len(sh.onWay))
	}
	e.pending = 0
	it.owed, e.owed = uint64(e.owed), 0
	if mode == modeShare {
		it.offered, it.short = e.demand, e.short
		e.demand, e.short = 0, 0
	}
	return it
}

// dated reports whether e's units waiting to be synced all lie in the window of its
// view (no flagStray): their sync counts them in that window (modeDated), not by their
// age. Age counts from when the daemon sends the sync, and Redis reads it up to a lag
// later: units admitted just before the turn, in a sync sent just before it and read
// just after, were counted whole in the new window (TestHybridBurstAcrossTheTurn: 481
// units before a fixed window's turn and 521 after it, the new window full).
func dated(e *hentry) bool {
	return e.pending > 0 && e.grantWindow > 0 && e.flags&(flagStray|flagRelimit) == 0 &&
		e.lim.Algorithm() != localbucket.TokenBucket
}

// apply applies one sync's outcome to its entry (its shard's lock held), as a view of
// the key at the snapshot's time; arrived is when (daemon clock) the answer came, which
// bounds when Redis read the key.
func (h *Hybrid) apply(it *syncItem, n float64, arrived int64) {
	now := it.now
	e, sh := it.e, it.sh
	e.flags &^= flagBusy
	if it.used > 0 {
		delete(sh.onWay, e)
	}
	if it.err != nil {
		// Not confirmed: keep the counts for the next sync. One that asked for units
		// may have reserved them all the same (its reply lost or too late, a FetchWait
		// passed): the key is synced again until a sync is answered, which gives them
		// back. Before, a key with nothing else to settle was left, and Redis counted
		// units no daemon admitted until the window ended.
		if it.used > 0 {
			switch {
			case !it.dated || it.prev && e.pending > 0:
				// Units of no certain window, or of the window before the view's beside
				// units of the view's, admitted since.
				e.flags |= flagStray
			case it.prev:
				e.flags |= flagPrev
			}
		}
		e.pending += it.used
		e.addOwed(it.owed)
		e.demand = satAdd32(e.demand, uint64(it.offered))
		e.short = satAdd8(e.short, uint64(it.short))
		if (it.req != nil || it.demand > 0) && mayHaveRun(it.err) {
			e.flags |= flagUnsettled
		}
		if e.flags&flagGone == 0 {
			sh.markDirty(e)
		} else {
			h.dropped.Add(e.unsynced()) // evicted: no second sync (collect)
		}
		return
	}
	// Credit comes with a view only to an entry that holds some, or from a sync that
	// carried use or demand: Redis records the daemon as the key's last user (the
	// script's o) only for those, and the next daemon to use the key reserves the
	// credit of its last user only (k). A sync that carried neither (a question's exact
	// sync, a grant given back) to an entry with no credit (a key new here, shared, or
	// left) left it holding credit Redis knew nothing of: another daemon then took the
	// key as its own, its exact syncs free to take those units (24 admitted of 20:
	// TestHybridQuestionGivesNoCredit).
	noCredit := (e.synced == 0 || e.flags&flagShared != 0) && int64(it.used) <= int64(it.owed) && it.demand == 0
	e.flags &^= flagUnsettled
	if it.relimit && *it.lim == *e.lim {
		e.flags &^= flagRelimit // Redis has the key under this limit (else relimit set it again)
	}
	if it.vals[6]&4 != 0 {
		e.flags |= flagCut
	} else if it.relimit && *it.lim == *e.lim {
		e.flags &^= flagCut // read at the key's rate, or read back at another (scripts/hybrid.lua)
	}
	v := it.vals
	e.grant = uint32(min(max(0, v[0]), math.MaxUint32))
	e.token = it.token
	// A window's end (start) by the last view, if this one is of the same window: each
	// view bounds it from above by its sync's lag (when Redis read the key, at most the
	// answer's arrival), so the sooner holds. Replaced by a later one, a retry told by
	// the last view (the window's end, or a sliding window's estimate falling) was
	// refused at it, a fraction of a millisecond short: 1 in 10 retries of a sliding
	// window, 4 per 300 ms.
	if e.pending > 0 && e.grantWindow != v[4] && e.flags&flagStray == 0 {
		// Admitted while this sync was on its way, judged by the view it replaces, of
		// another window: in the window before this one's if that is the last view's
		// (the turn came while the sync was out), else in none for certain.
		if w := e.lim.Window().Microseconds(); e.lim.Algorithm() != localbucket.TokenBucket && e.synced > 0 &&
			e.grantWindow > 0 && e.grantWindow+w == v[4] && *it.lim == *e.lim && e.flags&flagPrev == 0 {
			e.flags |= flagPrev
		} else {
			e.flags |= flagStray
			e.flags &^= flagPrev
		}
	}
	sameWindow := *it.lim == *e.lim && e.synced > 0 && e.grantWindow == v[4]
	oldEnd, oldStart := int64(0), int64(0)
	switch e.lim.Algorithm() {
	case localbucket.FixedWindow:
		if sameWindow && e.vt > 0 {
			oldEnd = e.synced + int64(e.vt)
		}
	case localbucket.SlidingWindow:
		if sameWindow {
			oldStart = e.slide().start
		}
	}
	e.setTimes(v[2], v[3], arrived-now)
	e.synced = now
	if e.lim.Algorithm() == localbucket.FixedWindow && v[4] > 0 && e.vt > 0 && *it.lim == *e.lim {
		// A fixed window ends at its start (Redis TIME, µs) plus the window: where that
		// falls inside the sync's lag, the view's end is that, not the lag's bound.
		// Bounded by the lag, a retry told the window's end by the daemon's clock
		// (decide, the view's window over) was refused at it when a sync came between,
		// told 44 µs more (TestHybridFixedWindowRetryAfterTheTurn, 2 in 8 runs).
		lag := arrived - now
		if end := v[4]*int64(time.Microsecond) + int64(e.lim.Window()) - now; lag >= 0 && end > 0 && end < int64(e.vt) && end >= int64(e.vt)-lag-int64(time.Microsecond) {
			e.vt = ceilNs(end)
			if r := int64(math.Float32frombits(e.vr)); r > end {
				e.vr = math.Float32bits(ceilNs(end)) // nothing waits past the window's end
			}
		}
	}
	if oldEnd > now {
		end := oldEnd - now
		if int64(e.vt) > end {
			e.vt = ceilNs(end)
		}
		if r := int64(math.Float32frombits(e.vr)); r > end {
			e.vr = math.Float32bits(ceilNs(end))
		}
	}
	if oldStart != 0 {
		e.keepStart(oldStart)
	}
	e.grantWindow = v[4]
	e.view = float64(v[5]) / 1000
	over := 0.0 // units reserved beyond the limit now in force (below)
	relimited := *it.lim != *e.lim
	if relimited {
		// A reload (or another plan's request) changed the key's limit while this sync
		// was on its way: Redis judged it by the old one. The view moves as relimit
		// moves it, and so do its times.
		e.view += float64(e.lim.Capacity()) - float64(it.lim.Capacity())
		over = min(0, e.view)
		if it.lim.Algorithm() == e.lim.Algorithm() && it.lim.Window() == e.lim.Window() {
			e.rescaleTimes(it.lim)
		}
	}
	credit := math.Floor(max(0, e.view) / n)
	if v[6]&1 != 0 || it.mode == modeLeave || noCredit { // a daemon that left the key holds no credit on it
		e.flags |= flagShared
		credit = 0
	} else {
		e.flags &^= flagShared
	}
	if v[6]&2 != 0 {
		e.flags |= flagHeld
	} else {
		e.flags &^= flagHeld
	}
	// What was admitted while the sync was on its way counts against the new allowance.
	e.allowance = float64(e.grant) + credit - float64(e.pending) + over
	e.lastDemand = 0
	if it.mode == modeShare && !(relimited && e.lim.Capacity() > it.lim.Capacity()) {
		// (A share grant sized by the old limit, which a raise came after: not hot, as
		// relimit says.)
		e.lastDemand = uint16(min(it.demand, math.MaxUint16))
	}
	if relimited && (it.lim.Algorithm() != e.lim.Algorithm() || it.lim.Window() != e.lim.Window() ||
		e.flags&flagCut != 0 && e.lim.Capacity() > it.lim.Capacity()) {
		e.forgetView() // no view of it holds (relimit)
	}
	if e.flags&flagGone == 0 && (e.grant > 0 || e.needsSync()) {
		sh.markDirty(e)
	}
}

// mayHaveRun reports whether a sync that failed with err may have run in Redis all the
// same: a timeout, a connection lost with the call written. Not an error Redis answered
// (the script was refused or stopped: a key it cannot read would fail every resend, and
// each failure would count against its master's breaker), nor a connection that could
// not be made: refused, or a Redis Unix socket that is not there (ENOENT).
func mayHaveRun(err error) bool {
	var rerr redis.Error
	return !errors.As(err, &rerr) && !errors.Is(err, errNotServed) && !errors.Is(err, errNotSent) && !errors.Is(err, errNoTime) &&
		!errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.ENOENT)
}

// errNoTime is the error of a key a sync did not send because its time was running
// out: the pipelines before took so long that the next one would likely not be answered
// within the sync's budget (send). The key waits for the next sync, as a key past
// --hybrid-max-sync-keys does: not a failure of its master (which answered the
// pipelines before), and nothing of it reached Redis.
var errNoTime = errors.New("hybrid sync: not sent, the sync's time was running out; left for the next sync")

// applyAll applies items, locking each one's shard, and counts the items that failed
// (a key whose slot moved is not a failure: it stays pending for the next sync). It
// records, per master, that it answered, or, when it answered none of its items (or,
// with strict, any one of them failed), that a sync to it sent at sent (daemon clock)
// failed: no exact sync of its keys is tried until it answers (Master.failedSince). The
// outcome per master is returned for its breaker.
func (h *Hybrid) applyAll(items []syncItem, strict bool, sent int64) (failed int, by []masterOutcome, firstErr error) {
	h.applyEach(items)
	return h.outcomes(items, strict, sent)
}

// applyEach applies items, locking each one's shard, as replies that arrived now.
func (h *Hybrid) applyEach(items []syncItem) {
	n := h.creditShares()
	arrived := h.clock()
	for i := range items {
		it := &items[i]
		it.sh.mu.Lock()
		h.apply(it, n, arrived)
		it.sh.mu.Unlock()
	}
}

// outcomes counts the items (applied: applyEach) that failed and records each master's
// outcome, as applyAll says.
func (h *Hybrid) outcomes(items []syncItem, strict bool, sent int64) (failed int, by []masterOutcome, firstErr error) {
	var buf [4]masterOutcome
	by = buf[:0]
	for i := range items {
		it := &items[i]
		m := it.m
		if m == nil {
			m = h.masterOf(it.e)
		}
		k := len(by) - 1
		if k < 0 || by[k].m != m { // items come grouped by master, mostly
			k = 0
			for k < len(by) && by[k].m != m {
				k++
			}
			if k == len(by) {
				by = append(by, masterOutcome{m: m})
			}
		}
		switch {
		case errors.Is(it.err, errNotServed):
			// The master answered; the key's slot moved: resent to its new master next
			// time, not a failure (the breaker must not open on a reshard).
			by[k].ok++
		case errors.Is(it.err, errNoTime):
			// Not sent: left for the next sync, as a backlog (errNoTime).
			by[k].unsent++
		case it.err != nil:
			by[k].failed++
			failed++
			if firstErr == nil {
				firstErr = it.err
			}
		default:
			by[k].ok++
		}
	}
	now := h.clock()
	for _, o := range by {
		if o.ok > 0 {
			h.answeredBy(o.m, now)
		}
		if o.failed > 0 && (o.ok == 0 || strict) {
			o.m.failedSince(sent)
		}
	}
	return failed, by, firstErr
}

// masterOutcome is how one master's items of a sync went: answered, failed, or not
// sent for want of time (errNoTime).
type masterOutcome struct {
	m                  *Master
	ok, failed, unsent int
}

// report tells each master's breaker how its items went: a success when every item
// sent was answered, a failure when none was. A master that answered some of a sync's
// pipelines and timed out on a later one is slow, not gone (a flood of new keys, each
// needing a sync, on a loaded Redis): its breaker hears neither. Before, every such sync
// counted as a failure, the breaker opened, and every key of the master was decided by
// its rule's failure policy (degraded) while Redis answered: a well-behaved client beside
// 158,000 new keys a second had 1,374 of 3,553 answers degraded (BenchmarkHostile,
// RLSIDECAR_HOSTILE_MODE=hybrid). A Redis that stops answering fails the next sync's
// first pipeline, so the breaker still opens within a few syncs.
//
// An open breaker let this sync through as its probe (collect), and a probe must be
// settled, or the breaker refuses every later call, probes included, for good: a master
// that answered some of it answered, and closes it; one whose items all went unsent
// (errNoTime) hands the probe back for the next call. Before, such a probe was left
// taken: after a failover under load, the keys of a healthy master whose breaker had
// opened on CLUSTERDOWN stayed decided by their policy (degraded) until the daemon
// restarted, no sync, heartbeat or ping being let through to close it.
func report(by []masterOutcome) {
	for _, o := range by {
		switch {
		case o.failed == 0 && o.ok > 0:
			o.m.breaker.Success()
		case o.failed > 0 && o.ok == 0:
			o.m.breaker.Failure()
		case o.m.breaker.Open() && o.ok > 0:
			o.m.breaker.Success()
		case o.m.breaker.Open():
			o.m.breaker.unprobe()
		}
	}
}

// Flush runs one sync of every key that changed, with no cap on their number: what each
// admitted is settled against its last grant, keys whose demand outran their allowance
// get a share grant, and unused grants go back. On error the unsent or unconfirmed units
// are kept for the next sync, so nothing admitted is lost; and since every sync carries
// tokens that Redis records with the key, a sync whose reply was lost after Redis
// applied it is not counted again when its units are resent.
func (h *Hybrid) Flush(ctx context.Context, now int64) error {
	_, err := h.flush(ctx, now, math.MaxInt, false)
	return err
}

// Release is the last sync before a daemon stops: it settles what every key admitted
// and gives back every grant, asking for no new ones, and leaves every key synced
// lately, so no budget or credit stays reserved for a daemon that is gone. The daemon
// admits nothing on credit after it.
func (h *Hybrid) Release(ctx context.Context, now int64) error {
	_, err := h.flush(ctx, now, math.MaxInt, true)
	return err
}

// flush syncs at most limit keys that changed (release: every key holding something,
// asking for nothing, and the keys synced lately: Hybrid.release), and returns how many
// it sent. Except for a release, a key whose master's breaker refuses the call stays
// dirty for a later sync, and each master's breaker hears how its keys went.
func (h *Hybrid) flush(ctx context.Context, now int64, limit int, release bool) (int, error) {
	if release {
		return h.release(ctx, now)
	}
	items := h.collect(now, limit)
	if len(items) == 0 {
		return 0, nil
	}
	return h.settle(ctx, items, false)
}

// release is the last sync (flush with release): every key holding something is
// settled first, its grant given back; then, within leaveBudget, the other keys this
// daemon synced lately, which Redis may still record it as the last user of, the most
// recently synced first. Each sync leaves its key (modeLeave): a daemon gone holds no
// credit, so the next daemon to use the key must not reserve any for it (it did: a
// client that moved from a daemon stopped with SIGTERM to another was refused part of
// its remaining budget for 60 s).
func (h *Hybrid) release(ctx context.Context, now int64) (int, error) {
	// The keys Redis may record this daemon as the last user of (the script's o: a sync
	// by it within the last share_epochs, KeepAlive), or hold a reservation of its credit
	// on (k: made by another daemon's sync within share_epochs of this daemon's last
	// sync of the key, and kept for creditReserved), with a second's margin. Before, only
	// the first: a key this daemon last synced 15 s before it stopped kept a reservation
	// for it, withheld from the next daemon for the rest of the minute
	// (TestHybridReleaseLiftsOlderReservation).
	lately := now - int64(h.keepAlive+creditReserved+time.Second)
	type leaving struct {
		sh     *hshard
		e      *hentry
		synced int64
	}
	var held []syncItem
	var rest []leaving
	for i := range h.shards {
		sh := &h.shards[i]
		sh.mu.Lock()
		for _, e := range sh.m {
			switch {
			case e.flags&flagBusy != 0:
			case e.holds():
				e.short = 0
				held = append(held, h.snapshot(sh, e, now, modeLeave, 0))
			case e.synced > 0 && e.synced >= lately:
				rest = append(rest, leaving{sh, e, e.synced})
			}
		}
		for _, e := range sh.dirty { // evicted holding units no sync has carried yet (collect)
			if e.flags&(flagGone|flagBusy) == flagGone && e.unsynced() > 0 {
				e.short = 0
				held = append(held, h.snapshot(sh, e, now, modeLeave, 0))
			}
		}
		sh.mu.Unlock()
	}
	var errs []error
	sent := 0
	// What was admitted first, with the whole release's time.
	if len(held) > 0 {
		n, err := h.settle(ctx, held, true)
		sent += n
		errs = append(errs, err)
	}
	if len(rest) == 0 {
		return sent, errors.Join(errs...)
	}
	// The others only lift reservations: best effort, within leaveBudget, one pipeline
	// at a time, so a daemon that held many keys still exits soon.
	slices.SortFunc(rest, func(a, b leaving) int { return cmp.Compare(b.synced, a.synced) })
	lctx, cancel := context.WithTimeout(ctx, leaveBudget)
	defer cancel()
	until, _ := lctx.Deadline()
	const chunk = callKeys * pipeCalls
	var slowest time.Duration // the slowest chunk's round trip: none is begun that would not end in time
	for lo := 0; lo < len(rest) && time.Until(until) > 2*slowest; lo += chunk {
		part := rest[lo:min(lo+chunk, len(rest))]
		items := make([]syncItem, 0, len(part))
		for _, l := range part {
			l.sh.mu.Lock()
			if l.e.flags&(flagBusy|flagGone) == 0 {
				items = append(items, h.snapshot(l.sh, l.e, now, modeLeave, 0))
			}
			l.sh.mu.Unlock()
		}
		if len(items) == 0 {
			continue
		}
		start := time.Now()
		n, err := h.settle(lctx, items, true)
		slowest = max(slowest, time.Since(start))
		sent += n
		// The leave budget running out is no error: the keys not reached keep the old
		// reservation. (Its deadline is the connection's too: a timeout at it can come
		// back before lctx says so, and it failed the release, which the daemon then
		// tried again for 2 s and logged as lost, when syncs of 20,000 keys left on a
		// loaded machine.)
		budgetOut := lctx.Err() != nil || !time.Now().Before(until) || errors.Is(err, errNoTime)
		if err != nil && (ctx.Err() != nil || !budgetOut) {
			errs = append(errs, err)
		}
	}
	return sent, errors.Join(errs...)
}

// leaveBudget bounds the part of the last sync that only leaves keys (release): a key
// it does not reach keeps what happened before, a reservation of the stopped daemon's
// possible credit by the next daemon to use it (at most 60 s). The keys most recently
// synced, those a client is likeliest to take to another daemon at once, go first.
// BenchmarkHybridSIGTERM (400,000 keys held, all synced within the last seconds) is
// what bounds it: the daemon's exit must stay well within 2 s.
const leaveBudget = 250 * time.Millisecond

// creditReserved is how long Redis reserves a previous user's possible credit on a key
// that changed hands (credit_life in scripts/hybrid.lua), unless that daemon syncs the
// key again first.
const creditReserved = 60 * time.Second

// flushEach is flush for Run with a breaker per master of a Cluster: each master's keys
// go in a sync of their own, on a goroutine of its own (counted in wg), so a master that
// does not answer holds up its own keys only, not the next syncs of the others. A
// master whose last sync is still on its way is left for the next call. done hears each
// master's sync: the keys it sent, how long it took, its error.
func (h *Hybrid) flushEach(now int64, limit int, budget time.Duration, wg *gosync.WaitGroup, done func(sent int, d time.Duration, err error)) {
	items := h.collect(now, limit)
	for lo := 0; lo < len(items); {
		// Each master's items, brought together (collect takes them by shard).
		m := items[lo].m
		hi := lo + 1
		for k := hi; k < len(items); k++ {
			if items[k].m == m {
				items[hi], items[k] = items[k], items[hi]
				hi++
			}
		}
		group := items[lo:hi:hi]
		lo = hi
		m.syncing.Store(true)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer m.syncing.Store(false)
			ctx, cancel := context.WithTimeout(context.Background(), budget)
			defer cancel()
			start := time.Now()
			sent, err := h.settle(ctx, group, false)
			done(sent, time.Since(start), err)
		}()
	}
}

// collect takes the keys a sync carries (see flush) out of the dirty lists: at most limit,
// each marked busy until its reply is applied (a release takes its own: release). A key
// whose master's breaker refuses, or whose master's last sync is still on its way (flushEach),
// stays dirty for a later sync; each item then carries the master that let it.
func (h *Hybrid) collect(now int64, limit int) []syncItem {
	// Room for the keys at once, from the dirty lists' lengths: most of a long list
	// goes (keys new here, or used since their last sync). Grown by append, a sync of
	// 100,000 keys (17.6 MB of items) allocated 40 MB, and syncing a flood of new keys
	// that was 86% of what the daemon allocated (a heap profile: 5.8 GB of 6.8 GB), the
	// garbage that took its heap to twice what it held.
	dirty := 0
	for i := range h.shards {
		sh := &h.shards[i]
		sh.mu.Lock()
		dirty += len(sh.dirty)
		sh.mu.Unlock()
	}
	items := make([]syncItem, 0, min(limit, dirty))
	backlog := 0
	// The masters asked, each once per sync (an open breaker gives one probe): a master
	// a sync does not reach is not asked.
	var gates []masterGate
	allowed := func(e *hentry) *Master {
		m := h.masterOf(e)
		if g := gateOf(&gates, m, func(m *Master) bool { return !m.syncing.Load() && m.breaker.Allow() }); !gates[g].ok {
			return nil
		}
		return m
	}
	// From a shard further on each time: a sync cut short (its limit, or its time:
	// errNoTime) leaves the keys of the shards it reached last, so those are not always
	// the same shards' keys.
	from := int(h.nextFrom.Add(1)) % hybridShards
	for j := range h.shards {
		sh := &h.shards[(from+j)%hybridShards]
		sh.mu.Lock()
		keep := sh.dirty[:0]
		for _, e := range sh.dirty {
			if e.flags&flagIdle != 0 && (e.pending > 0 || e.short >= 2 || e.flags&flagShared != 0) {
				// Used here since it was marked (or in demand here, or told it is shared):
				// no leave; synced as usual, its credit as that sync says.
				e.flags &^= flagIdle
			}
			switch {
			case e.flags&flagGone != 0:
				// Evicted by the key cap holding units beyond its grant: they go now,
				// once, or are lost (Dropped). Forgotten with the entry, they were lost
				// at every eviction of such a key, and its client could spend them
				// again: a flood of new keys past the cap, 64 units of 600
				// (TestHybridEvictedKeySyncsItsUnits). A sync of it costs Redis what the
				// key kept would have cost; it is never kept for a later one, so the
				// evicted entries held stay those of one interval, as before.
				e.flags &^= flagDirty
				if u := e.unsynced(); u > 0 {
					var m *Master
					if len(items) < limit {
						m = allowed(e)
					}
					if m == nil {
						h.dropped.Add(u)
						continue
					}
					it := h.snapshot(sh, e, now, modeShare, 0)
					it.m = m
					items = append(items, it)
				}
			case e.flags&flagBusy != 0:
				keep = append(keep, e) // a request's exact sync has it: next time
			case e.flags&flagIdle != 0 && e.pending == 0 && e.short < 2 && e.flags&flagShared == 0:
				// Its checks here were refused elsewhere (refusedElsewhere), and it admitted
				// nothing since: it leaves the key, giving up its credit, and Redis drops a
				// reservation of that credit (k) and this daemon as the key's last user.
				// What it holds (a grant, units given back) is settled as a share sync
				// settles it.
				if len(items) >= limit {
					backlog++
					keep = append(keep, e)
					continue
				}
				m := allowed(e)
				if m == nil {
					keep = append(keep, e)
					continue
				}
				e.flags &^= flagDirty | flagIdle
				e.short = 0
				it := h.snapshot(sh, e, now, modeLeave, 0)
				it.m = m
				items = append(items, it)
			case !e.needsSync():
				e.flags &^= flagDirty
			case e.short < 2 && e.lastDemand < 2 && !e.holds():
				// A lone unit refused, nothing to settle: no share grant to ask (below),
				// so nothing to send. The key's next request here is decided by its view,
				// or by an exact sync once that is stale.
				e.short = 0
				e.flags &^= flagDirty
			case e.lastDemand >= 2 && e.short < 2 && e.unsynced() == 0 && e.owed == 0 &&
				e.flags&(flagUnsettled|flagRelimit) == 0 && e.synced > 0 && now-e.synced < int64(h.interval)/2:
				// A hot key whose share grant, asked less than half an interval ago, still
				// covers its demand: it waits for a later sync. Synced again at once (a sync
				// made early for a new key, just after the periodic one), it asked a share
				// grant for the demand of those few milliseconds, none: the grant went back
				// and the key cooled, and each of its requests was an exact sync until a
				// shortfall made it hot again (a per-plan key beside per-user keys of new
				// clients, 4 daemons: 0.43 script calls per check, 0.03 without the user
				// rule; TestHybridEarlySyncKeepsShareGrant).
				keep = append(keep, e)
			case len(items) >= limit:
				backlog++
				keep = append(keep, e)
			default:
				m := allowed(e) // after the limit: a master asked has a key in this sync
				if m == nil {
					keep = append(keep, e) // its master's breaker is open, or it is syncing: later
					continue
				}
				// Ask for a share grant while the key is hot here: its demand outran the
				// allowance by two units or more since its last sync (within about an
				// interval: a refusal makes the key dirty), or it held a share grant and is
				// still in demand. Not for a lone request refused: a client spread over
				// many daemons comes back to this one rarely, and a grant reserved for it
				// idled in Redis while the requests that came elsewhere were refused (for
				// a window, lost if the window ended meanwhile: a sliding window spread at
				// random over 20 daemons was admitted 0.94 of the exact mode). Without a
				// grant the key's next request here is decided by an exact sync when the
				// view has room for it or has gone stale.
				demand := uint32(0)
				if e.short >= 2 || e.lastDemand >= 2 {
					demand = e.demand
				}
				e.flags &^= flagDirty
				it := h.snapshot(sh, e, now, modeShare, demand)
				it.m = m
				items = append(items, it)
			}
		}
		clear(sh.dirty[len(keep):])
		sh.dirty = keep
		sh.mu.Unlock()
	}
	h.backlog.Store(int64(backlog))
	urgentFirst(items)
	return items
}

// urgent reports whether the item's sync should go before the others': the key's next
// request here may wait for its reply (a key new here, its one unit on credit spent; one
// asking a share grant, its demand outran what it holds; one leaving, its credit given
// up), or this sync is its only one (evicted by the key cap: units it does not send are
// dropped, never resent). The others carry units admitted on credit or a grant, go on
// deciding from their view meanwhile, and wait for the next sync if this one runs out of
// time.
func (it *syncItem) urgent() bool {
	return it.first || it.demand > 0 || it.mode == modeLeave || it.gone
}

// urgentFirst moves the urgent items ahead of the others, each group in its order: a
// sync sends its pipelines one after another and leaves what its time did not reach for
// the next (errNoTime), and a request on a key of the sync waits for its reply,
// FetchWait at most, then goes to its rule's policy. In collection
// order, with more keys to sync than Redis could take (4 × 32 checks over 100,000 known
// keys, Redis on the loaded host's 2 cores), a new key's first sync came behind the
// credit of keys that needed none, and 15-28% of new clients' second requests, a
// quarter of a second after their first, were degraded (refused under
// on_store_failure: closed) while Redis answered every call; 0.3-4.7% with this and
// settle's applying each pipeline as it comes (BenchmarkHybridNewClients). Stable, with
// a copy of the smaller group.
func urgentFirst(items []syncItem) {
	n := 0
	for i := range items {
		if items[i].urgent() {
			n++
		}
	}
	if n == 0 || n == len(items) {
		return
	}
	want := n <= len(items)-n // buffer the urgent items (else the others)
	buf := make([]syncItem, 0, min(n, len(items)-n))
	w := 0
	for i := range items {
		if items[i].urgent() == want {
			buf = append(buf, items[i])
		} else {
			items[w] = items[i]
			w++
		}
	}
	if want {
		copy(items[len(buf):], items[:w])
		copy(items, buf)
	} else {
		copy(items[w:], buf)
	}
	clear(buf)
}

// settle sends items, applies the replies, and (but for a release) tells each master's
// breaker how its keys went: every master that let items through (item.m) hears back.
// It returns how many items it sent: those it left for want of time (errNoTime) wait
// for the next sync, counted in the backlog; a release reports them as its error, to be
// tried again (lastSync).
func (h *Hybrid) settle(ctx context.Context, items []syncItem, release bool) (int, error) {
	sentAt := h.clock()
	// Each pipeline's keys are applied as its replies come in, not once the whole sync
	// has: a key stays busy (flagBusy) until then, and a request that needs an exact sync
	// of a busy key waits for that sync, FetchWait at most, then goes to the rule's
	// policy. Applied at the end, a sync of many keys (20,000 a sync, 40 pipelines one
	// after another, 300 ms on a loaded host) held its first pipeline's keys busy
	// through all the others, and sending the keys requests wait on first (collect,
	// urgentFirst) gained nothing alone (TestHybridLongSyncSendsWaitedOnKeysFirst).
	sendErr := h.send(ctx, items, h.replicaCount(), callKeys, pipeCalls, h.applyEach)
	failed, by, firstErr := h.outcomes(items, false, sentAt)
	if !release {
		report(by)
	}
	unsent := 0
	for _, o := range by {
		unsent += o.unsent
	}
	sent := len(items) - unsent
	if unsent > 0 {
		h.backlog.Add(int64(unsent))
		if failed == 0 && release {
			return sent, fmt.Errorf("hybrid sync: %d of %s not sent in time: %w", unsent, plural.Count(len(items), "key"), errNoTime)
		}
	}
	if failed > 0 {
		if firstErr == nil {
			firstErr = sendErr
		}
		return sent, fmt.Errorf("hybrid sync: %d of %s not synced: %w", failed, plural.Count(len(items), "key"), firstErr)
	}
	return sent, nil
}

// masterGate is a master's breaker's answer for one sync.
type masterGate struct {
	m  *Master
	ok bool
}

// gateOf returns the index in *gs of m's answer for this sync, asking ask(m) the first
// time m is seen: each master is asked once (an open breaker gives one probe).
func gateOf(gs *[]masterGate, m *Master, ask func(*Master) bool) int {
	for i := range *gs {
		if (*gs)[i].m == m {
			return i
		}
	}
	*gs = append(*gs, masterGate{m, ask(m)})
	return len(*gs) - 1
}

// newToken returns a sync token: never 0 (an entry's "no sync confirmed yet"), unique
// among the tokens this process hands out until the 32 bits wrap, and starting at a
// random point in each process (NewHybrid), so a daemon restarted under the same ID does
// not repeat the tokens its previous run recorded in Redis: the script takes a sync whose
// token a key's record holds for a replay, and counts nothing of it.
func (h *Hybrid) newToken() uint32 {
	for {
		if t := uint32(h.tokens.Add(1)); t != 0 {
			return t
		}
	}
}

// maxChargeAge bounds how far back (ms) a sync dates the units it charges (syncItem.age):
// a unit admitted longer ago than a sync record lasts (the script's minimum TTL) is
// charged as of then.
const maxChargeAge = 10_000

// Batching: a periodic sync's script call carries up to callKeys keys (on a cluster, of
// one master, whatever their slots), and a pipeline up to pipeCalls calls per node
// (go-redis splits a cluster's pipeline per node and sends to the nodes at once): a sync
// of fewer than callKeys × pipeCalls keys per node is one pipeline per node. Exact syncs
// (hybrid_fetch.go) carry up to fetchCallKeys keys a call, every call in one pipeline:
// requests wait for them, so a call stays short (as the global mode's merged calls,
// mergeMax).
const (
	callKeys      = 128
	pipeCalls     = 4
	fetchCallKeys = 64
)

type syncCall struct {
	items []syncItem
	cmd   *redis.Cmd
	beat  bool  // carries this daemon's heartbeat (standalone; Hybrid.beat)
	live  int64 // its answer: the live daemons (0: none)
}

// errNotServed is a key's error when the node a sync went to no longer serves its slot
// (it moved since go-redis last read the slot map): its units stay pending.
var errNotServed = errors.New("hybrid sync: the key's slot is not served by the node the sync went to")

// byNode sorts a cluster sync's items by the master serving each key (by slot within
// it) and returns the number of masters. A key whose master is unknown (no slot map
// yet) is grouped by its slot alone: a call carries one slot then, as before the slot
// map.
func (h *Hybrid) byNode(ctx context.Context, items []syncItem) ([]string, int) {
	cc, _ := h.rdb.(*redis.ClusterClient)
	nodes := make([]string, len(items))
	slots := make([]uint16, len(items))
	distinct := map[string]bool{}
	for i := range items {
		k := items[i].e.key()
		slots[i] = Slot(k)
		if cc != nil {
			if m, err := cc.MasterForKey(ctx, k); err == nil {
				nodes[i] = m.Options().Addr
				distinct[nodes[i]] = true
				continue
			}
		}
		nodes[i] = fmt.Sprintf("slot %d", slots[i])
		distinct[nodes[i]] = true
	}
	idx := make([]int, len(items))
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool {
		i, j := idx[a], idx[b]
		if nodes[i] != nodes[j] {
			return nodes[i] < nodes[j]
		}
		if wi, wj := items[i].urgent(), items[j].urgent(); wi != wj {
			return wi // as collect orders them (urgentFirst)
		}
		return slots[i] < slots[j]
	})
	sorted := make([]syncItem, len(items))
	sn := make([]string, len(items))
	for k, i := range idx {
		sorted[k], sn[k] = items[i], nodes[i]
	}
	copy(items, sorted)
	return sn, len(distinct)
}

// callsOf cuts items into script calls of up to perCall keys. On a cluster (nodes: each
// item's master, from byNode) a call carries the keys of one master and of one of
// byNode's groups (urgent, or not), each group sorted by slot: the keys of a call's
// first slot are then all at its start, where firstSlotKeys counts them. A call across
// the two groups could hold keys of its first slot in both, the second group's
// undeclared: the fault firstSlotKeys describes, while that slot migrates. It returns
// the calls and, on a cluster, each call's master.
func callsOf(items []syncItem, nodes []string, perCall int) (calls []syncCall, callNode []string) {
	for lo := 0; lo < len(items); {
		hi := min(lo+perCall, len(items))
		if nodes != nil {
			for k := lo + 1; k < hi; k++ {
				if nodes[k] != nodes[lo] || items[k].urgent() != items[lo].urgent() {
					hi = k
					break
				}
			}
		}
		calls = append(calls, syncCall{items: items[lo:hi]})
		if nodes != nil {
			callNode = append(callNode, nodes[lo])
		}
		lo = hi
	}
	return calls, callNode
}

// send runs the script for items, up to perCall keys per call, up to perPipe calls (per
// node, on a cluster) per pipeline, and records each item's reply or error in it. On a
// cluster it reorders items (by master). Calls that come back NOSCRIPT (a restarted or
// failed-over node) are sent again with EVAL, which loads the script; only those, so
// nothing is applied twice. A call not sent for want of time carries the context's error.
// With applied, send hands it each call's items once their replies (or errors) are in,
// as each pipeline comes back: on a cluster, one master's before another's.
//
// On a cluster a call carries keys of one master and declares only the keys of its
// first key's slot (which route it: firstSlotKeys): the script reaches the others, in
// other slots of the same node, from ARGV. One sync is then one pipeline per master,
// however many slots its keys span.
func (h *Hybrid) send(ctx context.Context, items []syncItem, replicas, perCall, perPipe int, applied func([]syncItem)) error {
	var nodes []string
	if h.cluster {
		nodes, _ = h.byNode(ctx, items)
	}
	calls, callNode := callsOf(items, nodes, perCall)
	// A heartbeat Run offered rides on the first call (standalone: the live-daemons set is
	// on the same node).
	if !h.cluster && len(calls) > 0 && h.beat.CompareAndSwap(beatOffered, beatTaken) {
		calls[0].beat = true
		defer func() { h.rideBeat(calls[0].live) }()
	}
	minTTL := max(10*time.Second, 20*h.interval).Milliseconds()
	shareEpochs := max(1, int64(h.keepAlive/h.interval))
	run := func(pipe redis.Pipeliner, c *syncCall, load bool) {
		declared := len(c.items)
		if h.cluster {
			declared = firstSlotKeys(c.items)
		}
		keys := make([]string, declared, declared+1)
		beatTTL := int64(0)
		if c.beat {
			keys = append(keys, h.daemonsKey)
			beatTTL = h.beatTTL.Milliseconds()
		}
		// The distinct limits go once per call; each key names its own by index.
		limIdx := make(map[localbucket.Limit]int, 4)
		var lims []*localbucket.Limit
		for i := range c.items {
			if _, ok := limIdx[*c.items[i].lim]; !ok {
				limIdx[*c.items[i].lim] = len(lims) + 1
				lims = append(lims, c.items[i].lim)
			}
		}
		// Every number in one string of little-endian int64s (scripts/hybrid.lua).
		nums := make([]byte, 0, 8*(callNums+4*len(lims)+syncArgs*len(c.items)))
		put := func(vs ...int64) {
			for _, v := range vs {
				nums = binary.LittleEndian.AppendUint64(nums, uint64(v))
			}
		}
		put(h.interval.Microseconds(), int64(replicas), minTTL, shareEpochs, int64(len(c.items)-declared), int64(len(lims)), beatTTL)
		for _, lim := range lims {
			put(int64(lim.Algorithm()), int64(lim.Requests()), lim.Window().Microseconds(), int64(lim.Burst()))
		}
		for i := range c.items {
			it := &c.items[i]
			if i < declared {
				keys[i] = it.e.key()
			}
			if it.token == 0 {
				it.token = h.newToken()
			}
			mode := int64(it.mode)
			if it.relimit {
				mode += modeRelimit
			}
			if it.first {
				mode += modeFirst
			}
			if it.gone {
				mode += modeGone
			}
			if it.dated {
				mode += modeDated
			}
			if it.prev {
				mode += modePrev
			}
			put(int64(limIdx[*it.lim]), int64(it.used)-int64(it.owed), int64(it.prevGrant), it.grantWindow, int64(it.demand), mode,
				int64(it.prevToken), int64(it.token), int64(it.age)*1000)
		}
		args := make([]any, 0, 2+len(c.items)-declared)
		args = append(args, h.id, nums)
		for i := declared; i < len(c.items); i++ {
			args = append(args, c.items[i].e.key())
		}
		if load {
			c.cmd = hybridScript.Eval(ctx, pipe, keys, args...)
		} else {
			c.cmd = hybridScript.EvalSha(ctx, pipe, keys, args...)
		}
	}
	// exec sends calls in one pipeline, and those that come back NOSCRIPT again with EVAL.
	exec := func(calls []syncCall) error {
		pipe := h.rdb.Pipeline()
		for i := range calls {
			run(pipe, &calls[i], false)
		}
		_, err := pipe.Exec(ctx)
		if err != nil {
			var again []*syncCall
			for i := range calls {
				if isNoScriptErr(calls[i].cmd.Err()) {
					again = append(again, &calls[i])
				}
			}
			if len(again) > 0 {
				pipe = h.rdb.Pipeline()
				for _, c := range again {
					run(pipe, c, true)
				}
				_, err = pipe.Exec(ctx)
			}
		}
		return err
	}
	// pipeline sends calls, perPipe a pipeline, one pipeline after another. Once the
	// time left before ctx's deadline is less than twice the slowest pipeline's so far, it
	// sends no more: the rest carry errNoTime, left for the next sync, rather than go in a
	// pipeline that would likely time out (a failure of its master) and hold Redis with
	// work whose answer nobody waits for.
	pipeline := func(calls []syncCall) (moved bool, firstErr error) {
		deadline, bounded := ctx.Deadline()
		var slowest time.Duration
		for lo := 0; lo < len(calls); lo += perPipe {
			batch := calls[lo:min(lo+perPipe, len(calls))]
			if err := ctx.Err(); err != nil || bounded && lo > 0 && time.Until(deadline) < 2*slowest {
				// Out of time: the rest stays pending for the next sync.
				if err == nil {
					err = errNoTime
				}
				for i := range batch {
					for k := range batch[i].items {
						batch[i].items[k].err = err
					}
				}
				if firstErr == nil {
					firstErr = err
				}
				if applied != nil {
					for i := range batch {
						applied(batch[i].items)
					}
				}
				continue
			}
			sentAt := time.Now()
			err := exec(batch)
			for i := range batch {
				moved = parseSyncReply(&batch[i]) || moved
			}
			// On a cluster, a call that meets a migrating slot (TRYAGAIN, served by ASK on
			// the target, or keys of a later slot not served): its keys not served go
			// again at once, led by their own first key (splitAgain). A standalone Redis
			// moves no slot: a key it does not serve there is one it cannot read (of
			// another type), which a resend would not serve either.
			var rest []syncCall
			if h.cluster {
				rest = splitAgain(batch)
			}
			for ; len(rest) > 0 && ctx.Err() == nil; rest = splitAgain(rest) {
				if err2 := exec(rest); err == nil || redis.HasErrorPrefix(err, "TRYAGAIN") {
					err = err2
				}
				for i := range rest {
					moved = parseSyncReply(&rest[i]) || moved
				}
			}
			if err != nil && redis.HasErrorPrefix(err, "TRYAGAIN") {
				err = nil // its keys wait for the next sync (errNotServed)
			}
			slowest = max(slowest, time.Since(sentAt))
			if err != nil && firstErr == nil {
				firstErr = err
			}
			h.answeredCalls(batch)
			if applied != nil {
				for i := range batch {
					applied(batch[i].items)
				}
			}
		}
		return moved, firstErr
	}
	// On a cluster each master's calls go in pipelines of their own, the masters at once:
	// go-redis's cluster pipeline, when a node fails, sets the error on every command of
	// the pipeline once its retry runs out of time, so one frozen master would fail the
	// keys of every other.
	var firstErr error
	moved := false
	if !h.cluster {
		moved, firstErr = pipeline(calls)
	} else {
		var wg gosync.WaitGroup
		var mu gosync.Mutex
		for lo := 0; lo < len(calls); {
			hi := lo + 1
			for hi < len(calls) && callNode[hi] == callNode[lo] {
				hi++
			}
			wg.Add(1)
			go func(calls []syncCall) {
				defer wg.Done()
				m, err := pipeline(calls)
				mu.Lock()
				defer mu.Unlock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				moved = moved || m
			}(calls[lo:hi])
			lo = hi
		}
		wg.Wait()
	}
	if moved {
		if cc, ok := h.rdb.(*redis.ClusterClient); ok {
			cc.ReloadState(ctx)
		}
	}
	return firstErr
}

// answeredCalls records that the masters of calls answered, now, for those whose items
// have a reply (a key whose slot moved is answered too: applyAll), as each pipeline of a
// sync comes back. applyAll records it too, once the whole sync is applied: a sync of
// many keys (a flood of new ones) takes many pipelines, and recorded only at its end, a
// sync longer than StaleAfter made the daemon unhealthy, every check going to the rules'
// failure policies, while Redis answered every pipeline (TestHybridLongSyncAnswersAsItGoes).
// A master's breaker still hears how the sync went from applyAll's outcome alone.
func (h *Hybrid) answeredCalls(calls []syncCall) {
	var last *Master
	for i := range calls {
		for k := range calls[i].items {
			it := &calls[i].items[k]
			if it.err != nil && !errors.Is(it.err, errNotServed) {
				continue
			}
			m := it.m
			if m == nil {
				m = h.masterOf(it.e)
			}
			if m != last {
				h.answeredBy(m, h.clock())
				last = m
			}
		}
	}
}

// firstSlotKeys returns how many of items, from the first, are in the first one's hash
// slot: the keys a cluster sync call declares (a call's items are of one master and one
// of byNode's groups, sorted by slot: callsOf).
// The call's other keys, of other slots of the same master, are named in ARGV.
//
// Every key of the first slot is declared, not the first alone: while that slot
// migrates, Redis then runs the call only where all of them are (on the source, or, by
// ASK, on the target), and answers TRYAGAIN while they are split. With only the first
// declared, a call led by a key that had moved went by ASK to the target, where a key
// of the same slot not yet moved read as absent (the slot importing, the call ASKING)
// and was written afresh: its client had a whole new budget there, and the slot's
// migration then failed on that key (BUSYKEY).
func firstSlotKeys(items []syncItem) int {
	s := Slot(items[0].e.key())
	n := 1
	for n < len(items) && Slot(items[n].e.key()) == s {
		n++
	}
	return n
}

// splitAgain returns the calls to send again at once, of the keys of calls past their
// first slot's:
//
//   - of a call Redis refused with TRYAGAIN (it ran nothing: its first slot migrating,
//     that slot's keys split between the two nodes, or some of them in neither, as a new
//     client's are), and each of its first slot's keys in a call of its own: Redis
//     answers TRYAGAIN to a call of several keys of a migrating slot until the slot is
//     handed over (for good when a reshard stopped before that), and runs a call of one
//     key where the key is (by ASK on the target for a key the source lacks). Until
//     their replies come, the call's keys are all marked not served (errNotServed:
//     pending for the next sync, no failure), as they stay if the sync's time runs out
//     first (before, the keys past its first slot kept the TRYAGAIN, a failure that
//     counted against the master's breaker during a reshard);
//   - of a call whose first slot's keys were served and some other keys not, those
//     keys (moved to the end of the call's items, in their order): either the call went
//     by ASK to the node importing its first slot, which serves no other slot of the
//     call, or it ran on its master and some of its other keys are in a slot that
//     migrates from there and are not there (moved already, or new: Redis sends them to
//     the target, and a script's read of them fails). Either lasts while the slot
//     migrates, and for good when a reshard stopped before it handed the slot over:
//     those keys would never be synced. (Before, only the first case was sent again:
//     a key of a slot left migrating, not its call's first slot, had its units left
//     pending for good, uncounted in Redis.) Sent again, led by their own first key,
//     which the call declares, Redis sends them where that key is (ASK, or MOVED on a
//     stale slot map), so each resend serves at least that key's slot.
//
// A call of one key gives none; a call of one slot's keys alone, served, none.
func splitAgain(calls []syncCall) []syncCall {
	var rest []syncCall
	for i := range calls {
		c := &calls[i]
		if c.cmd == nil || len(c.items) == 1 {
			continue
		}
		n := firstSlotKeys(c.items)
		switch err := c.cmd.Err(); {
		case err != nil && redis.HasErrorPrefix(err, "TRYAGAIN"):
			for k := range c.items {
				c.items[k].err = errNotServed // Redis ran nothing of the call
			}
			for k := range c.items[:n] {
				rest = append(rest, syncCall{items: c.items[k : k+1]})
			}
			if n == len(c.items) {
				continue
			}
		case n < len(c.items) && err == nil && servedAll(c.items[:n]):
			if k := notServedLast(c.items[n:]); k > 0 {
				rest = append(rest, syncCall{items: c.items[len(c.items)-k:]})
			}
			continue
		default:
			continue
		}
		rest = append(rest, syncCall{items: c.items[n:]}) // their replies replace their errors
	}
	return rest
}

// notServedLast moves the items whose keys were not served (errNotServed) to the end
// of items, each part in its order (so by slot), and returns how many they are.
func notServedLast(items []syncItem) int {
	var not []syncItem
	k := 0
	for i := range items {
		if errors.Is(items[i].err, errNotServed) {
			not = append(not, items[i])
			continue
		}
		if k != i {
			items[k] = items[i]
		}
		k++
	}
	copy(items[k:], not)
	return len(not)
}

func servedAll(items []syncItem) bool {
	for i := range items {
		if items[i].err != nil {
			return false
		}
	}
	return true
}

// callNums and syncArgs are how many numbers scripts/hybrid.lua takes per call (before
// the limits) and per key.
const (
	callNums = 7
	syncArgs = 9
)

// replyInts is how many integers scripts/hybrid.lua answers per key.
const replyInts = 7

// parseSyncReply stores each item's integers of c's reply, or c's error, and reports
// whether a key was not served by the node (errNotServed).
func parseSyncReply(c *syncCall) (moved bool) {
	vals, err := int64s(c.cmd)
	want := replyInts * len(c.items)
	if c.beat {
		want++
	}
	if err == nil && len(vals) != want {
		err = fmt.Errorf("script reply has %d elements, want %d", len(vals), want)
	}
	if err == nil && c.beat {
		c.live = vals[want-1]
	}
	for i := range c.items {
		it := &c.items[i]
		if err != nil {
			it.err = err
			continue
		}
		if vals[replyInts*i] < 0 {
			it.err = errNotServed
			moved = true
			continue
		}
		copy(it.vals[:], vals[replyInts*i:replyInts*i+replyInts])
		it.err = nil // a call sent again (splitAgain): its first error is gone
	}
	return moved
}

func isNoScriptErr(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT")
}

// int64s reads a script reply that must be an array of integers, checking types instead
// of asserting them.
func int64s(cmd *redis.Cmd) ([]int64, error) {
	if cmd == nil {
		return nil, errors.New("not sent")
	}
	v, err := cmd.Result()
	if err != nil {
		return nil, err
	}
	arr, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("script reply is %T, want an array", v)
	}
	out := make([]int64, len(arr))
	for i, x := range arr {
		switch n := x.(type) {
		case int64:
			out[i] = n
		case float64:
			out[i] = int64(n)
		default:
			return nil, fmt.Errorf("script reply element %d is %T, want an integer", i, x)
		}
	}
	return out, nil
}
