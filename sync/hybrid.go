package sync

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/maphash"
	"strings"
	gosync "sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

//go:embed scripts/hybrid.lua
var hybridLua string

var hybridScript = redis.NewScript(hybridLua)

// Hybrid is the hybrid mode: checks are decided from a local allowance per key, with no
// network on the hot path. Every interval Flush settles, per key, what this daemon used
// of its last grant and reserves its next one in Redis (scripts/hybrid.lua): the key's
// headroom over the next interval times this daemon's share of the key's demand. Grants
// are taken from the global state when granted, so daemons never hand out the same
// budget twice.
//
// Safe for concurrent use. Run (or Flush, in tests) is the only caller of Redis.
type Hybrid struct {
	rdb       redis.UniversalClient
	interval  time.Duration
	keepAlive time.Duration
	seed      maphash.Seed
	shards    [hybridShards]hshard

	// replicas is the number of live daemons (from heartbeats; at least 1).
	mu       gosync.Mutex
	replicas int

	id       string        // this daemon, in sync records
	tokens   atomic.Uint64 // sync tokens: each sync of a key carries a fresh one
	perShard int           // keys a shard holds at most
	dropped  atomic.Uint64 // admitted units lost to the key cap before they reached Redis
	evicted  atomic.Uint64 // keys evicted for the cap

	clock func() int64 // HybridOptions.Clock
	// lastOK is when Redis last answered a heartbeat or a flush (daemon clock, ns).
	lastOK  atomic.Int64
	breaker *Breaker      // nil: always call
	kick    chan struct{} // a key was seen for the first time: sync it without waiting
	observe Observer      // nil: none

	daemonsKey string // the live-daemons set, under the configured prefix
}

// WithObserver makes h report its calls to Redis (ops hybrid_sync and heartbeat).
func (h *Hybrid) WithObserver(o Observer) *Hybrid {
	h.observe = o
	return h
}

func (h *Hybrid) observed(op string, start time.Time, err error) {
	if h.observe != nil {
		h.observe(op, time.Since(start), err)
	}
}

// WithBreaker makes h skip its syncs while b is open (what was admitted stays pending),
// count as unhealthy meanwhile, and report to b.
func (h *Hybrid) WithBreaker(b *Breaker) *Hybrid {
	h.breaker = b
	return h
}

// StaleAfter is how long the allowances stay trusted after Redis last answered: past it,
// Healthy is false and the rules' failure policies decide.
func (h *Hybrid) StaleAfter() time.Duration { return max(5*h.interval, time.Second) }

// Healthy reports whether Redis answered recently enough for the allowances to stand.
// A Hybrid that has never reached Redis counts from its creation.
func (h *Hybrid) Healthy(now int64) bool {
	return !h.breaker.Open() && now-h.lastOK.Load() <= int64(h.StaleAfter())
}

const hybridShards = 64

type hshard struct {
	mu gosync.Mutex
	m  map[string]*hentry
	_  [40]byte
}

// hentry is one key's local view.
type hentry struct {
	lim         *localbucket.Limit
	allowance   float64 // what this daemon may still admit until the next grant
	grant       float64 // the units reserved for this daemon at the last sync
	grantWindow int64   // the window start (µs) that grant was taken from
	token       uint64  // the token of the last sync Redis confirmed
	pending     uint64  // admitted since the last flush began
	demand      uint64  // offered since the last flush began
	seen        int64   // last check, daemon clock (ns)
	synced      int64   // when the view was read (ns; 0: never)
	remaining   uint64  // global view: units left
	reset       int64   // global view: ns until full
	retry       int64   // global view: ns until one unit passes
}

// HybridOptions configures a Hybrid.
type HybridOptions struct {
	Interval  time.Duration // between flushes; default 100ms
	KeepAlive time.Duration // a key unused this long is no longer refreshed; default 10s
	// MaxKeys caps the keys held (default 1,000,000), so a flood of never-repeating keys
	// cannot grow memory without bound; see Dropped.
	MaxKeys int
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

// NewHybrid returns a Hybrid flushing to rdb.
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
	if o.ID == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		o.ID = hex.EncodeToString(b[:])
	}
	if o.Prefix == "" {
		o.Prefix = DefaultPrefix
	}
	h := &Hybrid{rdb: rdb, interval: o.Interval, keepAlive: o.KeepAlive, seed: maphash.MakeSeed(), replicas: 1, id: o.ID,
		daemonsKey: DaemonsKeyFor(o.Prefix), perShard: (o.MaxKeys + hybridShards - 1) / hybridShards, clock: o.Clock}
	h.lastOK.Store(h.clock())
	h.kick = make(chan struct{}, 1)
	for i := range h.shards {
		h.shards[i].m = make(map[string]*hentry)
	}
	return h
}

