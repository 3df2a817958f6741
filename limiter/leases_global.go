package limiter

import (
	"encoding/base64"
	"slices"
	"strings"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"

	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// The global leases this daemon acquired are tracked in Leases beside the local ones,
// under the same mutex: by owner, so that a closed connection frees them, and in their
// rules' LeaseStats (InFlight counts them until they are seen freed). Redis decides;
// this is bookkeeping.

// track registers gl, whose part p is of the rule nameOf(p), taken now.
func (ls *Leases) track(gl *globalLease, nameOf func(p int) string, ops []rlsync.LeaseOp) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.global == nil {
		ls.global = map[string]*globalLease{}
		ls.globalOwners = map[uint64]map[string]*globalLease{}
		ls.globalKeys = map[string]map[uint64]int{}
	}
	for p := range ops {
		if !ops[p].Allowed || !ops[p].Take {
			continue
		}
		st := ls.statsOf(nameOf(p))
		st.InFlight++
		gl.stats = append(gl.stats, st)
	}
	ls.global[gl.id] = gl
	ls.keyUnits += gl.keyUnits()
	if gl.owner != 0 {
		m := ls.globalOwners[gl.owner]
		if m == nil {
			m = map[string]*globalLease{}
			ls.globalOwners[gl.owner] = m
		}
		m[gl.id] = gl
		for _, p := range gl.parts {
			k := ls.globalKeys[p.Key]
			if k == nil {
				k = map[uint64]int{}
				ls.globalKeys[p.Key] = k
			}
			k[gl.owner]++
		}
	}
}

// statsOf returns rule's LeaseStats, created on first use. ls.mu must be held.
func (ls *Leases) statsOf(rule string) *LeaseStats {
	st := ls.stats[rule]
	if st == nil {
		st = new(LeaseStats)
		ls.stats[rule] = st
	}
	return st
}

// untrack forgets gl, if still tracked, counting each of its parts with count (nil:
// not counted). It reports whether gl was tracked.
func (ls *Leases) untrack(gl *globalLease, count func(*LeaseStats)) bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.untrackLocked(gl, count)
}

func (ls *Leases) untrackLocked(gl *globalLease, count func(*LeaseStats)) bool {
	if ls.global[gl.id] != gl {
		return false
	}
	delete(ls.global, gl.id)
	ls.keyUnits -= gl.keyUnits()
	if m := ls.globalOwners[gl.owner]; m != nil {
		delete(m, gl.id)
		if len(m) == 0 {
			delete(ls.globalOwners, gl.owner)
		}
		for _, p := range gl.parts {
			if k := ls.globalKeys[p.Key]; k != nil {
				if k[gl.owner]--; k[gl.owner] <= 0 {
					delete(k, gl.owner)
					if len(k) == 0 {
						delete(ls.globalKeys, p.Key)
					}
				}
			}
		}
	}
	for _, st := range gl.stats {
		st.InFlight--
		if count != nil {
			count(st)
		}
	}
	return true
}

// releasedGlobal records the release through this daemon of the global lease id, whose
// parts are of rules rs: freed says whether Redis freed a live part.
func (ls *Leases) releasedGlobal(id string, rs []*rules.Rule, freed bool, now int64) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if gl := ls.global[id]; gl != nil {
		var count func(*LeaseStats)
		switch {
		case freed:
			count = func(s *LeaseStats) { s.Released++ }
		case gl.expires <= now:
			// Released too late: it ran out first (a renewal through another daemon
			// would have kept it). Counted expired, the leak signal, as the sweep
			// counts one never released, and as a local lease released late is; it was
			// counted nowhere when released before the sweep came to it.
			count = func(s *LeaseStats) { s.Expired++ }
		default:
			count = gl.goneCount() // nothing freed: gone, by an earlier release maybe
		}
		ls.untrackLocked(gl, count)
		return
	}
	if freed {
		for _, r := range rs {
			ls.statsOf(r.Name).Released++ // acquired through another daemon
		}
	}
}

// tokenEncoding reads a global token's body: base64 without padding, strict, so that the
// unused low bits of its last character must be zero.
var tokenEncoding = base64.RawURLEncoding.Strict()

// decodeTokenBody returns the bytes of a global token's body (after its prefix), and false
// when it is not exactly how a token is written: Go's base64 decoders skip CR and LF
// anywhere, and a lease with a line break added was taken for the lease (released,
// renewed: the conformance suite's mangled leases, with Redis), where a lease the daemon
// did not issue is unknown; and a last character whose unused bits are not zero decoded
// to the same bytes too.
func decodeTokenBody(body string) ([]byte, bool) {
	if strings.ContainsAny(body, "\r\n") {
		return nil, false
	}
	raw, err := tokenEncoding.DecodeString(body)
	return raw, err == nil
}

