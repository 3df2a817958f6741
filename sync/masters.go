package sync

import (
	"context"
	"fmt"
	"strconv"
	gosync "sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Masters is a circuit breaker per Redis master, and with it what the hybrid mode knows
// of each master: when it last answered and when a sync to it last failed. On a Redis
// Cluster a key's master is its hash slot's owner in the cluster client's slot map
// (Refresh, Run), so a frozen or dead master opens its own breaker and makes only its own
// keys follow their failure policies; the other masters' keys are decided as usual. On a
// standalone Redis there is one master, and so one breaker, for every key.
//
// The slot map is an array swapped whole: finding a key's master costs an atomic load and
// two indexings, no lock. A master keeps its breaker and its times while it owns slots;
// when a failover or a reshard gives its slots to another node, those slots follow the
// new owner (a fresh, closed breaker), so no slot stays behind a dead node's open one.
// Until the first Refresh on a cluster every slot has one shared master (as one breaker
// per daemon did).
//
// Build it with [NewMasters]; a nil *Masters lets every call through. Safe for concurrent
// use.
type Masters struct {
	cc       *redis.ClusterClient // nil: standalone, one master
	failures int
	cooldown time.Duration
	clock    func() int64 // the hybrid mode's clock: a new master has answered "now"

	table   atomic.Pointer[masterTable]
	mu      gosync.Mutex  // serializes Refresh
	retired atomic.Uint64 // Opened of the masters dropped from the table

	// followers are other clients of the same Cluster whose slot maps Run keeps in step
	// with this one's (see [Masters.Follow]). Set before Run.
	followers []*redis.ClusterClient
}

// Follow makes Run reload c's slot map whenever it disagrees with the one m keeps: c is
// another client of the same Cluster, one no breaker watches (the daemon's client for
// releases, renewals, refund retries and bans). go-redis reloads a client's map only on
// a redirection or once a minute, and a call to a dead master gets no redirection: such
// a client went on sending to a failed-over master for up to a minute, after the checks
// had moved to the promoted replica (a global lease taken there could not be released
// and stayed held for its whole lease). A client that is not a Cluster's is ignored.
func (m *Masters) Follow(c redis.UniversalClient) *Masters {
	if cc, ok := c.(*redis.ClusterClient); ok && m != nil && m.cc != nil && cc != m.cc {
		m.followers = append(m.followers, cc)
	}
	return m
}

// syncFollowers asks each follower whose slot map gives the first slot of one of m's
// slot ranges another master than m's map does to reload its map from the cluster (at
// most one reload in flight and one every 200 ms: go-redis's LazyReload). A failover
// moves whole ranges; a follower that missed a reshard's finer change is redirected,
// and go-redis reloads it then.
func (m *Masters) syncFollowers(ctx context.Context) {
	if len(m.followers) == 0 {
		return
	}
	t := m.table.Load()
	keys := slotKeys()
	for _, f := range m.followers {
		for s := range Slots {
			if s > 0 && t.slot[s] == t.slot[s-1] {
				continue
			}
			want := t.list[t.slot[s]].Addr
			if want == "" {
				continue // m has no master for it: nothing to follow
			}
			c, err := f.MasterForKey(ctx, keys[s])
			if err != nil || c.Options().Addr != want {
				f.ReloadState(ctx)
				break
			}
		}
	}
}

// masterTable is one slot map: slot i's master is list[slot[i]].
type masterTable struct {
	slot  [Slots]uint16
	list  []*Master
	first []uint16 // per master: a slot it owns
}

// Master is one Redis master's breaker and health, as [Masters] keeps them.
type Master struct {
	// Addr is the master's address in the cluster client's slot map; "" on a standalone
	// Redis, and on a cluster before the slot map is known.
	Addr    string
	breaker *Breaker
	// lastOK is when the master last answered a heartbeat, a ping or a sync (hybrid
	// clock, ns); syncFailed when the latest sync (or heartbeat) to it that failed with
	// no answer was sent (failedSince).
	lastOK     atomic.Int64
	syncFailed atomic.Int64
	// calls is the master's queue of global checks (autoPipe), on a cluster.
	calls combiner[*apCall]
	// syncing: a periodic sync of its keys is on its way (Hybrid.flushEach).
	syncing atomic.Bool
	// beating: a heartbeat (or ping) to it is on its way (Hybrid.beatOnce).
	beating atomic.Bool
}

// Breaker returns m's circuit breaker.
func (m *Master) Breaker() *Breaker { return m.breaker }

// answered records that m answered at now.
func (m *Master) answered(now int64) {
	for {
		old := m.lastOK.Load()
		if now <= old || m.lastOK.CompareAndSwap(old, now) {
			return
		}
	}
}

// answering reports whether a request may wait for m: its breaker is closed and it has
// answered since the latest sync to it that failed was sent.
func (m *Master) answering() bool {
	return !m.breaker.Open() && m.syncFailed.Load() <= m.lastOK.Load()
}

// failedSince records that a call to m sent at sent (hybrid clock) got no answer: m is
// not answering until it answers something after sent. Counted from when the call was
// sent, not from when the daemon saw it fail: an answer to another call while this one
// waited (a heartbeat, another sync) says m answers, slowly for this call. Counted from
// the failure, one call Redis was slow to answer (a loaded host) made every key only
// Redis could decide follow its rule's policy, degraded, until the next answer, while
// Redis answered (TestHybridSlowCallBesideAnAnswerIsNoOutage). Never moved back: a
// failure of an older call, seen later, says less.
func (m *Master) failedSince(sent int64) {
	for {
		old := m.syncFailed.Load()
		if sent <= old || m.syncFailed.CompareAndSwap(old, sent) {
			return
		}
	}
}

// fresh reports whether m answered within stale of now, with its breaker closed.
func (m *Master) fresh(now int64, stale time.Duration) bool {
	return !m.breaker.Open() && now-m.lastOK.Load() <= int64(stale)
}

// NewMasters returns the masters of c (a *redis.ClusterClient: one per master, once
// Refresh has read its slot map; any other client: one), each breaker opening after
// failures consecutive failures for cooldown (see [NewBreaker]). clock is the daemon's
// clock (ns; nil: the wall clock), on which a master's last answer is kept.
func NewMasters(c redis.UniversalClient, failures int, cooldown time.Duration, clock func() int64) *Masters {
	if clock == nil {
		clock = func() int64 { return time.Now().UnixNano() }
	}
	m := &Masters{failures: failures, cooldown: cooldown, clock: clock}
	m.cc, _ = c.(*redis.ClusterClient)
	m.table.Store(&masterTable{list: []*Master{m.newMaster("")}, first: []uint16{0}})
	return m
}

// mastersOf returns a Masters whose one master uses b, for every key: one breaker for
// a whole store, as [Global.WithBreaker] and [Hybrid.WithBreaker] ask.
func mastersOf(b *Breaker, clock func() int64) *Masters {
	m := NewMasters(nil, 0, 0, clock)
	m.table.Load().list[0].breaker = b
	return m
}

func (m *Masters) newMaster(addr string) *Master {
	x := &Master{Addr: addr, breaker: NewBreaker(m.failures, m.cooldown)}
	x.lastOK.Store(m.clock())
	return x
}

// Cluster reports whether m keeps one breaker per master of a Redis Cluster.
func (m *Masters) Cluster() bool { return m != nil && m.cc != nil }

// ForSlot returns the master of hash slot s in the current slot map.
func (m *Masters) ForSlot(s uint16) *Master {
	t := m.table.Load()
	return t.list[t.slot[s%Slots]]
}

// ForKey returns key's master: on a standalone Redis the only one, without hashing key.
func (m *Masters) ForKey(key string) *Master {
	t := m.table.Load()
	if m.cc == nil {
		return t.list[0]
	}
	return t.list[t.slot[Slot(key)]]
}

// List returns the masters of the current slot map (on a standalone Redis, one).
func (m *Masters) List() []*Master {
	if m == nil {
		return nil
	}
	return m.table.Load().list
}

// AnyOpen reports whether some master's breaker is open: rlsidecar_breaker_open.
func (m *Masters) AnyOpen() bool {
	for _, x := range m.List() {
		if x.breaker.Open() {
			return true
		}
	}
	return false
}

// OpenCount returns how many masters' breakers are open.
func (m *Masters) OpenCount() int {
	n := 0
	for _, x := range m.List() {
		if x.breaker.Open() {
			n++
		}
	}
	return n
}

// Opened returns how many times a breaker of m has opened, over every master ever held.
func (m *Masters) Opened() uint64 {
	if m == nil {
		return 0
	}
	n := m.retired.Load()
	for _, x := range m.List() {
		n += x.breaker.Opened()
	}
	return n
}

// slotKeys holds, for each hash slot, a short key in it: the keys Refresh asks the
// cluster client about. Computed once, when a cluster first needs them.
var slotKeys = gosync.OnceValue(func() *[Slots]string {
	var keys [Slots]string
	for i, left := 0, Slots; left > 0; i++ {
		k := strconv.Itoa(i)
		if s := Slot(k); keys[s] == "" {
			keys[s] = k
			left--
		}
	}
	return &keys
})

// Refresh reads the cluster client's slot map (no network call once the client holds
// one) and gives each slot its master: a master still owning slots keeps its breaker and
// times, one new to the map starts closed, as having answered now. On a standalone Redis
// it does nothing. The error is the client's, when it has no slot map and cannot load one;
// the previous map then stays.
func (m *Masters) Refresh(ctx context.Context) error {
	if m == nil || m.cc == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	keys := slotKeys()
	if _, err := m.cc.MasterForKey(ctx, keys[0]); err != nil {
		return fmt.Errorf("reading the cluster's slot map: %w", err)
	}
	old := m.table.Load()
	initial := len(old.list) == 1 && old.list[0].Addr == "" // LoadScripts ran at start
	var joined []*redis.Client
	byAddr := make(map[string]*Master, len(old.list))
	for _, x := range old.list {
		byAddr[x.Addr] = x
	}
	t := &masterTable{}
	index := make(map[string]uint16, len(old.list))
	var last *redis.Client // slots come in ranges: the previous slot's master, mostly
	var lastI uint16
	for s := range Slots {
		c, err := m.cc.MasterForKey(ctx, keys[s])
		if err == nil && c == last && s > 0 {
			t.slot[s] = lastI
			continue
		}
		addr := ""
		if err == nil {
			addr = c.Options().Addr
		}
		i, ok := index[addr]
		if !ok {
			x := byAddr[addr]
			if x == nil {
				x = m.newMaster(addr)
				if err == nil && !initial {
					joined = append(joined, c)
				}
			}
			delete(byAddr, addr)
			i = uint16(len(t.list))
			index[addr] = i
			t.list = append(t.list, x)
			t.first = append(t.first, uint16(s))
		}
		t.slot[s] = i
		last, lastI = c, i
		if err != nil {
			last = nil
		}
	}
	for _, x := range byAddr { // masters that own no slot any more
		m.retired.Add(x.breaker.Opened())
	}
	loadJoined(ctx, joined)
	m.table.Store(t)
	return nil
}

// joinedLoadTimeout bounds loading the scripts into the masters new to a slot map.
const joinedLoadTimeout = time.Second

// loadJoined loads the daemon's scripts into each of masters (new to the slot map: a
// replica promoted by a failover, a master added and given slots), at once, before the
// new map sends them any call: Redis does not replicate SCRIPT LOAD, so a promoted
// replica's script cache is empty, as an added master's is. Without it the first calls
// to such a master come back NOSCRIPT and go again with EVAL and the script's body:
// two round trips and a compile per script and connection, the cost LoadScripts spares
// a daemon's start and ProbeOpen a restarted master, here right after a failover, when
// the failed-over master's global checks resume at once. Bounded by joinedLoadTimeout;
// a failure leaves them to NOSCRIPT and EVAL, as before.
func loadJoined(ctx context.Context, masters []*redis.Client) {
	if len(masters) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, joinedLoadTimeout)
	defer cancel()
	var wg gosync.WaitGroup
	for _, c := range masters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = loadScripts(ctx, c)
		}()
	}
	wg.Wait()
}

