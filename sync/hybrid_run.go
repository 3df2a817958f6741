package sync

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	gosync "sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

//go:embed scripts/heartbeat.lua
var heartbeatLua string

var heartbeatScript = redis.NewScript(heartbeatLua)

// DaemonsKey is the sorted set of live daemons (member: daemon id, score: Redis time of
// its last heartbeat, ms). On a Redis Cluster two more sets, on slots of the other two
// thirds of the slot space (other masters, in the usual layout), hold the same, so losing
// one master loses neither the count nor the heartbeat.
const DaemonsKey = DefaultPrefix + "daemons"

// heartbeatKeys returns the keys heartbeats go to: base (the live-daemons set under the
// configured prefix, DaemonsKeyFor) and, on a cluster, two more named after it.
func heartbeatKeys(base string, cluster bool) []string {
	keys := []string{base}
	if !cluster {
		return keys
	}
	third := func(k string) int { return int(Slot(k)) * 3 / Slots }
	seen := map[int]bool{third(base): true}
	for i := 0; len(seen) < 3; i++ {
		k := fmt.Sprintf("%s:{%d}", base, i)
		if t := third(k); !seen[t] {
			seen[t] = true
			keys = append(keys, k)
		}
	}
	return keys
}

// Heartbeat records this daemon as live and returns how many daemons are: those that
// sent a heartbeat within ttl (the most any heartbeat set counts). It also updates the
// replica count shares are sized by. It fails only if no heartbeat set answered.
func (h *Hybrid) Heartbeat(ctx context.Context, id string, ttl time.Duration) (int, error) {
	keys := h.heartbeatKs
	ns := make([]int64, len(keys))
	errs := make([]error, len(keys))
	each(len(keys), func(i int) { ns[i], errs[i] = h.beatKey(ctx, keys[i], id, ttl) })
	return h.counted(keys, ns, errs)
}

// beatKey sends the heartbeat to the set at k alone, and records k's master as
// answering as soon as it answers. One call per set, not one cluster pipeline for all:
// a pipeline returns when its slowest node has answered, and a frozen master held the
// others' answers back for its call's whole timeout (TestHybridClusterFrozenMasterIdle).
func (h *Hybrid) beatKey(ctx context.Context, k, id string, ttl time.Duration) (int64, error) {
	n, err := heartbeatScript.EvalSha(ctx, h.rdb, []string{k}, id, ttl.Milliseconds()).Int64()
	if isNoScriptErr(err) {
		n, err = heartbeatScript.Eval(ctx, h.rdb, []string{k}, id, ttl.Milliseconds()).Int64()
	}
	if err == nil {
		h.answeredBy(h.masters.ForKey(k), h.clock())
	}
	return n, err
}

// counted returns the count of live daemons the heartbeats to keys answered (ns, errs:
// each key's reply), the most any set counts, and sets the replica count to it. It fails
// only if no set answered; when some did, the others' errors come with the count.
func (h *Hybrid) counted(keys []string, ns []int64, errs []error) (int, error) {
	best := 0
	var failed []error
	for i, k := range keys {
		if errs[i] != nil {
			failed = append(failed, fmt.Errorf("%s: %w", k, errs[i]))
			continue
		}
		best = max(best, int(ns[i]))
	}
	if best == 0 {
		return 0, fmt.Errorf("heartbeat: %w", errors.Join(failed...))
	}
	h.SetReplicas(best)
	if len(failed) > 0 {
		return best, fmt.Errorf("heartbeat (counted from the others): %w", errors.Join(failed...))
	}
	return best, nil
}

// each runs f(0) ... f(n-1), each on a goroutine of its own when there are several,
// and returns when all have.
func each(n int, f func(i int)) {
	if n == 1 {
		f(0)
		return
	}
	var wg gosync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f(i)
		}()
	}
	wg.Wait()
}

//go:embed scripts/beat_age.lua
var beatAgeLua string