// trackedGlobal returns the global lease of token if this daemon tracks it (it
// acquired it and has not seen it freed), else nil. The whole token must match: its id
// alone (random, but written in the token in the clear) is not taken as proof.
func (ls *Leases) trackedGlobal(token string) *globalLease {
	if len(token) < 2 || token[0] != globalTokenPrefix || len(token) > proto.MaxLeaseLen {
		return nil
	}
	raw, ok := decodeTokenBody(token[1:])
	if !ok || len(raw) < 1+leaseIDBytes {
		return nil
	}
	id := base64.RawURLEncoding.EncodeToString(raw[1 : 1+leaseIDBytes])
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if gl := ls.global[id]; gl != nil && gl.token == token {
		return gl
	}
	return nil
}

// renewedGlobal notes that the global lease id, if tracked here, now first expires at
// expires.
func (ls *Leases) renewedGlobal(id string, expires int64) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if gl := ls.global[id]; gl != nil {
		gl.expires = expires
	}
}

// countGlobal counts each part of gl with count.
func (ls *Leases) countGlobal(gl *globalLease, count func(*LeaseStats)) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for _, st := range gl.stats {
		count(st)
	}
}

// takeOwnerGlobal forgets the global leases of owner and returns them for releasing in
// Redis (releaseAll counts those it frees as closed), with the release, under way until
// releaseAll ends it (nil when there are none).
func (ls *Leases) takeOwnerGlobal(owner uint64) ([]*globalLease, *globalRelease) {
	if owner == 0 {
		return nil, nil
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	gls := ls.takeOwnerGlobalLocked(owner, nil)
	return gls, ls.beginReleaseLocked(gls)
}

// globalRelease is the release in Redis of global leases this daemon has stopped
// tracking (releaseAll), under way until done is closed: a check refused on one of
// their keys meanwhile waits for it, and asks again if it freed any (reapGone). Before,
// a check sent right after a connection's close, once the daemon had seen the close,
// often reached Redis before the close's release and was refused.
type globalRelease struct {
	done  chan struct{}
	freed bool // written before done is closed
}

// beginReleaseLocked registers the release of gls, no longer tracked, under their parts'
// keys, and returns it (nil for none). ls.mu must be held.
func (ls *Leases) beginReleaseLocked(gls []*globalLease) *globalRelease {
	if len(gls) == 0 {
		return nil
	}
	gr := &globalRelease{done: make(chan struct{})}
	if ls.releasing == nil {
		ls.releasing = map[string][]*globalRelease{}
	}
	for _, gl := range gls {
		for _, p := range gl.parts {
			if rs := ls.releasing[p.Key]; len(rs) == 0 || rs[len(rs)-1] != gr {
				ls.releasing[p.Key] = append(rs, gr)
			}
		}
	}
	return gr
}

// endRelease ends gr (nil: none), the release of gls, which freed a slot or not.
func (ls *Leases) endRelease(gr *globalRelease, gls []*globalLease, freed bool) {
	if gr == nil {
		return
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for _, gl := range gls {
		for _, p := range gl.parts {
			rs := slices.DeleteFunc(ls.releasing[p.Key], func(r *globalRelease) bool { return r == gr })
			if len(rs) == 0 {
				delete(ls.releasing, p.Key)
			} else {
				ls.releasing[p.Key] = rs
			}
		}
	}
	gr.freed = freed
	close(gr.done)
}

// takeOwnerGlobalLocked is takeOwnerGlobal with ls.mu held, appending to out.
func (ls *Leases) takeOwnerGlobalLocked(owner uint64, out []*globalLease) []*globalLease {
	m := ls.globalOwners[owner]
	if len(m) == 0 {
		return out
	}
	from := len(out)
	for _, gl := range m {
		out = append(out, gl)
	}
	for _, gl := range out[from:] {
		ls.untrackLocked(gl, nil)
	}
	return out
}

// SetGlobalOwnerGone is SetOwnerGone for the global leases: a global check refused
// because a slot is full frees first the global leases of the owners holding parts of
// that key whose connections their clients have closed (reapGoneGlobal). The daemon
// answers false while it drains: a gateway that closes its connections then keeps its
// global leases (Limiter.ReleaseOwnerAtShutdown). The function must not block; it is
// called with the store's lock held.
func (ls *Leases) SetGlobalOwnerGone(gone func(owner uint64) bool) { ls.goneGlobal.Store(&gone) }

// reapGoneGlobal is for a global check refused on keys (full): it returns the releases
// under way of leases with a part on one of them (at most maxReleaseWaits), and it
// forgets and returns, with their release begun, the global leases of the owners holding
// parts on the keys of poll (other than self, the owner checking) whose connections their
// clients have closed, at most maxGoneChecks owners asked: for releasing in Redis as
// their close would (releaseAll; their close, seen later, finds them gone:
// takeOwnerGlobal).
func (ls *Leases) reapGoneGlobal(keys []string, poll []bool, self uint64) (waits []*globalRelease, gls []*globalLease, gr *globalRelease) {
	f := ls.goneGlobal.Load()
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for _, key := range keys {
		for _, r := range ls.releasing[key] {
			if len(waits) < maxReleaseWaits && !slices.Contains(waits, r) {
				waits = append(waits, r)
			}
		}
	}
	if f == nil {
		return waits, nil, nil
	}
	var asked, gone [maxGoneChecks]uint64
	na, ng := 0, 0
	for i, key := range keys {
		if !poll[i] {
			continue
		}
		for o := range ls.globalKeys[key] {
			if na == len(asked) {
				break
			}
			if o == self || slices.Contains(asked[:na], o) {
				continue
			}
			asked[na] = o
			na++
			if (*f)(o) {
				gone[ng] = o
				ng++
			}
		}
	}
	for _, o := range gone[:ng] {
		gls = ls.takeOwnerGlobalLocked(o, gls)
	}
	return waits, gls, ls.beginReleaseLocked(gls)
}

// maxReleaseWaits bounds the releases under way a refused global check waits for.
const maxReleaseWaits = 4

// retrack tracks again gl, taken off its owner (takeOwnerGlobal) but not released in
// Redis, with no owner and marked unreleased: in flight until the sweep releases it.
//
// partFreed: a part of it was freed (ReleaseAll's Freed), which counts it freed once
// the rest is settled.
// unsure: the release may have run in Redis all the same (rlsync.Released.Unsure), at
// now (see globalLease.sentUnsure).
func (ls *Leases) retrack(gl *globalLease, partFreed, unsure bool, now int64) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	gl.partFreed = gl.partFreed || partFreed
	gl.sentAt(unsure, now, true) // its connection's close
	if ls.global[gl.id] != nil {
		return
	}
	gl.owner = 0
	gl.unreleased = true
	for _, st := range gl.stats {
		st.InFlight++
	}
	ls.global[gl.id] = gl
	ls.keyUnits += gl.keyUnits()
}

// keyUnits is what gl's token and its parts' keys (each holding its clients' keys)
// count toward the bound on live leases beyond gl itself (slotUnits).
func (gl *globalLease) keyUnits() int {
	n := slotUnits(len(gl.token))
	for _, p := range gl.parts {
		n += slotUnits(len(p.Key))
	}
	return n
}

// dueGlobal returns the tracked global leases whose first part was due to expire by now,
// at most maxDue of them (the next sweep takes the rest).
func (ls *Leases) dueGlobal(now int64) []*globalLease {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var due []*globalLease
	for _, gl := range ls.global {
		if gl.expires <= now && !gl.unreleased { // those: releaseAgain
			due = append(due, gl)
			if len(due) == maxDue {
				break
			}
		}
	}
	return due
}

// untrackReleased forgets gl, if still tracked, freed by releaseAgain: its parts
// counted closed when its connection's close gave it up (it has no owner left), else
// released.
func (ls *Leases) untrackReleased(gl *globalLease) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	count := func(st *LeaseStats) { st.Released++ }
	if gl.owner == 0 {
		count = func(st *LeaseStats) { st.Closed++ }
	}
	ls.untrackLocked(gl, count)
}

