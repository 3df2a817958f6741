package limiter

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// banScope is where an op's penalty bans live: this daemon's table (bans.go), or Redis,
// shared by every daemon (sharedBans), checked at once (global) or from what this daemon
// last learned (hybrid).
type banScope uint8

const (
	bansLocal  banScope = iota
	bansHybrid          // known within one sync interval; refusals summed per interval
	bansGlobal          // read from Redis before the check; refusals counted at once
)

// maxPendingRefusals bounds the hybrid refusals waiting for the next interval: past it a
// refused key that has none pending is not counted (as the local table's bound).
const maxPendingRefusals = 1 << 16

// maxKnownBans bounds the bans a daemon learns per read of the index (those ending
// last): a read costs Redis and the daemon O(bans in force), every interval.
const maxKnownBans = 10_000

// sharedBans is the penalty rules' bans in hybrid and global modes, shared through Redis
// (rlsync.Bans): the pre-check of limiter/doc.go "Extending it" for those modes.
//
//   - global: the check's script call also checks the penalty op's ban key (global.lua's
//     algorithm 5; store_global.go), so a ban raised or lifted anywhere counts at once, in
//     the check's one round trip; each refusal is counted in Redis at once (one more
//     round trip, for refusals only): the refusal that reaches `after` starts the ban and
//     says so in its answer;
//   - hybrid: a check consults the bans this daemon knows, refreshed every interval from
//     the index (run); refusals are counted here and summed into Redis every interval.
//     So a ban raised on one daemon is enforced by every other within one interval, and
//     starts at most one interval after the refusal that reached `after` (that many more
//     refusals may pass unbanned, and refusals near the end of a `within` window may be
//     counted in the next).
//
// Times in Redis are Redis's clock (rlsync.Bans: Redis TIME decides the bans, so daemons
// with skewed wall clocks agree on them); the limiter decides on its own clock
// (monotonic in the daemon), which rlsync.Bans is given and measures Redis's clock
// against (redisOf). Safe for concurrent use.
type sharedBans struct {
	b    *rlsync.Bans
	wait time.Duration      // bounds a check's ban read and refusal count
	wall *localbucket.Store // WallOffset: wall - the limiter's clock

	// known is the bans in force this daemon knows, by rule client key: replaced whole by
	// each read of the index, and copied to add one this daemon started or to drop one it
	// lifted (bans are rare; checks read it without a lock).
	known atomic.Pointer[map[string]knownBan]
	mu    sync.Mutex // serializes writers of known, and guards pending
	// pending is the hybrid refusals not yet sent, by rule client key.
	pending map[string]*pendingRefusal
	// onStarted hears each ban a batch of hybrid refusals started (its rule client key),
	// which no answer reports (OnSharedBanStarted); nil: none.
	onStarted func(key string)
	// unindexed is the bans this daemon started and has not yet added to the index
	// (rlsync.Bans.Index); each round retries them, and keeps them known meanwhile.
	unindexed []rlsync.SharedBan
	// found is the clients whose ban a global check found in force, this daemon not
	// knowing it (Redis's index may lack it): the next round reads each ban and indexes
	// it (saw).
	found map[string]struct{}
}

type knownBan struct {
	until int64 // Unix ns by Redis's clock
	count uint32
}

type pendingRefusal struct {
	n      uint64
	policy rlsync.BanPolicy
	admit  int64 // the limiter's clock: the latest moment the rule would admit one of them again; 0: none
}

func policyOf(p *rules.Penalty) rlsync.BanPolicy {
	return rlsync.BanPolicy{After: p.After, Within: p.Within, Ban: p.Ban, Factor: p.Factor, Max: p.Max}
}

// WithSharedBans makes the penalty rules in hybrid and global mode share their bans
// through b, bounding a global check's reads and counts by wait. The daemon must then run
// RunSharedBans. Call it before the limiter is used; without it those rules' bans stay
// per daemon.
func (l *Limiter) WithSharedBans(b *rlsync.Bans, wait time.Duration) *Limiter {
	s := &sharedBans{b: b, wait: wait, wall: l.buckets, pending: map[string]*pendingRefusal{}}
	s.known.Store(&map[string]knownBan{})
	l.shared = s
	if g, ok := l.stores[storeGlobal].(globalStore); ok {
		g.bans = b // its ban checks' BanShift (tests)
		l.stores[storeGlobal] = g
	}
	l.recompile(nil)
	return l
}

// OnSharedBanStarted makes f hear the rule of each ban that a batch of this daemon's
// hybrid refusals started in Redis: no answer reports those (Result.BanStarted), so
// metrics count them here. Call it after WithSharedBans, before RunSharedBans.
func (l *Limiter) OnSharedBanStarted(f func(rule string)) {
	if l.shared != nil {
		l.shared.onStarted = func(key string) { f(ruleOfKey(key, l.prefix)) }
	}
}

