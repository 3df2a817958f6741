package limiter

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"hash/maphash"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// globalLeaseStore is the store of concurrency rules in global mode: their slots are
// members of Redis sorted sets (rlsync.LeaseCheck and Global.Acquire, taken by
// sync/scripts/global.lua; released, renewed and queried by sync/scripts/lease.lua), so
// the max holds across every daemon on one Redis. Its take acquires one slot in each op
// of the check, all-or-nothing, as one global lease: a random id, and the parts (rule and
// client of each op) that any daemon needs to find its members again, all encoded in the
// lease's token (globalToken). When the check has global rate rules too, the global
// store (which apply visits first) decides the slots in its own Check, with them: one
// script call per hash slot for both; take then only keeps the lease (leaseBatch).
// giveBack releases it when a later store refuses the request. A take waits at most wait; past it, or on any Redis error, the ops' failure
// policies decide (open: allowed, no slot held; closed: refused; local: a local lease).
//
// The daemon that acquired a lease tracks it in ls (by owner, for the connection-close
// release, and in its rules' LeaseStats); its Redis state is what counts. This file is
// the only one calling rlsync.Global's lease methods.
type globalLeaseStore struct {
	g    *rlsync.Global
	wait time.Duration
	ls   *Leases
	lim  *Limiter
	// names indexes the current rule set's global concurrency rules by name, for
	// decoding tokens; rebuilt when the set changes.
	names atomic.Pointer[ruleNames]
	// relieving and relieved throttle relieve: one at a time, at most one per
	// relieveEvery (relieved is the limiter's clock at the last).
	relieving atomic.Bool
	relieved  atomic.Int64
	// reaped throttles reapGone: by a hash of the key (reapBucket), the limiter's clock
	// when it last found none of its holders gone.
	reaped [reapBuckets]atomic.Int64
	// freed counts, by a hash of the key (reapBucket), the releases of leases this
	// daemon no longer tracks (releaseAll) that freed a slot there: a check refused
	// on a key whose count moved while it was asked asks again (reapGone).
	freed [reapBuckets]atomic.Uint64
}

// ruleNames is the global concurrency rules of one rule set, by name.
type ruleNames struct {
	set    *rules.Set
	byName map[string]*rules.Rule
}

// globalLease is a global lease this daemon acquired and has not seen freed.
type globalLease struct {
	id      string // the Redis member prefix: lease.lua's members are "<id>:<part>"
	token   string
	owner   uint64
	parts   []rlsync.LeasePart
	stats   []*LeaseStats // per part
	expires int64         // this daemon's clock: when the first part expires, as last known
	// unreleased marks a lease given up (released by its holder, or its connection
	// closed) whose release Redis did not answer: the sweep sends it again (a release
	// only removes the lease's members, so sending it twice frees nothing more).
	unreleased bool
	// partFreed: a release of an unreleased lease freed a live part of it (on a Cluster,
	// the parts on the masters that answered): it is counted as freed when the rest is
	// settled, whatever Redis says of the rest then.
	partFreed bool
	// sentUnsure: a release of it (its holder's, or its connection's close) went
	// unanswered after it may have reached Redis (rlsync.MayHaveRun), which then ran it
	// in most cases (a Redis frozen a moment runs what it was sent once thawed): a later
	// release, or query, that finds it gone counts it as that release would have, as
	// expired when it had run out by then (sentLate) as this daemon knew (goneCount).
	// Before, it was counted nowhere: rlsidecar_leases_total lost a lease per release
	// that a frozen Redis ran late.
	sentUnsure, sentLate bool
	// sentClosed: that release was its connection's close's (or the sweep's, sent again
	// after it), not its holder's. Set with sentUnsure, as the lease's owner is not: a
	// close after an unsure release by its holder leaves it ownerless (retrack), and it
	// was counted closed, though the holder's release, which Redis ran first, freed it.
	sentClosed bool
}

// leaseIDBytes is the size of a global lease's random id: unguessable, so that a token
// cannot be forged to release another client's lease.
const leaseIDBytes = 12

// maxLeaseParts bounds the parts a global token may name (a check's concurrency rules).
const maxLeaseParts = 64

// maxPartNumber bounds a part's number in a version 2 token (the op's place among the
// check's concurrency ops, some of which hold nothing).
const maxPartNumber = 1<<16 - 1

// globalTokenPrefix starts a global lease's token; a local token starts with hex digits.
const globalTokenPrefix = 'g'

// leaseBatch is the store's batch of one check, kept in the Decision (its scratch): the
// lease ops and the lease's id (prepare), and, when the global store decided them in its
// own Check (combined, read and cleared by take or skip), the outcome.
type leaseBatch struct {
	native[rlsync.LeaseOp]
	raw      [leaseIDBytes]byte
	id       string
	combined bool     // decided by the global store's call: take and skip call no Redis
	freedAt  []uint64 // per op: its key's freed count (globalLeaseStore.freed) before it was asked
	capped   bool     // the daemon holds the most live leases it keeps: refused as full, unasked
	err      error    // prepare's error, or the combined call's
}