// Run refreshes the slot map every d until ctx ends. While a breaker is open it first
// asks the cluster client to reload its slot map from the cluster (go-redis otherwise
// reloads it only on a redirection or once a minute), so a failover is followed within
// about 2d of the cluster promoting a replica. On a standalone Redis it returns at once.
func (m *Masters) Run(ctx context.Context, d time.Duration) {
	if m == nil || m.cc == nil {
		return
	}
	_ = m.Refresh(ctx)
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if m.AnyOpen() || len(m.List()) == 1 && m.List()[0].Addr == "" {
				// The followers too, and first, at once: a call no breaker watches (a
				// lease's release) must not go to a dead master once a check has gone
				// to its promoted replica. Left to syncFollowers, they learned the new
				// map a tick after the checks did, a second in which every global lease
				// taken on the promoted replica failed to be released and stayed held
				// for its whole lease.
				for _, f := range m.followers {
					reloadNow(ctx, f)
				}
				m.cc.ReloadState(ctx)
			}
			_ = m.Refresh(ctx)
			m.syncFollowers(ctx)
		}
	}
}

// followReloadTimeout bounds reloadNow.
const followReloadTimeout = time.Second

// reloadNow reloads c's slot map from the cluster before it returns, within
// followReloadTimeout: ForEachMaster reloads the map first and waits for it, where
// ReloadState only has a goroutine do it (and does nothing while an earlier reload is
// in progress or in its 200 ms wait after).
func reloadNow(ctx context.Context, c *redis.ClusterClient) {
	ctx, cancel := context.WithTimeout(ctx, followReloadTimeout)
	defer cancel()
	_ = c.ForEachMaster(ctx, func(context.Context, *redis.Client) error { return nil })
}

