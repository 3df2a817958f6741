package sync

import (
	"bytes"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/plural"
)

//go:embed scripts/ban.lua
var banSrc string

//go:embed scripts/ban_known.lua
var banKnownSrc string

//go:embed scripts/ban_lift.lua
var banLiftSrc string

var (
	banScript      = script{redis.NewScript(banSrc), banSrc}
	banKnownScript = script{redis.NewScript(banKnownSrc), banKnownSrc}
	banLiftScript  = script{redis.NewScript(banLiftSrc), banLiftSrc}
)

// maxOffsetRTT bounds the round trip of a reply that measures the offset of Redis's
// clock from the caller's ([Bans.Offset]) once one is known: a reply's Redis time is
// placed in the middle of its round trip, so the estimate is off by at most half of it.
const maxOffsetRTT = 250 * time.Millisecond

// Bans is the penalty rules' escalating bans in hybrid and global modes, shared by every
// daemon on one Redis under one prefix. Per client of a penalty rule, one hash
// <prefix><rule>@ban:{<client>} (BanKey; the client's hash tag, so it lives on the slot of
// the client's other keys) holds its refusals in the current `within` window, the end of
// its ban and its count of bans, and expires once it carries nothing (scripts/ban.lua).
// Every ban in force is also a member of the sorted set <prefix>~bans (score: its end in
// Unix ms, member: "<count>|<key>"), which each daemon reads once per interval to learn
// the bans raised elsewhere ([Bans.Known]). No rule name contains '@' or starts with '~',
// so neither key is any rule's key under any prefix.
//
// Clock: Redis TIME decides, in the scripts, the window of refusals, a ban's start and
// end, what Known lists as in force and what Lift finds, so daemons whose wall clocks
// differ (by minutes: NTP broken on one host) agree on who is banned and until when.
// The ends Bans reports (BanRefusal.Until, SharedBan.Until) are Unix ns by Redis's
// clock; a daemon that enforces a ban itself turns them into its own clock with the
// offset Bans learns from Known's and Lift's replies ([Bans.Offset]), or with the time
// left that a reply carries (BanRefusal.At). The now the methods take is the caller's
// clock (Unix ns: its wall clock, or a clock that does not step, anchored to it; the
// same in every call), used only to measure that offset and to turn a refusal's Admit,
// on the same clock, into a delay. On a Cluster, the nodes' clocks are taken to agree (servers' clocks;
// the daemons' may not).
//
// A daemon of a version before this wrote the ends by its own wall clock, in the same
// fields and index: where its clock is right, the two agree; where it is not, its bans
// are as wrong as they were before, and it reads the bans others raise no worse.
//
// Safe for concurrent use.
type Bans struct {
	rdb   redis.UniversalClient
	index string
	// off is the offset of Redis's clock from the caller's (ns), as last measured, at
	// offAt (ns since offEpoch; 0: never); rmono is Redis's clock less the time since
	// offEpoch, as the same reply measured it (redisNow); shift is added to Redis TIME
	// (Shift).
	off   atomic.Int64
	offAt atomic.Int64
	rmono atomic.Int64
	shift atomic.Int64
}

// offEpoch is what Bans.offAt counts from (a monotonic reading).
var offEpoch = time.Now()

// Offset returns Redis's clock minus the caller's, in ns, as the last reply of Known or
// Lift measured it, and whether one has: Redis's time is the caller's now + Offset. It is
// off by at most half a round trip: a reply slower than maxOffsetRTT is used only when
// the estimate is a minute old (or there is none).
func (b *Bans) Offset() (int64, bool) { return b.off.Load(), b.offAt.Load() != 0 }

// Shift moves the clock the bans are decided on, Redis TIME, by d for every later call
// of b (and of the global ban checks given BanShift = b.ShiftOf()): a testing aid, for
// tests in which a ban's minutes must pass. The daemon never calls it.
func (b *Bans) Shift(d time.Duration) { b.shift.Add(int64(d)) }

