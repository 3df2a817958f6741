package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// TestHybridEvictedLimitedKeyGetsNoFirstUnit: more clients over their limit than the
// daemon keeps keys (--max-keys). A key evicted and seen again is a key new to the
// daemon, which used to admit a unit before its first sync: 2,000 clients of a limit of
// 4 an hour, 10 requests each through 640 keys, were admitted 19,169 of 20,000 (Redis
// counted up to 10 a client). Now a shard that forgot a key not yet full gives its new
// keys no such unit until that key would be full again: each is decided by an exact
// sync, as the global mode decides it. What is admitted is the limit, plus the units
// eviction dropped before they reached Redis (counted in Dropped; a separate loss).
func TestHybridEvictedLimitedKeyGetsNoFirstUnit(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	h := NewHybrid(rdb, HybridOptions{MaxKeys: 640})
	const limit, clients, visits = 4, 2000, 10
	lim := mustLimit(t, localbucket.FixedWindow, limit, hourWindow())
	now := time.Now().UnixNano()
	admitted := 0
	for v := 0; v < visits; v++ {
		for k := 0; k < clients; k++ {
			if take(h, now, fmt.Sprintf("rl:evict:{user=%d}", k), lim, 1).Allowed {
				admitted++
			}
			if k%20 == 0 { // a sync every 20 new keys, as Run's early syncs
				if err := h.Flush(ctx, now); err != nil {
					t.Fatal(err)
				}
			}
			now += int64(time.Millisecond)
		}
	}
	if err := h.Flush(ctx, now); err != nil {
		t.Fatal(err)
	}
	if h.Evicted() == 0 {
		t.Fatal("nothing was evicted: the test does not test eviction")
	}
	if bound := clients*limit + int(h.Dropped()); admitted > bound {
		t.Fatalf("%d clients of a limit of %d, %d requests each, through %d keys: admitted %d, at most %d (the limit, plus %d units eviction dropped); %d evictions",
			clients, limit, visits, 640, admitted, bound, h.Dropped(), h.Evicted())
	}
	t.Logf("admitted %d of %d requests (limit %d; %d dropped, %d evicted)", admitted, clients*visits, clients*limit, h.Dropped(), h.Evicted())
}

// TestHybridKeyCapKeepsTheRequestsOwnKeys: a request of two descriptors whose keys,
// both new, fall in one full shard. Making room for the second must not evict the
// first, which the same request has just added and is about to charge: a key new here
// holds nothing yet and ranks first for eviction, and the unit it then admitted was
// charged to a forgotten entry, never synced, and counted nowhere (not in Dropped).
func TestHybridKeyCapKeepsTheRequestsOwnKeys(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	// 2 keys a shard. The new keys' takes wait for their exact syncs: FetchWait's default
	// (25 ms) ran out on a loaded machine, and each of the six was refused unsynced.
	h := NewHybrid(rdb, HybridOptions{MaxKeys: 2 * hybridShards, FetchWait: 5 * time.Second})
	lim := mustLimit(t, localbucket.FixedWindow, 2, hourWindow())
	now := time.Now().UnixNano()
	// Four keys of one shard: two to fill it, holding units not yet synced, and the
	// request's two.
	var keys []string
	want := uint32(0)
	for i := 0; len(keys) < 4; i++ {
		k := fmt.Sprintf("rl:own:{user=%d}", i)
		s := h.shardOf([]byte(k))
		if len(keys) == 0 {
			want = s
		}
		if s == want {
			keys = append(keys, k)
		}
	}
	for _, k := range keys[:2] {
		if !take(h, now, k, lim, 1).Allowed {
			t.Fatalf("%s: the first unit, on credit, refused", k)
		}
	}
	ops := []HybridOp{{Key: []byte(keys[2]), Limit: lim, Cost: 1}, {Key: []byte(keys[3]), Limit: lim, Cost: 1}}
	for i := 0; !h.Take(now, ops); i++ {
		t.Logf("refused: %+v %+v", ops[0].Result, ops[1].Result)
		if i == 5 {
			t.Fatalf("a request on two new keys refused %d times", i+1)
		}
		now += int64(200 * time.Millisecond)
	}
	if err := h.Flush(ctx, now); err != nil {
		t.Fatal(err)
	}
	dropped := h.Dropped()
	// A second daemon reads what Redis counts of the request's first key: 1 of 2 used.
	h2 := NewHybrid(rdb, HybridOptions{})
	admitted := 0
	for i := 0; i < 5; i++ {
		if take(h2, now, keys[2], lim, 1).Allowed {
			admitted++
		}
		if err := h2.Flush(ctx, now); err != nil {
			t.Fatal(err)
		}
	}
	if admitted != 1 {
		t.Fatalf("the request's first key, admitted 1 of a limit of 2: another daemon admitted %d more, want 1 (dropped %d, evicted %d)", admitted, dropped, h.Evicted())
	}
}

// checkLoads fails unless each shard's load is the units of the keys it holds.
func checkLoads(t *testing.T, h *Hybrid) {
	t.Helper()
	for i := range h.shards {
		sh := &h.shards[i]
		sh.mu.Lock()
		sum := 0
		for k := range sh.m {
			sum += units(len(k), h.perShard)
		}
		load := sh.load
		sh.mu.Unlock()
		if load != sum {
			t.Fatalf("shard %d: load %d, its keys' units %d", i, load, sum)
		}
	}
}

// The key cap's load stays the units of the keys held through evictions and sweeps,
// with keys short and long.
func TestHybridKeyCapLoadBalances(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	h := NewHybrid(rdb, HybridOptions{MaxKeys: 8 * hybridShards, KeepAlive: time.Millisecond})
	lim := mustLimit(t, localbucket.TokenBucket, 50, time.Second)
	now := time.Now().UnixNano()
	long := string(make([]byte, 300))
	for round := 0; round < 4; round++ {
		for i := 0; i < 3000; i++ {
			k := fmt.Sprintf("rl:load:{k=%d}", i%1500)
			if i%3 == 0 {
				k += long
			}
			ops := []HybridOp{{Key: []byte(k), Limit: lim, Cost: 1}, {Key: []byte(k + "x"), Limit: lim, Cost: 1}}
			h.Take(now, ops)
			if i%100 == 0 {
				if err := h.Flush(ctx, now); err != nil {
					t.Fatal(err)
				}
			}
		}
		checkLoads(t, h)
		if err := h.Flush(ctx, now); err != nil {
			t.Fatal(err)
		}
		now += int64(5 * time.Second)
		for i := range h.shards {
			h.sweep(i, now)
		}
		checkLoads(t, h)
	}
	if h.Evicted() == 0 {
		t.Fatal("nothing was evicted")
	}
}