// leaseBatchOf returns d's lease batch, created on first use.
func leaseBatchOf(d *Decision) *leaseBatch {
	lb, _ := d.scratch[storeGlobalLease].(*leaseBatch)
	if lb == nil {
		lb = new(leaseBatch)
		d.scratch[storeGlobalLease] = lb
	}
	return lb
}

// prepare builds d's lease batch: one op per op routed here, and a fresh random id. Its
// err is errTokenTooLong when the lease's token would be too long: nothing to ask Redis.
// It is capped when the lease would take a slot and the daemon holds the most live
// leases it keeps (Leases.SetMax, local and global together): nothing to ask Redis
// either, the ops are refused as full (capped).
func (s *globalLeaseStore) prepare(now int64, d *Decision) *leaseBatch {
	lb := leaseBatchOf(d)
	lb.ops, lb.at, lb.combined, lb.capped, lb.err = lb.ops[:0], lb.at[:0], false, false, nil
	takes := false
	for i := range d.ops {
		o := &d.ops[i]
		if o.store != storeGlobalLease {
			continue
		}
		lb.ops = append(lb.ops, rlsync.LeaseOp{Key: string(o.key), Part: len(lb.ops), Max: o.lim.Requests(),
			Lease: o.lim.Window(), Take: o.cost > 0, Shadow: o.shadow})
		lb.at = append(lb.at, i)
		takes = takes || o.cost > 0
	}
	if takes && s.ls.full() && !(s.relieve(now) && !s.ls.full()) {
		lb.capped = true
		return lb
	}
	if s.tokenLen(d, &lb.native) > maxGlobalToken {
		lb.err = errTokenTooLong
		return lb
	}
	_, _ = rand.Read(lb.raw[:]) // never fails (crypto/rand)
	lb.id = base64.RawURLEncoding.EncodeToString(lb.raw[:])
	return lb
}

// take acquires the check's lease: in its own call, or, when the global store's Check
// has decided it with the check's global rate rules (combined), from that outcome (that
// Check passed, or take would not be called).
func (s *globalLeaseStore) take(now int64, d *Decision) (bool, error) {
	lb := leaseBatchOf(d)
	if lb.combined {
		lb.combined = false
		if lb.capped {
			return s.refuseCapped(d, lb), nil
		}
		if lb.err != nil {
			return false, lb.err
		}
		return s.hold(now, d, lb, true), nil
	}
	lb = s.prepare(now, d)
	if lb.capped {
		return s.refuseCapped(d, lb), nil
	}
	if lb.err != nil {
		return false, lb.err
	}
	lb.freedAt = lb.freedAt[:0]
	for k := range lb.ops {
		lb.freedAt = append(lb.freedAt, s.freed[reapBucket(lb.ops[k].Key)].Load())
	}
	ctx, cancel := context.WithTimeout(d.queuedCtx(), s.wait)
	ok, err := s.g.Acquire(ctx, lb.id, lb.ops)
	cancel()
	if err == nil && !ok && s.reapGone(now, d, lb) {
		// Full, but this daemon freed slots of it held by closed connections: once more,
		// under a fresh id (the refused call held nothing).
		_, _ = rand.Read(lb.raw[:])
		lb.id = base64.RawURLEncoding.EncodeToString(lb.raw[:])
		ctx, cancel := context.WithTimeout(d.queuedCtx(), s.wait)
		ok, err = s.g.Acquire(ctx, lb.id, lb.ops)
		cancel()
	}
	if err != nil {
		return false, err
	}
	return s.hold(now, d, lb, ok), nil
}