// ShiftOf returns the sum of the shifts given to Shift (0 in the daemon).
func (b *Bans) ShiftOf() time.Duration { return time.Duration(b.shift.Load()) }

func (b *Bans) shiftMs() int64 { return b.shift.Load() / int64(time.Millisecond) }

// measure learns the offset of Redis's clock from the caller's, given the caller's now
// when the call began, the call's start (for its round trip) and Redis's time in the
// reply (µs): Redis read it about halfway through the round trip.
func (b *Bans) measure(now int64, start time.Time, redisUs int64) {
	rtt := time.Since(start)
	at := int64(time.Since(offEpoch)) + 1 // never 0
	if last := b.offAt.Load(); rtt > maxOffsetRTT && last != 0 && at-last < int64(time.Minute) {
		return // a slow reply: keep the estimate of a quicker one, while recent
	}
	redisNs := redisUs*int64(time.Microsecond) + int64(time.Microsecond)/2
	b.off.Store(redisNs - (now + int64(rtt)/2))
	b.rmono.Store(redisNs - (int64(start.Sub(offEpoch)) + int64(rtt)/2))
	b.offAt.Store(at)
}

// redisNow returns Redis's time now (Unix ns, plus any Shift) as the last reply that
// measured the offset places it, and whether one has; it needs no clock of the caller.
func (b *Bans) redisNow() (int64, bool) {
	return int64(time.Since(offEpoch)) + b.rmono.Load(), b.offAt.Load() != 0
}

// NewBans returns the shared bans under prefix (checked by [CheckPrefix]) on c, a
// *redis.Client or a *redis.ClusterClient.
func NewBans(c redis.UniversalClient, prefix string) (*Bans, error) {
	if err := CheckPrefix(prefix); err != nil {
		return nil, err
	}
	return &Bans{rdb: c, index: prefix + "~bans"}, nil
}

// BanKey returns the ban key of key, a rule's client key <prefix><rule>[~<fingerprint>]
// [@<window start>]:{<client>}: <prefix><rule>@ban:{<client>}, the same under any
// algorithm, window or calendar window of the rule (BanIdentity). It panics on a key
// without a hash tag (a bug).
func BanKey(key string) string {
	key = BanIdentity(key)
	tag := strings.IndexByte(key, '{') - 1
	return key[:tag] + "@ban" + key[tag:]
}

// BanIdentity returns the client a ban is of, given key, a rule's client key: the key
// without the rule's fingerprint (its algorithm and window) nor a calendar window's
// start, <prefix><rule>:{<client>}. A ban is of a client of a rule, as the local mode
// keeps it: a reload that changes the rule's window or algorithm starts its counts
// afresh, not its bans (it lifted them in hybrid and global mode, while /bans still
// listed them; found by a bans audit). It panics on a key without a hash tag (a bug).
func BanIdentity(key string) string {
	tag := strings.IndexByte(key, '{') - 1
	if tag < 0 || key[tag] != ':' {
		panic("BUG: sync: a ban of a key without a hash tag: " + key)
	}
	// The prefix ends with ':' and a rule name has none, nor '~' or '@'.
	name := strings.LastIndexByte(key[:tag], ':') + 1
	cut := strings.IndexAny(key[name:tag], "~@")
	if cut < 0 {
		return key
	}
	return key[:name+cut] + key[tag:]
}

// AppendBanIdentity appends BanIdentity(key) to dst.
func AppendBanIdentity(dst, key []byte) []byte {
	tag := bytes.IndexByte(key, '{') - 1
	if tag < 0 || key[tag] != ':' {
		panic("BUG: sync: a ban of a key without a hash tag: " + string(key))
	}
	name := bytes.LastIndexByte(key[:tag], ':') + 1
	cut := bytes.IndexAny(key[name:tag], "~@")
	if cut < 0 {
		return append(dst, key...)
	}
	dst = append(dst, key[:name+cut]...)
	return append(dst, key[tag:]...)
}