// markUnreleased marks gl (nil: none), if still tracked, as given up by its holder but
// not released in Redis: the sweep releases it again (releaseAgain). partFreed: a part
// of it was freed (see globalLease.partFreed); unsure: the release may have run in
// Redis all the same, at now (see globalLease.sentUnsure). It reports whether gl is
// tracked.
func (ls *Leases) markUnreleased(gl *globalLease, partFreed, unsure bool, now int64) bool {
	if gl == nil {
		return false
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.global[gl.id] != gl {
		return false
	}
	gl.unreleased = true
	gl.partFreed = gl.partFreed || partFreed
	gl.sentAt(unsure, now, gl.owner == 0) // its holder's release, or the sweep's after a close
	return true
}

// sentAt notes, when unsure, that a release of gl that may have run in Redis went
// unanswered at now (the first such release counts), closed: a release of its
// connection's close. The store's lock must be held.
func (gl *globalLease) sentAt(unsure bool, now int64, closed bool) {
	if unsure && !gl.sentUnsure {
		gl.sentUnsure, gl.sentLate, gl.sentClosed = true, gl.expires <= now, closed
	}
}

// goneCount returns how gl, found gone from Redis, is counted: as the release of it
// that went unanswered but may have run would have been (sentUnsure), expired when it
// had run out by then, closed when that release was its connection's close's (or the
// sweep's sent again after it: sentClosed), else released; nil (not counted) without
// such a release: it was released through another daemon, which counted it. The
// store's lock must be held, or gl no longer tracked.
func (gl *globalLease) goneCount() func(*LeaseStats) {
	switch {
	case !gl.sentUnsure:
		return nil
	case gl.sentLate:
		return func(st *LeaseStats) { st.Expired++ }
	case gl.sentClosed:
		return func(st *LeaseStats) { st.Closed++ }
	}
	return func(st *LeaseStats) { st.Released++ }
}

// untrackGone forgets gl, if still tracked, found gone from Redis, counted by
// goneCount.
func (ls *Leases) untrackGone(gl *globalLease) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.untrackLocked(gl, gl.goneCount())
}