var beatAgeScript = redis.NewScript(beatAgeLua)

// LastBeat reports whether the live-daemons set counts id as live now (its last
// heartbeat, by Redis's clock, is within the heartbeat TTL) and how long ago that
// heartbeat was. A daemon asks before its first heartbeat: live then means another
// daemon runs under its id (two live daemons must not share one: each takes the other's
// syncs of a key for its own), or one that stopped without leaving the set (killed)
// within the TTL.
func (h *Hybrid) LastBeat(ctx context.Context, id string) (age time.Duration, live bool, err error) {
	ms, err := beatAgeScript.Run(ctx, h.rdb, []string{h.heartbeatKs[0]}, id).Int64()
	if err != nil {
		return 0, false, fmt.Errorf("reading the live daemons: %w", err)
	}
	if ms < 0 {
		return 0, false, nil
	}
	age = time.Duration(ms) * time.Millisecond
	return age, age < h.beatTTL, nil
}

// Join sends this daemon's first heartbeat and counts the live daemons, before it
// serves: what their count sizes (a split: auto rule's share, a local failure policy's
// bucket) is then right from the first check, where until Run's first heartbeat had
// answered the count was 1 and a daemon just started, or restarted, held each such
// rule's whole limit. Run sends its own first heartbeat all the same.
func (h *Hybrid) Join(ctx context.Context, id string) error {
	_, _, err := h.beatOnce(ctx, id, h.beatTTL)
	return err
}

// leave takes id out of the live-daemons sets, as a daemon that stops cleanly does after
// its last sync: the others count it gone at their next heartbeat (a second), not once
// its last heartbeat is three seconds old, so in a blue/green switch their shares (and
// their local failure policies' buckets) are not cut by a daemon that has stopped.
func (h *Hybrid) leave(ctx context.Context, id string) error {
	pipe := h.rdb.Pipeline()
	for _, k := range h.heartbeatKs {
		pipe.ZRem(ctx, k, id)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("leaving the live daemons: %w", err)
	}
	return nil
}

// leaveSetBudget is how long a stopping daemon's leave of the live-daemons sets
// (leaveAtStop) is given, at least: as a lease's release, max(timeout, 250 ms), tried
// again within it while it fails (each try still bounded by the client's own timeout),
// where it had one try bounded by the calls' timeout (50 ms by default), which a loaded
// host's Cluster pipeline can outlast. A leave that fails has the other daemons count
// one that stopped until its last heartbeat is three seconds old, their shares cut
// meanwhile in a blue/green switch. ZREM twice is ZREM once.
const leaveSetBudget = 250 * time.Millisecond

