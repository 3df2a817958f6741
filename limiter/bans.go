package limiter

import (
	"hash/maphash"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/rlsidecar/rlsidecar/rules"
)

// bans is the local mode's ban table (a rule's penalty): per client key (which starts
// with the rule's name), its refusals in the current `within` window and its bans. Only
// keys a penalty rule has refused are stored; Sweep drops those that carry nothing any
// more. At most maxPerShard units per shard (4,194,304 in all), a key taking one and one
// more per whole 128 bytes of it (banUnits): past it a refused key that has no record
// yet is not recorded (it earns no ban until a sweep makes room), so a flood of
// distinct keys, however long, cannot grow memory without bound. Safe for concurrent
// use: banShards independently locked shards.
type bans struct {
	seed        maphash.Seed
	maxPerShard int
	shards      [banShards]banShard
}

// banShards is the shards of the table. A walk of every ban (the sweep, a scrape of
// rlsidecar_banned_keys) holds one shard's lock at a time, for as long as its bans take,
// which a check of a key of that shard may wait for: a 256th of the walk. Under a million
// bans (BenchmarkBannedKeys, a loaded 2-core machine) a check's p99 wait was 2 µs, and
// 1-4.7 ms with 64 shards.
const banShards = 256

const defaultBansPerShard = 1 << 14 // 4,194,304 in all

type banShard struct {
	mu   sync.Mutex
	m    map[string]*banEntry
	load int      // the units its keys take (banUnits)
	_    [32]byte // keep shards on separate cache lines
}

// banUnits is what a record of a key of n bytes takes of its shard's bound: one (a
// short key's record, its entry and its map slot: about 130 bytes), and one more per
// whole 128 bytes of the key, at most max. Counted as one, records of 4 KB keys (a
// client's own API key) took 4.2 KB each: 100,000 banned clients held 0.99 GB of RSS,
// and the bound of 4,194,304 records about 17 GB.
func banUnits(n, max int) int { return min(1+n/128, max) }

// banEntry is one key's record under a penalty rule.
type banEntry struct {
	rule        string // the rule's name, for listings
	windowStart int64  // start of the current `within` window of refusals
	refusals    uint64 // in that window
	bans        uint32 // bans so far, since the count last decayed
	until       int64  // the current (or last) ban ends; 0: never banned
	lastEnd     int64  // when the last ban ended or will end
}

func newBans() *bans {
	b := &bans{seed: maphash.MakeSeed(), maxPerShard: defaultBansPerShard}
	for i := range b.shards {
		b.shards[i].m = map[string]*banEntry{}
	}
	return b
}

func (b *bans) shard(key []byte) *banShard {
	return &b.shards[maphash.Bytes(b.seed, key)%banShards]
}

// bannedUntil returns when key's ban ends, or 0 when it is not banned at now.
func (b *bans) bannedUntil(key []byte, now int64) int64 {
	sh := b.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if e := sh.m[string(key)]; e != nil && e.until > now {
		return e.until
	}
	return 0
}

// refused records that rule r (with a penalty) refused key at now, and returns when the
// ban this refusal starts ends (0 when it starts none), started true. admit is when r
// itself would admit the refused request again (0: never, or unknown): a ban lasts at
// least until then (banEnd), so that obeying a banned answer's retry_after_ms never meets
// a refusal of the rule, which would count toward the next ban. A refusal counted while
// key is banned (a check that read no ban, racing one whose refusal started it) does not
// count: it returns the ban in force, started false (as ban.lua; before, with after: 1 it
// started a second ban at once, factor times as long, and each was counted as started).
func (b *bans) refused(key []byte, r *rules.Rule, now, admit int64) (until int64, started bool) {
	p := r.Penalty
	sh := b.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[string(key)]
	if e == nil {
		w := banUnits(len(key), b.maxPerShard)
		if sh.load+w > b.maxPerShard {
			return 0, false
		}
		e = &banEntry{rule: r.Name}
		sh.m[string(key)] = e
		sh.load += w
	}
	if e.until > now {
		return e.until, false
	}
	if e.refusals == 0 || now-e.windowStart >= int64(p.Within) {
		e.windowStart, e.refusals = now, 0
	}
	e.refusals++
	if e.refusals < p.After {
		return 0, false
	}
	if e.bans > 0 && now-e.lastEnd >= int64(p.Max) {
		e.bans = 0 // max without a ban: the count decays
	}
	d := p.BanFor(e.bans)
	e.bans++
	e.refusals = 0
	e.until = banEnd(now, d, admit)
	e.lastEnd = e.until
	return e.until, true
}