// gate lets a call go to the masters ms (each once) only if each one's breaker lets it:
// a master whose breaker is open and not due for a probe refuses, and then the probes
// taken from the others are handed back (they were not used) and gate returns false.
//
// probes tells which of ms gave the call its probe (settle).
func gate(ms []*Master) (ok bool, probes probeSet) {
	for i, x := range ms {
		ok, probe := x.breaker.allow()
		if probe && i < 64 {
			probes |= 1 << i
		}
		if !ok {
			for j, y := range ms[:i] {
				if probes.has(j, y) {
					y.breaker.unprobe()
				}
			}
			return false, 0
		}
	}
	return true, probes
}

// probeSet tells which masters of a call's list (ms) gave it their breaker's probe: bit
// i for ms[i]; past 64 masters, every one whose breaker is open.
type probeSet uint64

func (p probeSet) has(i int, x *Master) bool {
	if i >= 64 {
		return x.breaker.Open()
	}
	return p&(1<<i) != 0
}

// keepAnswered clears the error of each cmd that holds a reply: go-redis's cluster
// pipeline, when a node fails and its retry runs out of time, sets that error on every
// command of the pipeline, those other masters answered included. A reply that arrived
// stands: the script ran.
func keepAnswered(cmds ...*redis.Cmd) {
	for _, c := range cmds {
		if c != nil && c.Err() != nil && c.Val() != nil {
			c.SetErr(nil)
		}
	}
}
