package sync

import (
	"hash/maphash"
	"math"
	"slices"
	"sort"
	gosync "sync"
	"time"
	"unsafe"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// The key table: 64 shards, each a map from the Redis key to its entry under a mutex,
// plus the list of its keys that have something to tell Redis (dirty), so a sync visits
// only those, never every key held.

const hybridShards = 64

type hshard struct {
	mu    gosync.Mutex
	m     map[string]*hentry
	dirty []*hentry // entries with flagDirty, to consider at the next sync
	// onWay holds, for each entry whose sync is on its way (flagBusy) and carries units,
	// those units: sent, so no longer pending, and not yet in a view (pendingOf).
	onWay map[*hentry]uint64
	// onWayPeak is the most entries onWay has held since it was made: a Go map keeps
	// the memory of its largest size (giveBack).
	onWayPeak int
	// mPeak is the most keys m has held since it was made, as sweep found them
	// (giveBack).
	mPeak int
	// load is what the keys held take of the shard's cap (Hybrid.perShard): units each.
	load int
	// noFirstUntil (daemon clock, ns): until then a key new in this shard gets no unit
	// before its first sync. Set by evict when it forgets a key that was not full: seen
	// again, that key would be new here, and a limited client evicted by others got a
	// first unit at every visit (evict).
	noFirstUntil int64
}

// onWayKeep is the most entries a shard's onWay map may have held and still be kept
// once empty (giveBack): about 20 KB, made again by the next sync that needs it.
const onWayKeep = 1024

// dirtyKeep is the capacity of a shard's dirty list kept however few keys it holds
// (giveBack).
const dirtyKeep = 1024

// mapKeep is the most keys a shard's map may have held and be kept as it is however
// few it holds now (giveBack).
const mapKeep = 1024

// giveBack gives back what a flood of keys grew in sh and no longer uses (the shard's
// lock held): its map of units on their way once empty, if it held more than onWayKeep,
// its dirty list's array once under a quarter full (for one twice the keys it holds, at
// least dirtyKeep), and its key map once its keys are under a quarter of its peak. Kept, a Go map holds the memory of its largest size and a
// slice resliced to nothing its array: after 4,000,000 new keys (--max-keys' default)
// were synced, 60 MB of maps holding nothing and 41 MB of dirty lists stayed for good
// (a heap profile of BenchmarkMemoryAtMaxKeys' daemon). Called by sweep, each shard once
// every hybridShards intervals, not by every sync: during a flood, which empties a list
// or a map at one sync and fills it at the next, given back at each sync they were
// grown again as often.
func (sh *hshard) giveBack() {
	if len(sh.onWay) == 0 && sh.onWayPeak > onWayKeep {
		sh.onWay, sh.onWayPeak = nil, 0
	}
	if c := cap(sh.dirty); c > dirtyKeep && len(sh.dirty) < c/4 {
		sh.dirty = append(make([]*hentry, 0, max(dirtyKeep, 2*len(sh.dirty))), sh.dirty...)
	}
	// The key map itself, once its keys fell under a quarter of the most it held: a
	// flood of 4,000,000 keys gone (swept, each unused for KeepAlive) left about 200 MB
	// of map holding nothing. Made again at its size: the entries' keys (hentry.kp) are
	// the same strings.
	sh.mPeak = max(sh.mPeak, len(sh.m))
	if sh.mPeak > mapKeep && len(sh.m) < sh.mPeak/4 {
		m := make(map[string]*hentry, len(sh.m))
		for k, e := range sh.m {
			m[k] = e
		}
		sh.m, sh.mPeak = m, len(m)
	}
}

// units is what a key of n bytes takes of a shard's cap of max: one entry, and one more
// per whole 96 bytes (an entry's size) of the key, held beside it, so that the cap
// bounds memory, not only keys. Counted as one, keys of 4 KB (a client's own API key,
// up to rules.MaxKeyValue an attribute) took 4.2 KB each, and 200,000 of them held 1.2
// GB of RSS. At most max, so that a key longer than a shard's cap is still held.
func units(n, max int) int { return min(1+n/96, max) }

// pendingOf is what e admitted that its view does not count: its pending units and
// those a sync of it has on their way to Redis. Counted only as pending, the units
// on their way counted nowhere while the sync was out: a shadow rule of 2 per minute,
// its key new here, reported its second request with 1 left and admitted a third.
func (sh *hshard) pendingOf(e *hentry) uint64 {
	if e.flags&flagBusy != 0 && len(sh.onWay) > 0 {
		return e.pending + sh.onWay[e]
	}
	return e.pending
}

// hentry is one key's local view. Guarded by its shard's mutex.
type hentry struct {
	// The fields are ordered and sized so that an entry takes 96 bytes, a size class
	// (TestHentrySize): 112 put a million keys' heap at 209 bytes a key, over 200.
	kp          *byte              // the map key's bytes (key)
	lim         *localbucket.Limit // interned (limitTable): never a caller's
	allowance   float64            // grant left plus credit, at the view (see credit)
	view        float64            // units the key could admit beyond every reservation, at the last sync
	grantWindow int64              // the window start (µs) the grant was taken from
	pending     uint64             // admitted since the last sync was sent
	synced      int64              // when the view was read (ns; 0: never)
	kn          uint32             // the map key's length (key)
	owed        uint32             // admitted, sent in a sync, then given back (Undo): the next sync takes them off (saturating: Redis then keeps the rest, never loses one)
	// The view's times (resetNs, retryNs). Token bucket and fixed window: vt is the ns
	// until full, rounded up; vr the bits of a float32, the ns until one more unit fits,
	// rounded up (0: one fits). Sliding window (slide): vt is the ns gone of its window,
	// rounded down; vr the previous window's count.
	vt         float32
	vr         uint32
	seen       uint32 // last admission while units wait to be synced, else last check; ms of the daemon clock, wrapping (seenMs)
	token      uint32 // the token of the last sync Redis confirmed (before that, the one snapshot names; 0: never synced)
	grant      uint32 // the units reserved for this daemon at the last sync
	demand     uint32 // offered since the last sync was sent
	lastDemand uint16 // the demand the last sync asked a share grant for
	slot       uint16 // the key's hash slot, on a cluster (its master: Hybrid.masterOf); else 0
	flags      uint16
	short      uint8 // of which refused locally for want of allowance (saturating: read only against 2)
	lag        uint8 // how long the view's sync took, at most (lagNs): when Redis read the key, after the view's time
}

// relimit makes lim (interned) e's limit: a reload changed it, or a plan's (the same
// client key under another plan: one IP shared by clients of two plans). A key's limit
// changes only in its requests and burst (its Redis key names its algorithm and window:
// limiter.AppendFingerprint), and Redis keeps its count under the new limit: the view
// moves by the change in capacity, and what e may admit locally with it. Its credit
// was a share of the old view (floor(view/n)): the share of the new one replaces it.
// A view below zero (more reserved than the new capacity) takes its excess off e's
// grant. Kept as it was, 100 an hour lowered to 5 after 4 used admitted 10 more on one
// daemon (its credit of 48). Dropping the view instead (an exact sync at the next
// check) refused concurrent requests under two plans' limits: each one's change dropped
// the view the other's sync had just brought.
//
// A raise adds to the view units that no share grant was sized by: a key hot here (its
// last share grant asked for two units or more) is no longer, so a request beyond the
// credit that the raised view has room for is decided by an exact sync at once, as on a
// key that is not hot, not refused until the next sync's share grant. Kept hot, a client
// that had used its 10 of 10 per hour, the limit raised to 20, got 5 (its credit, a
// 2N-th of the view) and was refused the other 5, as if the key were at its limit.
//
// A raise of a token bucket that Redis cut to a whole burst of the lower limit (flagCut)
// drops the view (forgetView): the view says the cut state, and the units the cut left
// out count again under the raised limit (read back at the key's next sync), so the
// capacity's change is more room than the key has. Moved by it, a client that used 30 of
// 30 per hour, then sent one check of a plan of 3 per hour, had 13 units of credit back
// (⌊27 ÷ 2N⌋, one daemon) to spend before the next sync read the units (9 more admitted
// with a sync every 10 checks: TestHybridPlanFlappingKeepsUnits). Dropped, the key's
// next check is an exact sync, which reads them.
func (e *hentry) relimit(lim *localbucket.Limit, n float64) {
	old := e.lim
	e.lim = lim
	if old.Algorithm() != lim.Algorithm() || old.Window() != lim.Window() {
		e.forgetView() // not a key's change (see above); if it were, no view of it holds
		return
	}
	d := float64(lim.Capacity()) - float64(old.Capacity())
	if d > 0 && e.flags&flagCut != 0 {
		e.forgetView()
		e.flags |= flagRelimit
		return
	}
	v := e.view + d
	if e.flags&flagShared == 0 && e.synced > 0 {
		e.allowance -= math.Floor(max(0, e.view)/n) - math.Floor(max(0, v)/n)
	}
	if v < 0 && e.view >= 0 {
		e.allowance += v
	} else if v < 0 {
		e.allowance += min(0, d)
	}
	e.view = v
	e.flags |= flagRelimit
	if d > 0 {
		e.lastDemand = 0
	}
	e.rescaleTimes(old)
}

// rescaleTimes moves a token bucket's view times, read under the limit old, to e's
// limit, as the key's next sync moves its state in Redis (scripts/hybrid.lua, after
// relimit: the same units used, at most a whole burst, localbucket.Limit.Rescale). vt,
// the time to full, counts units at the emission interval; kept, 10 used of 10 per hour
// raised to 20 said full in over an hour (the hour of the old rate, plus the units
// admitted since at the new one), more than a whole bucket of the new limit. A window's
// times (its end, its phase and previous count) do not depend on the limit; vr is not
// read for a token bucket (retryNs).
func (e *hentry) rescaleTimes(old *localbucket.Limit) {
	lim := e.lim
	if lim.Algorithm() != localbucket.TokenBucket || e.vt == 0 {
		return
	}
	// Both intervals as window/requests: the window is the same, so their ratio is that
	// of the requests. The sync's lag, counted in vt (setTimes), moves with it: off by
	// less than that lag.
	tau := float64(lim.Window()) * float64(lim.Burst()) / float64(lim.Requests())
	ns := min(float64(e.vt)*float64(old.Requests())/float64(lim.Requests()), tau)
	e.vt = ceilNs(int64(math.Ceil(ns)))
}

// forgetView drops e's view and what it may admit on it: the key's next check makes an
// exact sync. What e admitted, reserved or owes is kept for the next sync to settle.
func (e *hentry) forgetView() {
	e.allowance = min(e.allowance, 0)
	e.view = min(e.view, float64(e.lim.Capacity()))
	e.synced = 0
	e.lastDemand = 0
	e.flags &^= flagShared
}

// key is the Redis key e is the entry of (the map's key: one copy of its bytes).
func (e *hentry) key() string { return unsafe.String(e.kp, e.kn) }

// setKey makes k e's key.
func (e *hentry) setKey(k string) { e.kp, e.kn = unsafe.StringData(k), uint32(len(k)) }

// resetNs is the view's reset: ns from it until the key is full (token bucket) or
// empty (windows), by what Redis counted.
func (e *hentry) resetNs() int64 {
	if e.lim.Algorithm() != localbucket.SlidingWindow {
		return int64(e.vt)
	}
	return e.slideReset(e.slide())
}

// slideReset is a sliding window view's resetNs, from its slide s (e.slide()): one
// computation of it for the callers that need both.
func (e *hentry) slideReset(s slideView) int64 {
	var at int64
	switch {
	case s.q > 0: // until the current window's count weighs less than one
		at = emptyAt(s.start, s.w, s.q)
	case s.p > 0: // until the previous window's does
		at = emptyAt(s.start-s.w, s.w, s.p)
	default:
		return 0
	}
	return max(0, at+slideMargin-e.synced)
}

// retryNs is the view's retry: ns from it until one more unit fits (0: one fits).
func (e *hentry) retryNs() int64 {
	if e.lim.Algorithm() != localbucket.SlidingWindow {
		return int64(math.Float32frombits(e.vr))
	}
	if e.view >= 1 {
		return 0
	}
	return max(1, e.slide().at(1, 0)-e.synced)
}

// setTimes stores the view's times from the script's reply: reset_us and retry_us, or
// for a sliding window the previous window's count and the µs gone of the window. Redis
// read the key up to lag (ns) after the view's time (the sync's round trip and its wait
// to be sent): its times count from then, so they are stored that much later, never
// early.
func (e *hentry) setTimes(a, b, lag int64) {
	if lag < 0 || lag > int64(time.Minute) {
		lag = 0 // the answer's time is on another clock than the view's (tests)
	}
	if e.lim.Algorithm() == localbucket.SlidingWindow {
		e.vr = uint32(min(max(0, a), math.MaxUint32))
		ns := max(0, b) * int64(time.Microsecond)
		if e.vt = float32(ns); int64(e.vt) > ns {
			e.vt = math.Nextafter32(e.vt, 0) // rounded down (slide)
		}
		e.lag = lagCode(lag)
		return
	}
	e.lag = lagCode(lag) // a token bucket's refill since the view counts from then (decide)
	if a > 0 {           // 0: full, or empty (a fixed window with nothing counted), whenever read
		a = a*int64(time.Microsecond) + lag
	}
	if b > 0 { // 0: one fits
		b = b*int64(time.Microsecond) + lag
	}
	e.vt, e.vr = ceilNs(a), math.Float32bits(ceilNs(b))
}

// keepStart moves a sliding window view's start (slide) back to start, a bound from
// an earlier view of the same window, when that is sooner: the time gone of the window
// (vt) grows by the difference, rounded down (the start no sooner than start). Only
// while the previous window's share at the view (its weight by the time gone) stays
// the same: the current count (slide's q) is what the view leaves of it.
func (e *hentry) keepStart(start int64) {
	s := e.slide()
	if start >= s.start {
		return
	}
	vt := float32(float64(e.vt) + float64(s.start-start))
	if float64(vt) > float64(e.vt)+float64(s.start-start) {
		vt = math.Nextafter32(vt, 0)
	}
	if vt <= e.vt || float64(vt) >= float64(s.w) {
		return
	}
	share := func(vt float32) float64 {
		gone := float64(math.Nextafter32(vt, math.MaxFloat32))
		return math.Floor(s.p * max(0, float64(s.w)-gone) / float64(s.w))
	}
	if share(vt) == share(e.vt) {
		e.vt = vt
	}
}

// lagCode is lag (ns) in a byte, rounded up: the first code whose lagNs is no less
// (2^(code/8) - 1 µs, about 9% apart, up to 65 minutes).
func lagCode(lag int64) uint8 {
	if lag <= 0 {
		return 0
	}
	return uint8(min(255, sort.Search(len(lagTable), func(c int) bool { return lagTable[c] >= lag })))
}

// lagNs decodes lagCode: a table read, as slide does on the check path (an Exp2 per
// sliding-window check before).
func lagNs(c uint8) int64 { return lagTable[c] }

// lagTable holds lagNs of every code.
var lagTable = func() (t [256]int64) {
	for c := range t {
		t[c] = int64(math.Ceil((math.Exp2(float64(c)/8) - 1) * 1e3))
	}
	return t
}()

// slideView is a sliding window's view: its previous window's count p; q, the
// current window's count plus every reservation; and start, when (daemon clock) the
// window began. The estimate is floor(p·r/w) + q while the window runs (r: the time
// left of it), then floor(q·r/w) in the next (r: the time left of that one).
type slideView struct {
	p, q, r  float64
	start, w int64
}

// slideAt is a sliding window view's slide and its reset (slideReset), worked out once
// for a check, at its first use (of): its projection (project), its resets (resetOf)
// before and after it is charged, and a refusal's retry. Each worked them out afresh, a
// third of a sliding window's check admitted on credit (BenchmarkHybridTakeOnCredit).
// lim is the limit they were worked out under (nil: not yet): a reload's or another
// plan's limit (relimit) moves the view, and with it the slide. A check's first use
// must find lim nil (the zero value): the view may have moved since the last check.
type slideAt struct {
	s     slideView
	reset int64
	lim   *localbucket.Limit
}

// slideAt returns e's slideAt; the zero value for a view that is not a sliding window's.
func (e *hentry) slideAt() (v slideAt) {
	if e.synced > 0 && e.lim.Algorithm() == localbucket.SlidingWindow {
		v.s = e.slide()
		v.reset, v.lim = e.slideReset(v.s), e.lim
	}
	return v
}

// of returns v if it was worked out under e's limit, else e's slideAt afresh (only a
// sliding window's view is read from it).
func (v *slideAt) of(e *hentry) *slideAt {
	if v.lim != e.lim {
		*v = e.slideAt()
	}
	return v
}

// slideMargin covers the µs Redis counts in, against the ns here.
const slideMargin = int64(time.Microsecond)

// slide is e's view of a sliding window. Redis gives the µs gone of the window, which
// the view stores rounded down: the window's start is taken no earlier than Redis's
// (the view's time, the snapshot's, is before Redis's by up to the sync's round trip,
// as for every view time), and the previous window's share at the view no larger
// (its count, q, taken from what the view left: no smaller), so what follows is never
// early.
func (e *hentry) slide() slideView {
	lim := e.lim
	w := int64(lim.Window())
	gone := float64(math.Nextafter32(e.vt, math.MaxFloat32)) // no less than Redis's
	s := slideView{p: float64(e.vr), r: float64(lim.Requests()), w: w, start: e.synced - int64(e.vt) + lagNs(e.lag)}
	share := math.Floor(s.p * max(0, float64(w)-gone) / float64(w))
	s.q = max(0, s.r-math.Floor(e.view)-share)
	return s
}

// emptyAt returns when (daemon clock) a sliding window that began at start (length w)
// and counts q units is empty: when its count weighs less than one unit into the next
// window, from start+2w-ceil(w/q)+1 on, as localbucket's estimate does.
func emptyAt(start, w int64, q float64) int64 {
	return start + 2*w - int64(math.Ceil(float64(w)/q)) + 1
}

// at returns when (daemon clock) cost more units fit, beside extra units counted here
// and not in Redis: the first time the estimate plus them is at most the limit.
func (s slideView) at(cost, extra float64) int64 {
	q := s.q + extra
	w := float64(s.w)
	if k := s.r - cost - q; k >= 0 {
		// In the view's window, as the previous window's share falls.
		if s.p <= k {
			return s.start
		}
		rmax := int64(math.Ceil((k+1)*w/s.p)) - 1
		return s.start + s.w - max(0, rmax) + slideMargin
	}
	// In the next window, as this window's count (then the previous) falls.
	x := s.r - cost
	if q <= 0 || x < 0 {
		return s.start + s.w + slideMargin // x < 0: a cost above the limit, never asked here
	}
	rmax := int64(math.Ceil((x+1)*w/q)) - 1
	if rmax >= s.w {
		return s.start + s.w + slideMargin
	}
	return s.start + 2*s.w - max(0, rmax) + slideMargin
}

// ceilNs is ns (at least 0) as a float32 no smaller: 24 bits of precision, so at most
// 4 s late for a 732-day reset (a sliding window of the longest, 366 days, empties in
// two), 60 ns for a second. A view's times are hints of when units come back, never early.
func ceilNs(ns int64) float32 {
	if ns <= 0 {
		return 0
	}
	f := float32(ns)
	if int64(f) < ns {
		f = math.Nextafter32(f, math.MaxFloat32)
	}
	return f
}

// addOwed adds n to e.owed, saturating.
func (e *hentry) addOwed(n uint64) {
	e.owed = uint32(min(uint64(e.owed)+min(n, math.MaxUint32), math.MaxUint32))
}

const (
	flagDirty  uint16 = 1 << iota // on its shard's dirty list
	flagBusy                      // a sync of it is on its way: no second one meanwhile
	flagGone                      // evicted: a sync still holding it skips it
	flagShared                    // another daemon used the key lately: no credit, grants only
	// flagUnsettled: a sync that asked for units (an exact sync, a share grant) failed
	// without an answer, so Redis may have run it and reserved them for this daemon. The
	// next sync of the key (the record's token tells Redis it is a resend) gives them
	// back, so the key is synced, and kept, until one succeeds.
	flagUnsettled
	// flagHeld: at the last sync other daemons held units of the key reserved (their
	// grants), which come back at their next syncs unless used: a refusal for want of
	// room is retried after this daemon's next sync, not at the window's end or the
	// bucket's refill.
	flagHeld
	// flagRelimit: the key's limit changed (relimit) since its last confirmed sync,
	// whose next sync tells scripts/hybrid.lua so (modeRelimit): the one sync of this
	// change that cuts a token bucket's state to a whole burst of the new limit.
	flagRelimit
	// flagCut: the key's token bucket holds units a cut to a whole burst left out
	// (scripts/hybrid.lua's gu; the reply's flag 4), which the view, at this limit, does
	// not count. Redis reads them back at the key's next sync at another rate; until then
	// a raise of the limit moves the view by more room than the key has, and drops it
	// instead (relimit). Cleared by a relimit sync that finds none.
	flagCut
	// flagIdle: a check of the key here that would have used it was refused elsewhere
	// (another rule of the request, another store, a ban) while this daemon could hold
	// credit on it, its view at least leaveAfter intervals old (unused). Its next sync,
	// if the key admitted nothing here meanwhile, leaves it (modeLeave): the daemon gives
	// up its credit, and Redis drops any reservation of it (k) and this daemon as the
	// key's last user (refusedElsewhere).
	flagIdle
	// flagStray: a window's key admitted a unit beyond its grant, not yet synced, that
	// may lie outside the window of its view (admitted with no view, after the window's
	// earliest end or before its latest start, or while a sync that brought a view of
	// another window was on its way). Without it, its next sync counts what it admitted
	// in that window (modeDated); with it, by the last admission's age. Cleared when a
	// sync takes the units (snapshot).
	flagStray
	// flagPrev: the units waiting to be synced all lie in the window before the view's:
	// admitted in the window of the last view while the sync that brought this one, of
	// the next window, was on its way. Their sync counts them there (modePrev); the
	// key's next unit beyond its grant is decided by an exact sync that carries them
	// first (decide), or makes them stray. Cleared when a sync takes the units.
	flagPrev
)

func (h *Hybrid) shardOf(key []byte) uint32 {
	return uint32(maphash.Bytes(h.seed, key)) & (hybridShards - 1)
}

// markDirty puts e on its shard's dirty list (the shard's lock held).
func (sh *hshard) markDirty(e *hentry) {
	if e.flags&flagDirty == 0 {
		e.flags |= flagDirty
		sh.dirty = append(sh.dirty, e)
	}
}

// needsSync reports whether e has something to tell Redis: units used beyond (or short
// of) its grant, a window's grant not yet reported (reserved), or demand that outran its
// allowance.
func (e *hentry) needsSync() bool {
	return e.holds() || e.short > 0
}

// holds reports whether forgetting e would lose something: units not yet in Redis (used
// beyond the grant), a grant not yet given back (used short of it), a window's grant not
// yet reported (reserved), or units given back that Redis still counts (owed).
func (e *hentry) holds() bool {
	return e.pending != uint64(e.grant) || e.reserved() || e.owed > 0 || e.flags&flagUnsettled != 0
}

// reserved reports whether Redis counts e's grant as reserved: a window's grant, until
// the key's next sync reports it, used or not. Redis keeps the sum of a window's
// reservations (scripts/hybrid.lua's g), and says "other daemons hold units" while it
// has any but the asking sync's own new grant, so a refusal at the limit is told to
// retry after the next sync. A grant used exactly (the usual end of an exact sync) was
// never reported before: its units counted once in the window's count, as they must,
// but g kept them until the window ended, and a refusal at the limit, nothing reserved
// anywhere, was told the next sync over and over (TestHybridUsedGrantReleasesReservation).
// Reported, the key's next sync leaves it with no grant (a sync with no demand asks
// none), so it is then swept as any key holding nothing. A token bucket's grant is its
// units taken from the bucket, used or not: Redis keeps no reservation of it, and a grant
// used exactly has nothing to report.
func (e *hentry) reserved() bool {
	return e.grant > 0 && e.lim.Algorithm() != localbucket.TokenBucket
}

// unsynced is what forgetting e loses of what it admitted: the units beyond its grant.
func (e *hentry) unsynced() uint64 { return e.pending - min(e.pending, uint64(e.grant)) }

// evict makes room in a full shard (its lock held): among a sample of keys it drops one
// holding nothing if it finds one, else one holding only a grant (left to expire in
// Redis: a little budget idles, none is lost), else the one with the fewest units
// beyond its grant, which the next sync still carries (collect), else a limited one
// (its last view had no room for a unit). Keys with a sync on its way are left alone. A
// limited key holds nothing once its units are synced, yet forgetting it is not free:
// seen again it is a key new here, admitted a unit on credit (take) with a view of its
// whole capacity, and a limited client is kept before any that is not, as the local
// store keeps it. Ranked with the keys holding nothing, a client over its limit was
// evicted by a flood of one-off keys over and over, and admitted each time: 7 of 10
// requests within 3 s under a limit of 5 a minute it had used
// (TestHybridKeyCapKeepsLimitedKeys). When the shard holds only such keys, one goes all
// the same, and the shard's new keys get no unit before their first sync for as long as
// the evicted key could take to be full again (noFirstUntil): the daemon cannot tell
// that key from a key new to it when it comes back. Before, a client over its limit,
// evicted by other limited clients, got a unit at every visit: 2,000 clients of a
// limit of 4 an hour, 10 requests each, through 640 keys, 19,169 admitted
// (TestHybridEvictedLimitedKeyGetsNoFirstUnit). The keys of keep (the entries of the
// request making room, which it is about to charge) are left alone, as keys with a sync
// on their way are: a key the request had just added holds nothing yet and went first,
// and what the request then admitted on it, or the grant its exact sync reserved, was
// charged to a forgotten entry and never counted or given back (a request on two new
// keys of a full shard, a limit of 2 an hour: refused at every try, and the key's
// units gone in Redis; TestHybridKeyCapKeepsTheRequestsOwnKeys). It reports whether it
// dropped a key.
func (h *Hybrid) evict(sh *hshard, now int64, keep []*hentry) bool {
	var ve *hentry
	rank := func(e *hentry) int {
		switch {
		case e.flags&flagBusy != 0 || slices.Contains(keep, e):
			return 4
		case !e.holds():
			if e.synced > 0 && e.view < 1 {
				return 3
			}
			return 0
		case e.unsynced() == 0:
			return 1
		}
		return 2
	}
	n := 0
	for _, e := range sh.m {
		if ve == nil || rank(e) < rank(ve) || rank(e) == 2 && rank(ve) == 2 && e.unsynced() < ve.unsynced() {
			ve = e
		}
		if n++; n == 16 || rank(ve) == 0 {
			break
		}
	}
	if ve == nil || rank(ve) == 4 {
		return false
	}
	if ve.holds() || project(ve, now) < float64(ve.lim.Capacity()) {
		sh.noFirstUntil = max(sh.noFirstUntil, now+fullSpan(ve.lim))
	}
	h.evicted.Add(1)
	sh.load -= units(len(ve.key()), h.perShard)
	delete(sh.m, ve.key())
	// The dirty list holds it while it holds units beyond its grant: the next sync
	// carries them (collect), as it would have, kept.
	ve.flags |= flagGone
	return true
}

// fullSpan is the longest a key of lim takes to be full again: a token bucket's whole
// burst refilled, a fixed window, a sliding window and the one after it.
func fullSpan(lim *localbucket.Limit) int64 {
	w := int64(lim.Window())
	switch lim.Algorithm() {
	case localbucket.TokenBucket:
		return int64(math.Ceil(float64(w) * float64(lim.Burst()) / float64(lim.Requests())))
	case localbucket.SlidingWindow:
		return 2 * w
	}
	return w
}

// seenMs is the daemon clock now (ns) in milliseconds, wrapping every 49 days, as
// entries record their last check or admission (hentry.seen): 4 bytes a key, fine enough to date what a key
// admitted (syncItem.age), and compared only by differences (sinceSeen, sweep), which
// wrap correctly.
func seenMs(now int64) uint32 { return uint32(now / int64(time.Millisecond)) }

// sinceSeen is how long (ms) before now e.seen is: 0 if it is later. A request reads its
// clock before it takes its shard's lock, and a sync before it takes its keys (collect;
// an exact sync's is its request's, which may have waited on another sync meanwhile):
// under load another request, whose clock was read after, may have set e.seen past the
// now it is compared with. The unsigned difference then wrapped to 49 days: a key's
// first sync charged its units as of maxChargeAge (10 s) before Redis's time, before
// the window they were admitted in (scripts/hybrid.lua's "at"), and a fixed window
// never counted them (an audit: 4 to 38 units of 48,000 lost, one daemon, Redis
// healthy; TestHybridSyncClockBeforeAdmission).
func (e *hentry) sinceSeen(now int64) uint32 {
	if d := int32(seenMs(now) - e.seen); d > 0 {
		return uint32(d)
	}
	return 0
}

// admitted records an admission at now (take): e.seen becomes now, unless it records a
// later admission already, from a request whose clock was read after this one's (see
// sinceSeen). The sync dates what the key admitted by the last admission; moved back, it
// dated a unit admitted in a window before that window began, and a fixed window did
// not count it (TestHybridAdmissionsOutOfOrder).
func (e *hentry) admitted(now int64) {
	if s := seenMs(now); e.pending == 0 || int32(s-e.seen) > 0 {
		e.seen = s
	}
}

// sweep forgets the keys of shard i unused for KeepAlive that hold nothing and that are
// full again by their view: Redis already has everything they admitted, and a key
// forgotten gets one unit on credit when it comes back, which only a full key may give
// (a limited client whose requests rotate slowly over the daemons would otherwise get
// that unit on every visit).
func (h *Hybrid) sweep(i int, now int64) {
	sh := &h.shards[i]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.mPeak = max(sh.mPeak, len(sh.m))
	defer sh.giveBack() // after the keys this sweep forgets
	for k, e := range sh.m {
		if seenMs(now)-e.seen > uint32(h.keepAlive/time.Millisecond) && !e.holds() && e.flags&(flagDirty|flagBusy) == 0 &&
			fullAgain(e, now) {
			sh.load -= units(len(k), h.perShard)
			delete(sh.m, k)
		}
	}
}

// fullAgain reports whether e is full again at now: by its view, or, for a view a reload
// forgot (forgetView: synced 0, the view kept short of the limit, and the key's next
// check an exact sync), once unused for as long as its limit takes to come back full
// from empty (two windows; a token bucket's whole burst refilled). project takes a view
// with synced 0 as it stands, for good: before, such a key that no check asked for
// again was never swept, and every reload that made a rule hybrid again pinned the keys
// its clients had used (a soak's idle daemon held 216,324 of them, Redis 1).
func fullAgain(e *hentry, now int64) bool {
	if project(e, now) >= float64(e.lim.Capacity()) {
		return true
	}
	if e.synced != 0 {
		return false
	}
	lim := e.lim
	refill := 2 * lim.Window()
	if lim.Algorithm() == localbucket.TokenBucket && lim.Requests() > 0 {
		refill = max(refill, time.Duration(float64(lim.Window())*float64(lim.Capacity())/float64(lim.Requests())))
	}
	return time.Duration(e.sinceSeen(now))*time.Millisecond >= refill
}