// reapGone is for a check of lb refused by Redis, and reports whether this daemon has
// since freed slots of the keys that refused it (full), in which case the check asks
// again. A client that closes a connection holding every slot of a key and checks at
// once on another found them still held in a share of rounds (145 of 1,000 on a
// concurrency rule of max 2, the rule in Redis): the daemon sees the close tens of
// microseconds later, and its release of the connection's leases reaches Redis a round
// trip after that. So reapGone waits for the releases of those keys under way
// (takeOwnerGlobal, releaseAll), and frees in Redis, as their close would (releaseAll,
// counted closed), the global leases this daemon tracks of the owners holding slots of
// those keys whose connections their clients have closed (Leases.SetGlobalOwnerGone).
// A key whose owners it asked about and found none gone is not asked about again for
// reapGoneEvery (one throttle per hash bucket of the keys), so that a flood of refused
// checks on a full key does not poll its holders each time. Nothing is asked of Redis,
// and no wait made, unless a release is under way or a holder is gone.
func (s *globalLeaseStore) reapGone(now int64, d *Decision, lb *leaseBatch) bool {
	var keys [4]string
	var poll [4]bool
	var buckets [4]*atomic.Int64
	var bucket [4]uint64
	var freedAt [4]uint64
	n, freed := 0, false
	for k := range lb.ops {
		lo := &lb.ops[k]
		if lo.Allowed || !lo.Take || lo.Shadow || n == len(keys) {
			continue
		}
		i := reapBucket(lo.Key)
		b := &s.reaped[i]
		last := b.Load()
		keys[n], poll[n], buckets[n] = lo.Key, last == 0 || now-last >= int64(reapGoneEvery), b
		bucket[n], freedAt[n] = i, lb.freedAt[k]
		n++
	}
	if n == 0 {
		return false
	}
	waits, gls, gr := s.ls.reapGoneGlobal(keys[:n], poll[:n], d.Owner)
	// A release of a slot of these keys ended while the check was asked: it may have
	// reached Redis after the check. Read after reapGoneGlobal, which no longer lists a
	// release that has ended: a release counts its freed slots before it ends
	// (releaseAll, endRelease), so one ended since the check was asked is seen here, and
	// one not ended is among waits. Before, the counts were read first, and a release
	// that ended between that read and reapGoneGlobal was seen by neither: the check was
	// refused though its slots were free (TestE2EGlobalLeaseFreedByCloseBeforeTheNextCheck,
	// 1 of 1,000 rounds in 4 of 24 runs under -race).
	for j := range n {
		freed = freed || s.freed[bucket[j]].Load() != freedAt[j]
	}
	if len(gls) > 0 {
		freed = s.releaseAll(gls, gr, now) > 0 || freed
	} else {
		for i, b := range buckets[:n] {
			if poll[i] {
				b.Store(now)
			}
		}
	}
	if len(waits) > 0 {
		ctx, cancel := context.WithTimeout(d.queuedCtx(), s.wait)
		defer cancel()
		for _, w := range waits {
			select {
			case <-w.done:
				freed = freed || w.freed
			case <-ctx.Done():
				return freed
			}
		}
	}
	return freed
}

// reapGoneEvery is how long after finding no holder of a full key gone a refused check
// does not ask about that key's holders again (reapGone): as for the local leases
// (goneAskEvery), far shorter than a client's round trip from a refusal to a close and
// a check on another connection, which must find the closed holder gone.
const reapGoneEvery = goneAskEvery

// reapBuckets is the number of reapGone's throttles and freed counts.
const reapBuckets = 64

// reapSeed hashes keys to their reapGone throttle and freed count.
var reapSeed = maphash.MakeSeed()

// reapBucket returns key's reapGone throttle and freed count.
func reapBucket(key string) uint64 { return maphash.String(reapSeed, key) % reapBuckets }

// relieve is for a daemon at the bound on live leases: it asks Redis about up to maxDue
// of the global leases it tracks, whatever their expiry (the sweep asks only about those
// due), and forgets those gone, released through another daemon, which this daemon
// cannot otherwise know before they are due: they would hold the bound. At most one at
// a time and one per relieveEvery; it reports whether it ran.
func (s *globalLeaseStore) relieve(now int64) bool {
	if last := s.relieved.Load(); last != 0 && now-last < int64(relieveEvery) {
		return false
	}
	if !s.relieving.CompareAndSwap(false, true) {
		return false
	}
	defer s.relieving.Store(false)
	s.relieved.Store(now)
	some := s.ls.someGlobal(maxDue)
	if len(some) == 0 {
		return true
	}
	ctx, cancel := context.WithTimeout(context.Background(), max(s.wait, rlsync.DefaultRefundTimeout))
	defer cancel()
	ids, parts := leaseParts(some)
	st, err := s.g.LeaseStates(ctx, ids, parts)
	if err != nil {
		return true
	}
	for i, gl := range some {
		if st[i].Err == nil {
			s.ls.settleGlobal(gl, now, st[i].Left, st[i].Present)
		}
	}
	return true
}

// relieveEvery bounds how often relieve asks Redis.
const relieveEvery = 250 * time.Millisecond

// refuseCapped reports lb's ops refused as full, as the local store does at the bound on
// live leases (nothing was asked of Redis, nothing is held), counts the check capped,
// and reports whether the request may still pass: only when every op is a shadow.
func (s *globalLeaseStore) refuseCapped(d *Decision, lb *leaseBatch) bool {
	s.ls.countCapped()
	ok := true
	for k, i := range lb.at {
		lo := &lb.ops[k]
		d.report(i, &localbucket.Result{Limit: lo.Max, RetryAfter: int64(maxRetryHint), Reset: int64(maxRetryHint)})
		ok = ok && lo.Shadow
	}
	return ok
}

