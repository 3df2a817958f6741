package sync

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"hash/maphash"
	"strings"
	gosync "sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// Hybrid is the hybrid mode: checks are decided from a local view of each key, with no
// network on the hot path for keys that have budget. docs/accuracy.md derives the bound.
//
// Per key a daemon holds a grant (units reserved for it in Redis) and a credit (its
// share, 1/N for N live daemons, of what the key could still admit at its last sync,
// growing with the refill since). A request within grant plus credit passes locally. A
// key whose demand outruns that on a daemon where it is hot is given a grant sized by
// its share of the key's demand at the next sync. A request the daemon cannot decide
// locally (no fresh view, or a share too small to hold a whole request: a slow limit
// over many daemons) waits for one exact sync of its key, as in the global mode.
//
// Every interval Run syncs, many keys per script call (scripts/hybrid.lua), only the keys
// that changed: those used since their last sync, those whose demand outran their
// allowance by two units or more (a lone refusal, nothing to settle, sends nothing), and
// those holding an unused grant, which goes back once. A key nobody uses costs Redis
// nothing; after traffic stops Redis sees only heartbeats.
//
// Safe for concurrent use.
type Hybrid struct {
	rdb         redis.UniversalClient
	cluster     bool // rdb is a Redis Cluster: one script call per slot
	interval    time.Duration
	keepAlive   time.Duration
	fetchWait   time.Duration // how long a request waits for an exact sync of its key
	maxSync     int           // keys one periodic sync sends at most
	seed        maphash.Seed
	shards      [hybridShards]hshard
	limits      limitTable
	heartbeatKs []string // DaemonsKey, and on a cluster two more on other masters

	replicas atomic.Int64 // live daemons (from heartbeats; at least 1)
	// counts keeps the most live daemons counted within the last creditPeak: what a
	// view's credit is sized by (creditShares), never by fewer than a sync of the key
	// recorded in Redis while its credit may be spent.
	counts creditCount

	id       string              // this daemon, in sync records
	tokens   atomic.Uint64       // sync tokens: each sync of a key carries a fresh one (newToken)
	perShard int                 // keys a shard holds at most
	dropped  atomic.Uint64       // admitted units lost to the key cap before they reached Redis
	evicted  atomic.Uint64       // keys evicted for the cap
	backlog  atomic.Int64        // keys that needed a sync and waited for the next one
	nextFrom atomic.Uint32       // the shard the next periodic sync collects from first (collect)
	fetches  atomic.Uint64       // exact syncs made for a waiting request
	fetchQ   combiner[*fetchReq] // exact syncs waiting for the batch in flight (hybrid_fetch.go)
	// masters holds, per Redis master (one on a standalone Redis, or without
	// WithMasters), its breaker, when it last answered a heartbeat, a ping or a sync
	// (lastOK, daemon clock, ns), and when a sync to it last failed (syncFailed: an exact
	// sync that did, or a periodic one that got no answer from it). Until a master answers
	// something, no exact sync of its keys is tried and its keys that only Redis can
	// decide are Unreachable; past StaleAfter without an answer, or with its breaker open,
	// every one of its keys is (Take). Never nil.
	masters    *Masters
	single     *Master       // the one master of masters, when it is not per master of a cluster
	health     *Master       // Healthy's: single, or one no breaker guards, answered when any master is
	staleAfter time.Duration // StaleAfter: 5 intervals, at least 2 heartbeats
	kick       chan struct{} // a key was seen for the first time: sync soon, not at the next tick
	observe    Observer      // nil: none
	syncDone   func(d time.Duration, keys int)
	clock      func() int64                      // HybridOptions.Clock
	wall       atomic.Pointer[localbucket.Store] // SetWall: its WallOffset turns the clock given into wall time

	daemonsKey string // the live-daemons set, under the configured prefix

	// On a standalone Redis a heartbeat rides on a sync's script call when one goes
	// while it is due (hybrid_run.go): Run offers it, send takes it.
	beat    atomic.Int32 // beatIdle, beatOffered or beatTaken
	rodeAt  atomic.Int64 // when a heartbeat riding on a sync last succeeded (monoNow)
	beatTTL time.Duration
}