// Interval returns the flush interval.
func (h *Hybrid) Interval() time.Duration { return h.interval }

// SetReplicas records the number of live daemons.
func (h *Hybrid) SetReplicas(n int) {
	h.mu.Lock()
	h.replicas = max(1, n)
	h.mu.Unlock()
}

// Replicas returns the number of live daemons last counted (at least 1).
func (h *Hybrid) Replicas() int { return h.replicaCount() }

func (h *Hybrid) replicaCount() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.replicas
}

// HybridOp is one hybrid check in an all-or-nothing batch.
type HybridOp struct {
	Key    []byte // the Redis key, hash tag included; copied if stored
	Limit  *localbucket.Limit
	Cost   uint64
	Shadow bool
	Result localbucket.Result // output

	shard uint32 // set by Take
}

func (h *Hybrid) shardOf(key []byte) uint32 {
	return uint32(maphash.Bytes(h.seed, key)) & (hybridShards - 1)
}

// Take decides ops at now from the local allowances, all-or-nothing: if every non-shadow
// op fits its allowance, every fitting op is charged and it returns true; otherwise nothing
// is charged and it returns false. Offered cost counts as demand either way.
func (h *Hybrid) Take(now int64, ops []HybridOp) bool {
	var lockBuf [8]uint32
	var entBuf [8]*hentry
	locks := lockBuf[:0]
	ents := entBuf[:0]
	if len(ops) > len(entBuf) {
		ents = make([]*hentry, 0, len(ops))
	}
	for i := range ops {
		s := h.shardOf(ops[i].Key)
		ops[i].shard = s
		k := len(locks)
		for k > 0 && locks[k-1] > s {
			k--
		}
		if k > 0 && locks[k-1] == s {
			continue
		}
		locks = append(locks, 0)
		copy(locks[k+1:], locks[k:])
		locks[k] = s
	}
	for _, s := range locks {
		h.shards[s].mu.Lock()
	}
	defer func() {
		for _, s := range locks {
			h.shards[s].mu.Unlock()
		}
	}()

	replicas := 0
	ok := true
	for i := range ops {
		op := &ops[i]
		sh := &h.shards[op.shard]
		e := sh.m[string(op.Key)]
		if e == nil {
			if replicas == 0 {
				replicas = h.replicaCount()
			}
			// Before its first grant a daemon may admit one request on credit, if the
			// key's capacity leaves one for every live daemon; the first sync records it.
			credit := 0.0
			if op.Limit.Capacity() >= uint64(replicas) {
				credit = 1
			}
			e = &hentry{lim: op.Limit, allowance: credit, remaining: op.Limit.Capacity()}
			if len(sh.m) >= h.perShard {
				h.evict(sh)
			}
			sh.m[string(op.Key)] = e
			select { // ask Run for a first sync now, not at the next tick
			case h.kick <- struct{}{}:
			default:
			}
		}
		ents = append(ents, e)
		e.lim = op.Limit
		e.seen = now
		op.Result = h.decide(e, now, op.Cost)
		if !op.Result.Allowed && !op.Shadow {
			ok = false
		}
	}
	for i := range ops {
		op := &ops[i]
		e := ents[i]
		cost := op.Cost
		e.demand += max(cost, 1)
		if ok && op.Result.Allowed && cost > 0 {
			e.allowance -= float64(cost)
			e.pending += cost
			op.Result.Remaining = subFloor(op.Result.Remaining, cost)
		}
		if !ok && op.Result.Allowed {
			op.Result.RetryAfter = 0
		}
	}
	return ok
}

