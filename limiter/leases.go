package limiter

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"hash/maphash"
	"math/bits"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// Leases is the local store of concurrency rules: slots held by requests in flight.
//
// A concurrency rule's key has max slots (the op's Limit.Requests) and each slot is held
// for the rule's lease (Limit.Window) unless released or renewed first. One allowed check
// takes one lease, holding one slot in every concurrency rule it matched (a part per
// rule); its id goes in Decision.Lease, and Token turns it into the opaque string a
// client gets. A lease is freed by Release, by ReleaseOwner (the connection that took it
// closed), or part by part as each part's lease runs out: expired parts are dropped when
// their key is next checked, and by Sweep.
//
// Times are the limiter's clock (monotonic Unix nanoseconds), passed in by the caller,
// so tests inject them. Leases is safe for concurrent use: one mutex guards it (a check
// with a concurrency rule holds it for a few map operations). Its zero value is not
// usable; the Limiter makes one (New) and returns it from Limiter.Leases.
type Leases struct {
	nonce string    // starts every token: tokens from another daemon or run are unknown here
	key   [2]uint64 // the SipHash key of the tokens' tags: a token cannot be guessed from another

	mu     sync.Mutex
	max    int // the most live leases; past it a check is refused as if its slots were full
	capped uint64
	next   uint64
	slots  map[string]*slot
	leases map[uint64]*lease
	owners map[uint64]*ownerLeases // owner → its live leases; owner 0 is not tracked
	stats  map[string]*LeaseStats  // by rule name
	free   []*lease                // released leases, for reuse (at most the live ones plus spareKeep: keepSpare)
	spare  []*slot                 // emptied slots, for reuse (likewise)

	// keyUnits is what the keys of the held slots and of the tracked global leases'
	// parts take of max beyond their leases: a key counts one lease more per whole
	// slotKeyUnit bytes (slotUnits).
	keyUnits int

	// The global leases this daemon acquired (leases_global.go), by id and by owner;
	// nil until the first.
	global       map[string]*globalLease
	globalOwners map[uint64]map[string]*globalLease
	// globalKeys counts, by Redis key, the tracked global leases with a part there, by
	// owner (owner 0 is not counted): the owners a refused global check asks about
	// (reapGoneGlobal).
	globalKeys map[string]map[uint64]int
	// releasing lists, by Redis key, the releases under way of global leases with a
	// part there that this daemon no longer tracks (a closed connection's): a refused
	// global check waits for them (reapGone).
	releasing map[string][]*globalRelease

	// gone, when set (SetOwnerGone), reports whether an owner's connection has been
	// closed by its client: see reapGoneLocked.
	gone atomic.Pointer[func(owner uint64) bool]
	// goneGlobal is gone for the global leases (SetGlobalOwnerGone): see reapGoneGlobal.
	goneGlobal atomic.Pointer[func(owner uint64) bool]
}

// LeaseStats counts one concurrency rule's leases on this daemon.
type LeaseStats struct {
	InFlight int64  // slots held now
	Released uint64 // parts freed by Release
	Expired  uint64 // parts whose lease ran out: the leak signal
	Closed   uint64 // parts freed because the owning connection closed
}

// slot is one concurrency key's held parts.
type slot struct {
	// buf holds the slot's key, and its key in Leases.slots reads it (key): a slot
	// reused for another key (Leases.spare) overwrites it only once it has left the map,
	// so that a lease's slot costs no allocation for its key (BenchmarkHandleLease).
	buf  []byte
	held []*leasePart
	// askedAt is when a check that found it full last asked about its holders'
	// connections and found none gone (reapGoneLocked); 0: not since it was made.
	askedAt int64
}

// lease is one check's hold: a part per concurrency rule it matched.
type lease struct {
	id    uint64
	owner uint64
	parts []leasePart
	live  int // parts not yet freed
	// renewals counts the lease's renewals, so that restore undoes only the last one.
	renewals uint64
	// The owner's list of live leases this one is in (nil for owner 0), and its
	// neighbours there.
	owned            *ownerLeases
	ownPrev, ownNext *lease
}

// key is s's key in Leases.slots, aliasing s.buf.
func (s *slot) key() string { return unsafe.String(unsafe.SliceData(s.buf), len(s.buf)) }

