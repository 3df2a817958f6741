package localbucket

import (
	"bytes"
	"hash/maphash"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Options configures a [Store]. The zero value gives the defaults.
type Options struct {
	// Shards is the number of independently locked shards, a power of two; default 256.
	Shards int
	// MaxKeys caps the keys stored over all shards; default 4,000,000. Each shard holds at
	// most ceil(MaxKeys/Shards) keys, a key longer than 55 bytes counting as one more per
	// 96 bytes of it, started (so that the cap bounds memory whatever the keys' lengths);
	// past it by at most one batch's keys while the others are all limited (insert).
	MaxKeys int
	// PrefetchFrom is about how many keys the store holds (one shard's share of them,
	// reached by any shard) when [Store.Prefetch] starts fetching: below it a check's
	// keys are mostly in the CPU's caches already; default 65,536; negative, never.
	PrefetchFrom int
}

const (
	defaultShards  = 256
	defaultMaxKeys = 4_000_000
	// defaultPrefetchFrom: in the connection loop on the 2-core VMs this was measured
	// on (1 MB of L2 a core), pipelined checks over keys drawn uniformly took, fetching
	// ahead, 1.13-1.20 of the time at 4,096 keys (each Prefetch costs a hash and a few
	// loads, and the lines were there already), 0.95 at 16,384, 0.72 at 65,536, 0.69 at
	// 131,072 and 0.65-0.75 at 1,048,576 (BenchmarkLoopPrefetch); under hot keys the
	// crossover moves up, so the default is past it.
	defaultPrefetchFrom = 65_536
	maxShards           = 1 << 16
)

// Store is a sharded in-memory map from key to [State] that applies batches of checks
// all-or-nothing ([Store.Apply]). Each shard is a mutex and a hash table; a batch locks the
// shards it touches in ascending order, so batches on overlapping keys never deadlock and
// never admit more than the limit. States that carry no information are not stored, and
// [Store.Sweep] drops the ones that expired. When a shard is full, inserting a key evicts
// a key that is not currently limited; a shard full of limited clients stores no new key,
// and decides new keys on a fallback state per rule that they share ([Store.Untracked]).
// A state is read only by a limit of the algorithm (and window) that wrote it; another
// (after a reload changed the rule) starts it afresh.
//
// Build it with [NewStore]; the zero value is not usable. A Store is safe for concurrent
// use.
type Store struct {
	seed      maphash.Seed
	mask      uint32
	shards    []shard
	evictions atomic.Uint64
	untracked atomic.Uint64
	// big is set when a shard first holds prefetchAt keys (Options.PrefetchFrom's share
	// of a shard): the store is then too big for the caches, and Prefetch fetches
	// (prefetch.go). It stays set.
	big        atomic.Bool
	prefetchAt int
	// wallOffset is wall time minus the time Apply is given (see SetWallOffset).
	wallOffset atomic.Int64
}

// entry is what is stored for one key: 40 bytes.
type entry struct {
	st      State
	expires int64
	// limitedUntil is, for a key limited when it was written, the Result's LimitedUntil;
	// else (any value <= now says not limited) a negative mark of the units of its
	// capacity it had used (markOf): evict removes the entry that has used the fewest.
	limitedUntil int64
	kind         uint64 // Limit.stateKind of the limit that wrote st
}

// markOf is what an entry written with r by l keeps as its limitedUntil: r.LimitedUntil
// when r says limited, else -1 - (the units of l's capacity used), from -1 (none used)
// down. Negative, so at or before any now: not limited.
func markOf(r *Result, l *Limit) int64 {
	if r.LimitedUntil != 0 {
		return r.LimitedUntil
	}
	return -1 - int64(l.burst-min(r.Remaining, l.burst)) // burst < 2^32 (NewLimit)
}

// usedUnits is the units of its capacity an entry not limited now had used when it was
// written (markOf); for one that was limited then (its mark, when, has passed), 2^32,
// above any capacity (NewLimit): it had used all of it, and goes last. Read as units,
// the mark ranked such a client below every other entry: a client over its limit was
// evicted at each new key and came back with its capacity whole
// (TestStoreKeepsAClientOnceLimited).
func usedUnits(limitedUntil int64) int64 {
	if limitedUntil >= 0 {
		return 1 << 32
	}
	return -1 - limitedUntil
}

// record is one slot of a shard's record arena: 96 bytes (two adjacent cache lines), with
// the key's bytes in it when the key is short (inlineKey bytes or fewer: most keys), so
// that a lookup's hit reads the slot and the record and nothing else, not a separately
// allocated key. A longer key is in its shard's long map (klen is then longKey). Records
// hold no pointer, so the garbage collector does not scan the arena. A free record has
// e.expires == freeMark.
type record struct {
	klen uint8 // the key's length when it is inline, else longKey
	kin  [inlineKey]byte
	e    entry
}

const (
	inlineKey = 55
	longKey   = math.MaxUint8
	chunkBits = 8
	chunkSize = 1 << chunkBits // 256 records of 96 bytes: 24 KiB, a size class
	freeMark  = math.MinInt64
	minSlots  = 16
)

// is reports whether record i, r, holds key.
func (sh *shard) is(r *record, i uint32, key []byte) bool {
	if n := int(r.klen); n == len(key) && n <= inlineKey {
		return string(r.kin[:n]) == string(key)
	}
	return r.klen == longKey && sh.isLong(i, key)
}

// isLong reports whether record i holds key, a long one.
func (sh *shard) isLong(i uint32, key []byte) bool { return sh.long[i] == string(key) }

// setKey stores key in record i, r.
func (sh *shard) setKey(r *record, i uint32, key []byte) {
	if len(key) <= inlineKey {
		r.klen = uint8(copy(r.kin[:], key))
		return
	}
	if sh.long == nil {
		sh.long = map[uint32]string{}
	}
	r.klen, sh.long[i] = longKey, string(key)
}

// hash returns the hash under seed of the key of record i, r.
func (sh *shard) hash(seed maphash.Seed, r *record, i uint32) uint64 {
	if r.klen == longKey {
		return maphash.String(seed, sh.long[i])
	}
	return maphash.Bytes(seed, r.kin[:r.klen])
}

// shard is an open-addressing hash table (linear probing, backward-shift deletion) over
// an arena of records in fixed-size chunks. A slot is 8 bytes: the high 32 bits of the
// key's hash, which rule out other keys without reading their records, and the record
// index + 1 (0 is an empty slot). A hit reads the slot and its record (the key's bytes
// and its entry): two dependent cache misses under many keys. About 115 bytes per key of
// up to 55 bytes (a 96-byte record, 11 to 21 bytes of slots), and an update of an
// existing key is a store through a pointer, not a map assignment (which would
// allocate).
type shard struct {
	// Shards sit side by side in one slice and are locked from different cores: each
	// takes a whole number of 128-byte blocks (two cache lines, which the adjacent-line
	// prefetcher pulls together), so that no two share a line. TestShardSize checks it.
	// The padding comes last, so that the fields a hit reads (the mutex, the slots'
	// header and the first chunk's address) open the shard's first line: first, they
	// began at the padding's length, and the chunk directory's header sat in the next
	// 128-byte block, one more line to fetch on every lookup. It is 1 to shardAlign
	// bytes, never zero: a zero-size last field would itself add padding.
	shardFields
	_ [shardAlign - unsafe.Sizeof(shardFields{})%shardAlign]byte
}

// shardAlign is the block a shard's size is a multiple of.
const shardAlign = 128

// shardFields is a shard's state; shard pads it.
type shardFields struct {
	// The fields a hit reads, together in the shard's first cache line (64 bytes).
	mu    sync.Mutex
	slots []uint64
	// chunk0 is chunks[0], nil until the shard's first record: the records of a shard
	// of up to chunkSize keys (256 shards hold 65,536 keys so) are found from here,
	// without reading the chunk directory, a separate allocation and so one more
	// dependent cache miss on every hit (rec).
	chunk0 *[chunkSize]record
	chunks []*[chunkSize]record
	n      int // live records
	// load is what the live records take of cap: one unit each, and a key longer than
	// inlineKey its units besides (units).
	load int
	free []uint32 // indexes of free records
	// long holds, by record index, the keys longer than inlineKey.
	long map[uint32]string
	used uint32 // records handed out from chunks
	cap  int
	// allLimitedUntil is a lower bound on every entry's limitedUntil, recorded when a
	// full scan found only limited entries; while it is in the future no scan can find
	// an entry to evict.
	allLimitedUntil int64
	// last is the latest now a batch on the shard was decided at (clock): a batch whose
	// clock was read earlier, and that got the lock later, is decided at it.
	last int64
	// fallback holds, per rule (the part of a key before its hash tag), the state that
	// decides the rule's new keys while the shard is full of limited clients: they share
	// it, so a flood of limited keys cannot make every new key unlimited. At most
	// maxFallbacks rules; past them, one shared by the rest.
	fallback map[string]*entry
	// ghosts remembers the entries evicted live (see ghostFor); nil until the first.
	ghosts []ghost
	// view is slots and chunks as a prefetch reads them without the lock (prefetch.go),
	// published whole each time either is replaced.
	view atomic.Pointer[shardView]
}

const maxFallbacks = 64

// ghost is an entry evicted before it expired, with its key's hash: a key's full 64-bit
// hash under the store's random seed stands for the key (two keys of a shard share one
// with a chance of 2^-64, and a client cannot aim at another's without the seed).
type ghost struct {
	h uint64
	e entry
}

// ghostShare is the shard's cap over its ghosts: one per 4 keys, 12 bytes a key.
const ghostShare = 4

// ghostFor returns the state evicted for the key of hash h, nil when none is remembered
// or it has expired at now. A key comes back from an eviction with the state it left
// with, not a fresh one, while its ghost lasts: a ghost is overwritten by a later
// eviction to its place, after about cap/ghostShare evictions from the shard.
//
// Ranked as evict ranks them, some clients always lose to others: by the units used, a
// brute-forcer at 4 of 5 a minute went before a flood of one-off keys at 10 units of
// 100,000 a day, and came back with its 5 again at each new key (2.2 times its limit in
// BenchmarkEvictZipf); by the share used, a client at 1 of 100 a day went before one-off
// keys at 1 of 10 a minute. No rank keeps both: a client evicted is remembered instead.
func (sh *shard) ghostFor(h uint64, now int64) *entry {
	if sh.ghosts == nil {
		return nil
	}
	if g := &sh.ghosts[ghostAt(h, len(sh.ghosts))]; g.h == h && g.e.expires > now {
		return &g.e
	}
	return nil
}

// ghostAt is the place of hash h among n ghosts (a power of two): bits above those that
// pick the shard, below those the slots compare.
func ghostAt(h uint64, n int) int { return int(h>>16) & (n - 1) }

// keepGhost remembers e, of the key of hash h, evicted live.
func (sh *shard) keepGhost(h uint64, e *entry) {
	if sh.ghosts == nil {
		n := minSlots
		for n < sh.cap/ghostShare {
			n <<= 1
		}
		sh.ghosts = make([]ghost, n)
	}
	sh.ghosts[ghostAt(h, len(sh.ghosts))] = ghost{h: h, e: *e}
}

// forgetGhost drops the ghost of the key of hash h, stored again.
func (sh *shard) forgetGhost(h uint64) {
	if sh.ghosts != nil {
		if g := &sh.ghosts[ghostAt(h, len(sh.ghosts))]; g.h == h {
			*g = ghost{}
		}
	}
}

// lowerLimited lowers allLimitedUntil to t if t is lower. It writes only when it does: a
// store on every check, even of the value already there, dirties the shard's line.
func (sh *shard) lowerLimited(t int64) {
	if t < sh.allLimitedUntil {
		sh.allLimitedUntil = t
	}
}

// fallbackFor returns the fallback state of key's rule, creating it if needed.
func (sh *shard) fallbackFor(key []byte) *entry {
	name := key
	if i := bytes.Index(key, []byte(":{")); i >= 0 {
		name = key[:i]
	}
	if e := sh.fallback[string(name)]; e != nil {
		return e
	}
	if sh.fallback == nil {
		sh.fallback = map[string]*entry{}
	}
	if len(sh.fallback) >= maxFallbacks {
		name = nil
		if e := sh.fallback[""]; e != nil {
			return e
		}
	}
	e := &entry{}
	sh.fallback[string(name)] = e
	return e
}

// rec returns record i, handed out (i < used). One of the first chunk's is found from
// chunk0 by arithmetic, with no bounds or nil check, which would read the chunk
// directory or the chunk's first line (a cache line besides the record's under many
// keys); the others through the directory.
func (sh *shard) rec(i uint32) *record {
	if i < chunkSize {
		return (*record)(unsafe.Add(unsafe.Pointer(sh.chunk0), uintptr(i)*unsafe.Sizeof(record{})))
	}
	return &sh.chunks[i>>chunkBits][i&(chunkSize-1)]
}

// find returns the slot of key (hi: the high 32 bits of its hash) and its record, or the
// empty slot where it would go.
func find(sh *shard, hi uint32, key []byte) (slot int, idx uint32, found bool) {
	mask := len(sh.slots) - 1
	for p := int(hi) & mask; ; p = (p + 1) & mask {
		v := sh.slots[p]
		if v == 0 {
			return p, 0, false
		}
		if uint32(v>>32) == hi {
			if i := uint32(v) - 1; sh.is(sh.rec(i), i, key) {
				return p, i, true
			}
		}
	}
}

// lookup returns the record of key (hi: the high 32 bits of its hash): find's hit,
// small enough to be inlined into apply's loop.
func (sh *shard) lookup(hi uint32, key []byte) (idx uint32, found bool) {
	mask := len(sh.slots) - 1
	for p := int(hi) & mask; ; p = (p + 1) & mask {
		v := sh.slots[p]
		if v == 0 {
			return 0, false
		}
		if i := uint32(v) - 1; uint32(v>>32) == hi && sh.is(sh.rec(i), i, key) {
			return uint32(v) - 1, true
		}
	}
}

// add stores a key known to be absent, in the record it returns.
func (sh *shard) add(hi uint32, key []byte, e entry) uint32 {
	if (sh.n+1)*4 > len(sh.slots)*3 {
		sh.resize(max(2*len(sh.slots), minSlots))
	}
	var i uint32
	if n := len(sh.free); n > 0 {
		i = sh.free[n-1]
		sh.free = sh.free[:n-1]
	} else {
		if int(sh.used) == len(sh.chunks)*chunkSize {
			sh.chunks = append(sh.chunks, new([chunkSize]record))
			sh.chunk0 = sh.chunks[0]
			sh.publish()
		}
		i = sh.used
		sh.used++
	}
	r := sh.rec(i)
	*r = record{e: e}
	sh.setKey(r, i, key)
	p, _, _ := find(sh, hi, key)
	sh.slots[p] = uint64(hi)<<32 | uint64(i+1)
	sh.n++
	sh.load += sh.units(len(key))
	return i
}

// recordSize is the size of a record, the unit of a shard's cap.
const recordSize = int(unsafe.Sizeof(record{}))

// units is what a key of n bytes takes of its shard's cap: one record, and for a key
// longer than inlineKey (held in the long map, beside its record) one more per
// recordSize bytes of it, started, so that the cap bounds the shard's memory, not only
// its keys: counted as one, keys of 4 KB (a client's own API key or path, up to
// rules.MaxKeyValue an attribute) held 4.2 KB each, and a flood of them under the default
// cap of 4,000,000 would have held 17 GB. Never more than the whole cap, so that a key
// longer than it can still be held (alone).
func (sh *shard) units(n int) int {
	if n <= inlineKey {
		return 1
	}
	return min(1+(n+recordSize-1)/recordSize, sh.cap)
}

// full reports that a key of n bytes, not stored, does not fit in the shard's cap.
func (sh *shard) full(n int) bool { return sh.load+sh.units(n) > sh.cap }

func (sh *shard) resize(size int) {
	old := sh.slots
	sh.slots = make([]uint64, size)
	mask := size - 1
	for _, v := range old {
		if v == 0 {
			continue
		}
		p := int(v>>32) & mask
		for sh.slots[p] != 0 {
			p = (p + 1) & mask
		}
		sh.slots[p] = v
	}
	sh.publish()
}

// removeAt deletes the key in slot p, whose record is i.
func (sh *shard) removeAt(p int, i uint32) {
	if r := sh.rec(i); r.klen == longKey {
		sh.load -= sh.units(len(sh.long[i]))
		delete(sh.long, i)
	} else {
		sh.load--
	}
	*sh.rec(i) = record{e: entry{expires: freeMark}}
	sh.free = append(sh.free, i)
	sh.n--
	// Backward-shift deletion: move later entries of the probe run into the hole when
	// their home slot is not cyclically in (hole, their slot].
	mask := len(sh.slots) - 1
	hole := p
	sh.slots[hole] = 0
	for j := (hole + 1) & mask; ; j = (j + 1) & mask {
		v := sh.slots[j]
		if v == 0 {
			return
		}
		home := int(v>>32) & mask
		if hole <= j {
			if hole < home && home <= j {
				continue
			}
		} else if hole < home || home <= j {
			continue
		}
		sh.slots[hole] = v
		sh.slots[j] = 0
		hole = j
	}
}

// NewStore returns an empty store. It panics if o.Shards is not a power of two (a
// programmer error: validate configuration before).
func NewStore(o Options) *Store {
	if o.Shards <= 0 {
		o.Shards = defaultShards
	}
	if o.Shards&(o.Shards-1) != 0 || o.Shards > maxShards {
		panic("BUG: localbucket: Options.Shards must be a power of two up to 65536")
	}
	if o.MaxKeys <= 0 {
		o.MaxKeys = defaultMaxKeys
	}
	s := &Store{
		seed:   maphash.MakeSeed(),
		mask:   uint32(o.Shards - 1),
		shards: make([]shard, o.Shards),
	}
	switch {
	case o.PrefetchFrom == 0:
		s.prefetchAt = (defaultPrefetchFrom + o.Shards - 1) / o.Shards
	case o.PrefetchFrom < 0:
		s.prefetchAt = math.MaxInt
	default:
		s.prefetchAt = shareOf(o.PrefetchFrom, o.Shards)
	}
	per := shareOf(o.MaxKeys, o.Shards)
	for i := range s.shards {
		s.shards[i].slots = make([]uint64, minSlots)
		s.shards[i].cap = per
		s.shards[i].publish()
	}
	return s
}

// shareOf is a shard's share of n (positive) over shards, rounded up. Not (n+shards-1)/
// shards, which overflowed for n near math.MaxInt (a flag given "as many as you like")
// to a negative share: every shard full from its first key (MaxKeys), or fetching ahead
// from it (PrefetchFrom).
func shareOf(n, shards int) int {
	q := n / shards
	if n%shards != 0 {
		q++
	}
	return q
}

// Op is one check in an all-or-nothing batch given to [Store.Apply].
type Op struct {
	// Key identifies the state. It is copied when stored, so the caller may reuse its
	// buffer after Apply returns.
	Key []byte
	// Limit decides; all ops on one key should share one algorithm.
	Limit *Limit
	// Cost is what the op takes; 0 is a peek (see [Limit.Take]).
	Cost uint64
	// Shadow marks a dry run: a shadow op never makes the batch fail, and if it would
	// reject it consumes nothing. Its Result still says whether it would have passed.
	Shadow bool
	// Shared is written by Apply and Reject: the key was not stored (its shard is full of
	// limited clients) and was decided on its rule's fallback state, which every such key
	// of the shard shares ([Store.Untracked]). A refusal then says that the shared state
	// is spent, not that this client went over its limit.
	Shared bool
	// Result is written by Apply.
	Result Result

	// hash is the key's hash, as Prefetch left it for PrefetchRecord (a hint: Apply
	// hashes the key itself).
	hash uint64
}

// opScratch is Apply's per-op working state.
type opScratch struct {
	in, out State
	hash    uint64
	over    *entry // the rule's fallback state deciding an untracked key, else nil
	e       *entry // the stored entry (records never move), nil when the key is not stored
	idx     int32  // index of the stored entry, -1 when the key is not stored
	prev    int32  // the previous op on the same key, -1 if none
	// carry: the cost of the earlier refused ops on the same key, which this one is
	// decided on top of (see applyWith).
	carry uint64
	shard uint32
	last  bool // no later op has the same key
}

const inlineOps = 16

// stateFor returns e's state if it was written under l's kind of state, else a fresh one:
// a reload that changed a rule's algorithm or window (same name) resets its clients
// rather than misreading their states. A token bucket's state written at another rate
// (a reload changed the limit) is rescaled to the same units used (Limit.Rescale).
//
// A fixed window's state whose window starts after wall time by more than
// max(its window, wallStepBack) is moved to the wall time's window, its count kept, and written
// back at once (whether the check then commits or not): the wall clock went back (NTP, a
// VM resumed), and the state's window would otherwise hold the count, and refuse the
// client, for as long as the step (an hour for a 1 s window after a step of an hour).
// Kept, the count refuses for at most a window; a step shorter than that bound leaves
// the count in its window, so small steps forgive nothing. Only a step moves it: the
// wall clock must have gone back by more than the bound since the state was written
// (its expiry, e.expires, is its window's end less the offset then), so that a check
// whose clock was read long before it got here (the daemon decides a check that waits
// on Redis at its arrival time) keeps the clamp. Moved on such a late read alone, the
// count went to an earlier window, and the next check on time found its own window
// empty (TestStoreFixedWindowLateClockRead).
//
// wall is now plus the store's wall offset. The fast paths test fresh and call
// stateSlow themselves: stateFor is over the compiler's budget for inlining.
func stateFor(e *entry, l *Limit, now, wall int64) State {
	if fresh(e, l, wall) {
		return e.st
	}
	return stateSlow(e, l, now, wall)
}

// fresh reports whether e's state is l's to read as it is (stateFor): written under l's
// kind of state, and not a fixed window's left in the future by the wall clock.
func fresh(e *entry, l *Limit, wall int64) bool {
	return e.kind == l.kind && e.st.T-wall <= l.stepBack
}

// stateSlow is stateFor's state of an entry written under another kind, or of a fixed
// window's state the wall time has fallen behind (stateFor). A Limit not built by
// NewLimit (stepBack 0) comes here more often, and is decided the same.
func stateSlow(e *entry, l *Limit, now, wall int64) State {
	if e.kind != l.stateKind() {
		return otherKind(e, l, now)
	}
	if bound := max(l.window, wallStepBack); l.alg == FixedWindow && e.st.T-wall > bound {
		// How far the wall clock went back since the state was written: its expiry is
		// its window's end less the offset then (wall-now is the offset now).
		if _, end := l.fixedBounds(e.st.T); end-(wall-now)-e.expires > bound {
			e.st.T, end = l.fixedBounds(wall)
			e.expires = end - (wall - now)
		}
	}
	return e.st
}

// wallStepBack is the least backward step of the wall clock that moves a fixed window's
// count to the earlier window (stateFor): far beyond a batch's clock read arriving late.
const wallStepBack = int64(1e9) // 1 s

// otherKind is stateFor's state of an entry written under another kind. A token
// bucket's rescaled state is written back at once (under the shard's lock, as stateFor
// is called), whether the check then commits or not: it consumes nothing, and read again
// later from the old rate's state it would drain at the old rate (a client refused
// under a lowered limit would be refused longer than the new limit says).
func otherKind(e *entry, l *Limit, now int64) State {
	if k := l.stateKind(); e.kind&7 == 1 && k&7 == 1 && e.kind>>35 == k>>35 {
		// Token buckets both, of the same window: another limit. Its emission interval,
		// as NewLimit rounds it.
		if requests := int64(e.kind >> 3 & math.MaxUint32); requests > 0 {
			st := l.Rescale(e.st, l.window/requests, now)
			e.st, e.kind = st, k
			if t := max(st.T, int64(st.N)); t > now {
				e.expires = t // a token bucket's state tells nothing once it is full (uncut)
			}
			return st
		}
	}
	return State{}
}

// take is l.Take at now, writing the result through r, except that a fixed window is
// aligned to wall time now+off; the instants it returns are brought back to now's clock.
func take(l *Limit, st State, now, off int64, cost uint64, r *Result) State {
	if l.alg == TokenBucket && l.emission != 0 {
		return l.takeToken(st, now, cost, r) // the common case, one call down
	}
	if l.alg != FixedWindow || off == 0 {
		return l.takeInto(st, now, cost, r)
	}
	out := l.takeInto(st, now+off, cost, r)
	r.Expires -= off
	if r.LimitedUntil != 0 {
		r.LimitedUntil -= off
	}
	return out
}

// SetWallOffset tells the store the wall clock's offset from the clock Apply is given
// (wall - now, in ns). The daemon decides on a monotonic clock (so that a wall clock step
// neither refills buckets nor rejects active clients) and fixed windows still align to
// wall time: Apply gives them now+offset. 0 (the default) when now is the wall clock.
// Safe for concurrent use.
func (s *Store) SetWallOffset(off int64) { s.wallOffset.Store(off) }

// WallOffset returns the offset SetWallOffset last set (wall - now, in ns).
func (s *Store) WallOffset() int64 { return s.wallOffset.Load() }

// Apply decides ops together at time now (ns since the Unix epoch). If every non-shadow
// op is allowed, it commits every allowed op and returns true. Otherwise it commits
// nothing and returns false; the Result of each op that was itself allowed then reports
// the key's current state as a cost-0 peek would, with Allowed still true and RetryAfter
// 0. Ops on the same key in one batch are applied in order on the tentative state, each
// decided on top of the cost of the refused ones before it (their retry is when all fit).
//
// A batch is decided at now, or at the latest time a batch on one of its keys' shards
// was decided at, when that is later: concurrent callers read their clocks in one
// order and may get the shards' locks in the other, and a token bucket's check decided
// at an earlier now than its state's last is stricter by the lag (the last unit of a
// burst refused for a few nanoseconds, a remaining one less than is left).
//
// Apply is atomic and safe for concurrent use: it locks the shards involved in ascending
// order and releases them when done. It allocates only to store a new key (and for
// batches of more than 16 ops).
func (s *Store) Apply(now int64, ops []Op) bool { return s.apply(now, ops, false) }

// Reject decides ops as Apply does when something outside the batch has already rejected
// the request: it commits nothing, and each op reports what it would have decided alone
// (an op that would pass reports the current state as a cost-0 peek, Allowed true).
// The limiter uses it when a check on another store (Redis) rejected first.
func (s *Store) Reject(now int64, ops []Op) { s.apply(now, ops, true) }

// smallOps is the largest batch applySmall takes, and the batch size whose scratch
// applyGeneral keeps in a smaller array, so that it is not zeroing inlineOps entries per
// check; batches of one or two get one smaller still.
const smallOps = 4

// apply is Apply (veto false) and Reject (veto true). Batches of one op, and of up to
// four ops on distinct keys whose stored keys (if absent) fit in their shards, take a
// fast path (apply1, apply2: no scratch, no lock list; applySmall); the rest, and
// whatever those paths decline before changing anything, the general one
// (applyGeneral). Every path gives the same results and leaves the same state
// (TestFastPathMatchesGeneral).
func (s *Store) apply(now int64, ops []Op, veto bool) bool {
	switch len(ops) {
	case 1:
		return s.apply1(now, ops, veto)
	case 2:
		return s.apply2(now, ops, veto)
	case 3, smallOps:
		return s.applySmall(now, ops, veto)
	}
	return s.applyGeneral(now, ops, veto)
}

// entry returns the stored entry of key (hi: the high 32 bits of its hash), nil when the
// key is not stored: lookup for the fast paths, which need the entry, not its index.
func (sh *shard) entry(hi uint32, key []byte) *entry {
	mask := len(sh.slots) - 1
	for p := int(hi) & mask; ; p = (p + 1) & mask {
		v := sh.slots[p]
		if v == 0 {
			return nil
		}
		if uint32(v>>32) == hi {
			if i := uint32(v) - 1; sh.is(sh.rec(i), i, key) {
				return &sh.rec(i).e
			}
		}
	}
}

// apply1 is apply for one op. When the key is not stored and its shard is full, it
// hands the batch, unchanged, to the general path (evictions, the rule's fallback state).
func (s *Store) apply1(now int64, ops []Op, veto bool) bool {
	op := &ops[0]
	op.Shared = false
	h := maphash.Bytes(s.seed, op.Key)
	sh := &s.shards[uint32(h)&s.mask]
	sh.mu.Lock()
	now = sh.clock(now)
	e := sh.entry(uint32(h>>32), op.Key)
	var in State
	off := s.wallOffset.Load()
	if e != nil {
		if in = e.st; !fresh(e, op.Limit, now+off) {
			in = stateSlow(e, op.Limit, now, now+off)
		}
	} else if sh.full(len(op.Key)) {
		sh.mu.Unlock()
		return s.applyGeneral(now, ops, veto)
	} else if g := sh.ghostFor(h, now); g != nil {
		in = stateFor(g, op.Limit, now, now+off)
	}
	r := &op.Result
	out := takeFast(op.Limit, in, now, off, op.Cost, r)
	ok := !veto && (r.Allowed || op.Shadow)
	if !ok {
		if r.Allowed {
			peekPassed(op.Limit, in, now, off, r)
		}
	} else if e != nil {
		if r.Expires > now {
			e.set(out, r, op.Limit)
			sh.lowerLimited(r.LimitedUntil)
		} else {
			sh.remove(h, op.Key)
		}
	} else if r.Expires > now {
		s.insert(sh, h, op.Key, entry{st: out, expires: r.Expires, limitedUntil: markOf(r, op.Limit), kind: op.Limit.stateKind()}, now, nil)
	}
	sh.mu.Unlock()
	return ok
}

// apply2 is apply for two ops on distinct keys. When both ops have the same key (or
// their hashes collide), or when a key is not stored and its shard is full, it hands the
// batch, unchanged, to the general path.
func (s *Store) apply2(now int64, ops []Op, veto bool) bool {
	a, b := &ops[0], &ops[1]
	a.Shared, b.Shared = false, false
	ha, hb := maphash.Bytes(s.seed, a.Key), maphash.Bytes(s.seed, b.Key)
	if ha == hb {
		return s.applyGeneral(now, ops, veto)
	}
	ia, ib := uint32(ha)&s.mask, uint32(hb)&s.mask
	sa, sb := &s.shards[ia], &s.shards[ib]
	// Lock in ascending shard order, as applyGeneral does, and a shared shard once.
	switch {
	case ia == ib:
		sa.mu.Lock()
	case ia < ib:
		sa.mu.Lock()
		sb.mu.Lock()
	default:
		sb.mu.Lock()
		sa.mu.Lock()
	}
	now = sb.clock(sa.clock(now))
	sa.last = now
	// Both keys' home slots, then the records they lead to, before either is compared
	// (their misses overlap under many keys); a key elsewhere in its probe run, by entry.
	hia, hib := uint32(ha>>32), uint32(hb>>32)
	va, vb := sa.slots[int(hia)&(len(sa.slots)-1)], sb.slots[int(hib)&(len(sb.slots)-1)]
	var ea, eb *entry
	if ia := uint32(va) - 1; va != 0 && uint32(va>>32) == hia && sa.is(sa.rec(ia), ia, a.Key) {
		ea = &sa.rec(ia).e
	} else {
		ea = sa.entry(hia, a.Key)
	}
	if ib := uint32(vb) - 1; vb != 0 && uint32(vb>>32) == hib && sb.is(sb.rec(ib), ib, b.Key) {
		eb = &sb.rec(ib).e
	} else {
		eb = sb.entry(hib, b.Key)
	}
	var ina, inb State
	off := s.wallOffset.Load()
	if ea != nil {
		if ina = ea.st; !fresh(ea, a.Limit, now+off) {
			ina = stateSlow(ea, a.Limit, now, now+off)
		}
	} else if sa.full(len(a.Key)) {
		unlock2(sa, sb)
		return s.applyGeneral(now, ops, veto)
	} else if g := sa.ghostFor(ha, now); g != nil {
		ina = stateFor(g, a.Limit, now, now+off)
	}
	if eb != nil {
		if inb = eb.st; !fresh(eb, b.Limit, now+off) {
			inb = stateSlow(eb, b.Limit, now, now+off)
		}
	} else if sb.full(len(b.Key)) {
		unlock2(sa, sb)
		return s.applyGeneral(now, ops, veto)
	} else if g := sb.ghostFor(hb, now); g != nil {
		inb = stateFor(g, b.Limit, now, now+off)
	}
	ra, rb := &a.Result, &b.Result
	// takeFast, inlined (the compiler does not).
	var outa, outb State
	if l := a.Limit; l.alg == TokenBucket && l.emission != 0 {
		outa = l.takeToken(ina, now, a.Cost, ra)
	} else {
		outa = take(l, ina, now, off, a.Cost, ra)
	}
	if l := b.Limit; l.alg == TokenBucket && l.emission != 0 {
		outb = l.takeToken(inb, now, b.Cost, rb)
	} else {
		outb = take(l, inb, now, off, b.Cost, rb)
	}
	if veto || !(ra.Allowed || a.Shadow) || !(rb.Allowed || b.Shadow) {
		if ra.Allowed {
			peekPassed(a.Limit, ina, now, off, ra)
		}
		if rb.Allowed {
			peekPassed(b.Limit, inb, now, off, rb)
		}
		unlock2(sa, sb)
		return false
	}
	// As commit does: updates and deletions of stored keys first, then inserts.
	if ea != nil {
		if ra.Expires > now {
			ea.set(outa, ra, a.Limit)
			sa.lowerLimited(ra.LimitedUntil)
		} else {
			sa.remove(ha, a.Key)
		}
	}
	if eb != nil {
		if rb.Expires > now {
			eb.set(outb, rb, b.Limit)
			sb.lowerLimited(rb.LimitedUntil)
		} else {
			sb.remove(hb, b.Key)
		}
	}
	own := func(e *entry) bool { return e == ea || e == eb } // the batch's: not evicted for it
	if ea == nil && ra.Expires > now {
		ea = s.insert(sa, ha, a.Key, entry{st: outa, expires: ra.Expires, limitedUntil: markOf(ra, a.Limit), kind: a.Limit.stateKind()}, now, own)
	}
	if eb == nil && rb.Expires > now {
		s.insert(sb, hb, b.Key, entry{st: outb, expires: rb.Expires, limitedUntil: markOf(rb, b.Limit), kind: b.Limit.stateKind()}, now, own)
	}
	sa.mu.Unlock()
	if sb != sa {
		sb.mu.Unlock()
	}
	return true
}

// applySmall is apply for three or four ops (smallOps) on distinct keys, as apply2 does
// for two: when two ops have the same key (or their hashes collide), or when a key is
// not stored and its shard is full, it hands the batch, unchanged, to the general path.
func (s *Store) applySmall(now int64, ops []Op, veto bool) bool {
	var (
		hs    [smallOps]uint64
		shs   [smallOps]*shard
		es    [smallOps]*entry
		ins   [smallOps]State
		outs  [smallOps]State
		locks [smallOps]uint32 // the shards to lock, ascending, each once
	)
	nl := 0
	for i := range ops {
		ops[i].Shared = false
		h := maphash.Bytes(s.seed, ops[i].Key)
		for j := range i {
			if hs[j] == h {
				return s.applyGeneral(now, ops, veto)
			}
		}
		hs[i] = h
		si := uint32(h) & s.mask
		shs[i] = &s.shards[si]
		k := nl
		for k > 0 && locks[k-1] > si {
			k--
		}
		if k > 0 && locks[k-1] == si {
			continue
		}
		for m := nl; m > k; m-- {
			locks[m] = locks[m-1]
		}
		locks[k] = si
		nl++
	}
	for _, li := range locks[:nl] {
		s.shards[li].mu.Lock()
	}
	now = s.clock(locks[:nl], now)
	off := s.wallOffset.Load()
	for i := range ops {
		sh := shs[i]
		if es[i] = sh.entry(uint32(hs[i]>>32), ops[i].Key); es[i] != nil {
			if ins[i] = es[i].st; !fresh(es[i], ops[i].Limit, now+off) {
				ins[i] = stateSlow(es[i], ops[i].Limit, now, now+off)
			}
		} else if sh.full(len(ops[i].Key)) {
			s.unlock(locks[:nl])
			return s.applyGeneral(now, ops, veto)
		} else if g := sh.ghostFor(hs[i], now); g != nil {
			ins[i] = stateFor(g, ops[i].Limit, now, now+off)
		}
	}
	ok := !veto
	for i := range ops {
		op := &ops[i]
		outs[i] = takeFast(op.Limit, ins[i], now, off, op.Cost, &op.Result)
		if !op.Result.Allowed && !op.Shadow {
			ok = false
		}
	}
	if !ok {
		for i := range ops {
			if ops[i].Result.Allowed {
				peekPassed(ops[i].Limit, ins[i], now, off, &ops[i].Result)
			}
		}
		s.unlock(locks[:nl])
		return false
	}
	// As commit does: updates and deletions of stored keys first, then inserts.
	inserts := false
	for i := range ops {
		op, e, sh := &ops[i], es[i], shs[i]
		switch r := &op.Result; {
		case e == nil:
			inserts = true
		case r.Expires > now:
			e.set(outs[i], r, op.Limit)
			sh.lowerLimited(r.LimitedUntil)
		default:
			sh.remove(hs[i], op.Key)
		}
	}
	if inserts {
		own := func(e *entry) bool { return slices.Contains(es[:len(ops)], e) } // the batch's: not evicted for it
		for i := range ops {
			if r := &ops[i].Result; es[i] == nil && r.Expires > now {
				es[i] = s.insert(shs[i], hs[i], ops[i].Key, entry{st: outs[i], expires: r.Expires, limitedUntil: markOf(r, ops[i].Limit), kind: ops[i].Limit.stateKind()}, now, own)
			}
		}
	}
	s.unlock(locks[:nl])
	return true
}

// unlock unlocks the shards numbered in locks.
func (s *Store) unlock(locks []uint32) {
	for _, li := range locks {
		s.shards[li].mu.Unlock()
	}
}

// unlock2 unlocks what apply2 locked.
func unlock2(sa, sb *shard) {
	sa.mu.Unlock()
	if sb != sa {
		sb.mu.Unlock()
	}
}

// clock returns the time a batch on sh is decided at: now, or the latest time a batch on
// sh was decided at when now is before it (see Store.Apply), which it notes.
func (sh *shard) clock(now int64) int64 {
	if now < sh.last {
		return sh.last
	}
	sh.last = now
	return now
}

// clock is shard.clock for a batch on the shards numbered in locks, all locked: the
// latest of now and their times, noted in each.
func (s *Store) clock(locks []uint32, now int64) int64 {
	for _, li := range locks {
		now = max(now, s.shards[li].last)
	}
	for _, li := range locks {
		s.shards[li].last = now
	}
	return now
}

// takeFast is take for the fast paths: a token bucket's takeToken called directly (the
// common case), anything else through take.
func takeFast(l *Limit, in State, now, off int64, cost uint64, r *Result) State {
	if l.alg == TokenBucket && l.emission != 0 {
		return l.takeToken(in, now, cost, r)
	}
	return take(l, in, now, off, cost, r)
}

// peekPassed rewrites r, the result of an op that passed in a batch that failed, as a cost-0
// peek of the key's state before the batch (in), Allowed true and RetryAfter 0.
func peekPassed(l *Limit, in State, now, off int64, r *Result) {
	take(l, in, now, off, 0, r)
	r.Allowed, r.RetryAfter = true, 0
}

// set stores in e the state out that l's take left with result r.
func (e *entry) set(out State, r *Result, l *Limit) {
	e.st, e.expires, e.limitedUntil, e.kind = out, r.Expires, markOf(r, l), l.stateKind()
}

// remove deletes key (hash h), which is stored.
func (sh *shard) remove(h uint64, key []byte) {
	p, i, _ := find(sh, uint32(h>>32), key)
	sh.removeAt(p, i)
}

// applyGeneral is apply for any batch: duplicate keys, full shards, more than two ops.
func (s *Store) applyGeneral(now int64, ops []Op, veto bool) bool {
	if len(ops) <= 2 {
		var scBuf [2]opScratch
		var lockBuf [2]uint32
		return s.applyWith(now, ops, veto, scBuf[:len(ops)], lockBuf[:0])
	}
	if len(ops) <= smallOps {
		var scBuf [smallOps]opScratch
		var lockBuf [smallOps]uint32
		return s.applyWith(now, ops, veto, scBuf[:len(ops)], lockBuf[:0])
	}
	if len(ops) <= inlineOps {
		var scBuf [inlineOps]opScratch
		var lockBuf [inlineOps]uint32
		return s.applyWith(now, ops, veto, scBuf[:len(ops)], lockBuf[:0])
	}
	return s.applyWith(now, ops, veto, make([]opScratch, len(ops)), make([]uint32, 0, len(ops)))
}

// applyWith is apply with its scratch: sc one per op, locks empty with room for one per op.
func (s *Store) applyWith(now int64, ops []Op, veto bool, sc []opScratch, locks []uint32) bool {
	// A batch past inlineOps (a request matching hundreds of rules) finds each key's
	// previous op through a map of the last op of each hash, not by scanning back over
	// every op before it: the scan made such a batch quadratic (8,000 rules matching one
	// request: 150 ms a check).
	var lastOf map[uint64]int32
	if len(ops) > inlineOps {
		lastOf = make(map[uint64]int32, len(ops))
	}
	for i := range ops {
		h := maphash.Bytes(s.seed, ops[i].Key)
		x := &sc[i]
		x.hash, x.shard, x.prev, x.idx, x.last = h, uint32(h)&s.mask, -1, -1, true
		from := i - 1
		if lastOf != nil {
			from = -1
			if j, seen := lastOf[h]; seen {
				from = int(j) // the last op of this hash; an earlier one only on a collision
			}
			lastOf[h] = int32(i)
		}
		for j := from; j >= 0; j-- {
			if sc[j].hash == h && bytes.Equal(ops[j].Key, ops[i].Key) {
				x.prev = int32(j)
				sc[j].last = false
				break
			}
		}
		// Insert the shard into the sorted, deduplicated lock list.
		k := len(locks)
		for k > 0 && locks[k-1] > x.shard {
			k--
		}
		if k > 0 && locks[k-1] == x.shard {
			continue
		}
		locks = append(locks, 0)
		for m := len(locks) - 1; m > k; m-- { // a few entries: cheaper than copy's memmove
			locks[m] = locks[m-1]
		}
		locks[k] = x.shard
	}

	for _, li := range locks {
		s.shards[li].mu.Lock()
	}
	now = s.clock(locks, now)

	off := s.wallOffset.Load()
	ok := !veto
	for i := range ops {
		op, x := &ops[i], &sc[i]
		x.over, x.e, x.carry = nil, nil, 0
		sh := &s.shards[x.shard]
		if x.prev >= 0 {
			p := &sc[x.prev]
			x.in, x.idx, x.e, x.over = p.out, p.idx, p.e, p.over
			// Ops on one key are decided as if the ones before them were charged (the
			// identical descriptors of an Envoy call, each charged once): one refused
			// leaves the state as it was, and the next is decided on top of its cost, so
			// that its retry is when both fit. Before, it said when its own cost fit: a
			// call of two identical descriptors, a token bucket empty, was told to retry
			// after one unit's refill, and was refused again then.
			x.carry = p.carry
			if po := &ops[x.prev]; !po.Result.Allowed {
				x.carry = satAdd(x.carry, po.Cost)
			}
		} else if idx, found := sh.lookup(uint32(x.hash>>32), op.Key); found {
			x.idx = int32(idx)
			x.e = &sh.rec(idx).e
			x.in = stateFor(x.e, op.Limit, now, now+off)
		} else if sh.full(len(op.Key)) && sh.allLimitedUntil > now {
			// The shard is full of limited clients: the key cannot be stored, and a
			// fresh state would let it pass every time. It is decided on its rule's
			// fallback state, which every such key shares.
			x.over = sh.fallbackFor(op.Key)
			x.in = stateFor(x.over, op.Limit, now, now+off)
			s.untracked.Add(1)
		} else if g := sh.ghostFor(x.hash, now); g != nil {
			x.in = stateFor(g, op.Limit, now, now+off)
		} else {
			x.in = State{}
		}
		op.Shared = x.over != nil
		x.out = take(op.Limit, x.in, now, off, satAdd(op.Cost, x.carry), &op.Result)
		if !op.Result.Allowed && !op.Shadow {
			ok = false
		}
	}

	if !ok {
		for i := range ops {
			if !ops[i].Result.Allowed {
				continue
			}
			first := i
			for sc[first].prev >= 0 {
				first = int(sc[first].prev)
			}
			r := &ops[i].Result
			take(ops[i].Limit, sc[first].in, now, off, 0, r)
			r.Allowed, r.RetryAfter = true, 0
		}
	} else {
		s.commit(now, ops, sc)
	}

	for _, li := range locks {
		s.shards[li].mu.Unlock()
	}
	return ok
}

// commit stores the final state of every key of the batch: updates and deletions of
// stored keys first (their indexes were looked up before anything moved), then inserts,
// which may evict.
func (s *Store) commit(now int64, ops []Op, sc []opScratch) {
	inserts := false
	for i := range ops {
		x := &sc[i]
		if !x.last {
			continue
		}
		r := &ops[i].Result
		if x.over != nil {
			*x.over = entry{st: x.out, expires: r.Expires, limitedUntil: markOf(r, ops[i].Limit), kind: ops[i].Limit.stateKind()}
			continue
		}
		if x.idx < 0 {
			inserts = true
			continue
		}
		sh := &s.shards[x.shard]
		if r.Expires <= now {
			p, _, _ := find(sh, uint32(x.hash>>32), ops[i].Key)
			sh.removeAt(p, uint32(x.idx))
			continue
		}
		*x.e = entry{st: x.out, expires: r.Expires, limitedUntil: markOf(r, ops[i].Limit), kind: ops[i].Limit.stateKind()}
		sh.lowerLimited(r.LimitedUntil)
	}
	if !inserts {
		return
	}
	own := func(e *entry) bool { // the batch's entries: not evicted for it (insert)
		for j := range sc {
			if sc[j].e == e && sc[j].over == nil {
				return true
			}
		}
		return false
	}
	for i := range ops {
		x := &sc[i]
		r := &ops[i].Result
		if !x.last || x.idx >= 0 || x.over != nil || r.Expires <= now {
			continue
		}
		x.e = s.insert(&s.shards[x.shard], x.hash, ops[i].Key, entry{st: x.out, expires: r.Expires, limitedUntil: markOf(r, ops[i].Limit), kind: ops[i].Limit.stateKind()}, now, own)
	}
}

// insert stores key, absent, with e, evicting others to make room, and returns its
// entry (nil: not stored, the shard is full of limited keys). own reports the entries of
// the batch being committed (nil: none), which are not evicted for it: a key the batch
// has just stored, or updated, is not limited, and when the shard held only limited keys
// besides, it went first; a client whose check has two keys in such a shard then came
// back fresh on one of them at each request, and never reached its limit (20 admitted
// of 20 under a limit of 5; TestStoreKeyCapKeepsTheBatchsOwnKeys). When nothing else
// can go, the key is stored past the cap, by at most the batch's keys, which the next
// insert into the shard evicts back under it.
func (s *Store) insert(sh *shard, h uint64, key []byte, e entry, now int64, own func(*entry) bool) *entry {
	for sh.full(len(key)) {
		evicted, live, kept := s.evict(sh, h, now, own)
		if !evicted {
			if kept {
				break
			}
			s.untracked.Add(1)
			return nil
		}
		if live {
			s.evictions.Add(1)
		}
	}
	i := sh.add(uint32(h>>32), key, e)
	if sh.n >= s.prefetchAt && !s.big.Load() {
		s.big.Store(true)
	}
	sh.forgetGhost(h)
	sh.lowerLimited(e.limitedUntil)
	return &sh.rec(i).e
}

const evictionSample = 16

// evict removes one entry of a full shard to make room: an expired one if seen, else,
// among a sample of 16 (from a position picked by the new key's hash h), else among the
// whole shard, the entry that is not limited and has used the fewest units of its own
// limit (what an evicted client could be admitted again past its limit, coming back
// with a fresh state), the one that expires first among equals. It never removes a
// limited entry. live reports that the removed entry had not expired.
//
// Ranked by when they expire alone, entries of a rule with a short window or a fast
// refill went first: a client that had used 99 of its 100 a minute was evicted before
// a one-off key of a rule of 1,000 a day, and came back with all 100, so a flood of new
// keys on such a rule handed it a fresh budget again and again (936-1,135 admitted in
// 30 s where at most 151 pass: an audit). Ranked by the share of its capacity used, a
// client of a generous rule went first the other way: at 1 of 100 a day (1%) it ranked
// below a one-off key of 1 of 10 a minute (10%), was evicted, came back fresh at 1%, and
// again: one request per 10,000 such keys was admitted 2,000 times of 2,000 against its
// 100 a day (an audit). By units used, it ties with the flood's keys, which expire first.
// The units are those used when the entry was last written (markOf): a key that has
// refilled since ranks as it was, until it expires.
func (s *Store) evict(sh *shard, h uint64, now int64, own func(*entry) bool) (evicted, live, kept bool) {
	if sh.allLimitedUntil > now || sh.used == 0 {
		return false, false, false
	}
	best, found := uint32(0), false
	bestExp, bestUsed := int64(math.MaxInt64), int64(math.MaxInt64)
	consider := func(i uint32) (expired bool) {
		e := &sh.rec(i).e
		if e.expires == freeMark {
			return false
		}
		if own != nil && own(e) {
			kept = kept || e.limitedUntil <= now // it would have gone
			return false
		}
		if e.expires <= now {
			return true
		}
		if e.limitedUntil > now {
			return false
		}
		used := usedUnits(e.limitedUntil)
		if used < bestUsed || used == bestUsed && e.expires < bestExp {
			best, bestExp, bestUsed, found = i, e.expires, used, true
		}
		return false
	}
	start := uint32((h >> 8) % uint64(sh.used))
	for k, seen := uint32(0), 0; k < sh.used && seen < evictionSample; k++ {
		i := (start + k) % sh.used
		if sh.rec(i).e.expires == freeMark {
			continue
		}
		seen++
		if consider(i) {
			s.removeRecord(sh, i)
			return true, false, false
		}
	}
	if !found {
		lowest := int64(math.MaxInt64)
		for i := range sh.used {
			if consider(i) {
				s.removeRecord(sh, i)
				return true, false, false
			}
			if e := &sh.rec(i).e; e.expires != freeMark {
				lowest = min(lowest, e.limitedUntil)
			}
		}
		if !found {
			if !kept {
				sh.allLimitedUntil = lowest
			}
			return false, false, kept
		}
	}
	sh.keepGhost(sh.hash(s.seed, sh.rec(best), best), &sh.rec(best).e)
	s.removeRecord(sh, best)
	return true, true, false
}

// removeRecord removes record i, which is live.
func (s *Store) removeRecord(sh *shard, i uint32) {
	mask := len(sh.slots) - 1
	p := int(sh.hash(s.seed, sh.rec(i), i)>>32) & mask
	for uint32(sh.slots[p]) != i+1 { // its slot is in the probe run from its home

		p = (p + 1) & mask
	}
	sh.removeAt(p, i)
}

// Len returns the number of keys stored. It locks each shard in turn.
func (s *Store) Len() int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += sh.n
		sh.mu.Unlock()
	}
	return n
}

// Sweep removes every entry whose Expires <= now, locking one shard at a time, and
// returns how many it removed.
func (s *Store) Sweep(now int64) int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for j := range sh.used {
			if e := sh.rec(j).e.expires; e != freeMark && e <= now {
				s.removeRecord(sh, j)
				n++
			}
		}
		sh.mu.Unlock()
	}
	return n
}

// Evictions returns how many live (unexpired, not limited) entries were evicted to keep
// a shard within its share of MaxKeys.
func (s *Store) Evictions() uint64 { return s.evictions.Load() }

// Untracked returns how many decisions were made for keys the store could not hold
// because their shard was full of limited clients: decided on their rule's fallback
// state (shared by every such key of the rule in the shard), or, the first time a shard
// is found full, on a fresh state.
func (s *Store) Untracked() uint64 { return s.untracked.Load() }

// satAdd returns a + b, or the largest uint64 where that overflows.
func satAdd(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return ^uint64(0)
}