// BanPolicy is a penalty rule's escalation, as rules.Penalty: After refusals within
// Within start a ban of Ban, each later one Factor times longer, at most Max; the count
// decays after Max without a ban.
type BanPolicy struct {
	After  uint64
	Within time.Duration
	Ban    time.Duration
	Factor float64
	Max    time.Duration
}

// BanRefusal is refusals of one client by a penalty rule, given to [Bans.Refused], and
// what they did.
type BanRefusal struct {
	Key    string // the rule's client key (not the ban key)
	N      uint64 // refusals, at least 1
	Policy BanPolicy
	// Admit (Unix ns; 0: none) is when the rule would admit the refused requests again:
	// a ban they start ends no earlier (its length for the escalation stays Policy's).
	Admit int64
	// Written by Refused: Until is the end of the client's ban in force (Unix ns by
	// Redis's clock), 0 when none; Count its number since the count decayed; Started:
	// these refusals started it; At: when they were counted (Unix ns by Redis's clock,
	// in whole ms as the script judged it), so that Until-At is the time the ban had
	// left then, no less (a ban they started: its length).
	Until   int64
	Count   uint32
	Started bool
	At      int64
	// Unsent (written by Refused): the refusals did not reach Redis, for sure (no
	// connection to it, a reply saying the script did not run, or the context ended
	// before the call was written: notWritten): the caller may send them again. Not
	// after a timeout, which may have come after the script ran: sent again, they could
	// count twice.
	Unsent bool
}

// Refused adds each refusal batch to its client's count by Redis's clock, starting a ban
// where the count reaches the policy's After, and writes what happened into rs. now is
// the caller's clock (Unix ns) when it calls: a refusal's Admit is taken as a delay from
// it, and while no reply has measured the offset ([Bans.Offset]), the first reply's Redis
// time does. The
// calls go in one pipeline. An error leaves the failed batches' results zero. The caller
// adds the bans started to the index ([Bans.Index]): on a Cluster the index is on
// another node, so it cannot be in the same script.
func (b *Bans) Refused(ctx context.Context, now int64, rs []BanRefusal) error {
	if len(rs) == 0 {
		return nil
	}
	ms := now / int64(time.Millisecond)
	calls := make([]call, len(rs))
	for i := range rs {
		r := &rs[i]
		p := r.Policy
		admit := (max(r.Admit, 0) + int64(time.Millisecond) - 1) / int64(time.Millisecond) // rounded up: never early
		calls[i] = call{keys: []string{BanKey(r.Key)}, args: []any{ms, max(r.N, 1), p.After,
			p.Within.Milliseconds(), max(p.Ban.Milliseconds(), 1), p.Factor, max(p.Max.Milliseconds(), 1), admit, b.shiftMs()}}
	}
	start := time.Now()
	run(ctx, b.rdb, banScript, calls)
	var firstErr error
	measured := false
	for i := range rs {
		r := &rs[i]
		r.Until, r.Count, r.Started, r.At, r.Unsent = 0, 0, false, 0, false
		v, err := calls[i].cmd.Int64Slice()
		if err == nil && len(v) != 4 {
			err = fmt.Errorf("ban.lua replied %d values, want 4", len(v))
		}
		if err != nil {
			r.Unsent = notRun(err) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) ||
				errors.Is(err, errNotSent) || notWritten(err)
			if firstErr == nil {
				firstErr = fmt.Errorf("ban refusals of %s: %w", plural.Count(len(rs), "key"), err)
			}
			continue
		}
		r.Until, r.Count, r.Started, r.At = v[0]*int64(time.Millisecond), uint32(v[1]), v[2] == 1, v[3]/1000*int64(time.Millisecond)
		if !measured {
			// Until Known or Lift has measured the offset, the first reply does: a caller
			// that enforces the bans these start needs it (its clock may be minutes off).
			measured = true
			if _, ok := b.Offset(); !ok {
				b.measure(now, start, v[3])
			}
		}
	}
	return firstErr
}