// leaveAtStop is Run's leave after its last sync.
func (h *Hybrid) leaveAtStop(id string, timeout time.Duration) error {
	c, cancel := context.WithTimeout(context.Background(), max(timeout, leaveSetBudget))
	defer cancel()
	for {
		err := h.leave(c, id)
		if err == nil {
			return nil
		}
		select {
		case <-c.Done():
			return err
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// beatOnce sends a heartbeat to the sets whose masters let it (each master asked once):
// its breaker lets it, and its last heartbeat is not still on its way (a master that does
// not answer holds its own heartbeat for the call's timeout, not the others'). Each set
// gets a call of its own, at once, and each master's breaker hears how it answered as
// soon as it has. With a breaker per master of a cluster it also pings, at the same time,
// each master holding no heartbeat set that lets it, so a master no key of this daemon
// is synced to is judged too: its keys go stale only when it stops answering. It returns
// the heartbeat's count of live daemons (0: none answered, or none was sent), whether a
// heartbeat was sent (with every breaker open, none is: no success to count), and its
// error.
func (h *Hybrid) beatOnce(ctx context.Context, id string, ttl time.Duration) (int, bool, error) {
	let := func(m *Master) bool {
		if !m.beating.CompareAndSwap(false, true) {
			return false
		}
		if !m.breaker.Allow() {
			m.beating.Store(false)
			return false
		}
		return true
	}
	var keys []string
	var gates []masterGate
	var keyGate []int
	for _, k := range h.heartbeatKs {
		g := gateOf(&gates, h.masters.ForKey(k), let)
		if gates[g].ok {
			keys = append(keys, k)
			keyGate = append(keyGate, g)
		}
	}
	var wg gosync.WaitGroup
	if h.masters.Cluster() {
		t := h.masters.table.Load()
		for i, m := range t.list {
			held := false
			for _, g := range gates {
				held = held || g.m == m
			}
			if held || m.Addr == "" || !let(m) {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer m.beating.Store(false)
				h.ping(ctx, m, slotKeys()[t.first[i]])
			}()
		}
	}
	n := 0
	var err error
	if len(keys) > 0 {
		// Per master: its sets still to answer (mostly one), and whether one did.
		left := make([]atomic.Int32, len(gates))
		answered := make([]atomic.Bool, len(gates))
		for _, g := range keyGate {
			left[g].Add(1)
		}
		ns := make([]int64, len(keys))
		errs := make([]error, len(keys))
		sent := h.clock()
		each(len(keys), func(i int) {
			g := keyGate[i]
			ns[i], errs[i] = h.beatKey(ctx, keys[i], id, ttl)
			if errs[i] == nil {
				answered[g].Store(true)
			}
			if left[g].Add(-1) > 0 {
				return
			}
			m := gates[g].m
			if answered[g].Load() {
				m.breaker.Success()
			} else {
				m.breaker.Failure()
				// Not answering, as a failed sync says: a key new here is then decided by
				// its rule's policy (degraded), not by a first unit of credit that Redis
				// never sees. (A daemon started with Redis away has synced nothing yet.)
				m.failedSince(sent)
			}
			m.beating.Store(false)
		})
		n, err = h.counted(keys, ns, errs)
	}
	wg.Wait()
	return n, len(keys) > 0, err
}

// ping asks master m (through key, in one of its slots) whether it answers, and tells
// its breaker.
func (h *Hybrid) ping(ctx context.Context, m *Master, key string) {
	start := time.Now()
	err := ping(ctx, h.rdb, key) // global.go
	h.observed("ping", start, err)
	if err != nil {
		m.breaker.Failure()
		return
	}
	h.answeredBy(m, h.clock())
	m.breaker.Success()
}

// Where the next heartbeat stands (Hybrid.beat), on a standalone Redis.
const (
	beatIdle    int32 = iota // not due, or due and not yet offered
	beatOffered              // due: the next sync's first script call may carry it
	beatTaken                // a sync's call carries it; its reply is on its way
)

// rideBeat settles a heartbeat that rode on a sync's script call: live is the count of
// live daemons it answered (0: the call failed, and Run offers it again).
func (h *Hybrid) rideBeat(live int64) {
	if live > 0 {
		m := h.masters.List()[0] // standalone: the only one
		h.answeredBy(m, h.clock())
		h.SetReplicas(int(live))
		h.rodeAt.Store(monoNow())
		m.breaker.Success()
	}
	h.beat.Store(beatIdle)
}

// monoEpoch and monoNow time the heartbeats on Go's monotonic clock (ns since the
// package started), which no step of the wall clock moves. rodeAt was a wall clock
// reading: after a step back (NTP, a VM resumed) the last ride lay in the future, the
// time since it was negative, and a daemon on a standalone Redis sent no heartbeat until
// the wall clock caught up, for as long as the step; after 3 s every daemon counted one
// less (TestHybridHeartbeatAfterWallStepBack).
var monoEpoch = time.Now()

func monoNow() int64 { return int64(time.Since(monoEpoch)) }

// heartbeatEvery is the period of heartbeats: the count of daemons changes slowly, and a
// heartbeat costs Redis a few commands, so at most one per second.
func (h *Hybrid) heartbeatEvery() time.Duration { return max(h.interval, time.Second) }

// releaseBudget bounds the last sync before a daemon stops. Keys already synced need
// nothing then; this is for units admitted and not yet synced, and grants not yet used.
const releaseBudget = 10 * time.Second

// lastSyncRetry bounds how long the last sync before a daemon stops is tried again
// when Redis does not answer it: a Redis out of reach for less (a network blip, a
// restart, a proxy's reconnection) still counts what the daemon admitted; past it the
// daemon exits, logging what it could not hand in, rather than hold up a restart (the
// next daemon, socket-activated, waits for it) for an outage that goes on.
const lastSyncRetry = 2 * time.Second

// lastSync runs the last sync (Release), tried again after a pause, the pause
// doubling from 20 ms up to 250 ms, until it succeeds or lastSyncRetry has passed since
// the first try; each try may take up to max(timeout, releaseBudget). A try whose reply
// was lost after Redis applied it counts nothing twice: every sync carries a token
// Redis records with the key (newToken). fail hears the last try's error.
func (h *Hybrid) lastSync(clock func() int64, timeout time.Duration, fail func(error)) {
	until := time.Now().Add(lastSyncRetry)
	for pause := 20 * time.Millisecond; ; pause = min(2*pause, 250*time.Millisecond) {
		c, cancel := context.WithTimeout(context.Background(), max(timeout, releaseBudget))
		start := time.Now()
		sent, err := h.flush(c, clock(), 0, true)
		cancel()
		if sent > 0 || err != nil {
			h.observed("hybrid_sync", start, err)
		}
		if err == nil {
			return
		}
		if time.Now().Add(pause).After(until) {
			fail(err)
			return
		}
		time.Sleep(pause)
	}
}

// kickEvery is how often at most Run syncs early because keys were seen for the first
// time: new clients get their first view within it, and a flood of new keys costs Redis
// one sync per kickEvery, many keys per script call, not one per key.
const kickEvery = 50 * time.Millisecond

// Run syncs every interval and sends a heartbeat every second until ctx ends, then
// releases (a last sync that gives every grant back and takes none), with a fresh
// context, tried again while Redis does not answer for up to lastSyncRetry (lastSync),
// so what was admitted before a shutdown reaches Redis and no budget stays reserved. A
// heartbeat that fails does not hold the syncs back: each key's sync goes to the node
// that holds it. clock returns the daemon's time (ns); onErr sees every failure.
//
// With a breaker per master of a Cluster (WithMasters), each master's periodic sync and
// each heartbeat after the first run on goroutines of their own, waited for before the
// last sync: a master that does not answer holds up its own keys, not the others'.
//
// On a standalone Redis, when id is the Hybrid's own ID, a heartbeat rides on a sync's
// script call (a periodic sync or an exact one) that goes in the interval before it is
// due, and is sent alone when due only if none does: a busy daemon's heartbeats then cost
// Redis no call of their own.
func (h *Hybrid) Run(ctx context.Context, id string, clock func() int64, timeout time.Duration, onErr func(error)) {
	t := time.NewTicker(h.interval)
	defer t.Stop()
	beatEvery := h.heartbeatEvery()
	// With a breaker per master of a Cluster each master's periodic sync runs on its own
	// goroutine (flushEach), all counted here and waited for before the last sync; onErr
	// is then called from them too, one call at a time.
	var syncs gosync.WaitGroup
	var errMu gosync.Mutex
	fail := func(err error) {
		errMu.Lock()
		defer errMu.Unlock()
		onErr(err)
	}
	beatNow := func() {
		c, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		start := time.Now()
		_, sent, err := h.beatOnce(c, id, 3*beatEvery)
		if sent {
			h.observed("heartbeat", start, err)
		}
		if err != nil {
			fail(err)
		}
	}
	beat := func() {
		if h.single != nil {
			beatNow()
			return
		}
		// A breaker per master: a master that does not answer its heartbeat (or ping)
		// must not hold up the others' syncs, nor their heartbeats. Each heartbeat skips
		// the masters whose last one is still on its way (beatOnce); before, the whole
		// heartbeat was skipped while a frozen master's call waited out its timeout, and
		// the others' last answer grew two heartbeats old, StaleAfter.
		syncs.Add(1)
		go func() {
			defer syncs.Done()
			beatNow()
		}()
	}
	flush := func() {
		// A sync of many keys takes several pipelines: allow it a few intervals.
		budget := max(timeout, 5*h.interval)
		if h.single == nil {
			// A breaker per master: a master that does not answer holds up its own
			// keys' syncs, not the others'.
			h.flushEach(clock(), h.maxSync, budget, &syncs, func(sent int, d time.Duration, err error) {
				if h.observe != nil {
					h.observe("hybrid_sync", d, err)
				}
				if h.syncDone != nil {
					h.syncDone(d, sent)
				}
				if err != nil {
					fail(err)
				}
			})
			return
		}
		start := time.Now()
		items := h.collect(clock(), h.maxSync)
		if len(items) == 0 {
			return
		}
		// The budget from here, once the keys are collected: collecting 100,000 on a
		// starved host took so long that the sync ran out of time before its first
		// pipeline, and every key of it counted as a failure of Redis.
		c, cancel := context.WithTimeout(context.Background(), budget)
		defer cancel()
		sent, err := h.settle(c, items, false)
		h.observed("hybrid_sync", start, err)
		if h.syncDone != nil {
			h.syncDone(time.Since(start), sent)
		}
		if err != nil {
			fail(err) // each master's breaker heard how its keys went (flush)
		}
	}
	beatNow() // the live daemons counted before the first sync sizes its credits
	// When the last heartbeat went (monoNow).
	lastBeat := monoNow()
	ride := !h.cluster && id == h.id
	sweep := 0
	for {
		select {
		case <-ctx.Done():
			// The last sync after a drain is tried even with the breaker open: it is
			// the daemon's last chance to hand in what it admitted. The syncs on their
			// way first: their keys are busy until then.
			syncs.Wait()
			h.lastSync(clock, timeout, fail)
			if err := h.leaveAtStop(id, timeout); err != nil {
				fail(err)
			}
			return
		case <-t.C:
			now := monoNow()
			if r := h.rodeAt.Load(); r > lastBeat && r <= now { // never later, on this clock
				lastBeat = r
			}
			// Riding, a heartbeat is offered to the syncs an interval before it is due,
			// and goes alone when due if none took it: one a second either way.
			switch since := time.Duration(now - lastBeat); {
			case !ride:
				if since >= beatEvery {
					lastBeat = now
					beat()
				}
			case since >= beatEvery-h.interval && h.beat.CompareAndSwap(beatIdle, beatOffered):
				// the next sync's first call carries it
			case since >= beatEvery && h.beat.CompareAndSwap(beatOffered, beatIdle):
				lastBeat = now // no sync took it: alone
				beat()
			}
			flush()
			h.sweep(sweep, clock())
			sweep = (sweep + 1) % hybridShards
		case <-h.kick:
			flush()
			select {
			case <-ctx.Done():
			case <-time.After(kickEvery):
			}
		}
	}
}

// unanswered gives each of cmds that holds neither an answer nor an error of its own
// the error of the pipeline that carried them, err. go-redis leaves them so when the
// connection could not be set up (a wrong password: WRONGPASS), and reading one then
// said "unexpected type=<nil> for Int64" instead of why.
func unanswered(err error, cmds ...*redis.Cmd) {
	if err == nil {
		return
	}
	for _, c := range cmds {
		if c != nil && c.Err() == nil && c.Val() == nil {
			c.SetErr(err)
		}
	}
}
