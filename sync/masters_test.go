package sync

import (
	"context"
	"errors"
	"fmt"
	gosync "sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// gate lets a call through only when every master it needs lets it, and hands back the
// probes it took from the others when one refuses: a probe not used must not stay out,
// or that breaker would never be probed again.
func TestGate(t *testing.T) {
	const cool = 20 * time.Millisecond
	newMaster := func() *Master { return &Master{breaker: NewBreaker(1, cool)} }
	closed, due, notDue := newMaster(), newMaster(), newMaster()
	due.breaker.Failure()
	time.Sleep(2 * cool) // past its cool-down: it gives one probe
	notDue.breaker.Failure()
	notDue.breaker.until = time.Now().Add(time.Hour)

	tests := []struct {
		name string
		ms   []*Master
		want bool
	}{
		{"closed alone", []*Master{closed}, true},
		{"closed and one not due", []*Master{closed, notDue}, false},
		{"due, then one not due", []*Master{due, notDue}, false},
		{"due and closed", []*Master{due, closed}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got, _ := gate(tt.ms); got != tt.want {
				t.Fatalf("gate = %v, want %v", got, tt.want)
			}
			if !tt.want && !due.breaker.Allow() {
				t.Fatal("the probe taken from the due breaker was not handed back")
			}
			due.breaker.unprobe() // for the next case
		})
	}
	if !closed.breaker.Allow() || notDue.breaker.Allow() {
		t.Fatal("closed must allow, not-due must refuse")
	}
}

// clusterMasters starts a 3-master cluster and returns a client on it, its Masters
// (refreshed), and keys spread over every master, per master address.
func clusterMasters(t *testing.T, cooldown time.Duration, prefix string, perMaster int) (*redistest.Cluster, redis.UniversalClient, *Masters, map[string][]string) {
	t.Helper()
	return clusterMastersWait(t, cooldown, prefix, perMaster, time.Second)
}

// clusterMastersWait is clusterMasters with a client whose calls each wait up to wait.
func clusterMastersWait(t *testing.T, cooldown time.Duration, prefix string, perMaster int, wait time.Duration) (*redistest.Cluster, redis.UniversalClient, *Masters, map[string][]string) {
	t.Helper()
	// A master frozen for seconds must not be marked failed by the others (which, with
	// no replica to promote, would answer CLUSTERDOWN for every key): Redis's default
	// node timeout, not the quick tests' 2 s.
	cl := redistest.StartCluster(t, redistest.WithClusterNodeTimeout(15*time.Second))
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: wait}) // each call bounds its own wait
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	m := NewMasters(rdb, 3, cooldown, nil)
	if err := m.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := len(m.List()); n != len(cl.Addrs) {
		t.Fatalf("%d masters in the slot map, want %d", n, len(cl.Addrs))
	}
	keys := map[string][]string{}
	for i := 0; len(keys) < len(cl.Addrs) || !full(keys, perMaster); i++ {
		k := fmt.Sprintf("%s:{user=%d}", prefix, i)
		a := m.ForKey(k).Addr
		if len(keys[a]) < perMaster {
			keys[a] = append(keys[a], k)
		}
	}
	return cl, rdb, m, keys
}

func full(keys map[string][]string, n int) bool {
	for _, ks := range keys {
		if len(ks) < n {
			return false
		}
	}
	return true
}

// node returns the process of the cluster node at addr.
func node(t *testing.T, cl *redistest.Cluster, addr string) *redistest.Server {
	t.Helper()
	for _, n := range cl.Nodes {
		if n.Addr == addr {
			return n
		}
	}
	t.Fatalf("no node at %s", addr)
	return nil
}