// Index adds bans (as Refused reported them started) to the index, where every daemon
// learns them ([Bans.Known]). It is idempotent: the caller retries what failed.
func (b *Bans) Index(ctx context.Context, bans []SharedBan) error {
	if len(bans) == 0 {
		return nil
	}
	zs := make([]redis.Z, len(bans))
	var last int64
	for i, sb := range bans {
		zs[i] = redis.Z{Score: float64(sb.Until / int64(time.Millisecond)), Member: member(int64(sb.Count), sb.Key)}
		last = max(last, sb.Until)
	}
	// The index lives until its last ban ends (and a minute more): reads drop ended
	// members, but a deployment that stops reading it (no penalty rule left) would
	// otherwise keep it for good. The ends are by Redis's clock (less any Shift), so the
	// expiry is a time, PEXPIREAT, whatever the daemon's clock says. NX gives one to an
	// index without; GT only ever lengthens it. It is never less than a minute from
	// Redis's time (as Known last measured it; before, the wall clock): bans indexed
	// late (the round retries them after an outage) may all have ended more than a minute
	// ago, and an expiry in the past deletes the index, with the live bans another
	// daemon added between the ZADD that created it and the PEXPIREAT NX.
	floor := time.Now().UnixNano() + int64(b.ShiftOf())
	if r, ok := b.redisNow(); ok {
		floor = r
	}
	at := (max(last, floor)-int64(b.ShiftOf()))/int64(time.Millisecond) + time.Minute.Milliseconds()
	pipe := b.rdb.Pipeline()
	add := pipe.ZAdd(ctx, b.index, zs...)
	pipe.Do(ctx, "PEXPIREAT", b.index, at, "NX")
	pipe.Do(ctx, "PEXPIREAT", b.index, at, "GT")
	if _, err := pipe.Exec(ctx); err != nil && add.Err() != nil {
		return fmt.Errorf("adding %s to the index %s: %w", plural.Count(len(bans), "ban"), b.index, add.Err())
	}
	return b.recheck(ctx, bans)
}

// recheck reads the ban key of each of bans, just added to the index, and drops again
// the member of a ban its key no longer holds: one lifted (Lift) after it started. A
// daemon indexes the bans it started at its next round, and a lift in between deleted
// the ban key and the index's member before Index wrote the member back: every daemon
// then learned the ban from the index and enforced it, lifted, until its end. Lift
// deletes the key before the member and recheck reads the key after writing the member,
// so whichever goes first, the member is gone after both. A key banned again since
// with the same count (the count decayed) has the same member: it gets that ban's end
// back (XX: unless a lift has dropped it meanwhile).
func (b *Bans) recheck(ctx context.Context, bans []SharedBan) error {
	pipe := b.rdb.Pipeline()
	held := make([]*redis.SliceCmd, len(bans))
	for i, sb := range bans {
		held[i] = pipe.HMGet(ctx, BanKey(sb.Key), "u", "c")
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("checking %s added to the index %s: %w", plural.Count(len(bans), "ban"), b.index, err)
	}
	fix := b.rdb.Pipeline()
	for i, sb := range bans {
		v := held[i].Val()
		var u, c int64
		if len(v) == 2 {
			if s, ok := v[0].(string); ok {
				u, _ = strconv.ParseInt(s, 10, 64)
			}
			if s, ok := v[1].(string); ok {
				c, _ = strconv.ParseInt(s, 10, 64)
			}
		}
		switch until := sb.Until / int64(time.Millisecond); {
		case c == int64(sb.Count) && u == until:
			// still the ban indexed
		case c == int64(sb.Count) && u > until:
			fix.ZAddXX(ctx, b.index, redis.Z{Score: float64(u), Member: member(c, sb.Key)})
		default:
			fix.ZRem(ctx, b.index, member(int64(sb.Count), sb.Key))
		}
	}
	if fix.Len() == 0 {
		return nil
	}
	if _, err := fix.Exec(ctx); err != nil {
		return fmt.Errorf("dropping lifted bans from the index %s: %w", b.index, err)
	}
	return nil
}