// hold reports the results of lb, decided with outcome ok, and when ok and it holds a
// slot, makes it d's global lease: its token, tracked in ls. It returns ok.
func (s *globalLeaseStore) hold(now int64, d *Decision, lb *leaseBatch, ok bool) bool {
	held := 0
	for k, i := range lb.at {
		lo := &lb.ops[k]
		r := localbucket.Result{Allowed: lo.Allowed, Limit: lo.Max, Remaining: lo.Remaining}
		if !lo.Allowed {
			r.RetryAfter, r.Reset = int64(lo.RetryAfter), int64(lo.RetryAfter)
		}
		d.report(i, &r)
		if ok && lo.Allowed && lo.Take {
			held++
		}
	}
	if !ok || held == 0 {
		return ok
	}
	gl := &globalLease{id: lb.id, owner: d.Owner, expires: -1}
	// Version 1 numbers the parts by their place in the token; when an op held nothing
	// (a full shadow rule) the parts after it are numbered otherwise in Redis, and the
	// token is version 2, which writes each part's number.
	version, p := byte(tokenV1), 0
	for k := range lb.at {
		if lo := &lb.ops[k]; lo.Allowed && lo.Take {
			if lo.Part != p {
				version = tokenV2
			}
			p++
		}
	}
	var buf []byte
	buf = append(buf, version)
	buf = append(buf, lb.raw[:]...)
	buf = append(buf, byte(held))
	for k, i := range lb.at {
		lo := &lb.ops[k]
		if !lo.Allowed || !lo.Take {
			continue
		}
		rule := d.Results[i].Rule
		client := s.clientOf(lo.Key, rule)
		if version == tokenV2 {
			buf = binary.AppendUvarint(buf, uint64(lo.Part))
		}
		buf = binary.AppendUvarint(buf, uint64(len(rule.Name)))
		buf = append(buf, rule.Name...)
		buf = binary.AppendUvarint(buf, uint64(len(client)))
		buf = append(buf, client...)
		gl.parts = append(gl.parts, rlsync.LeasePart{Key: lo.Key, Part: lo.Part, Lease: lo.Lease})
		if e := now + int64(lo.Lease); gl.expires < 0 || e < gl.expires {
			gl.expires = e
		}
	}
	gl.token = string(globalTokenPrefix) + base64.RawURLEncoding.EncodeToString(buf)
	s.ls.track(gl, func(p int) string { return d.Results[lb.at[p]].Name }, lb.ops)
	d.globalLease = gl
	return true
}

// The versions of a global token (its first byte). Version 1: the lease id, the number
// of parts, and each part's rule and client, the parts numbered 0, 1, ... in their
// order (their members in Redis are "<id>:<part>"). Version 2: the same, each part's
// number written before its rule, for a lease whose parts are not numbered so (a
// check's op that held no slot, a full shadow rule, has a number too). A daemon writes
// version 1 whenever it can, so that daemons of before version 2 read its tokens.
const (
	tokenV1 = 1
	tokenV2 = 2
)

// maxGlobalToken bounds a global lease's token: what a release or renew request may
// carry (proto.MaxLeaseLen), less room for a local token joined to it.
const maxGlobalToken = proto.MaxLeaseLen - 64

// errTokenTooLong makes a check whose global lease's token would be too long (its
// client keys are) fall to its rules' on_store_failure, as if Redis could not decide.
var errTokenTooLong = errors.New("global lease: client keys too long for a lease token")

// tokenLen returns the length of the token of a lease taking every op of n that takes.
func (s *globalLeaseStore) tokenLen(d *Decision, n *native[rlsync.LeaseOp]) int {
	raw := 2 + leaseIDBytes
	for k, i := range n.at {
		if lo := &n.ops[k]; lo.Take {
			name := len(d.Results[i].Rule.Name)
			client := len(lo.Key) - len(s.lim.prefix) - name - 3
			raw += 3*binary.MaxVarintLen16 + name + client // a part's number (version 2), name and client lengths
		}
	}
	return 1 + base64.RawURLEncoding.EncodedLen(raw)
}

// clientOf returns the client part of key, a concurrency rule's Redis key: what is
// between the braces of prefix + rule + ":{" + client + "}".
func (s *globalLeaseStore) clientOf(key string, r *rules.Rule) string {
	return key[len(s.lim.prefix)+len(r.Name)+2 : len(key)-1]
}

func (s *globalLeaseStore) giveBack(now int64, d *Decision) {
	gl := d.globalLease
	n := leaseBatchOf(d)
	for k, i := range n.at {
		if lo := &n.ops[k]; lo.Allowed && lo.Take {
			d.Results[i].Remaining++
		}
	}
	if gl == nil {
		return
	}
	d.globalLease = nil
	s.ls.untrack(gl, nil)
	ctx, cancel := context.WithTimeout(context.Background(), rlsync.DefaultRefundTimeout)
	defer cancel()
	_, _ = s.g.Release(ctx, gl.id, gl.parts) // failed: the slots expire after their lease
}