// WithObserver makes h report its calls to Redis (ops hybrid_sync, hybrid_fetch,
// heartbeat, and ping: a master no heartbeat reaches, with a breaker per master).
func (h *Hybrid) WithObserver(o Observer) *Hybrid {
	h.observe = o
	return h
}

// WithSyncObserver makes Run report each periodic sync: how long it took and how many
// keys it carried. Call it before Run.
func (h *Hybrid) WithSyncObserver(f func(d time.Duration, keys int)) *Hybrid {
	h.syncDone = f
	return h
}

func (h *Hybrid) observed(op string, start time.Time, err error) {
	if h.observe != nil {
		h.observe(op, time.Since(start), err)
	}
}

// WithBreaker makes h skip its syncs while b is open (what was admitted stays pending),
// count as unhealthy meanwhile, and report to b: one breaker, and one judgement of
// whether Redis answers, for every key whichever master holds it. Call it before h is
// used. See WithMasters.
func (h *Hybrid) WithBreaker(b *Breaker) *Hybrid {
	return h.WithMasters(mastersOf(b, h.clock))
}

// WithMasters makes h judge each Redis master on its own (m: one per master of h's
// cluster, built with h's Clock and refreshed by m.Run): a master's syncs are skipped
// while its breaker is open, and its keys alone go stale when it stops answering
// (heartbeats, pings, syncs); the other masters' keys are decided as usual. Call it
// before h is used.
func (h *Hybrid) WithMasters(m *Masters) *Hybrid {
	h.masters, h.single, h.health = m, nil, &Master{}
	if !m.Cluster() {
		h.single = m.List()[0]
		h.health = h.single
	} else {
		h.health.lastOK.Store(h.clock())
	}
	return h
}

// masterOf returns the master of e's key in the current slot map.
func (h *Hybrid) masterOf(e *hentry) *Master {
	if h.single != nil {
		return h.single
	}
	t := h.masters.table.Load()
	return t.list[t.slot[e.slot]]
}

// StaleAfter is how long the allowances stay trusted after Redis last answered: past it,
// Healthy is false and the rules' failure policies decide.
func (h *Hybrid) StaleAfter() time.Duration { return h.staleAfter }

// Healthy reports whether Redis answered recently enough for the allowances to stand:
// on a cluster with a breaker per master (WithMasters), whether some master did (Take
// then judges each key by its own master, and its breaker); otherwise, whether Redis did
// and the breaker is closed. A master that has never answered counts from its creation.
func (h *Hybrid) Healthy(now int64) bool {
	return h.health.fresh(now, h.staleAfter) // on every check's path: inlined
}

// answeredBy records that master m answered at now.
func (h *Hybrid) answeredBy(m *Master, now int64) {
	m.answered(now)
	if h.health != m {
		h.health.answered(now)
	}
}

// Reachable reports whether every master answered recently enough for its allowances to
// stand (on a standalone Redis, Healthy): false while some keys are decided by the
// rules' failure policies for want of their master.
func (h *Hybrid) Reachable(now int64) bool {
	for _, m := range h.masters.List() {
		if !m.fresh(now, h.staleAfter) {
			return false
		}
	}
	return true
}

// HybridOptions configures a Hybrid.
type HybridOptions struct {
	Interval  time.Duration // between syncs; default 100ms
	KeepAlive time.Duration // a key unused this long, holding nothing, is forgotten; default 10s
	// MaxKeys caps the keys held (default 1,000,000), so a flood of never-repeating keys
	// cannot grow memory without bound; see Dropped.
	MaxKeys int
	// MaxSyncKeys caps the keys one periodic sync carries (default 100,000); the rest
	// wait for the next one (see Backlog).
	MaxSyncKeys int
	// FetchWait bounds a batch of exact syncs (default 25ms): a request waits for the
	// batch in flight and then its own; past it, the keys only Redis could decide are
	// Unreachable (HybridOp), for the rules' failure policies.
	FetchWait time.Duration
	// ID names this daemon in its sync records (default: random). Two daemons must
	// not share one.
	ID string
	// Prefix starts the live-daemons key (DaemonsKeyFor); default DefaultPrefix. It must
	// pass CheckPrefix. The keys Hybrid syncs come from its callers, prefix included.
	Prefix string
	// Clock is the daemon's clock (ns), the one checks are decided on: lastOK is read
	// on it, so Healthy compares like with like; default the wall clock.
	Clock func() int64
}