// ownerLeases lists one owner's live leases (Leases.owners), linked through the leases
// themselves: a lease joins and leaves it without a map operation, where each owner's
// map of leases cost two (a lookup and an insert or a delete) per lease. Kept while the
// owner's connection lives, empty or not, as that map was.
type ownerLeases struct{ first *lease }

// add puts l, not in any list, first in o.
func (o *ownerLeases) add(l *lease) {
	l.owned, l.ownPrev, l.ownNext = o, nil, o.first
	if o.first != nil {
		o.first.ownPrev = l
	}
	o.first = l
}

// leaveOwner takes l out of its owner's list, if it is in one.
func (l *lease) leaveOwner() {
	o := l.owned
	if o == nil {
		return
	}
	if l.ownPrev != nil {
		l.ownPrev.ownNext = l.ownNext
	} else {
		o.first = l.ownNext
	}
	if l.ownNext != nil {
		l.ownNext.ownPrev = l.ownPrev
	}
	l.owned, l.ownPrev, l.ownNext = nil, nil, nil
}

// each calls f for each lease in o, which f may free (its next is read before).
func (o *ownerLeases) each(f func(l *lease) bool) {
	for l := o.first; l != nil; {
		next := l.ownNext
		if !f(l) {
			return
		}
		l = next
	}
}

// leasePart is one slot a lease holds, in one rule.
type leasePart struct {
	l       *lease
	s       *slot // nil once freed
	stats   *LeaseStats
	expires int64  // now-clock nanoseconds
	dur     int64  // the rule's lease when taken, for Renew without a duration
	rule    string // the rule's name, for its lease now (Renew)
}

// maxRetryHint caps a refusal's retry-after: a slot may be released at any moment.
const maxRetryHint = time.Second

// DefaultMaxLeases bounds the live leases of a daemon (about 300 bytes each, the slot
// and a short key included: 299 in TestLeaseMemory; a global lease it tracks, about
// 550), local and global together, so that a flood of checks on
// distinct keys cannot grow memory without bound: past it, a check matching a
// concurrency rule is refused as if its slots were full (Leases.Capped). A local slot's
// key, and each global lease part's, counts one lease more per whole 200 bytes of it
// (slotUnits).
const DefaultMaxLeases = 1 << 20

func newLeases() *Leases {
	var b [20]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return &Leases{
		max:    DefaultMaxLeases,
		nonce:  hex.EncodeToString(b[:4]),
		key:    [2]uint64{binary.LittleEndian.Uint64(b[4:]), binary.LittleEndian.Uint64(b[12:])},
		slots:  map[string]*slot{},
		leases: map[uint64]*lease{},
		owners: map[uint64]*ownerLeases{},
		stats:  map[string]*LeaseStats{},
	}
}

// Token returns the opaque string a client gets for lease id: this daemon's nonce, a dot,
// the id in base 32, a dot, and the id's tag in base 32: a keyed hash (SipHash-2-4 under
// a random per-process key) that only this daemon can compute, so that a client holding
// leases cannot release or renew another's by counting (ids are sequential).
func (ls *Leases) Token(id uint64) string {
	var b [tokenMaxLen]byte
	return string(ls.AppendToken(b[:0], id))
}

// tokenMaxLen is the longest token Token returns: the nonce, and two dots each before
// 13 digits of base 32 at most.
const tokenMaxLen = 8 + 2*(1+13)

// AppendToken appends lease id's token (Token) to dst and returns it. Base 32, digits
// 0-9 then a-v, five bits a digit: written and read with shifts, where the base 36 of
// before took a division a digit to write and a multiplication to read, a tenth of a
// leased check's time in the daemon (BenchmarkHandleLease). Tokens live within one
// daemon's run (the nonce), so no token of an older build is ever presented to this one.
func (ls *Leases) AppendToken(dst []byte, id uint64) []byte {
	dst = append(dst, ls.nonce...)
	dst = appendBase32(append(dst, '.'), id)
	return appendBase32(append(dst, '.'), siphash(ls.key, id))
}

const base32Digits = "0123456789abcdefghijklmnopqrstuv"

// appendBase32 appends v in base 32, without leading zeros (0 is "0").
func appendBase32(dst []byte, v uint64) []byte {
	var b [13]byte
	i := len(b)
	for {
		i--
		b[i] = base32Digits[v&31]
		v >>= 5
		if v == 0 {
			break
		}
	}
	return append(dst, b[i:]...)
}

