package limiter

import (
	"encoding/base64"
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

// trackedGlobal returns the global lease of token if this daemon tracks it (it
// acquired it and has not seen it freed), else nil. The whole token must match: its id
// alone (random, but written in the token in the clear) is not taken as proof.
func (ls *Leases) trackedGlobal(token string) *globalLease {
	if len(token) < 2 || token[0] != globalTokenPrefix || len(token) > proto.MaxLeaseLen {
		return nil
	}
	raw, err := base64.RawURLEncoding.DecodeString(token[1:])
	if err != nil || len(raw) < 1+leaseIDBytes {
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
// Redis (releaseAll counts those it frees as closed).
func (ls *Leases) takeOwnerGlobal(owner uint64) []*globalLease {
	if owner == 0 {
		return nil
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	m := ls.globalOwners[owner]
	if len(m) == 0 {
		return nil
	}
	out := make([]*globalLease, 0, len(m))
	for _, gl := range m {
		out = append(out, gl)
	}
	for _, gl := range out {
		ls.untrackLocked(gl, nil)
	}
	return out
}

// retrack tracks again gl, taken off its owner (takeOwnerGlobal) but not released in
// Redis, with no owner and marked unreleased: in flight until the sweep releases it.
//
// partFreed: a part of it was freed (ReleaseAll's Freed), which counts it freed once
// the rest is settled.
func (ls *Leases) retrack(gl *globalLease, partFreed bool) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	gl.partFreed = gl.partFreed || partFreed
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
// of it was freed (see globalLease.partFreed). It reports whether gl is tracked.
func (ls *Leases) markUnreleased(gl *globalLease, partFreed bool) bool {
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
	return true
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
	for p, st := range gl.stats {
		if p < len(present) && present[p] {
			st.Expired++
			n++
		}
	}
	ls.untrackLocked(gl, nil)
	return n
}