// defaultFetchWait is HybridOptions.FetchWait's default. The package's tests raise it
// (fetchwait_test.go): on a loaded machine an exact sync can take longer than 25ms,
// and a test not about the wait would see a refusal it does not test.
var defaultFetchWait = 25 * time.Millisecond

// NewHybrid returns a Hybrid syncing to rdb.
func NewHybrid(rdb redis.UniversalClient, o HybridOptions) *Hybrid {
	if o.Interval <= 0 {
		o.Interval = 100 * time.Millisecond
	}
	if o.KeepAlive <= 0 {
		o.KeepAlive = 10 * time.Second
	}
	if o.MaxKeys <= 0 {
		o.MaxKeys = 1_000_000
	}
	if o.Clock == nil {
		o.Clock = func() int64 { return time.Now().UnixNano() }
	}
	if o.MaxSyncKeys <= 0 {
		o.MaxSyncKeys = 100_000
	}
	if o.FetchWait <= 0 {
		o.FetchWait = defaultFetchWait
	}
	if o.ID == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		o.ID = hex.EncodeToString(b[:])
	}
	if o.Prefix == "" {
		o.Prefix = DefaultPrefix
	}
	_, cluster := rdb.(*redis.ClusterClient)
	h := &Hybrid{rdb: rdb, cluster: cluster, interval: o.Interval, keepAlive: o.KeepAlive, fetchWait: o.FetchWait,
		maxSync: o.MaxSyncKeys, seed: maphash.MakeSeed(), id: o.ID, clock: o.Clock,
		daemonsKey: DaemonsKeyFor(o.Prefix), perShard: (o.MaxKeys + hybridShards - 1) / hybridShards}
	h.replicas.Store(1)
	h.counts.most.Store(1)
	// Tokens start at a random point, not at 1: a daemon restarted under the same ID finds
	// its previous run's sync records on the keys, and a token that run recorded must not
	// come back as this run's (newToken).
	var tb [4]byte
	_, _ = rand.Read(tb[:])
	h.tokens.Store(uint64(binary.LittleEndian.Uint32(tb[:])))
	h.staleAfter = max(5*h.interval, 2*h.heartbeatEvery())
	h.kick = make(chan struct{}, 1)
	h.heartbeatKs = heartbeatKeys(h.daemonsKey, cluster)
	h.beatTTL = 3 * h.heartbeatEvery()
	h.WithMasters(mastersOf(nil, h.clock))
	for i := range h.shards {
		h.shards[i].m = make(map[string]*hentry)
	}
	h.limits.m = make(map[localbucket.Limit]*localbucket.Limit)
	return h
}

// Interval returns the sync interval.
func (h *Hybrid) Interval() time.Duration { return h.interval }

// SetReplicas records the number of live daemons.
func (h *Hybrid) SetReplicas(n int) {
	n = max(1, n)
	h.replicas.Store(int64(n))
	h.counts.add(monoNow(), n)
}

// creditPeak is how long a count of the live daemons sizes credit after it was counted:
// as long as a reservation of credit lasts in Redis (credit_life in scripts/hybrid.lua),
// longer than credit may be spent (creditLife).
const creditPeak = 60 * time.Second

// creditCount keeps the most live daemons counted within creditPeak. A sync records,
// with this daemon as a key's last user, the count it was sized by (replicas), and the
// daemon that takes the key over reserves this daemon's credit by it (⌊C ÷ 2N⌋). The
// credit, from the view a sync brought and the refill since (growth), is sized here by
// no fewer: with a daemon gone, the count falls at the next heartbeat, and credit of
// ⌊V ÷ 2(N−1)⌋ would outgrow the reservation made by N.
type creditCount struct {
	most atomic.Int64 // the most within creditPeak, as of the last add (at least 1)
	mu   gosync.Mutex
	// The counts that may still be the most, oldest first: each greater than the ones
	// after it, a later count no smaller having displaced them.
	q []countAt
}

type countAt struct {
	at int64 // monoNow
	n  int
}