// RunSharedBans sends the hybrid refusals counted here and learns the bans raised by
// every daemon, every interval, until ctx is done; then it sends the refusals once more.
// now is the limiter's clock; onErr (may be nil) hears each failed round. A no-op without
// WithSharedBans.
func (l *Limiter) RunSharedBans(ctx context.Context, interval time.Duration, now func() int64, onErr func(error)) {
	s := l.shared
	if s == nil {
		return
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			// The last round sends the pending refusals and indexes the bans they start:
			// a ban only this daemon knew would otherwise never reach the others.
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), max(interval, time.Second))
			err := s.round(fctx, now(), false)
			cancel()
			if err != nil && onErr != nil {
				onErr(err) // ctx is done: the caller can tell the last round's failure
			}
			return
		case <-t.C:
		}
		if ctx.Err() != nil {
			continue // a tick that raced the stop: the last round follows
		}
		rctx, cancel := context.WithTimeout(ctx, max(interval, time.Second))
		err := s.round(rctx, now(), anyPenalty(l.Rules()))
		cancel()
		// A round the stop cut is not reported: once ctx is done, onErr hears only the
		// last round's outcome, which the caller reports as what the stop failed to
		// send (refusals the cut round surely did not send are pending for it: putBack).
		if err != nil && onErr != nil && ctx.Err() == nil {
			onErr(err)
		}
	}
}

// LearnSharedBans reads the shared bans in force once, at now (the limiter's clock), so
// that a daemon starting enforces them from its first check: its first round of
// RunSharedBans comes one interval after the start, and a hybrid rule's check until then
// did not see the bans Redis held (a banned client's first request after a restart was
// admitted, on the credit a key new on a daemon gets). A no-op without WithSharedBans or
// without a penalty rule. Call it before serving; an error (Redis away) leaves the bans
// to the rounds.
func (l *Limiter) LearnSharedBans(ctx context.Context, now int64) error {
	s := l.shared
	if s == nil || !anyPenalty(l.Rules()) {
		return nil
	}
	return s.round(ctx, now, true)
}

// redisOf returns now (the limiter's clock) on Redis's clock, as this daemon last
// measured the offset between them (rlsync.Bans.Offset: the limiter's clock is what it is
// given, so a step of the wall clock does not move it); before it has, the wall clock.
func (s *sharedBans) redisOf(now int64) int64 {
	if off, ok := s.b.Offset(); ok {
		return now + off
	}
	return now + s.wall.WallOffset()
}

// anyPenalty reports whether set has a penalty rule: without one nothing consults the
// bans, so a round does not read the index (two Redis commands per interval, every
// daemon's largest idle cost).
func anyPenalty(set *rules.Set) bool {
	if set == nil {
		return false
	}
	for _, r := range set.Rules {
		if r.Penalty != nil {
			return true
		}
	}
	return false
}

// round sends the pending refusals, indexes the bans started here, then, if read (the
// rules have a penalty rule), reads the index: what this daemon knows is the index, and
// its own bans not yet indexed.
func (s *sharedBans) round(ctx context.Context, now int64, read bool) error {
	began := time.Now()
	ferr := s.flush(ctx, now)
	s.mu.Lock()
	var found []string
	for k := range s.found {
		found = append(found, k)
	}
	clear(s.found)
	s.mu.Unlock()
	if len(found) > 0 {
		held, err := s.b.Held(ctx, found)
		ferr = errors.Join(ferr, err)
		s.started(held...) // indexed below, as the bans started here
	}
	s.mu.Lock()
	todo := s.unindexed
	s.unindexed = nil
	s.mu.Unlock()
	var ierr error
	if ierr = s.b.Index(ctx, todo); ierr != nil {
		s.started(todo...) // retried next round
	}
	if !read {
		return errors.Join(ferr, ierr)
	}
	// The limiter's clock when Known is sent, which it measures Redis's clock against:
	// the round's start plus what the flush and the index took.
	now += int64(time.Since(began))
	list, err := s.b.Known(ctx, now, maxKnownBans)
	if err != nil {
		return err
	}
	m := make(map[string]knownBan, len(list))
	for _, b := range list {
		m[b.Key] = knownBan{until: b.Until, count: b.Count}
	}
	rnow := s.redisOf(now) // as Known just measured it
	s.mu.Lock()
	for _, b := range s.unindexed {
		if o, ok := m[b.Key]; b.Until > rnow && (!ok || o.until < b.Until) {
			m[b.Key] = knownBan{until: b.Until, count: b.Count}
		}
	}
	s.known.Store(&m)
	s.mu.Unlock()
	return errors.Join(ferr, ierr)
}

