package sync

import (
	"context"
	"fmt"
	"io"
	"net"
	gosync "sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// loadHybridScript loads scripts/hybrid.lua on every node, as a daemon's first sync
// would: the counts below are of the calls themselves, not of NOSCRIPT retries.
func loadHybridScript(t *testing.T, nodes ...*redis.Client) {
	t.Helper()
	for _, n := range nodes {
		if err := hybridScript.Load(context.Background(), n).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// exactSyncsBatched runs n concurrent first requests, each on a key of its own with a
// limit of 1 per hour (so no credit: each needs an exact sync), while Redis is frozen
// under the first one's sync: the others arrive while a sync is in flight, and must go
// together in the next one. It returns the script calls the requests cost and the
// batches of exact syncs sent, and checks that each request was decided exactly: every
// first request admitted, a second one refused, Redis counting exactly one unit per key.
func exactSyncsBatched(t *testing.T, rdb redis.UniversalClient, freeze, thaw func(), calls func() int, prefix string, n int) (int, int) {
	t.Helper()
	ctx := context.Background()
	lim := mustLimit(t, localbucket.FixedWindow, 1, hourWindow())
	var batches atomic.Int64
	h := NewHybrid(rdb, HybridOptions{ID: "batch", FetchWait: 10 * time.Second}).WithObserver(func(op string, _ time.Duration, _ error) {
		if op == "hybrid_fetch" {
			batches.Add(1)
		}
	})
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s:{user=%d}", prefix, i)
	}
	before := calls()
	freeze()
	allowed := make([]bool, n)
	var wg gosync.WaitGroup
	for i := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ops := []HybridOp{{Key: []byte(keys[i]), Limit: lim, Cost: 1}}
			allowed[i] = h.Take(time.Now().UnixNano(), ops)
		}()
	}
	time.Sleep(500 * time.Millisecond) // every request has queued behind the frozen sync
	thaw()
	wg.Wait()
	got, sent := calls()-before, int(batches.Load())
	for i, k := range keys {
		if !allowed[i] {
			t.Fatalf("%s: a client's first request was refused with a limit of 1 per hour", k)
		}
		if take(h, time.Now().UnixNano(), k, lim, 1).Allowed {
			t.Fatalf("%s: a second request was admitted with a limit of 1 per hour", k)
		}
		if c, err := rdb.HGet(ctx, k, "n").Int(); err != nil || c != 1 {
			t.Fatalf("%s: Redis counts %d (%v), want 1: the unit admitted was not counted exactly once", k, c, err)
		}
	}
	return got, sent
}

// Exact syncs that arrive while one is in flight go together in the next send: many
// keys per script call (fetchCallKeys), as the global mode batches its checks. Before,
// each waiting request was a script call of its own.
func TestHybridExactSyncsBatched(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	node := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer node.Close()
	loadHybridScript(t, node)
	const n = 150
	got, batches := exactSyncsBatched(t, rdb, srv.Freeze, srv.Thaw, func() int { return evalCalls(t, rdb) }, "rl:xb", n)
	// Two batches at most (the one frozen, the rest) of n keys in all, fetchCallKeys
	// keys a call.
	want := 1 + (n+fetchCallKeys-1)/fetchCallKeys
	if got > want || batches > 2 {
		t.Fatalf("%d concurrent exact syncs cost %d script calls in %d batches, want at most %d in 2", n, got, batches, want)
	}
	t.Logf("%d concurrent exact syncs: %d script calls in %d batches", n, got, batches)
}

// On a 3-master cluster the exact syncs queued together are one call per master (of at
// most fetchCallKeys keys), whatever their slots.
func TestHybridExactSyncsBatchedCluster(t *testing.T) {
	cl := redistest.StartCluster(t)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	nodes := make([]*redis.Client, len(cl.Addrs))
	for i, a := range cl.Addrs {
		nodes[i] = redis.NewClient(&redis.Options{Addr: a})
		defer nodes[i].Close()
	}
	loadHybridScript(t, nodes...)
	calls := func() int {
		c := 0
		for _, n := range nodes {
			c += evalCalls(t, n)
		}
		return c
	}
	freeze := func() {
		for _, n := range cl.Nodes {
			n.Freeze()
		}
	}
	thaw := func() {
		for _, n := range cl.Nodes {
			n.Thaw()
		}
	}
	const n = 150 // about 50 keys on each master, in about 150 slots
	got, batches := exactSyncsBatched(t, rdb, freeze, thaw, calls, "rl:xbc", n)
	// Two batches at most (the one frozen, the rest), each one call per master (about
	// 50 keys each, under fetchCallKeys).
	if want := 2 * len(cl.Addrs); got > want || batches > 2 {
		t.Fatalf("%d concurrent exact syncs on a %d-master cluster cost %d script calls in %d batches, want at most %d calls in 2 batches",
			n, len(cl.Addrs), got, batches, want)
	}
	t.Logf("%d concurrent exact syncs on a %d-master cluster: %d script calls in %d batches", n, len(cl.Addrs), got, batches)
}