// add records a count of n at at and returns the most within creditPeak, which it
// stores in most (under the lock: two adds at once, a heartbeat's and one a sync
// carried, store in the order they counted).
func (c *creditCount) add(at int64, n int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.q) > 0 && c.q[len(c.q)-1].n <= n {
		c.q = c.q[:len(c.q)-1]
	}
	c.q = append(c.q, countAt{at, n})
	drop := 0
	for c.q[drop].at < at-int64(creditPeak) {
		drop++ // never the last: at is its time
	}
	c.q = c.q[drop:]
	c.most.Store(int64(c.q[0].n))
	return c.q[0].n
}

// Replicas returns the number of live daemons last counted (at least 1).
func (h *Hybrid) Replicas() int { return h.replicaCount() }

// SetWall gives h the store whose WallOffset (the wall clock minus the clock h is given,
// which the daemon keeps it told) places a fixed window's end where h's view of the key
// does not: on wall time, as the local mode aligns fixed windows (fixedLeft). Without it,
// on the clock h is given. Safe for concurrent use.
func (h *Hybrid) SetWall(s *localbucket.Store) { h.wall.Store(s) }

// wallOf returns now, on the clock h is given, in wall time (SetWall).
func (h *Hybrid) wallOf(now int64) int64 {
	if s := h.wall.Load(); s != nil {
		return now + s.WallOffset()
	}
	return now
}

func (h *Hybrid) replicaCount() int { return int(h.replicas.Load()) }

// Dropped returns the admitted units lost to the key cap before they reached Redis.
func (h *Hybrid) Dropped() uint64 { return h.dropped.Load() }

// Evicted returns the keys evicted to keep within the key cap.
func (h *Hybrid) Evicted() uint64 { return h.evicted.Load() }

// Backlog returns how many keys needed a sync but were left for the next one, at the
// last periodic sync (MaxSyncKeys reached, or out of time).
func (h *Hybrid) Backlog() int { return int(h.backlog.Load()) }

// Fetches returns how many exact syncs requests have waited for.
func (h *Hybrid) Fetches() uint64 { return h.fetches.Load() }

// Len returns the keys held locally.
func (h *Hybrid) Len() int {
	n := 0
	for i := range h.shards {
		h.shards[i].mu.Lock()
		n += len(h.shards[i].m)
		h.shards[i].mu.Unlock()
	}
	return n
}

// limitTable interns limits: an entry points at a copy owned by the table, never at the
// caller's Limit (an inline limit lives in a connection's scratch space and changes with
// the next request). Bounded: past limitTableMax distinct limits, each entry gets its
// own copy.
type limitTable struct {
	mu gosync.Mutex
	m  map[localbucket.Limit]*localbucket.Limit
}

const limitTableMax = 4096

func (t *limitTable) intern(l *localbucket.Limit) *localbucket.Limit {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p := t.m[*l]; p != nil {
		return p
	}
	p := new(localbucket.Limit)
	*p = *l
	if len(t.m) < limitTableMax {
		t.m[*l] = p
	}
	return p
}

// ForgetRuleViews drops the view, and the credit it gave, of every key held of the
// rules named in names: keys prefix + name + "~" (a rule's name, then its fingerprint:
// limiter.AppendFingerprint). Each such key's next check makes an exact sync, as a key
// new here does; what it admitted, reserved or owes is kept for its next sync to
// settle. For a reload that makes a rule hybrid again here after this daemon decided
// it in another mode: its views are older than what this daemon's global checks of the
// key spent in Redis meanwhile, which no view here counts and which global mode does
// not reserve against this daemon's credit. Kept, one daemon, 1,000 an hour, 100 used
// in hybrid mode, the other 900 in global mode, then hybrid again: 450 more admitted
// at once on credit from the view before (TestReloadHybridGlobalHybridKeepsTheLimit).
// It returns how many keys it found.
func (h *Hybrid) ForgetRuleViews(prefix string, names map[string]struct{}) int {
	if len(names) == 0 {
		return 0
	}
	n := 0
	for i := range h.shards {
		sh := &h.shards[i]
		sh.mu.Lock()
		for k, e := range sh.m {
			rest, ok := strings.CutPrefix(k, prefix)
			if !ok {
				continue
			}
			name, _, ok := strings.Cut(rest, "~")
			if !ok {
				continue
			}
			if _, in := names[name]; in {
				e.forgetView()
				n++
			}
		}
		sh.mu.Unlock()
	}
	return n
}