// skip asks Redis nothing (its ops are reported as unasked: Result.Unasked), unless the
// global store's call decided the batch with the rate rules that refused the request:
// then it reports them (nothing is held: that call was all-or-nothing).
func (s *globalLeaseStore) skip(now int64, d *Decision) {
	lb := leaseBatchOf(d)
	if lb.combined && lb.err == nil && !lb.capped {
		s.hold(now, d, lb, false)
	} else {
		d.markUnasked(storeGlobalLease)
	}
	lb.combined = false
}

// decodeGlobal returns the lease of a global token, its parts rebuilt from the current
// rule set: ok false when the token is not well formed, names more parts than a lease
// has, or names a rule that is not a concurrency rule in global mode, or a client that
// is not an escaped client key. So a forged token can only address the sorted set of a
// global concurrency rule, inside its hash tag.
func (s *globalLeaseStore) decodeGlobal(token string) (id string, parts []rlsync.LeasePart, rs []*rules.Rule, ok bool) {
	if len(token) < 2 || token[0] != globalTokenPrefix || len(token) > proto.MaxLeaseLen {
		return "", nil, nil, false
	}
	raw, ok := decodeTokenBody(token[1:])
	if !ok || len(raw) < 2+leaseIDBytes || (raw[0] != tokenV1 && raw[0] != tokenV2) {
		return "", nil, nil, false
	}
	numbered := raw[0] == tokenV2
	id = base64.RawURLEncoding.EncodeToString(raw[1 : 1+leaseIDBytes])
	np := int(raw[1+leaseIDBytes])
	rest := raw[2+leaseIDBytes:]
	if np == 0 || np > maxLeaseParts {
		return "", nil, nil, false
	}
	next := func() (string, bool) {
		n, w := binary.Uvarint(rest)
		if w <= 0 || n > uint64(len(rest)-w) {
			return "", false
		}
		v := string(rest[w : w+int(n)])
		rest = rest[w+int(n):]
		return v, true
	}
	byName := s.globalRules()
	part := -1
	for p := range np {
		if !numbered {
			part = p
		} else {
			// Numbers rise (each part its own member), within a check's ops.
			n, w := binary.Uvarint(rest)
			if w <= 0 || n > maxPartNumber || int(n) <= part {
				return "", nil, nil, false
			}
			part, rest = int(n), rest[w:]
		}
		name, ok1 := next()
		client, ok2 := next()
		if !ok1 || !ok2 || !validClient(client) {
			return "", nil, nil, false
		}
		r := byName[name]
		if r == nil {
			return "", nil, nil, false
		}
		parts = append(parts, rlsync.LeasePart{Key: s.lim.prefix + r.Name + ":{" + client + "}", Part: part, Lease: r.Per})
		rs = append(rs, r)
	}
	if len(rest) != 0 {
		return "", nil, nil, false
	}
	return id, parts, rs, true
}

// globalRules returns the current rule set's concurrency rules in global mode, by name.
func (s *globalLeaseStore) globalRules() map[string]*rules.Rule {
	set := s.lim.Rules()
	if n := s.names.Load(); n != nil && n.set == set {
		return n.byName
	}
	n := &ruleNames{set: set, byName: map[string]*rules.Rule{}}
	for _, r := range set.Rules {
		if r.Concurrency && s.lim.ModeOf(r) == rules.ModeGlobal {
			n.byName[r.Name] = r
		}
	}
	s.names.Store(n)
	return n.byName
}

// validClient reports whether c could be a rule's client key (rules.Rule.AppendKey):
// name=value pairs joined by '|', the values escaped (rules.AppendEscaped). Above all
// it has no brace, so it stays inside its hash tag.
func validClient(c string) bool {
	if c == "" {
		return false
	}
	for i := 0; i < len(c); i++ {
		if !clientByte[c[i]] {
			return false
		}
	}
	return true
}

var clientByte = func() (t [256]bool) {
	for _, c := range "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~:@/+%|=" {
		t[c] = true
	}
	return t
}()

// release frees the global lease of token through Redis, whichever daemon acquired it.
// A lease this daemon acquired and still tracks is released by the parts it was taken
// with when its token no longer decodes: a reload has since removed its rule, renamed it
// or made it local, and its slots are still held in Redis. Refused, the release left
// them held until their lease ran out (and counted expired), in the rule's sorted set
// that a reload putting the rule back reads again.
func (s *globalLeaseStore) release(token string, now int64) (bool, error) {
	id, parts, rs, ok := s.decodeGlobal(token)
	if !ok {
		gl := s.ls.trackedGlobal(token)
		if gl == nil {
			return false, nil
		}
		id, parts = gl.id, gl.parts
	}
	ctx, cancel := context.WithTimeout(context.Background(), max(s.wait, rlsync.DefaultRefundTimeout))
	defer cancel()
	freed, err := s.g.Release(ctx, id, parts)
	if err != nil {
		// Its holder is done with it: if this daemon tracks it, the sweep sends the
		// release again once Redis answers (else it expires after its lease).
		s.ls.markUnreleased(s.ls.trackedGlobal(token), freed, rlsync.MayHaveRun(err), now)
		return false, err
	}
	s.ls.releasedGlobal(id, rs, freed, now)
	return freed, nil
}