func member(count int64, key string) string { return strconv.FormatInt(count, 10) + "|" + key }

// Held reads the ban of each of keys (rule client keys) from its ban key: those that
// hold one (ended or not; Known drops the ended), for [Bans.Index]. One pipeline.
func (b *Bans) Held(ctx context.Context, keys []string) ([]SharedBan, error) {
	pipe := b.rdb.Pipeline()
	held := make([]*redis.SliceCmd, len(keys))
	for i, k := range keys {
		held[i] = pipe.HMGet(ctx, BanKey(k), "u", "c")
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("reading %s: %w", plural.Count(len(keys), "ban"), err)
	}
	var out []SharedBan
	for i, k := range keys {
		v := held[i].Val()
		if len(v) != 2 {
			continue
		}
		us, _ := v[0].(string)
		cs, _ := v[1].(string)
		u, err1 := strconv.ParseInt(us, 10, 64)
		c, err2 := strconv.ParseUint(cs, 10, 32)
		if err1 != nil || err2 != nil || u <= 0 || c == 0 {
			continue
		}
		out = append(out, SharedBan{Key: k, Until: u * int64(time.Millisecond), Count: uint32(c)})
	}
	return out, nil
}

// SharedBan is a ban in force, as [Bans.Known] lists it.
type SharedBan struct {
	Key   string // the rule's client key: <prefix><rule>:{<client>}
	Until int64  // Unix ns by Redis's clock
	Count uint32
}

// Known lists at most limit bans in force by Redis's clock from the index, latest to end
// first (past limit, the bans ending soonest are left out), and drops the index's ended
// ones. A key banned again appears once, with its latest ban. now is the caller's wall
// clock (Unix ns) when it calls: the reply's Redis time measures the offset ([Bans.Offset]).
func (b *Bans) Known(ctx context.Context, now int64, limit int) ([]SharedBan, error) {
	start := time.Now()
	calls := []call{{keys: []string{b.index}, args: []any{max(limit, 1), b.shiftMs()}}}
	run(ctx, b.rdb, banKnownScript, calls)
	v, err := calls[0].cmd.Slice()
	if err != nil {
		return nil, fmt.Errorf("reading the ban index %s: %w", b.index, err)
	}
	var (
		at int64
		zs []any
		ok = len(v) == 2
	)
	if ok {
		at, ok = v[0].(int64)
	}
	if ok {
		zs, ok = v[1].([]any)
	}
	if !ok || len(zs)%2 != 0 {
		// Its shape only: the reply holds the client key of every ban in force, and this
		// error is logged.
		return nil, fmt.Errorf("reading the ban index %s: ban_known.lua replied %s, want {now_us, {member, score, ...}}", b.index, replyShape(v))
	}
	b.measure(now, start, at)
	latest := map[string]int{}
	var out []SharedBan
	for i := 0; i < len(zs); i += 2 {
		m, _ := zs[i].(string)
		sc, _ := zs[i+1].(string)
		score, err := strconv.ParseFloat(sc, 64)
		if err != nil {
			continue // not a score
		}
		cs, key, ok := strings.Cut(m, "|")
		n, err := strconv.ParseUint(cs, 10, 32)
		if !ok || err != nil {
			continue // not ours
		}
		if i := strings.IndexByte(key, '{'); i < 1 || key[i-1] != ':' {
			continue // not ours
		}
		key = BanIdentity(key) // a member an earlier version indexed under the rule's fingerprint
		sb := SharedBan{Key: key, Until: int64(score) * int64(time.Millisecond), Count: uint32(n)}
		if j, seen := latest[key]; seen {
			if sb.Until > out[j].Until {
				out[j] = sb
			}
			continue
		}
		latest[key] = len(out)
		out = append(out, sb)
	}
	return out, nil
}