// parseBase32 reads s, as appendBase32 writes it (1 to 13 digits, lower case, no leading
// zero): false for anything else or a value past 64 bits, so that a lease has one token.
func parseBase32(s string) (uint64, bool) {
	if len(s) == 0 || len(s) > 13 || len(s) > 1 && s[0] == '0' {
		return 0, false
	}
	var v uint64
	for i := 0; i < len(s); i++ {
		d := base32Values[s[i]]
		if d > 31 || v>>59 != 0 { // not a digit, or a 14th bit-group: past 64 bits
			return 0, false
		}
		v = v<<5 | uint64(d)
	}
	return v, true
}

// base32Values maps a byte to its value as a digit of base32Digits; 0xff: not one.
var base32Values = func() (t [256]byte) {
	for i := range t {
		t[i] = 0xff
	}
	for i := range len(base32Digits) {
		t[base32Digits[i]] = byte(i)
	}
	return t
}()

// parse returns the lease id of token, or 0 when token is not one of this daemon's (or
// its tag is wrong).
func (ls *Leases) parse(token string) uint64 {
	rest, ok := strings.CutPrefix(token, ls.nonce)
	if !ok || len(rest) < 2 || rest[0] != '.' {
		return 0
	}
	idPart, tagPart, ok := strings.Cut(rest[1:], ".")
	if !ok {
		return 0
	}
	id, ok := parseBase32(idPart)
	if !ok {
		return 0
	}
	tag, ok := parseBase32(tagPart)
	if !ok || tag != siphash(ls.key, id) { // one compare of words: no timing to learn from
		return 0
	}
	return id
}

// siphash returns SipHash-2-4 of the 8 bytes of m (little-endian) under key k.
func siphash(k [2]uint64, m uint64) uint64 {
	v0 := k[0] ^ 0x736f6d6570736575
	v1 := k[1] ^ 0x646f72616e646f6d
	v2 := k[0] ^ 0x6c7967656e657261
	v3 := k[1] ^ 0x7465646279746573
	round := func() {
		v0 += v1
		v1 = bits.RotateLeft64(v1, 13) ^ v0
		v0 = bits.RotateLeft64(v0, 32)
		v2 += v3
		v3 = bits.RotateLeft64(v3, 16) ^ v2
		v0 += v3
		v3 = bits.RotateLeft64(v3, 21) ^ v0
		v2 += v1
		v1 = bits.RotateLeft64(v1, 17) ^ v2
		v2 = bits.RotateLeft64(v2, 32)
	}
	v3 ^= m
	round()
	round()
	v0 ^= m
	const last = 8 << 56 // the final block: the length, 8, in its top byte
	v3 ^= last
	round()
	round()
	v0 ^= last
	v2 ^= 0xff
	round()
	round()
	round()
	round()
	return v0 ^ v1 ^ v2 ^ v3
}