// renew extends the global lease of token (d 0: each rule's own lease). A lease this
// daemon tracks whose token no longer decodes (release says when) is renewed by the
// parts it was taken with, d 0 giving each the lease it was taken for: while its request
// runs it holds its slots, in case a reload puts its rule back.
func (s *globalLeaseStore) renew(token string, d time.Duration, now int64) (bool, time.Duration) {
	id, parts, _, ok := s.decodeGlobal(token)
	if !ok {
		gl := s.ls.trackedGlobal(token)
		if gl == nil {
			return false, 0
		}
		id, parts = gl.id, slices.Clone(gl.parts) // the copy's Lease may change below
	}
	if d > 0 {
		for i := range parts {
			parts[i].Lease = d
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), max(s.wait, rlsync.DefaultRefundTimeout))
	defer cancel()
	renewed, in, err := s.g.Renew(ctx, id, parts)
	if err != nil || !renewed {
		return false, 0
	}
	s.ls.renewedGlobal(id, now+int64(in))
	return true, in
}

// releaseAll frees the global leases gls (a closed connection's, no longer tracked) in
// Redis, on one bounded context, counts those it freed as closed, those Redis held
// expired as expired (the others were released through another daemon), and reports
// how many it freed. When
// Redis failed, those it did not free may still hold their slots: they are tracked
// again, ownerless and marked unreleased, so the sweep sends their release again.
func (s *globalLeaseStore) releaseAll(gls []*globalLease, gr *globalRelease, now int64) int {
	ctx, cancel := context.WithTimeout(context.Background(), closeReleaseWait)
	defer cancel()
	ids, parts := leaseParts(gls)
	rs, _ := s.g.ReleaseAll(ctx, ids, parts)
	n, freed := 0, false
	for i, r := range rs {
		switch {
		case r.Failed:
			// A part Redis did not answer for may still hold its slot, though others
			// were freed (a Cluster, one master away): the sweep releases it again.
			// Before, a part freed counted the lease closed and forgot it, and the
			// part left held its slot for the whole lease
			// (TestGlobalLeasePartlyReleasedOnClusterReleasedBySweep).
			s.ls.retrack(gls[i], r.Freed, r.Unsure, now)
			if r.Freed {
				freed = true
				for _, p := range gls[i].parts {
					s.freed[reapBucket(p.Key)].Add(1) // one part freed: which is not known
				}
			}
		case r.Freed:
			n++
			s.ls.countGlobal(gls[i], func(st *LeaseStats) { st.Closed++ })
			for _, p := range gls[i].parts {
				s.freed[reapBucket(p.Key)].Add(1)
			}
		case r.Expired:
			// Redis held it expired: it ran out unreleased (a renewal through another
			// daemon would have kept it, and it would be freed). One not there was
			// released through another daemon, which counted it: before, one past its
			// expiry as this daemon knew it was counted expired here too.
			s.ls.countGlobal(gls[i], func(st *LeaseStats) { st.Expired++ })
		default:
			// Gone: released through another daemon, which counted it, or by a release
			// of this daemon's that Redis ran after it went unanswered (goneCount).
			s.ls.countGone(gls[i])
		}
	}
	s.ls.endRelease(gr, gls, n > 0 || freed)
	return n
}

// leaseParts lists gls's tokens and parts, as rlsync.Global's lease queries take them.
func leaseParts(gls []*globalLease) ([]string, [][]rlsync.LeasePart) {
	ids := make([]string, len(gls))
	parts := make([][]rlsync.LeasePart, len(gls))
	for i, gl := range gls {
		ids[i], parts[i] = gl.id, gl.parts
	}
	return ids, parts
}

// closeReleaseWait bounds the release of a closed connection's global leases.
const closeReleaseWait = time.Second

// sweep asks Redis about the tracked global leases whose first part is due by now: a
// part still there and expired is counted expired (the leak signal), one renewed
// through another daemon stays tracked, one gone was released through another daemon.
func (s *globalLeaseStore) sweep(now int64) int {
	s.releaseAgain(now)
	due := s.ls.dueGlobal(now)
	if len(due) == 0 {
		return 0
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeReleaseWait)
	defer cancel()
	ids, parts := leaseParts(due)
	st, err := s.g.LeaseStates(ctx, ids, parts) // one pipeline
	n := 0
	for i, gl := range due {
		if err != nil || st[i].Err != nil {
			if now-gl.expires > int64(rlsync.LeaseGrace) {
				s.ls.untrack(gl, nil) // Redis has dropped it by now, whatever it was
			}
			continue
		}
		n += s.ls.settleGlobal(gl, now, st[i].Left, st[i].Present)
	}
	return n
}