// Concurrent requests on a few keys, over their limit, from several daemons: every key
// admits exactly its limit in all, whatever the batches, and Redis counts exactly what
// was admitted (nothing taken twice, nothing lost).
func TestHybridExactSyncsBatchedExact(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	const daemons, keys, perKey, limit = 3, 40, 12, 5
	lim := mustLimit(t, localbucket.FixedWindow, limit, hourWindow())
	hs := make([]*Hybrid, daemons)
	for i := range hs {
		hs[i] = NewHybrid(rdb, HybridOptions{ID: fmt.Sprint("d", i), FetchWait: 5 * time.Second})
		hs[i].SetReplicas(daemons)
	}
	admitted := make([]int, keys)
	var mu gosync.Mutex
	var wg gosync.WaitGroup
	for k := range keys {
		for r := range perKey {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ops := []HybridOp{{Key: []byte(fmt.Sprintf("rl:xe:{user=%d}", k)), Limit: lim, Cost: 1}}
				if hs[(k+r)%daemons].Take(time.Now().UnixNano(), ops) {
					mu.Lock()
					admitted[k]++
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	for _, h := range hs { // settle every key and give back every grant
		if err := h.Release(ctx, time.Now().UnixNano()); err != nil {
			t.Fatal(err)
		}
	}
	total := 0
	for k := range keys {
		key := fmt.Sprintf("rl:xe:{user=%d}", k)
		if admitted[k] > limit {
			t.Fatalf("%s: admitted %d of %d with a limit of %d", key, admitted[k], perKey, limit)
		}
		if c, err := rdb.HGet(ctx, key, "n").Int(); err != nil || c != admitted[k] {
			t.Fatalf("%s: Redis counts %d (%v), %d admitted", key, c, err, admitted[k])
		}
		total += admitted[k]
	}
	t.Logf("admitted %d of %d requests, limit %d per key over %d keys", total, keys*perKey, limit, keys)
}

// A batch whose call to one master fails (the master frozen past FetchWait) fails only
// the requests whose keys live there: the others, in the same batch, are decided from
// their replies as soon as their masters answer, not when the frozen one times out, and
// nothing is counted twice once the master is back.
func TestHybridExactSyncsBatchFailureIsPerCall(t *testing.T) {
	cl := redistest.StartCluster(t)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	cc := rdb.(*redis.ClusterClient)
	ctx := context.Background()
	nodes := make([]*redis.Client, len(cl.Addrs))
	for i, a := range cl.Addrs {
		nodes[i] = redis.NewClient(&redis.Options{Addr: a})
		defer nodes[i].Close()
	}
	loadHybridScript(t, nodes...)
	lim := mustLimit(t, localbucket.FixedWindow, 1, hourWindow())
	const n = 60
	keys := make([]string, n)
	onFrozen := make([]bool, n)
	frozen := cl.Nodes[0]
	for i := range keys {
		keys[i] = fmt.Sprintf("rl:xf:{user=%d}", i)
		m, err := cc.MasterForKey(ctx, keys[i])
		if err != nil {
			t.Fatal(err)
		}
		onFrozen[i] = m.Options().Addr == frozen.Addr
	}
	const fetchWait = time.Second
	h := NewHybrid(rdb, HybridOptions{ID: "fail", FetchWait: fetchWait})
	// Every request queues behind a batch in flight (as if one were), so all of them go
	// in one batch when it is handed on.
	q := &h.fetchQ
	q.mu.Lock()
	q.busy = true
	q.mu.Unlock()
	allowed := make([]bool, n)
	took := make([]time.Duration, n)
	var start time.Time
	var wg gosync.WaitGroup
	for i := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			allowed[i] = h.Take(time.Now().UnixNano(), []HybridOp{{Key: []byte(keys[i]), Limit: lim, Cost: 1}})
			took[i] = time.Since(start)
		}()
	}
	for {
		q.mu.Lock()
		queued := len(q.queue)
		q.mu.Unlock()
		if queued == n {
			break
		}
		time.Sleep(time.Millisecond)
	}
	frozen.Freeze()
	q.mu.Lock()
	lead := q.queue[0]
	q.mu.Unlock()
	leadKey := lead.items[0].e.key() // the request that sends the batch waits for all of it
	start = time.Now()
	lead.done <- true // the batch in flight is done: the first queued sends the next
	wg.Wait()
	frozen.Thaw()
	healthy := 0
	for i, k := range keys {
		if onFrozen[i] {
			if allowed[i] {
				t.Fatalf("%s: admitted though its master was frozen past FetchWait", k)
			}
			continue
		}
		healthy++
		if !allowed[i] {
			t.Fatalf("%s: refused though its master answered (a failure on another master failed it)", k)
		}
		if k != leadKey && took[i] >= fetchWait/2 {
			t.Fatalf("%s: decided %v after its batch went, though its master answered: it waited for the frozen one", k, took[i])
		}
	}
	if healthy == 0 || healthy == n {
		t.Fatalf("%d of %d keys on healthy masters: want some of each", healthy, n)
	}
	// Nothing was admitted for the frozen master's keys, and the healthy keys were
	// counted once: a sync of every key now settles what each admitted.
	if err := h.Release(ctx, time.Now().UnixNano()); err != nil {
		t.Fatal(err)
	}
	for i, k := range keys {
		want := 0
		if allowed[i] {
			want = 1
		}
		if c, err := rdb.HGet(ctx, k, "n").Int(); (err != nil && err != redis.Nil) || c != want {
			t.Fatalf("%s: Redis counts %d (%v), want %d", k, c, err, want)
		}
	}
}

// On a standalone Redis a daemon's heartbeat rides on its syncs' script calls while it
// makes some (an exact sync every few milliseconds here): no heartbeat call of its own
// after the first, yet the live-daemons set sees it every second; once the traffic
// stops, heartbeats go alone again.
func TestHybridHeartbeatRidesOnSyncs(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	var alone atomic.Int64
	h := NewHybrid(rdb, HybridOptions{ID: "ride", Interval: 20 * time.Millisecond}).WithObserver(func(op string, _ time.Duration, err error) {
		if op == "heartbeat" && err == nil {
			alone.Add(1)
		}
	})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.Run(runCtx, "ride", func() int64 { return time.Now().UnixNano() }, time.Second, func(error) {})
	}()
	defer func() { stop(); <-done }()
	score := func() float64 {
		v, err := rdb.ZScore(ctx, DaemonsKey, "ride").Result()
		if err == redis.Nil {
			return 0 // dropped from the set: no heartbeat within its TTL
		}
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for alone.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	first := score()
	lim := mustLimit(t, localbucket.FixedWindow, 1, hourWindow())
	fetches := h.Fetches()
	// Until two heartbeats have ridden (about 2 s): each is offered an interval before
	// it is due, a second after the last one's reply, and rides on the next sync. On a
	// starved host (load 17-19, -race) the ticks and replies come late and the second
	// ride came after the 2.5 s this loop once had: the set had advanced 1,075 ms.
	start, last := time.Now(), first
	for i, end := 0, start.Add(10*time.Second); last < first+1500 || h.Fetches()-fetches < 100; i++ {
		if time.Now().After(end) {
			t.Fatalf("the live-daemons set saw the daemon at %v ms, then at %v after %d exact syncs in 10 s: no heartbeat rode on the syncs",
				first, last, h.Fetches()-fetches)
		}
		take(h, time.Now().UnixNano(), fmt.Sprintf("rl:ride:{user=%d}", i), lim, 1) // an exact sync each
		time.Sleep(5 * time.Millisecond)
		last = score()
	}
	if n := alone.Load(); n != 1 {
		t.Fatalf("%d heartbeat calls of their own while exact syncs went every 5 ms, want 1 (the first)", n)
	}
	t.Logf("the set advanced %v ms in %s, %d exact syncs", last-first, time.Since(start).Round(time.Millisecond), h.Fetches()-fetches)
	if h.Replicas() != 1 {
		t.Fatalf("replicas %d, want 1", h.Replicas())
	}
	// No traffic: the next heartbeat goes alone, within its period and an interval.
	deadline := time.Now().Add(3 * time.Second)
	for alone.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("no heartbeat of its own within 3 s of the traffic stopping")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// An exact sync that outlives FetchWait is decided without Redis, but Redis may run it
// all the same and reserve its units for this daemon. The key's next sync gives them
// back (the record's token marks it a resend), so that sync must come: Redis then counts
// nothing for the request no daemon admitted, and another daemon admits the key's one
// unit. Before, the entry, having nothing else to settle, was never synced again, and
// Redis counted a unit nobody had admitted until the window ended.
func TestHybridLateExactSyncGivesBack(t *testing.T) {
	srv := redistest.StartStandalone(t)
	var slow atomic.Bool
	// FetchWait and the answers' delay leave a loaded machine time to write the sync
	// (with 100 ms, and the connection dialed within it, a -race run under load sent
	// nothing before the deadline: Redis counted 0, and the test showed nothing).
	const fetchWait, delay = 500 * time.Millisecond, time.Second
	addr := delayedReplies(t, srv.Addr, &slow, delay)
	rdb, err := Open(Config{URL: "redis://" + addr, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	node := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer node.Close()
	loadHybridScript(t, node)
	ctx := context.Background()
	if err := rdb.Ping(ctx).Err(); err != nil { // dialed: the sync is written at once
		t.Fatal(err)
	}
	lim := mustLimit(t, localbucket.FixedWindow, 1, hourWindow())
	const key = "rl:late:{user=u}"
	a := NewHybrid(rdb, HybridOptions{ID: "late-a", FetchWait: fetchWait})
	b := NewHybrid(rdb, HybridOptions{ID: "late-b", FetchWait: 5 * time.Second})

	// Redis runs the exact sync at once; its answer comes a second later, after FetchWait.
	slow.Store(true)
	if take(a, time.Now().UnixNano(), key, lim, 1).Allowed {
		t.Fatal("admitted without an answer from Redis and no view of the key")
	}
	slow.Store(false)
	// Redis has run it, or does soon (the proxy forwards it on its own time).
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		n, err := node.HGet(ctx, key, "n").Int()
		if err == nil && n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Redis counts %d (%v) after the late exact sync, want its reserved unit: the test shows nothing", n, err)
		}
	}
	time.Sleep(delay + 100*time.Millisecond) // the late answer is out of the way
	if err := a.Flush(ctx, time.Now().UnixNano()); err != nil {
		t.Fatal(err)
	}
	if n, _ := node.HGet(ctx, key, "n").Int(); n != 0 {
		t.Fatalf("after the next sync Redis counts %d for a request no daemon admitted, want 0", n)
	}
	if !take(b, time.Now().UnixNano(), key, lim, 1).Allowed {
		t.Fatal("another daemon was refused the key's one unit, which nobody had admitted")
	}
}

// delayedReplies proxies TCP connections to target, holding the arrays target answers
// (a script's answers) for delay while slow is set: requests, and a new connection's
// handshake, go through at once. It returns its address.
func delayedReplies(t *testing.T, target string, slow *atomic.Bool, delay time.Duration) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			go func() { _, _ = io.Copy(s, c); s.Close() }()
			go func() {
				defer c.Close()
				buf := make([]byte, 64<<10)
				for {
					n, err := s.Read(buf)
					if n > 0 {
						// A script's answer is an array; the handshake's (HELLO) is a
						// map.
						if slow.Load() && buf[0] == '*' {
							time.Sleep(delay)
						}
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// A sync Redis answered with an error did not reserve anything, and a resend would fail
// the same way (counting against the breaker each time): only a sync whose answer was
// lost is settled again.
func TestMayHaveRun(t *testing.T) {
	srv := redistest.StartStandalone(t)
	node := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer node.Close()
	refused := node.Do(context.Background(), "NOSUCHCOMMAND").Err()
	if refused == nil || mayHaveRun(refused) {
		t.Fatalf("an error Redis answered (%v) taken for a lost answer", refused)
	}
	// errNotSent: a global call the auto-pipeline held past its deadline and never sent
	// (a lease acquire's give-back was queued for it, filling the bounded queue).
	for _, err := range []error{errNotServed, &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED},
		&net.OpError{Op: "dial", Err: syscall.ENOENT}, fmt.Errorf("%w (%w)", errNotSent, context.DeadlineExceeded)} {
		if mayHaveRun(err) {
			t.Fatalf("%v: a sync that never reached Redis taken for a lost answer", err)
		}
	}
	for _, err := range []error{context.DeadlineExceeded, io.EOF, fmt.Errorf("sync: %w", context.DeadlineExceeded)} {
		if !mayHaveRun(err) {
			t.Fatalf("%v: a lost answer taken for a refusal", err)
		}
	}
}