// evict makes room in a full shard (its lock held): among a sample of keys it drops one
// holding nothing (no pending units, no grant) if it finds one, else one holding only a
// grant (left to expire in Redis: a little budget idles, none is lost), else the one with
// the least pending, whose units are then lost and counted in Dropped.
func (h *Hybrid) evict(sh *hshard) {
	var victim string
	var ve *hentry
	rank := func(e *hentry) int {
		switch {
		case e.pending == 0 && e.grant == 0:
			return 0
		case e.pending == 0:
			return 1
		}
		return 2
	}
	n := 0
	for k, e := range sh.m {
		if ve == nil || rank(e) < rank(ve) || rank(e) == 2 && rank(ve) == 2 && e.pending < ve.pending {
			victim, ve = k, e
		}
		if n++; n == 16 || rank(ve) == 0 {
			break
		}
	}
	if ve == nil {
		return
	}
	if ve.pending > 0 {
		h.dropped.Add(ve.pending)
	}
	h.evicted.Add(1)
	delete(sh.m, victim)
}

// Dropped returns the admitted units lost to the key cap before they reached Redis.
func (h *Hybrid) Dropped() uint64 { return h.dropped.Load() }

// Evicted returns the keys evicted to keep within the key cap.
func (h *Hybrid) Evicted() uint64 { return h.evicted.Load() }

// Undo gives back what Take charged, for a request a later (local) check rejected.
func (h *Hybrid) Undo(ops []HybridOp) {
	for i := range ops {
		op := &ops[i]
		if !op.Result.Allowed || op.Cost == 0 {
			continue
		}
		sh := &h.shards[op.shard]
		sh.mu.Lock()
		if e := sh.m[string(op.Key)]; e != nil {
			e.allowance += float64(op.Cost)
			e.pending = subFloor(e.pending, op.Cost)
		}
		op.Result.Remaining += op.Cost
		sh.mu.Unlock()
	}
}

func subFloor(a, b uint64) uint64 {
	if b > a {
		return 0
	}
	return a - b
}

// decide judges cost against e without charging it.
func (h *Hybrid) decide(e *hentry, now int64, cost uint64) localbucket.Result {
	lim := e.lim
	r := localbucket.Result{Limit: lim.Requests()}
	elapsed := int64(0)
	if e.synced > 0 {
		elapsed = max(0, now-e.synced)
	}
	r.Reset = max(0, e.reset-elapsed)
	r.Remaining = subFloor(e.remaining, e.pending)
	if cost > lim.Capacity() {
		r.Impossible = true
		return r
	}
	need := float64(max(cost, 1))
	if e.allowance >= need {
		r.Allowed = true
		return r
	}
	// Out of allowance: retry when the global view says a unit frees up, but not before
	// the next flush brings a new allowance.
	nextView := int64(h.interval)
	if e.synced > 0 {
		nextView = max(int64(time.Millisecond), e.synced+int64(h.interval)-now)
	}
	r.RetryAfter = max(nextView, e.retry-elapsed)
	r.Remaining = 0
	return r
}

type flushItem struct {
	key   string
	token uint64 // this sync's
	// A snapshot of the entry, taken under its shard's lock: send reads only these.
	lim         *localbucket.Limit
	grant       uint64
	grantWindow int64
	prevToken   uint64
	e           *hentry
	delta       uint64
	demand      uint64
	cmd         *redis.Cmd
	idle        bool // unused for KeepAlive: dropped once this sync has given its grant back
}

// Flush runs one sync: for every key it holds it settles what was admitted against the
// key's last grant and reserves the next grant, sized by the demand offered since the last
// flush, all pipelined, and applies the views that come back. A key unused for KeepAlive
// gets a grant of zero, which gives its last one back, and is then dropped locally. On
// error the unsent or unconfirmed units are kept for the next flush, so nothing admitted
// is lost; and since every sync carries tokens that Redis records for 10 s, a sync whose
// reply was lost after Redis applied it is not counted again when its units are resent.
func (h *Hybrid) Flush(ctx context.Context, now int64) error { return h.flush(ctx, now, flushAll) }

// flushMode says which keys a flush syncs.
type flushMode uint8

const (
	flushAll     flushMode = iota // every key, with its demand
	flushRelease                  // every key, asking for no new grants (shutdown)
	flushNew                      // only keys never synced: a new client's first grant
)