// Lift ends the ban of key (a rule's client key) and forgets its refusals and bans, in
// Redis: every daemon stops enforcing it at its next read of the index (global checks at
// once). It reports whether key was banned, by Redis's clock. now is the caller's wall
// clock (Unix ns) when it calls: the reply's Redis time measures the offset.
func (b *Bans) Lift(ctx context.Context, now int64, key string) (bool, error) {
	return b.lift(ctx, now, key, false)
}

// LiftBanned is Lift of a ban in force only: a key that holds none, by Redis's clock, is
// left as it is (its refusals and count kept) and LiftBanned reports false. For a lift
// asked of a client the caller does not know to be banned (no read of the index listed
// it), which may name another client than the one meant.
func (b *Bans) LiftBanned(ctx context.Context, now int64, key string) (bool, error) {
	return b.lift(ctx, now, key, true)
}

func (b *Bans) lift(ctx context.Context, now int64, key string, onlyBanned bool) (bool, error) {
	start := time.Now()
	calls := []call{{keys: []string{BanKey(key)}, args: []any{b.shiftMs(), b01(onlyBanned)}}}
	run(ctx, b.rdb, banLiftScript, calls)
	v, err := calls[0].cmd.Int64Slice()
	if err == nil && len(v) != 3 {
		err = fmt.Errorf("ban_lift.lua replied %d values, want 3", len(v))
	}
	if err != nil {
		return false, fmt.Errorf("lifting the ban of %s: %w", key, err)
	}
	b.measure(now, start, v[2])
	was := v[0] > v[2]/int64(time.Millisecond/time.Microsecond)
	if onlyBanned && !was {
		return false, nil // nothing deleted
	}
	if c := v[1]; c > 0 {
		if err := b.rdb.ZRem(ctx, b.index, member(c, key)).Err(); err != nil {
			return false, fmt.Errorf("lifting the ban of %s from the index: %w", key, err)
		}
		return was, nil
	}
	// No ban key: no ban, or a lift whose removal from the index failed after it deleted
	// the key (the index is on another slot, on a Cluster another master, which may be
	// down or failing over). The member's name holds the ban's count, which went with the
	// key: find the index's members of key by scanning. Before, a lift tried again after
	// such a failure left the member, answered as done, and every daemon read the ban
	// back from the index at its next round and enforced it until its end.
	if err := b.unindex(ctx, key); err != nil {
		return false, fmt.Errorf("lifting the ban of %s from the index: %w", key, err)
	}
	return was, nil
}

// replyShape describes a script's reply by its types and lengths, naming none of its
// values (members of the bans' index are client keys).
func replyShape(v []any) string {
	parts := make([]string, len(v))
	for i, x := range v {
		if a, ok := x.([]any); ok {
			parts[i] = fmt.Sprintf("array of %d", len(a))
		} else {
			parts[i] = fmt.Sprintf("%T", x)
		}
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

// unindex removes from the index every member of key, whatever its count.
func (b *Bans) unindex(ctx context.Context, key string) error {
	var stale []any
	var cursor uint64
	match := "*|" + globEscape(key)
	for {
		ms, next, err := b.rdb.ZScan(ctx, b.index, cursor, match, 1000).Result()
		if err != nil {
			return err
		}
		for i := 0; i < len(ms); i += 2 { // member, score
			if cs, k, ok := strings.Cut(ms[i], "|"); ok && k == key {
				if _, err := strconv.ParseUint(cs, 10, 32); err == nil {
					stale = append(stale, ms[i])
				}
			}
		}
		if cursor = next; cursor == 0 {
			break
		}
	}
	if len(stale) == 0 {
		return nil
	}
	return b.rdb.ZRem(ctx, b.index, stale...).Err()
}

// globEscape escapes s for a Redis MATCH pattern: every byte taken literally.
func globEscape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '*', '?', '[', ']', '\\':
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