// banEnd is when a ban of length d started at now ends: now+d, or admit (when the rule
// that started it would admit the refused request again) if that is later. The length
// of the next ban (factor, max) still grows from d, the configured one.
func banEnd(now int64, d time.Duration, admit int64) int64 {
	return max(now+int64(d), admit)
}

// lift ends key's ban (and forgets its refusals and bans); it reports whether the key
// was banned at now.
func (b *bans) lift(key []byte, now int64) bool {
	sh := b.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[string(key)]
	if e == nil {
		return false
	}
	delete(sh.m, string(key))
	sh.load -= banUnits(len(key), b.maxPerShard)
	return e.until > now
}

// penalties returns set's penalty rules' penalties, by rule name.
func penalties(set *rules.Set) map[string]*rules.Penalty {
	pen := map[string]*rules.Penalty{}
	if set == nil {
		return pen
	}
	for _, r := range set.Rules {
		if r.Penalty != nil {
			pen[r.Name] = r.Penalty
		}
	}
	return pen
}

// sweep drops the records that carry nothing at now under set: those of a rule that no
// longer has a penalty (a ban in force included: nothing enforces it, and it must not
// come back with a penalty written again later), and those with no ban in force, no
// refusal in the current window and a ban count that has decayed. It returns how many
// it dropped.
func (b *bans) sweep(now int64, set *rules.Set) int {
	pen := penalties(set)
	n := 0
	for i := range b.shards {
		sh := &b.shards[i]
		sh.mu.Lock()
		var rule string      // the rule of the last entry, and its penalty p: looked up again
		var p *rules.Penalty // only when the rule changes (the strings compare by pointer first)
		for k, e := range sh.m {
			if e.rule != rule || p == nil {
				rule, p = e.rule, pen[e.rule]
			}
			if p != nil && (e.until > now || (e.refusals > 0 && now-e.windowStart < int64(p.Within)) || (e.bans > 0 && now-e.lastEnd < int64(p.Max))) {
				continue
			}
			delete(sh.m, k)
			sh.load -= banUnits(len(k), b.maxPerShard)
			n++
		}
		sh.mu.Unlock()
	}
	return n
}

// forgetUnpenalized drops the records of the rules that have no penalty in set, at a
// reload: a ban of a rule whose penalty was removed must not be enforced again if the
// penalty is written back before the next sweep.
func (b *bans) forgetUnpenalized(set *rules.Set) {
	pen := penalties(set)
	for i := range b.shards {
		sh := &b.shards[i]
		sh.mu.Lock()
		maps.DeleteFunc(sh.m, func(k string, e *banEntry) bool {
			if pen[e.rule] != nil {
				return false
			}
			sh.load -= banUnits(len(k), b.maxPerShard)
			return true
		})
		sh.mu.Unlock()
	}
}

// Ban is one ban in force, as Limiter.Bans lists it.
type Ban struct {
	Rule  string
	Key   string        // the client key, rule name included: rule:{attr=value}
	Left  time.Duration // until it ends
	Count uint32        // bans of this key since the count last decayed, this one included
}

// Bans lists the bans in force at now, by rule then key: this daemon's (local mode) and
// the shared ones it knows (hybrid and global modes; their keys carry the Redis prefix).
//
// Only the bans of rules that have a penalty are listed: a ban of a rule whose penalty
// a reload removed is not in force (its local record goes at the next sweep; a shared
// one stays in Redis until it ends, and is enforced again if the penalty comes back
// before then).
func (l *Limiter) Bans(now int64) []Ban {
	var out []Ban
	if l.shared != nil {
		out = l.shared.list(now, l.prefix, out)
	}
	for i := range l.bans.shards {
		sh := &l.bans.shards[i]
		sh.mu.Lock()
		for k, e := range sh.m {
			if e.until > now {
				out = append(out, Ban{Rule: e.rule, Key: k, Left: time.Duration(e.until - now), Count: e.bans})
			}
		}
		sh.mu.Unlock()
	}
	out = slices.DeleteFunc(out, l.unenforced())
	sort.Slice(out, func(i, j int) bool {
		if out[i].Rule != out[j].Rule {
			return out[i].Rule < out[j].Rule
		}
		return out[i].Key < out[j].Key
	})
	return out
}