// Release is the last flush before a daemon stops: it settles what was admitted and asks
// for no new grants, so no budget stays reserved for a daemon that is gone.
func (h *Hybrid) Release(ctx context.Context, now int64) error {
	return h.flush(ctx, now, flushRelease)
}

func (h *Hybrid) flush(ctx context.Context, now int64, mode flushMode) error {
	release := mode == flushRelease
	var items []flushItem
	for i := range h.shards {
		sh := &h.shards[i]
		sh.mu.Lock()
		for k, e := range sh.m {
			if mode == flushNew && e.synced != 0 {
				continue
			}
			idle := e.pending == 0 && e.demand == 0 && now-e.seen > int64(h.keepAlive)
			if idle && e.grant == 0 {
				delete(sh.m, k)
				continue
			}
			it := flushItem{key: k, e: e, delta: e.pending, demand: e.demand, idle: idle,
				lim: e.lim, grant: uint64(e.grant), grantWindow: e.grantWindow, prevToken: e.token}
			if release {
				it.demand = 0
			}
			items = append(items, it)
			e.pending, e.demand = 0, 0
		}
		sh.mu.Unlock()
	}
	if len(items) == 0 {
		return nil
	}
	sendErr := h.send(ctx, items)
	replicas := h.replicaCount()
	var failed int
	var firstErr error
	for i := range items {
		it := &items[i]
		vals, err := int64s(it.cmd)
		if err == nil && len(vals) != 6 {
			err = fmt.Errorf("script reply has %d elements, want 6", len(vals))
		}
		sh := &h.shards[h.shardOf([]byte(it.key))]
		sh.mu.Lock()
		e := it.e
		if err != nil {
			// Not confirmed: keep the counts for the next flush.
			e.pending += it.delta
			if !release {
				e.demand += it.demand
			}
			failed++
			if firstErr == nil {
				firstErr = err
			}
			sh.mu.Unlock()
			continue
		}
		grant := float64(max(0, vals[0]))
		e.grant = grant
		e.token = it.token
		e.grantWindow = vals[4]
		e.remaining = uint64(max(0, vals[1]))
		// What was admitted while the sync was on its way counts against the new grant.
		// A daemon without a grant (no recent demand) may still admit one request on
		// credit while the key has a unit free for every live daemon, so a client's
		// first request after a pause is not refused.
		credit := 0.0
		if grant == 0 && e.remaining >= uint64(replicas) {
			credit = 1
		}
		e.allowance = grant + credit - float64(e.pending)
		e.reset = vals[2] * int64(time.Microsecond)
		e.retry = vals[3] * int64(time.Microsecond)
		e.synced = now
		if it.idle && e.pending == 0 && e.demand == 0 && e.grant == 0 {
			delete(sh.m, it.key) // its grant is back in Redis; nothing is left here
		}
		sh.mu.Unlock()
	}
	if failed < len(items) {
		h.lastOK.Store(max(h.lastOK.Load(), now))
	}
	if failed > 0 {
		if firstErr == nil {
			firstErr = sendErr
		}
		return fmt.Errorf("hybrid flush: %d of %d keys not synced: %w", failed, len(items), firstErr)
	}
	return nil
}

// flushBatch is how many keys one pipeline carries: a flush of many keys goes as several
// pipelines, so no single one holds Redis (or waits on it) for long.
const flushBatch = 512