// Release frees every slot lease token holds and reports whether it freed any: false
// when the token is unknown, expired or already released (releasing is idempotent).
func (ls *Leases) Release(token string, now int64) bool {
	id := ls.parse(token)
	if id == 0 {
		return false
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	l := ls.leases[id]
	if l == nil {
		return false
	}
	ls.expireLease(l, now)
	if l.live == 0 {
		return false
	}
	ls.freeLease(l, func(s *LeaseStats) { s.Released++ })
	return true
}

// appendKeyHashes appends to dst the hash under seed of the key of each slot the lease
// token holds a part of still (Limiter.AppendLeaseKeyHashes), and returns it.
func (ls *Leases) appendKeyHashes(dst []uint64, token string, seed maphash.Seed) []uint64 {
	id := ls.parse(token)
	if id == 0 {
		return dst
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if l := ls.leases[id]; l != nil {
		for i := range l.parts {
			if s := l.parts[i].s; s != nil {
				dst = append(dst, maphash.String(seed, s.key())&^1) // here (KeyInRedis)
			}
		}
	}
	return dst
}

// Renew extends the live lease token to now+d in each of its parts (d 0: each rule's own
// lease: as own gives it for the rule's name now, a reload having changed it, or as it
// was when the lease was taken when own is nil or knows no such rule). It reports whether
// the lease was live, and then how long until its first part expires. A lease one of
// whose parts ran out (its rule's lease shorter than the others') holds no longer all the
// slots it was given: it is not renewed (false), and its other parts keep their expiry;
// before, it was renewed, and the gateway believed it held a slot another request had
// taken.
func (ls *Leases) Renew(token string, d time.Duration, now int64, own func(rule string) (int64, bool)) (renewed bool, expiresIn time.Duration) {
	renewed, expiresIn, _ = ls.renew(token, d, now, own, false)
	return renewed, expiresIn
}

// renewal is what restore needs to undo a renewal: the parts' expiries before it, and
// which of the lease's renewals it was.
type renewal struct {
	was []int64
	n   uint64
}

// renew is Renew; with keep, it also returns the renewal (when renewed), for restore.
func (ls *Leases) renew(token string, d time.Duration, now int64, own func(rule string) (int64, bool), keep bool) (bool, time.Duration, renewal) {
	id := ls.parse(token)
	if id == 0 {
		return false, 0, renewal{}
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	l := ls.leases[id]
	if l == nil {
		return false, 0, renewal{}
	}
	ls.expireLease(l, now)
	if l.live == 0 || l.live < len(l.parts) {
		// Run out: in part, or whole (expireLease then dropped it, its parts emptied).
		return false, 0, renewal{}
	}
	l.renewals++
	var was []int64
	if keep {
		was = make([]int64, len(l.parts))
	}
	first := int64(-1)
	for i := range l.parts {
		p := &l.parts[i]
		if p.s == nil {
			continue
		}
		if keep {
			was[i] = p.expires
		}
		dur := p.dur
		if own != nil {
			if cur, ok := own(p.rule); ok {
				dur = cur
			}
		}
		p.expires = now + dur
		if d > 0 {
			p.expires = now + int64(d)
		}
		if first < 0 || p.expires < first {
			first = p.expires
		}
	}
	return true, time.Duration(first - now), renewal{was, l.renewals}
}

// restore gives the parts of the lease token still held the expiries they had before
// the renewal r, undoing a renewal of its local half whose global half was not renewed.
// A lease released meanwhile is left alone, and so is one renewed again since r: undoing
// r then would take back the later renewal, which its caller was told succeeded.
func (ls *Leases) restore(token string, r renewal) {
	id := ls.parse(token)
	if id == 0 {
		return
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	l := ls.leases[id]
	if l == nil || l.renewals != r.n {
		return
	}
	for i := range l.parts {
		if p := &l.parts[i]; p.s != nil && i < len(r.was) {
			p.expires = r.was[i]
		}
	}
}

// ReleaseOwner frees every lease owner still holds (its connection closed), counting
// them as closed, and returns how many leases it freed.
func (ls *Leases) ReleaseOwner(owner uint64, now int64) int {
	if owner == 0 {
		return 0
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.releaseOwnerLocked(owner, now)
}

// SetOwnerGone sets the function that tells whether the connection of an owner
// (Decision.Owner) has been closed by its client, which the daemon has not yet seen end:
// a check that finds a slot full frees the leases of such owners first (reapGoneLocked).
// The function must not block; it is called with the store's lock held.
func (ls *Leases) SetOwnerGone(gone func(owner uint64) bool) { ls.gone.Store(&gone) }

// maxGoneChecks bounds the owners a full slot's check asks about (SetOwnerGone): a
// refused flood on a key held by many connections costs at most that many calls each.
const maxGoneChecks = 8

// goneAskEvery is how long a full slot whose holders were all found connected is not
// asked about again: the refused checks of one batch of frames (read at one instant),
// and a client's pipelined flood of them, ask once, not once each (each question is a
// system call, made under ls.mu). It is far shorter than a round trip through a client
// (an answer read, a connection closed, another dialed, a check written and read), so
// a check sent after a holder's close still finds it gone; and the daemon sees such a
// close itself some tens of microseconds after it.
const goneAskEvery = 20 * time.Microsecond

// reapGoneLocked frees the leases of the owners holding parts of s (other than self, the
// owner checking) whose connections their clients have closed, as ReleaseOwner does
// once the connection's goroutine sees the close, and reports whether it freed any. s
// is full: a client that closes a connection holding leases and checks again at once on
// another found its own slots still held about a third of the time (a scratch client:
// 580 of 2,000 such checks refused on a concurrency rule of max 2), since the daemon
// sees the close a few tens of microseconds later. ls.mu must be held; s may be reused
// once emptied (look its key up again).
func (ls *Leases) reapGoneLocked(s *slot, self uint64, now int64) bool {
	f := ls.gone.Load()
	if f == nil {
		return false
	}
	if s.askedAt != 0 && now >= s.askedAt && now-s.askedAt < int64(goneAskEvery) {
		return false
	}
	var asked, gone [maxGoneChecks]uint64
	na, ng := 0, 0
	for _, p := range s.held {
		o := p.l.owner
		if o == 0 || o == self || slices.Contains(asked[:na], o) {
			continue
		}
		if na == len(asked) {
			break
		}
		asked[na] = o
		na++
		if (*f)(o) {
			gone[ng] = o
			ng++
		}
	}
	if ng == 0 {
		s.askedAt = now
		return false
	}
	for _, o := range gone[:ng] {
		ls.releaseOwnerLocked(o, now)
	}
	return true
}

// releaseOwnerLocked is ReleaseOwner with ls.mu held.
func (ls *Leases) releaseOwnerLocked(owner uint64, now int64) int {
	n := 0
	if o := ls.owners[owner]; o != nil {
		o.each(func(l *lease) bool {
			ls.expireLease(l, now)
			if l.live > 0 {
				n++
				ls.freeLease(l, func(s *LeaseStats) { s.Closed++ })
			}
			return true
		})
	}
	delete(ls.owners, owner)
	return n
}

// Holds reports whether owner holds a lease, local or global, that has not run out by
// now (as far as this daemon knows: a global lease renewed through another daemon counts
// until its expiry here; Limiter.HoldsLeases then asks Redis).
func (ls *Leases) Holds(owner uint64, now int64) bool {
	if owner == 0 {
		return false
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	held := false
	if o := ls.owners[owner]; o != nil {
		o.each(func(l *lease) bool {
			ls.expireLease(l, now)
			held = l.live > 0
			return !held
		})
	}
	if held {
		return true
	}
	for _, gl := range ls.globalOwners[owner] {
		if gl.expires > now {
			return true
		}
	}
	return false
}

// Sweep frees every part whose lease ran out by now and returns how many it freed.
func (ls *Leases) Sweep(now int64) int {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	n := 0
	for _, l := range ls.leases {
		n += ls.expireLease(l, now)
	}
	return n
}

// Stats calls f for every concurrency rule that has taken a lease, with a copy of its
// counts. f runs under the store's lock: it must not call back into ls.
func (ls *Leases) Stats(f func(rule string, s LeaseStats)) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for name, s := range ls.stats {
		f(name, *s)
	}
}

// PruneStats forgets the statistics of the rules keep says no (rules no longer in force),
// except while a lease part of theirs is held: a lease taken under a rule that a reload
// removed is counted in its rule's InFlight until freed, and the rule's statistics are
// forgotten at the next PruneStats after that. A rule's statistics forgotten and
// counted again (a late release of a lease acquired through another daemon) start
// afresh, at 0.
func (ls *Leases) PruneStats(keep func(rule string) bool) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for name, s := range ls.stats {
		if s.InFlight <= 0 && !keep(name) {
			delete(ls.stats, name)
		}
	}
}

// SetMax bounds the live leases at n (at least 1); see DefaultMaxLeases.
func (ls *Leases) SetMax(n int) {
	ls.mu.Lock()
	ls.max = max(n, 1)
	ls.mu.Unlock()
}

// full reports whether the daemon holds the most live leases it keeps: its local leases
// and the global ones it tracks (leases_global.go) together, since each costs it memory.
func (ls *Leases) full() bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.fullLocked()
}

func (ls *Leases) fullLocked() bool {
	return len(ls.leases)+len(ls.global)+ls.keyUnits >= ls.max
}

// slotKeyUnit is the bytes of a slot's key that count as one lease toward the bound
// (about 200 bytes each): counted as nothing, leases held on keys of 4 KB (a client's
// own API key) took 4.3 KB each, and the bound of 1,048,576 leases about 4.5 GB.
const slotKeyUnit = 200

// slotUnits is what a slot's key of n bytes counts toward the bound beyond its leases.
func slotUnits(n int) int { return n / slotKeyUnit }

// countCapped counts a check refused at the bound.
func (ls *Leases) countCapped() {
	ls.mu.Lock()
	ls.capped++
	ls.mu.Unlock()
}

// Capped returns how many checks were refused because the live leases were at the bound.
func (ls *Leases) Capped() uint64 {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.capped
}

// Len returns the number of live leases.
func (ls *Leases) Len() int {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return len(ls.leases)
}

// expireLease frees l's parts whose lease ran out by now (and l, when none is left);
// it returns how many parts it freed.
func (ls *Leases) expireLease(l *lease, now int64) int {
	n := 0
	for i := range l.parts {
		p := &l.parts[i]
		if p.s != nil && p.expires <= now {
			ls.freePart(p)
			p.stats.Expired++
			n++
		}
	}
	if l.live == 0 {
		ls.dropLease(l)
	}
	return n
}

// expireSlot frees the parts held in s whose lease ran out by now.
func (ls *Leases) expireSlot(s *slot, now int64) {
	for i := 0; i < len(s.held); {
		p := s.held[i]
		if p.expires > now {
			i++
			continue
		}
		l := p.l
		ls.freePart(p) // removes s.held[i]
		p.stats.Expired++
		if l.live == 0 {
			ls.dropLease(l)
		}
	}
}

// freeLease frees l's live parts, counting each with count, and drops l.
func (ls *Leases) freeLease(l *lease, count func(*LeaseStats)) {
	for i := range l.parts {
		p := &l.parts[i]
		if p.s != nil {
			ls.freePart(p)
			count(p.stats)
		}
	}
	ls.dropLease(l)
}

// freePart frees the slot p holds.
func (ls *Leases) freePart(p *leasePart) {
	s := p.s
	for i, q := range s.held {
		if q == p {
			last := len(s.held) - 1
			s.held[i] = s.held[last]
			s.held[last] = nil
			s.held = s.held[:last]
			break
		}
	}
	p.s = nil
	p.stats.InFlight--
	p.l.live--
	if len(s.held) == 0 {
		delete(ls.slots, s.key())
		ls.keyUnits -= slotUnits(len(s.buf))
		s.buf = s.buf[:0]
		ls.spare = keepSpare(ls.spare, s, len(ls.slots))
	}
}

// dropLease forgets l, whose parts are all free, and keeps it for reuse.
func (ls *Leases) dropLease(l *lease) {
	delete(ls.leases, l.id)
	l.leaveOwner()
	l.parts = l.parts[:0]
	l.id, l.owner = 0, 0
	ls.free = keepSpare(ls.free, l, len(ls.leases))
}

// spareKeep is how many released leases, and emptied slots, are kept for reuse beyond
// the live ones (keepSpare).
const spareKeep = 1024

// keepSpare returns list, the released objects kept for reuse, with x added while it
// holds fewer than live (the objects of its kind in use, x no longer one of them) plus
// spareKeep, and trimmed to that; its array moves to one of twice its length once it
// is under a quarter full. A daemon whose live leases fall by one at a time from a peak
// then keeps about half of them at most, and spareKeep once they are gone, where it kept
// every object of the peak for good: up to DefaultMaxLeases leases, about 200 MB, for
// the rest of its run. Steady traffic, whose live leases stay about the same, reuses
// them as before: no allocation a check.
func keepSpare[T any](list []*T, x *T, live int) []*T {
	bound := live + spareKeep
	if len(list) < bound {
		list = append(list, x)
	}
	for len(list) > bound { // mostly once at most: live falls by one a call
		list[len(list)-1] = nil
		list = list[:len(list)-1]
	}
	if c := cap(list); c > 4*spareKeep && len(list) < c/4 {
		list = append(make([]*T, 0, 2*len(list)), list...)
	}
	return list
}

// peekSlot reports how many of s's slots are held and, when all max are, how long until
// the first of its parts expires (capped at maxRetryHint, at least 1ms).
func peekSlot(s *slot, slots uint64, now int64) (held uint64, retry int64) {
	if s == nil {
		return 0, 0
	}
	held = uint64(len(s.held))
	if held < slots {
		return held, 0
	}
	retry = int64(maxRetryHint)
	for _, p := range s.held {
		retry = min(retry, p.expires-now)
	}
	return held, max(retry, int64(time.Millisecond))
}