// countGone counts gl, no longer tracked, found gone from Redis, by goneCount.
func (ls *Leases) countGone(gl *globalLease) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if count := gl.goneCount(); count != nil {
		for _, st := range gl.stats {
			count(st)
		}
	}
}

// freedPart reports whether a release of gl freed a part of it already (partFreed).
func (ls *Leases) freedPart(gl *globalLease) bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return gl.partFreed
}

// untrackReleasedIf forgets gl, if still tracked, counted as untrackReleased counts it
// when a part of it was freed, else uncounted: Redis has dropped what was left of it.
func (ls *Leases) untrackReleasedIf(gl *globalLease) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var count func(st *LeaseStats)
	switch {
	case !gl.partFreed:
	case gl.owner == 0:
		count = func(st *LeaseStats) { st.Closed++ }
	default:
		count = func(st *LeaseStats) { st.Released++ }
	}
	ls.untrackLocked(gl, count)
}

// unreleasedGlobal returns the tracked global leases marked unreleased, at most maxDue
// of them (the next sweep takes the rest).
func (ls *Leases) unreleasedGlobal() []*globalLease {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var out []*globalLease
	for _, gl := range ls.global {
		if gl.unreleased {
			out = append(out, gl)
			if len(out) == maxDue {
				break
			}
		}
	}
	return out
}

// ownerGlobalDue returns owner's tracked global leases whose first part was due to
// expire by now, at most maxDue of them.
func (ls *Leases) ownerGlobalDue(owner uint64, now int64) []*globalLease {
	if owner == 0 {
		return nil
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var due []*globalLease
	for _, gl := range ls.globalOwners[owner] {
		if gl.expires <= now {
			due = append(due, gl)
			if len(due) == maxDue {
				break
			}
		}
	}
	return due
}

// someGlobal returns up to n of the tracked global leases, in no particular order.
func (ls *Leases) someGlobal(n int) []*globalLease {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	out := make([]*globalLease, 0, min(n, len(ls.global)))
	for _, gl := range ls.global {
		if len(out) == n {
			break
		}
		out = append(out, gl)
	}
	return out
}

// tracked reports whether gl is still tracked, expiring after now.
func (ls *Leases) tracked(gl *globalLease, now int64) bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.global[gl.id] == gl && gl.expires > now
}

// maxDue bounds the global leases one sweep asks Redis about (one pipeline).
const maxDue = 10000

// settleGlobal updates the tracking of gl from Redis's view of its parts (LeaseState):
// a live part keeps it tracked (renewed through another daemon); else it is forgotten,
// its parts still present counted expired, those gone having been released through
// another daemon. It returns the parts counted expired.
func (ls *Leases) settleGlobal(gl *globalLease, now int64, left []time.Duration, present []bool) int {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	first := time.Duration(-1)
	for p := range left {
		if present[p] && left[p] > 0 && (first < 0 || left[p] < first) {
			first = left[p]
		}
	}
	if first > 0 {
		gl.expires = now + int64(first)
		return 0
	}
	if ls.global[gl.id] != gl {
		return 0
	}
	n := 0
	gone := gl.goneCount()
	for p, st := range gl.stats {
		switch {
		case p < len(present) && present[p]:
			st.Expired++
			n++
		case gone != nil:
			gone(st) // freed by a release that went unanswered (sentUnsure)
		}
	}
	ls.untrackLocked(gl, nil)
	return n
}