// send runs the script for every item, pipelined in batches (go-redis splits each batch
// per node on a cluster). Items that come back NOSCRIPT (a restarted or failed-over node)
// are sent again with EVAL, which loads the script; only those, so nothing is applied
// twice.
func (h *Hybrid) send(ctx context.Context, items []flushItem) error {
	replicas := h.replicaCount()
	recordTTL := max(10*time.Second, 20*h.interval).Milliseconds()
	args := func(it *flushItem) []any {
		lim := it.lim
		if it.token == 0 {
			it.token = h.tokens.Add(1)
		}
		return []any{int(lim.Algorithm()), lim.Requests(), lim.Window().Microseconds(), lim.Burst(),
			it.delta, it.grant, it.grantWindow, it.demand, h.interval.Microseconds(), replicas,
			it.prevToken, it.token, recordTTL}
	}
	keys := func(it *flushItem) []string { return []string{it.key, it.key + ":s:" + h.id} }
	var firstErr error
	for lo := 0; lo < len(items); lo += flushBatch {
		batch := items[lo:min(lo+flushBatch, len(items))]
		pipe := h.rdb.Pipeline()
		for i := range batch {
			it := &batch[i]
			it.cmd = hybridScript.EvalSha(ctx, pipe, keys(it), args(it)...)
		}
		_, err := pipe.Exec(ctx)
		if err != nil && hasNoScript(batch) {
			pipe = h.rdb.Pipeline()
			for i := range batch {
				it := &batch[i]
				if isNoScriptErr(it.cmd.Err()) {
					it.cmd = hybridScript.Eval(ctx, pipe, keys(it), args(it)...)
				}
			}
			_, err = pipe.Exec(ctx)
		}
		if err != nil && firstErr == nil {
			firstErr = err
		}
		if ctx.Err() != nil {
			break // out of time: the rest stays pending for the next flush
		}
	}
	return firstErr
}

func isNoScriptErr(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT")
}

func hasNoScript(items []flushItem) bool {
	for _, it := range items {
		if it.cmd != nil && isNoScriptErr(it.cmd.Err()) {
			return true
		}
	}
	return false
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

//go:embed scripts/heartbeat.lua
var heartbeatLua string

var heartbeatScript = redis.NewScript(heartbeatLua)

// DaemonsKey is the sorted set of live daemons under DefaultPrefix (see DaemonsKeyFor).
const DaemonsKey = DefaultPrefix + "daemons"

// Heartbeat records this daemon as live and returns how many daemons are: those that
// sent a heartbeat within ttl. It also updates the replica count new keys are sized by.
func (h *Hybrid) Heartbeat(ctx context.Context, id string, ttl time.Duration) (int, error) {
	v, err := heartbeatScript.Run(ctx, h.rdb, []string{h.daemonsKey}, id, ttl.Milliseconds()).Int64()
	if err != nil {
		return 0, fmt.Errorf("heartbeat: %w", err)
	}
	h.lastOK.Store(h.clock())
	h.SetReplicas(int(v))
	return int(v), nil
}

// Run flushes and sends a heartbeat every interval until ctx ends, then releases (a last
// flush that takes no new grants), with a fresh context bounded by timeout, so what was
// admitted before a shutdown reaches Redis and no budget stays reserved. clock returns the daemon's time (ns); onErr sees every failure.
func (h *Hybrid) Run(ctx context.Context, id string, clock func() int64, timeout time.Duration, onErr func(error)) {
	t := time.NewTicker(h.interval)
	defer t.Stop()
	// Each sync starts with a heartbeat, which doubles as the breaker's probe: while
	// Redis is known to be down, nothing else is sent and admitted units stay pending.
	beat := func() bool {
		if !h.breaker.Allow() {
			return false
		}
		c, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		start := time.Now()
		_, err := h.Heartbeat(c, id, 10*h.interval+time.Second)
		h.observed("heartbeat", start, err)
		if err != nil {
			h.breaker.Failure()
			onErr(err)
			return false
		}
		h.breaker.Success()
		return true
	}
	flush := func(mode flushMode) {
		// A flush of many keys takes several pipelines: allow it a few intervals.
		c, cancel := context.WithTimeout(context.Background(), max(timeout, 5*h.interval))
		defer cancel()
		start := time.Now()
		err := h.flush(c, clock(), mode)
		h.observed("hybrid_sync", start, err)
		if err != nil {
			h.breaker.Failure()
			onErr(err)
		}
	}
	beat()
	for {
		select {
		case <-ctx.Done():
			// The last flush after a drain is tried even with the breaker open: it is
			// the daemon's last chance to hand in what it admitted.
			flush(flushRelease)
			return
		case <-t.C:
			if beat() {
				flush(flushAll)
			}
		case <-h.kick:
			// New clients get their first grant within a round trip instead of waiting
			// up to an interval on their single credit; at most one such sync per 2 ms,
			// so a flood of new keys costs Redis one pipeline per 2 ms, not one per key.
			if h.breaker.Allow() {
				flush(flushNew)
				time.Sleep(2 * time.Millisecond)
			}
		}
	}
}