// On a cluster each slot has the breaker of its master in the client's slot map;
// failures on one master open its breaker only; a slot moved to another master follows
// it, to that master's closed breaker, and is not left behind the open one.
func TestMastersClusterSlotMap(t *testing.T) {
	cl, rdb, m, keys := clusterMasters(t, time.Hour, "rl:ms", 2)
	cc := rdb.(*redis.ClusterClient)
	ctx := context.Background()
	for i := range 300 {
		k := fmt.Sprintf("rl:any:{%d}", i)
		want, err := cc.MasterForKey(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if got := m.ForKey(k); got.Addr != want.Options().Addr || m.ForSlot(Slot(k)) != got {
			t.Fatalf("%s (slot %d): master %s, the client routes it to %s", k, Slot(k), got.Addr, want.Options().Addr)
		}
	}

	from := cl.Addrs[0]
	bad := m.ForKey(keys[from][0])
	for range 3 {
		bad.Breaker().Failure()
	}
	for a, ks := range keys {
		if open := m.ForKey(ks[0]).Breaker().Open(); open != (a == from) {
			t.Fatalf("master %s: breaker open %v after 3 failures on %s", a, open, from)
		}
	}
	if !m.AnyOpen() || m.OpenCount() != 1 || m.Opened() != 1 {
		t.Fatalf("AnyOpen %v, OpenCount %d, Opened %d; want true, 1, 1", m.AnyOpen(), m.OpenCount(), m.Opened())
	}

	// Reshard one of its slots (empty) to another master, as a failover would hand them
	// all: once the client's map has it, the slot's breaker is the new master's.
	moved := keys[from][0]
	to := cl.Addrs[1]
	ids := map[string]string{}
	for _, a := range cl.Addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		id, err := c.Do(ctx, "CLUSTER", "MYID").Text()
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		ids[a] = id
	}
	slot := Slot(moved)
	for _, a := range append([]string{to, from}, cl.Addrs...) {
		c := redis.NewClient(&redis.Options{Addr: a})
		err := c.Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", ids[to]).Err()
		c.Close()
		if err != nil {
			t.Fatalf("SETSLOT on %s: %v", a, err)
		}
	}
	// Nothing is sent meanwhile (no MOVED makes go-redis reload its map): Run reloads it
	// because a breaker is open.
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		m.Run(runCtx, 50*time.Millisecond)
	}()
	defer func() { stop(); <-done }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m.ForKey(moved).Addr == to {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("slot %d still on %s after the reshard", slot, m.ForKey(moved).Addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if m.ForKey(moved).Breaker().Open() || !m.ForKey(moved).Breaker().Allow() {
		t.Fatal("the moved slot stays behind its old master's open breaker")
	}
	if m.ForKey(moved) != m.ForKey(keys[to][0]) {
		t.Fatal("the moved slot did not get its new master's breaker")
	}
	if !m.ForKey(keys[from][1]).Breaker().Open() && Slot(keys[from][1]) != slot {
		t.Fatal("the old master's other slots lost its open breaker")
	}
	if m.Opened() != 1 {
		t.Fatalf("Opened %d after a refresh, want 1", m.Opened())
	}
	start := time.Now()
	if err := m.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("a Refresh (16384 slots, from the client's map) took %s", time.Since(start))
}

// A master of a 3-master cluster frozen (SIGSTOP): global checks of keys on the two
// others are decided by Redis as usual, exactly (none fails, none waits on the frozen
// one's queue); checks needing the frozen master fail, at once once its breaker is
// open; a check spanning a healthy and the frozen master fails as a whole, and one
// spanning the two healthy ones passes. After SIGCONT every key is decided again, and
// Redis counts exactly what was admitted.
func TestGlobalClusterFrozenMaster(t *testing.T) {
	const cooldown = 300 * time.Millisecond
	cl, rdb, m, keys := clusterMasters(t, cooldown, "rl:gfm", 4)
	g := NewGlobal(rdb).WithAutoPipeline().WithMasters(m)
	ctx := context.Background()
	const limit = 40
	lim := mustLimit(t, localbucket.FixedWindow, limit, hourWindow())
	frozenAddr := cl.Addrs[0]
	healthyAddrs := cl.Addrs[1:]
	// A check waits up to 200 ms when it needs the frozen master while it is frozen, 2 s
	// otherwise (a loaded machine must not time out a healthy master: nor the frozen
	// one before its freeze, whose first check, its connection dialed, took more than
	// 200 ms in a -race run under load).
	isFrozen := false // set before the clients start, cleared after they end
	check := func(ks ...string) (bool, time.Duration, error) {
		ops := make([]GlobalOp, len(ks))
		wait := 2 * time.Second
		for i, k := range ks {
			ops[i] = GlobalOp{Key: k, Limit: lim, Cost: 1}
			if isFrozen && m.ForKey(k).Addr == frozenAddr {
				wait = 200 * time.Millisecond
			}
		}
		c, cancel := context.WithTimeout(ctx, wait)
		defer cancel()
		start := time.Now()
		ok, err := g.Check(c, ops)
		return ok, time.Since(start), err
	}
	for _, ks := range keys { // every master answers before the freeze
		if ok, _, err := check(ks[0]); !ok || err != nil {
			t.Fatalf("%s before the freeze: %v %v", ks[0], ok, err)
		}
	}
	admitted := map[string]int{}
	for _, ks := range keys {
		admitted[ks[0]] = 1
	}

	frozen := node(t, cl, frozenAddr)
	frozen.Freeze()
	isFrozen = true
	thawed := false
	defer func() {
		if !thawed {
			frozen.Thaw()
		}
	}()
	// Concurrent clients, one per key, each checking its key more times than its limit:
	// a healthy key admits exactly its limit and refuses the rest, with no error.
	type tally struct {
		allowed, refused, failed int
		openFailed, openSlow     int // failures with the breaker open; of which slow (probes)
	}
	var mu gosync.Mutex
	tallies := map[string]*tally{}
	var wg gosync.WaitGroup
	start := time.Now()
	for a, ks := range keys {
		for _, k := range ks[:3] {
			tl := &tally{}
			tallies[k] = tl
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < limit+10 || a == frozenAddr && time.Since(start) < 2*time.Second; i++ {
					open := m.ForKey(k).Breaker().Open()
					ok, took, err := check(k)
					mu.Lock()
					switch {
					case err != nil:
						tl.failed++
						if open {
							tl.openFailed++
							if took > 50*time.Millisecond {
								tl.openSlow++
							}
						}
					case ok:
						tl.allowed++
					default:
						tl.refused++
					}
					mu.Unlock()
					if a == frozenAddr {
						time.Sleep(5 * time.Millisecond)
					}
				}
			}()
		}
	}
	// Checks spanning masters, meanwhile.
	h0, h1 := keys[healthyAddrs[0]][3], keys[healthyAddrs[1]][3]
	if ok, _, err := check(h0, h1); !ok || err != nil {
		t.Errorf("a check on two healthy masters, one frozen elsewhere: allowed %v, %v; want allowed", ok, err)
	} else {
		admitted[h0]++
		admitted[h1]++
	}
	if ok, _, err := check(h0, keys[frozenAddr][3]); ok || err == nil {
		t.Errorf("a check needing the frozen master: allowed %v, %v; want an error (the caller's policy decides)", ok, err)
	}
	wg.Wait()
	if !m.ForKey(keys[frozenAddr][0]).Breaker().Open() {
		t.Error("the frozen master's breaker is not open")
	}
	for _, a := range healthyAddrs {
		if m.ForKey(keys[a][0]).Breaker().Open() {
			t.Errorf("healthy master %s: breaker open", a)
		}
	}
	for a, ks := range keys {
		for _, k := range ks[:3] {
			tl := tallies[k]
			if a == frozenAddr {
				if tl.allowed != 0 || tl.failed == 0 {
					t.Errorf("%s (frozen master): %d allowed, %d failed; want 0 allowed, failures", k, tl.allowed, tl.failed)
				}
				// With the breaker open a check fails at once, but for the one probe per
				// cool-down, which waits for its timeout.
				if tl.openFailed == 0 || tl.openSlow > tl.openFailed/2 {
					t.Errorf("%s (frozen master): %d of %d checks with the breaker open were slow; want most at once", k, tl.openSlow, tl.openFailed)
				}
				continue
			}
			t.Logf("%s (healthy master %s): %d allowed, %d refused, %d failed", k, a, tl.allowed, tl.refused, tl.failed)
			wantAllowed := limit - admitted[k]
			if tl.failed != 0 || tl.allowed != wantAllowed || tl.refused != limit+10-wantAllowed {
				t.Errorf("%s (healthy master): %d allowed, %d refused, %d failed; want %d, %d, 0",
					k, tl.allowed, tl.refused, tl.failed, wantAllowed, limit+10-wantAllowed)
			}
			admitted[k] += tl.allowed
		}
	}
	t.Logf("frozen master %s for %s", frozenAddr, time.Since(start).Round(time.Millisecond))

	frozen.Thaw()
	thawed = true
	isFrozen = false
	// Normal again: the next probe (within a cool-down) closes the breaker.
	fk := keys[frozenAddr][1]
	deadline := time.Now().Add(10 * time.Second)
	for {
		ok, _, err := check(fk)
		if err == nil {
			if !ok {
				t.Fatalf("%s after SIGCONT: refused", fk)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still failing 10 s after SIGCONT: %v", fk, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, a := range healthyAddrs {
		for _, k := range keys[a] {
			if n, err := rdb.HGet(ctx, k, "n").Int(); err != nil || n != admitted[k] {
				t.Errorf("%s: Redis counts %d (%v), admitted %d", k, n, err, admitted[k])
			}
		}
	}
}

// A master of a 3-master cluster frozen (SIGSTOP) for longer than StaleAfter under the
// hybrid mode: keys on the two others keep fresh allowances, synced every interval or
// so (their syncs do not wait for the frozen master), and are decided as usual (none
// refused, none Unreachable); the frozen master's keys go stale and are refused as
// Unreachable (the caller's policy decides); a key of the frozen master first seen
// after the freeze, which no sync has brought a view of, costs a check FetchWait at most,
// never a call's timeout. After SIGCONT all are decided normally again, and Redis counts
// exactly what was admitted.
func TestHybridClusterFrozenMaster(t *testing.T) {
	// A call to Redis waits up to 3 s (the client's timeout and Run's): a sync that
	// waited for the frozen master would leave the healthy ones' keys unsynced at least
	// that long, far beyond the 1.5 s the test allows them. With 1 s and 700 ms, a
	// process not scheduled for 750 ms on a loaded machine (-race, load 8) failed it: no
	// tick, no sync and no check ran in that time.
	const callWait = 3 * time.Second
	// A check waits for an exact sync up to FetchWait, which the package's tests raise to
	// 5 s (fetchwait_test.go), past the whole freeze: a key of the frozen master whose
	// first sync had not landed when it froze (the warm-up's syncs late, load 20) had no
	// allowance, and its check waited 5 s for an exact sync, the test's loop with it: 6
	// checks of the healthy masters' keys in the freeze, and no sync of them to keep
	// Healthy true. The daemon's FetchWait is --global-timeout (at least 25 ms), never
	// above its syncs' client timeout.
	const fetchWait = 100 * time.Millisecond
	cl, rdb, m, keys := clusterMastersWait(t, 300*time.Millisecond, "rl:hfm", 3, callWait)
	h := NewHybrid(rdb, HybridOptions{Interval: 50 * time.Millisecond, FetchWait: fetchWait}).WithMasters(m)
	halt := runWithMasters(h, m, callWait, 200*time.Millisecond)
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			halt() // Run's last sync settles what each key admitted
		}
	}
	defer stop()
	lim := mustLimit(t, localbucket.FixedWindow, 1_000_000, hourWindow())
	admitted := map[string]int{}
	// decide is what the limiter does: Healthy first, then Take.
	decide := func(k string) (ok, unreachable bool) {
		now := time.Now().UnixNano()
		if !h.Healthy(now) {
			return false, true
		}
		ops := []HybridOp{{Key: []byte(k), Limit: lim, Cost: 1}}
		ok = h.Take(now, ops)
		if ok {
			admitted[k]++
		}
		return ok, !ok && ops[0].Unreachable
	}
	// admitAll checks each of ks until it is admitted, for up to 10 s in all.
	admitAll := func(ks []string, when string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for _, k := range ks {
			for {
				if ok, _ := decide(k); ok {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s: not admitted %s", k, when)
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
	// Warm: every key has a view from its master (a check admitted on a key new here
	// was admitted on credit, before its first sync), then a few syncs.
	for _, ks := range keys {
		admitAll(ks, "before the freeze")
	}
	warm := time.Now().Add(10 * time.Second)
	for _, ks := range keys {
		for _, k := range ks {
			for syncedAt(h, k) == 0 {
				if time.Now().After(warm) {
					t.Fatalf("%s: no sync within 10 s", k)
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
	time.Sleep(200 * time.Millisecond)

	frozenAddr := cl.Addrs[0]
	// A key of the frozen master first checked after the freeze: no view of it, so
	// once its first unit (on credit) is spent only an exact sync could decide it.
	fresh := ""
	for i := 0; fresh == ""; i++ {
		if k := fmt.Sprintf("rl:hfm:new:{user=%d}", i); m.ForKey(k).Addr == frozenAddr {
			fresh = k
		}
	}
	frozen := node(t, cl, frozenAddr)
	frozen.Freeze()
	keys[frozenAddr] = append(keys[frozenAddr], fresh)
	thawed := false
	defer func() {
		if !thawed {
			frozen.Thaw()
		}
	}()
	freeze := 2*h.StaleAfter() + 500*time.Millisecond // 4.5 s
	start := time.Now()
	var healthyChecks, healthyBad, frozenChecks, frozenLateAllowed int
	var firstBad string
	// How long a unit admitted on a healthy master's key waited for a sync to take it, at
	// worst, by the key's own sync times (a sync's time is when it took the key's units):
	// each check admits one, so each interval (50 ms) has a sync of the key to make. Not
	// how long ago the key was last synced when checked: a key not checked (the test's
	// goroutine not scheduled, or the 200 ms pause above) needs no sync, and that age
	// grew with every pause of the checks.
	type syncWait struct {
		seen  int64 // the key's sync time last seen
		since int64 // the first check since seen that no sync has taken (0: none)
		last  int64 // when the key was last checked
	}
	waits := map[string]*syncWait{}
	var worstWait, longest time.Duration
	var worstKey, longestKey string
	waited := func(k string) {
		synced := syncedAt(h, k)
		now := time.Now().UnixNano() // after the check: a sync whose time is past it took its unit
		w := waits[k]
		if w == nil {
			w = &syncWait{seen: synced}
			waits[k] = w
		}
		d := time.Duration(0)
		if synced != w.seen {
			w.seen = synced
			if w.since != 0 && synced >= w.since { // it took the units of the checks from since on
				d = time.Duration(synced - w.since)
				w.since = 0
			}
		}
		if w.since == 0 {
			switch {
			case w.last > synced: // the last check came after the sync: its unit waits
				w.since = w.last
			case now > synced:
				w.since = now
			}
		}
		if w.since != 0 { // no sync yet, applied or not, for the checks from since on
			d = max(d, time.Duration(now-w.since))
		}
		w.last = now
		if d > worstWait {
			worstWait, worstKey = d, k
		}
	}
	for time.Since(start) < freeze {
		for a, ks := range keys {
			for _, k := range ks {
				t0 := time.Now()
				ok, unreachable := decide(k)
				if d := time.Since(t0); d > longest {
					longest, longestKey = d, k
				}
				if a != frozenAddr {
					waited(k)
					healthyChecks++
					if !ok {
						healthyBad++
						if firstBad == "" {
							firstBad = fmt.Sprintf("%s refused (unreachable %v) %s into the freeze", k, unreachable, time.Since(start).Round(time.Millisecond))
						}
					}
					continue
				}
				frozenChecks++
				// Past StaleAfter (and a margin for the last answer's time), every check of
				// its keys is the policy's.
				if time.Since(start) > h.StaleAfter()+time.Second && (ok || !unreachable) {
					frozenLateAllowed++
				}
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Logf("frozen %s: %d checks on the healthy masters' keys, %d refused; %d on the frozen one's, %d decided without Redis past StaleAfter",
		freeze, healthyChecks, healthyBad, frozenChecks, frozenLateAllowed)
	if healthyBad != 0 {
		t.Errorf("%d of %d checks on healthy masters' keys refused; first: %s", healthyBad, healthyChecks, firstBad)
	}
	t.Logf("a unit admitted on a healthy master's key waited at worst %s for a sync (%s); the longest check took %s (%s)",
		worstWait.Round(time.Millisecond), worstKey, longest.Round(time.Millisecond), longestKey)
	// FetchWait for the batch in flight and for its own, and FetchWait for another's sync
	// of the key: not a call's 3 s timeout, which the test's loop would wait with it.
	if longest > callWait/2 {
		t.Errorf("a check of %s took %s (FetchWait %s): it waited for the frozen master's call", longestKey, longest, fetchWait)
	}
	if worstWait > callWait/2 {
		t.Errorf("a unit admitted on %s waited %s for a sync (interval 50 ms): its syncs waited for the frozen master", worstKey, worstWait)
	}
	if frozenLateAllowed != 0 {
		t.Errorf("%d checks of the frozen master's keys decided from a stale allowance (or refused as a limit) past StaleAfter", frozenLateAllowed)
	}
	if h.Reachable(time.Now().UnixNano()) || !h.Healthy(time.Now().UnixNano()) {
		t.Error("want Reachable false (a master is away) and Healthy true (two answer)")
	}

	frozen.Thaw()
	thawed = true
	admitAll(keys[frozenAddr], "within 10 s of SIGCONT")
	stop()
	for _, ks := range keys {
		for _, k := range ks {
			if n, err := rdb.HGet(context.Background(), k, "n").Int(); err != nil && !errors.Is(err, redis.Nil) || n != admitted[k] {
				t.Errorf("%s: Redis counts %d (%v), admitted %d", k, n, err, admitted[k])
			}
		}
	}
}

// A periodic sync that takes no key of a master (its cap reached first) leaves that
// master's breaker's probe alone: a probe taken and not used would keep the breaker
// open for good, no call ever let through to close it.
func TestHybridFlushLeavesUnusedProbe(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never called
	defer rdb.Close()
	b := NewBreaker(1, 10*time.Millisecond)
	h := NewHybrid(rdb, HybridOptions{}).WithBreaker(b)
	lim := mustLimit(t, localbucket.FixedWindow, 50, hourWindow())
	take(h, time.Now().UnixNano(), "rl:probe:{user=1}", lim, 1) // on credit: dirty
	b.Failure()
	time.Sleep(30 * time.Millisecond) // open, and due for a probe
	if n, err := h.flush(context.Background(), time.Now().UnixNano(), 0, false); n != 0 || err != nil {
		t.Fatalf("a sync capped at 0 keys sent %d (%v)", n, err)
	}
	if !b.Allow() {
		t.Fatal("the sync took the breaker's probe and sent nothing")
	}
}

// A daemon with no key to sync while Redis is away: its sync breaker opens on the failed
// heartbeats, and once Redis answers again it closes. Before, the periodic sync took the
// open breaker's probe each cool-down even with nothing to send, never gave it back, and
// the heartbeat was refused for good: the breaker stayed open, every hybrid key stale,
// long after Redis was back.
func TestHybridIdleBreakerCloses(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	b := NewBreaker(1, 50*time.Millisecond)
	h := NewHybrid(rdb, HybridOptions{Interval: 20 * time.Millisecond}).WithBreaker(b)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.Run(ctx, h.id, func() int64 { return time.Now().UnixNano() }, 200*time.Millisecond, func(error) {})
	}()
	defer func() { cancel(); <-done }()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("not %s within 10 s", what)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	srv.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	waitFor("open", b.Open)
	time.Sleep(300 * time.Millisecond) // several cool-downs, and syncs with nothing to send
	srv.Thaw()
	thawed = true
	waitFor("closed after Redis answers again", func() bool { return !b.Open() && h.Healthy(time.Now().UnixNano()) })
}

// A master of the cluster killed, its replica promoted: global checks of its keys fail,
// its breaker opens (no call reaches the cluster client, so no redirection makes it
// reload its slot map), and Masters.Run, reloading the map while a breaker is open, gives
// those slots their new master and its closed breaker: the checks are decided by Redis
// again, not left behind the dead node's open breaker.
// runWithMasters runs h's syncs and heartbeats (Hybrid.Run, its calls bounded by
// callWait, on the wall clock) and m's slot map (Masters.Run, refreshed every mapEvery)
// until stop, which waits for both to end.
func runWithMasters(h *Hybrid, m *Masters, callWait, mapEvery time.Duration) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg gosync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		h.Run(ctx, h.id, func() int64 { return time.Now().UnixNano() }, callWait, func(error) {})
	}()
	go func() {
		defer wg.Done()
		m.Run(ctx, mapEvery)
	}()
	return func() { cancel(); wg.Wait() }
}

func TestMastersClusterFailover(t *testing.T) {
	cl := redistest.StartCluster(t) // node timeout 2 s: a quick failover
	replica := cl.AddReplica(t, 0)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	m := NewMasters(rdb, 3, 200*time.Millisecond, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		m.Run(ctx, 100*time.Millisecond)
	}()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(10 * time.Second)
	for len(m.List()) != 3 { // the first Refresh: the three masters
		if time.Now().After(deadline) {
			t.Fatalf("masters %d, want 3", len(m.List()))
		}
		time.Sleep(10 * time.Millisecond)
	}
	var key string
	for i := 0; key == ""; i++ {
		if k := fmt.Sprintf("rl:fo:{user=%d}", i); m.ForKey(k).Addr == cl.Addrs[0] {
			key = k
		}
	}
	g := NewGlobal(rdb).WithAutoPipeline().WithMasters(m)
	lim := mustLimit(t, localbucket.FixedWindow, 1000, hourWindow())
	check := func() error {
		c, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		ok, err := g.Check(c, []GlobalOp{{Key: key, Limit: lim, Cost: 1}})
		if err == nil && !ok {
			err = errors.New("refused")
		}
		return err
	}
	// The master decides the key before it dies. The first call on a new client also
	// loads its slot map and the script (NOSCRIPT, then EVAL), and a -race run at load 17
	// took longer than a check's 500 ms ("global check of 1 keys in slot 1006: i/o
	// timeout"): the test waits for a check that succeeds (failed ones may open the
	// master's breaker, which a later check closes as its probe).
	deadline = time.Now().Add(10 * time.Second)
	for {
		err := check()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not decided by its live master within 10 s: %v", key, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	dead := m.ForKey(key)
	cl.Nodes[0].Stop()
	start := time.Now()
	deadline = time.Now().Add(60 * time.Second)
	for !dead.Breaker().Open() {
		_ = check()
		if time.Now().After(deadline) {
			t.Fatal("the dead master's breaker did not open")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The failover takes the 2 s node timeout and an election; go-redis alone would
	// reload its slot map only after a minute.
	deadline = start.Add(20 * time.Second)
	var err2 error
	for {
		if err2 = check(); err2 == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still failing 20 s after its master died: %v (master %s, breaker open %v)", key, err2, m.ForKey(key).Addr, m.ForKey(key).Breaker().Open())
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("decided by Redis again %s after the master died (failover after the 2 s node timeout)", time.Since(start).Round(time.Millisecond))
	// The client's map may still be settling (a node's view can lag, and a redirection
	// answers the check meanwhile): the slot follows the map to the new master.
	for {
		got := m.ForKey(key)
		if got.Addr == replica.Addr && got != dead && !got.Breaker().Open() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: master %s (open %v), want the promoted replica %s, closed", key, got.Addr, got.Breaker().Open(), replica.Addr)
		}
		_ = check()
		time.Sleep(50 * time.Millisecond)
	}
}

// Global.ProbeOpen, on a cluster: an open breaker of a master that answers closes, with
// no check sent; one of a frozen master stays open; a closed one is not pinged.
func TestGlobalProbeOpenCluster(t *testing.T) {
	cl := redistest.StartCluster(t)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	m := NewMasters(rdb, 1, 50*time.Millisecond, nil)
	if err := m.Refresh(context.Background()); err != nil || len(m.List()) != 3 {
		t.Fatalf("masters %d (%v), want 3", len(m.List()), err)
	}
	var pings int
	g := NewGlobal(rdb).WithAutoPipeline().WithMasters(m).WithObserver(func(op string, _ time.Duration, _ error) {
		if op == "ping" {
			pings++
		}
	})
	byAddr := map[string]*Master{}
	for _, x := range m.List() {
		byAddr[x.Addr] = x
	}
	frozen, back := byAddr[cl.Addrs[0]], byAddr[cl.Addrs[1]]
	if frozen == nil || back == nil {
		t.Fatalf("masters %v: want %s and %s among them", m.List(), cl.Addrs[0], cl.Addrs[1])
	}
	frozen.Breaker().Failure()
	back.Breaker().Failure()
	cl.Nodes[0].Freeze()
	defer cl.Nodes[0].Thaw()
	time.Sleep(20 * time.Millisecond) // the first wait: an eighth of the cool-down
	g.ProbeOpen(context.Background(), 200*time.Millisecond)
	if back.Breaker().Open() {
		t.Error("the breaker of a master that answers is still open after ProbeOpen")
	}
	if !frozen.Breaker().Open() {
		t.Error("the breaker of the frozen master closed")
	}
	if pings != 2 {
		t.Errorf("%d pings, want 2: the two open breakers, not the closed one", pings)
	}
}

// A replica promoted by a failover (CLUSTER FAILOVER here) and a master added and given a
// slot have an empty script cache: Redis does not replicate SCRIPT LOAD. The daemon's
// slot map loads its scripts into each master new to it before the map sends it calls,
// so the first checks there are not answered NOSCRIPT (and sent again with EVAL, two
// round trips). Before, nothing loaded them.
func TestMastersLoadScriptsIntoNewMasters(t *testing.T) {
	cl := redistest.StartCluster(t)
	r := cl.AddReplica(t, 0)
	a := cl.AddMaster(t)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	cc := rdb.(*redis.ClusterClient)
	ctx := context.Background()
	if err := LoadScripts(ctx, rdb); err != nil { // as the daemon does at its start
		t.Fatal(err)
	}
	m := NewMasters(rdb, 3, time.Second, nil)
	if err := m.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	// The added master takes an empty slot of master 1; master 0's replica takes over.
	var slot int
	for s := range Slots {
		if m.ForSlot(uint16(s)).Addr == cl.Addrs[1] {
			slot = s
			break
		}
	}
	cl.MoveSlot(t, slot, cl.Nodes[1], a, 10, nil)
	if _, err := r.Command("CLUSTER", "FAILOVER"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		cc.ReloadState(ctx)
		if err := m.Refresh(ctx); err != nil {
			t.Fatal(err)
		}
		addrs := map[string]bool{}
		for _, x := range m.List() {
			addrs[x.Addr] = true
		}
		if addrs[r.Addr] && addrs[a.Addr] {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the slot map's masters %v lack the promoted replica %s or the added master %s", addrs, r.Addr, a.Addr)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, n := range []*redistest.Server{r, a} {
		c := redis.NewClient(&redis.Options{Addr: n.Addr})
		defer c.Close()
		var shas []string
		for _, src := range scriptSources() {
			shas = append(shas, redis.NewScript(src).Hash())
		}
		has, err := c.ScriptExists(ctx, shas...).Result()
		if err != nil {
			t.Fatal(err)
		}
		for i, ok := range has {
			if !ok {
				t.Errorf("master %s, new to the slot map, lacks script %d of %d", n.Addr, i+1, len(has))
			}
		}
	}
}