// BannedKeys counts the keys banned at now, per rule name (shared bans as this daemon
// knows them).
func (l *Limiter) BannedKeys(now int64) map[string]int {
	out := map[string]int{}
	unenforced := l.unenforced()
	if l.shared != nil {
		for _, b := range l.shared.list(now, l.prefix, nil) {
			if !unenforced(b) {
				out[b.Rule]++
			}
		}
	}
	// This daemon's bans, counted by rule as they come (the rule's name compared by
	// pointer first: its entries share it) and dropped after, by rule, where the active
	// rules do not enforce this table's bans: a scrape under a million bans holds each
	// shard's lock for its walk alone, not for a map update and a test per ban.
	local := map[string]int{}
	for i := range l.bans.shards {
		sh := &l.bans.shards[i]
		sh.mu.Lock()
		rule, n := "", 0
		for _, e := range sh.m {
			if e.until <= now {
				continue
			}
			if e.rule != rule {
				if n > 0 {
					local[rule] += n
				}
				rule, n = e.rule, 0
			}
			n++
		}
		if n > 0 {
			local[rule] += n
		}
		sh.mu.Unlock()
	}
	for r, n := range local {
		if !unenforced(Ban{Rule: r, Key: r + ":{}"}) { // a key of this table, as its bans' are
			out[r] += n
		}
	}
	return out
}

// unenforced returns a test of a ban (its Rule and Key) that the active rules do not
// enforce: its rule has no penalty, or keeps its bans in the other table, this daemon's
// (local mode) where the ban is a shared one (its key has the Redis prefix), or Redis
// (hybrid, global) where it is this daemon's. A reload moving a rule between local and
// a shared mode does not carry its bans across; before, /bans still listed the other
// table's bans, and rlsidecar_banned_keys counted them, while no check refused them.
// A shared ban's key is <prefix><rule>:{<client>}, a local one's <rule>:{<client>}: the
// prefix ends with ':' and holds no '{', so neither can be read as the other.
func (l *Limiter) unenforced() func(Ban) bool {
	c := l.active.Load()
	shared := map[string]bool{} // by penalty rule: whether its bans are Redis's
	for i, r := range c.set.Rules {
		if r.Penalty != nil && r.Index == i {
			shared[r.Name] = c.rules[i].bans != bansLocal
		}
	}
	return func(b Ban) bool {
		s, ok := shared[b.Rule]
		inRedis := len(b.Key) > len(l.prefix)+len(b.Rule)+1 && strings.HasPrefix(b.Key, l.prefix) &&
			strings.HasPrefix(b.Key[len(l.prefix):], b.Rule+":{")
		return !ok || s != inRedis
	}
}

// LiftBan ends the ban of key (a client key as Bans lists it, rule name included) and
// reports whether it was banned at now. A shared ban is lifted in Redis too: global
// checks stop enforcing it at once, the other daemons' hybrid checks within an interval.
// A shared ban that Redis did not answer for is not lifted: false (LiftBanErr says why).
func (l *Limiter) LiftBan(key string, now int64) bool {
	lifted, _ := l.LiftBanErr(key, now)
	return lifted
}

// LiftBanErr is LiftBan, with the error of Redis when a shared ban could not be lifted
// for want of it: the ban may well be in force, and a caller must not report it gone
// (the admin endpoint said 404 "no ban", during an outage, of a ban still enforced).
func (l *Limiter) LiftBanErr(key string, now int64) (bool, error) {
	if l.bans.lift([]byte(key), now) {
		return true, nil
	}
	if l.shared == nil {
		return false, nil
	}
	return l.shared.lift(key, now, false)
}

// LiftSharedBan lifts, in Redis, the shared ban of client (its key's form, as between
// the braces of its Redis keys: ip=1.2.3.4, user=%7Ba%7D|ip=1.2.3.4) by the rule named
// rule, when that rule has a penalty in a shared mode (hybrid, global) and Redis holds
// the client banned at now: whether or not this daemon knows the ban. Bans lists only
// the bans a read of the index returned (at most 10,000, those ending last), and a ban
// another daemon just started is not among them until the next reads; such a ban is
// enforced all the same (every global check reads it). It reports whether it lifted
// one; a client Redis holds no ban of is left as it is (its refusals and count kept).
// The error is Redis's, when it did not answer.
func (l *Limiter) LiftSharedBan(rule, client string, now int64) (bool, error) {
	if l.shared == nil || client == "" || strings.ContainsAny(client, "{}") {
		return false, nil
	}
	c := l.active.Load()
	for i, r := range c.set.Rules {
		if r.Name != rule || r.Index != i {
			continue
		}
		if r.Penalty == nil || c.rules[i].bans == bansLocal {
			return false, nil
		}
		return l.shared.lift(l.prefix+rule+":{"+client+"}", now, true)
	}
	return false, nil
}