// releaseAgain sends again the releases of the tracked global leases given up while
// Redis did not answer (unreleased: their holder released them, or their connection
// closed, during an outage or a Cluster failover), at most maxDue of them, in one
// pipeline on a bounded context. A lease freed is counted as its first release would
// have been (closed when it has no owner left, else released); one Redis holds run out
// is forgotten, counted expired; one it no longer holds (released through another
// daemon, or dropped) is forgotten uncounted; one Redis still does not answer for stays
// marked, until Redis has dropped it whatever it was. Before, such a lease held its
// slots for its whole lease: a client of a concurrency rule refused, not degraded, long
// after Redis was back.
func (s *globalLeaseStore) releaseAgain(now int64) {
	gls := s.ls.unreleasedGlobal()
	if len(gls) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeReleaseWait)
	defer cancel()
	ids, parts := leaseParts(gls)
	rs, _ := s.g.ReleaseAll(ctx, ids, parts)
	for i, gl := range gls {
		r := rs[i]
		if r.Failed {
			// A part still unanswered (the others may have been freed): sent again
			// at the next sweep, until Redis has dropped it whatever it was.
			if s.ls.markUnreleased(gl, r.Freed, r.Unsure, now) && now-gl.expires > int64(rlsync.LeaseGrace) {
				s.ls.untrackReleasedIf(gl)
			}
			continue
		}
		switch {
		case r.Freed || s.ls.freedPart(gl):
			s.ls.untrackReleased(gl)
		case r.Expired:
			s.ls.untrack(gl, func(st *LeaseStats) { st.Expired++ }) // Redis held it run out
		default:
			s.ls.untrackGone(gl)
		}
	}
}

// LeaseToken returns the opaque token of the lease d's allowed check took: "" when it
// took none. A check that matched both local and global concurrency rules holds a lease
// of each, joined in one token.
func (l *Limiter) LeaseToken(d *Decision) string {
	if d.globalLease == nil && d.Lease == 0 {
		return ""
	}
	if d.Lease == 0 {
		return d.globalLease.token
	}
	var b [tokenMaxLen]byte
	return string(l.AppendLeaseToken(b[:0], d))
}

// TookLease reports whether d's allowed check took a lease (LeaseToken is not "").
func (d *Decision) TookLease() bool { return d.Lease != 0 || d.globalLease != nil }

// AppendLeaseToken appends LeaseToken(d) to dst and returns it: without allocating for a
// local lease, into a buffer of tokenMaxLen bytes (LeaseTokenMaxLen).
func (l *Limiter) AppendLeaseToken(dst []byte, d *Decision) []byte {
	if d.Lease != 0 {
		dst = l.leases.AppendToken(dst, d.Lease)
		if d.globalLease != nil {
			dst = append(dst, tokenJoin...)
		}
	}
	if d.globalLease != nil {
		dst = append(dst, d.globalLease.token...)
	}
	return dst
}

// LeaseTokenMaxLen is the longest token of a local lease alone (AppendLeaseToken).
const LeaseTokenMaxLen = tokenMaxLen

// tokenJoin joins a local and a global token; neither contains it.
const tokenJoin = "~"

func splitToken(token string) (local, global string) {
	if i := strings.IndexByte(token, tokenJoin[0]); i >= 0 {
		return token[:i], token[i+1:]
	}
	if len(token) > 0 && token[0] == globalTokenPrefix {
		return "", token
	}
	return token, ""
}

// LeaseWaits reports whether releasing or renewing the lease of token goes to Redis (it
// has a global part and this limiter has a global store): the caller then does it off
// its fast path, as a global check. Without allocation; a local token is false.
func (l *Limiter) LeaseWaits(token string) bool {
	_, global := splitToken(token)
	return global != "" && l.global != nil
}

// AppendLeaseKeyHashes appends to dst the hash under seed of each key the lease of token
// holds a slot of (its local part's live slots, its global part's keys), as
// Decision.AppendKeyHashes hashes a check's keys, and returns it (nothing for a token that
// does not decode): the daemon orders a pipelined release or renew with the checks of
// those keys around it.
func (l *Limiter) AppendLeaseKeyHashes(dst []uint64, token string, seed maphash.Seed) []uint64 {
	local, global := splitToken(token)
	if local != "" {
		dst = l.leases.appendKeyHashes(dst, local, seed)
	}
	if global == "" || l.global == nil {
		return dst
	}
	if _, parts, _, ok := l.global.decodeGlobal(global); ok {
		for i := range parts {
			dst = append(dst, maphash.String(seed, parts[i].Key)|1) // in Redis (KeyInRedis)
		}
	}
	return dst
}