// started records bans this daemon started, for the next round to index (at most
// maxPendingRefusals waiting: past it a ban is enforced by its key and by this daemon,
// and the others learn it when it is raised again).
func (s *sharedBans) started(bans ...rlsync.SharedBan) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range bans {
		if len(s.unindexed) < maxPendingRefusals {
			s.unindexed = append(s.unindexed, b)
		}
	}
}

// flush sends the pending refusals in one pipeline and learns the bans they started.
func (s *sharedBans) flush(ctx context.Context, now int64) error {
	s.mu.Lock()
	if len(s.pending) == 0 {
		s.mu.Unlock()
		return nil
	}
	rs := make([]rlsync.BanRefusal, 0, len(s.pending))
	for k, p := range s.pending {
		rs = append(rs, rlsync.BanRefusal{Key: k, N: p.n, Policy: p.policy, Admit: p.admit})
	}
	clear(s.pending)
	s.mu.Unlock()
	err := s.b.Refused(ctx, now, rs)
	s.putBack(rs)
	for i := range rs {
		if rs[i].Until > rs[i].At {
			s.learn(rs[i].Key, knownBan{until: rs[i].Until, count: rs[i].Count})
			// Started here, or found in force: indexed (again) either way. A refusal
			// reaches Redis during a ban only from a daemon that does not know it: one
			// just started elsewhere (indexed already: the same member and score), or one
			// the index lacks (its daemon killed before indexing it, or the reply that
			// started it lost to a timeout). Before, the daemon learned such a ban here
			// and forgot it at this round's read of the index: no hybrid daemon enforced
			// it, /bans never listed it, and Redis ignored the client's refusals (made
			// while banned) for the ban's whole length.
			s.started(rlsync.SharedBan{Key: rs[i].Key, Until: rs[i].Until, Count: rs[i].Count})
		}
		if rs[i].Started && s.onStarted != nil {
			s.onStarted(rs[i].Key)
		}
	}
	return err
}

// putBack makes the refusals of rs that did not reach Redis (Unsent: Redis down, its
// connection refused) pending again, for the next round, beside any counted since. Before,
// a round that failed dropped them: five refusals made while Redis was away never counted
// toward a ban. At most maxPendingRefusals keys wait, as always.
func (s *sharedBans) putBack(rs []rlsync.BanRefusal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range rs {
		r := &rs[i]
		if !r.Unsent {
			continue
		}
		p := s.pending[r.Key]
		if p == nil {
			if len(s.pending) >= maxPendingRefusals {
				continue
			}
			p = &pendingRefusal{policy: r.Policy}
			s.pending[r.Key] = p
		}
		p.n += r.N
		p.admit = max(p.admit, r.Admit)
	}
}

// learn adds one ban to known.
func (s *sharedBans) learn(key string, b knownBan) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old := *s.known.Load()
	if o, ok := old[key]; ok && o.until >= b.until {
		return
	}
	m := make(map[string]knownBan, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[key] = b
	s.known.Store(&m)
}