// ReleaseLease frees the lease of token (Limiter.LeaseToken) and reports whether it
// freed its slots: false when it is unknown, expired, already released, forged, or its
// global part could not reach Redis (it then expires after its lease, or goes when its
// connection closes). A global lease is released through any daemon on the same Redis.
// A lease with a local and a global part whose global part could not reach Redis
// answers false, its local part freed all the same, so that the client may release it
// again (which frees the global part alone); before, it answered true, its global slot
// still held.
func (l *Limiter) ReleaseLease(token string, now int64) bool {
	local, global := splitToken(token)
	freed := false
	if local != "" {
		freed = l.leases.Release(local, now)
	}
	if global != "" && l.global != nil {
		ok, err := l.global.release(global, now)
		if err != nil {
			return false
		}
		freed = ok || freed
	}
	return freed
}

// RenewLease extends the live lease of token to now+d in each of its parts (d 0: each
// rule's own lease), through any daemon for a global lease. It reports whether the lease
// was live, every part of it, and then how long until its first part expires: a lease
// that lost a slot (a part run out, its local or its global half) is not renewed, or the
// gateway would believe it held what another request took, and its other parts keep
// their expiries (a local half renewed before its global half was refused is put back).
func (l *Limiter) RenewLease(token string, d time.Duration, now int64) (bool, time.Duration) {
	local, global := splitToken(token)
	if local == "" && (global == "" || l.global == nil) {
		return false, 0
	}
	in := time.Duration(-1)
	var was renewal
	if local != "" {
		ok, t, w := l.leases.renew(local, d, now, l.leaseNow, global != "")
		if !ok {
			return false, 0
		}
		in, was = t, w
	}
	if global != "" {
		ok := false
		var t time.Duration
		if l.global != nil {
			ok, t = l.global.renew(global, d, now)
		}
		if !ok {
			if local != "" {
				l.leases.restore(local, was)
			}
			return false, 0
		}
		if in < 0 || t < in {
			in = t
		}
	}
	return true, max(in, 0)
}

// leaseNow returns the lease of the concurrency rule named rule in the rule set in force.
func (l *Limiter) leaseNow(rule string) (int64, bool) {
	for _, r := range l.active.Load().set.Rules {
		if r.Name == rule && r.Concurrency {
			if lim, _ := r.LimitFor("", false); lim != nil {
				return int64(lim.Window()), true
			}
		}
	}
	return 0, false
}

// ReleaseOwnerAtShutdown is ReleaseOwner for a connection the daemon closes because it
// is shutting down: the local leases end with the daemon, but the global ones stay held
// in Redis. The gateway's requests holding them are still running; it releases them
// through whichever daemon serves it next (a global lease's token works on any daemon),
// or they expire after their lease. Freeing them here let the other daemons admit past
// a concurrency rule's max while those requests ran (a blue/green switch: the old
// daemon's SIGTERM freed every slot its gateway still held). Returns how many local
// leases it freed.
func (l *Limiter) ReleaseOwnerAtShutdown(owner uint64, now int64) int {
	return l.leases.ReleaseOwner(owner, now)
}

// HoldsLeases reports whether owner holds a lease, local or global, that has not run
// out by now. A global lease that has run out by this daemon's view is asked of Redis
// (the sweep's query, on a bounded context) before it counts as run out: it may have
// been renewed through another daemon.
func (l *Limiter) HoldsLeases(owner uint64, now int64) bool {
	if l.leases.Holds(owner, now) {
		return true
	}
	return l.global != nil && l.global.refreshOwner(owner, now)
}

// refreshOwner settles owner's global leases that have run out by this daemon's view
// from Redis, as the sweep does (a lease renewed through another daemon gets its new
// expiry, one run out or released is forgotten), and reports whether one of them is
// still live. A failed query counts none live.
func (s *globalLeaseStore) refreshOwner(owner uint64, now int64) bool {
	due := s.ls.ownerGlobalDue(owner, now)
	if len(due) == 0 {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeReleaseWait)
	defer cancel()
	ids, parts := leaseParts(due)
	st, err := s.g.LeaseStates(ctx, ids, parts)
	if err != nil {
		return false
	}
	live := false
	for i, gl := range due {
		if st[i].Err != nil {
			continue
		}
		s.ls.settleGlobal(gl, now, st[i].Left, st[i].Present)
		live = live || s.ls.tracked(gl, now)
	}
	return live
}

// ReleaseOwner frees every lease owner still holds (its connection closed), local and
// global (in Redis, batched on one bounded context), counting them as closed, and
// returns how many leases it freed.
func (l *Limiter) ReleaseOwner(owner uint64, now int64) int {
	n := l.leases.ReleaseOwner(owner, now)
	if l.global != nil {
		if gls, gr := l.leases.takeOwnerGlobal(owner); len(gls) > 0 {
			n += l.global.releaseAll(gls, gr, now)
		}
	}
	return n
}