// forget drops key from known.
func (s *sharedBans) forget(key string) {
	if _, ok := (*s.known.Load())[key]; !ok {
		return // the common case, without the lock
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old := *s.known.Load()
	if _, ok := old[key]; !ok {
		return
	}
	m := make(map[string]knownBan, len(old))
	for k, v := range old {
		if k != key {
			m[k] = v
		}
	}
	s.known.Store(&m)
}

// knownUntil returns when the ban of key this daemon knows ends (Unix ns by Redis's
// clock), or 0 when it is not in force at rnow (Redis's clock).
func (s *sharedBans) knownUntil(key []byte, rnow int64) int64 {
	if b, ok := (*s.known.Load())[string(key)]; ok && b.until > rnow {
		return b.until
	}
	return 0
}

// check sets bannedUntil (on the limiter's clock) on d's hybrid ops with shared bans,
// from what this daemon knows. A global op's ban is checked in its store's script call
// instead (store_global.go), so that Redis, not what a daemon last heard, decides it.
func (s *sharedBans) check(now int64, d *Decision) {
	rnow := s.redisOf(now)
	off := rnow - now
	for i := range d.ops {
		o := &d.ops[i]
		if o.bans != bansHybrid {
			continue
		}
		var buf [128]byte // the client a ban is of (rlsync.BanIdentity), on the stack when short
		if u := s.knownUntil(rlsync.AppendBanIdentity(buf[:0], o.key), rnow); u != 0 {
			o.bannedUntil = u - off
		}
	}
}

// saw notes that a global check of op i found its client banned until bannedUntil (the
// limiter's clock at now). A ban this daemon does not know is one the index may lack:
// the daemon that started it was killed before its round indexed it, or the reply of
// the refusal that started it came after the call's timeout (--global-timeout), and no
// daemon knew it had started. Global checks enforced it, but no /bans listed it and no
// hybrid check of the rule enforced it. The next round reads it and indexes it.
func (s *sharedBans) saw(now int64, d *Decision, i int) {
	o := &d.ops[i]
	var buf [128]byte
	key := rlsync.AppendBanIdentity(buf[:0], o.key)
	if s.knownUntil(key, s.redisOf(now)) != 0 {
		return // the common case, without the lock
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.found == nil {
		s.found = map[string]struct{}{}
	}
	if len(s.found) < maxPendingRefusals {
		s.found[string(key)] = struct{}{}
	}
}

// refused counts op i's refusal by rule r at now (the limiter's clock): at once in Redis
// for a global op, returning when the ban it started (or found) ends on the limiter's
// clock (now plus the time it had left by Redis's clock), 0 when none, and whether this
// refusal started it (not when another daemon's refusal started it after this check read
// the ban: before, both answers said started, and rlsidecar_bans_total counted the ban
// once per racing refusal); for a hybrid op, added to the next interval's batch (0). admit (the limiter's clock; 0: none) is when r
// would admit the request again: a ban these refusals start lasts at least until then
// (rlsync.BanRefusal.Admit).
func (s *sharedBans) refused(now int64, d *Decision, i int, r *rules.Rule, admit int64) (until int64, started bool) {
	o := &d.ops[i]
	var buf [128]byte // a ban is of the client, under any window of r (rlsync.BanIdentity)
	key := rlsync.AppendBanIdentity(buf[:0], o.key)
	if o.bans == bansHybrid {
		s.mu.Lock()
		defer s.mu.Unlock()
		p := s.pending[string(key)]
		if p == nil {
			if len(s.pending) >= maxPendingRefusals {
				return 0, false
			}
			p = &pendingRefusal{policy: policyOf(r.Penalty)}
			s.pending[string(key)] = p
		}
		p.n++
		p.admit = max(p.admit, admit)
		return 0, false
	}
	rs := [1]rlsync.BanRefusal{{Key: string(key), N: 1, Policy: policyOf(r.Penalty), Admit: admit}}
	ctx, cancel := context.WithTimeout(context.Background(), s.wait)
	err := s.b.Refused(ctx, now, rs[:])
	cancel()
	if err != nil || rs[0].Until <= rs[0].At {
		return 0, false
	}
	s.learn(rs[0].Key, knownBan{until: rs[0].Until, count: rs[0].Count})
	if rs[0].Started {
		s.started(rlsync.SharedBan{Key: rs[0].Key, Until: rs[0].Until, Count: rs[0].Count})
	}
	return now + (rs[0].Until - rs[0].At), rs[0].Started
}

// list appends the bans in force this daemon knows at now (the limiter's clock).
func (s *sharedBans) list(now int64, prefix string, out []Ban) []Ban {
	rnow := s.redisOf(now)
	for k, b := range *s.known.Load() {
		if b.until > rnow {
			out = append(out, Ban{Rule: ruleOfKey(k, prefix), Key: k, Left: time.Duration(b.until - rnow), Count: b.count})
		}
	}
	return out
}

// lift lifts key's ban in Redis and here; with onlyBanned, only a ban Redis holds in
// force (rlsync.Bans.LiftBanned).
func (s *sharedBans) lift(key string, now int64, onlyBanned bool) (bool, error) {
	if i := strings.IndexByte(key, '{'); i < 1 || key[i-1] != ':' {
		return false, nil // not a client key
	}
	key = rlsync.BanIdentity(key) // as /bans lists it; a key under the rule's fingerprint too
	ctx, cancel := context.WithTimeout(context.Background(), max(s.wait, time.Second))
	defer cancel()
	lift := s.b.Lift
	if onlyBanned {
		lift = s.b.LiftBanned
	}
	was, err := lift(ctx, now, key)
	if err != nil {
		return false, err
	}
	if onlyBanned && !was {
		return false, nil
	}
	was = was || s.knownUntil([]byte(key), s.redisOf(now)) != 0
	s.forget(key)
	s.mu.Lock()
	s.unindexed = slices.DeleteFunc(s.unindexed, func(b rlsync.SharedBan) bool { return b.Key == key }) // not to index it again
	s.mu.Unlock()
	return was, nil
}

// ruleOfKey returns the rule name in a Redis client key <prefix><rule>~<fp>:{<client>}
// (limiter/doc.go, "Redis keys"): what precedes the fingerprint, or the ':' before the
// hash tag. Rule names have no '~', '@' or ':'.
func ruleOfKey(key, prefix string) string {
	if len(key) < len(prefix) {
		return ""
	}
	k := key[len(prefix):]
	for i := 0; i < len(k); i++ {
		if k[i] == ':' || k[i] == '~' || k[i] == '@' {
			return k[:i]
		}
	}
	return k
}
