package sync

import (
	"context"
	"math"
	"runtime"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// floodCallWait bounds each call to Redis of this file's floods: at standalone's 1 s, a
// loaded machine's Redis took longer over one of a flood's calls (512 of 200000 keys not
// synced: i/o timeout; 512 of 50000 in TestHybridCollectAllocatesItsItemsOnce's settle).
const floodCallWait = 5 * time.Second

// After a flood of new keys is synced, the shards give back what the flood grew at their
// next sweep: the maps of units on their way (onWay) and the dirty lists' arrays. A Go map keeps the
// memory of its largest size, and a slice resliced to nothing its array: kept, they
// held about 100 MB for good after 4,000,000 keys (--max-keys' default) were synced
// (BenchmarkMemoryAtMaxKeys, a heap profile of the daemon: 60 MB of onWay maps, none of
// them holding an entry, and 41 MB of dirty lists).
func TestHybridSyncGivesBackFloodMemory(t *testing.T) {
	rdb := standaloneWait(t, floodCallWait)
	h := NewHybrid(rdb, HybridOptions{MaxKeys: 1_000_000})
	if _, err := h.Heartbeat(context.Background(), "flood", time.Minute); err != nil {
		t.Fatal(err)
	}
	lim := mustLimit(t, localbucket.TokenBucket, 100, time.Hour)
	now := time.Now().UnixNano()
	// About 1,560 keys a shard, each with a unit admitted on credit, so on its way at the
	// sync: more than onWayKeep and dirtyKeep in every shard.
	const keys = 100_000
	for i := range keys {
		if r := take(h, now, "rl:flood~fp:{user="+strconv.Itoa(i)+"}", lim, 1); !r.Allowed {
			t.Fatalf("key %d: its first unit was refused; the test needs it admitted on credit", i)
		}
	}
	for i := range h.shards {
		if sh := &h.shards[i]; len(sh.dirty) <= max(onWayKeep, dirtyKeep) {
			t.Fatalf("shard %d: %d keys to sync; the test needs more than %d", i, len(sh.dirty), max(onWayKeep, dirtyKeep))
		}
	}
	if err := h.Flush(context.Background(), now); err != nil {
		t.Fatal(err)
	}
	for i := range h.shards {
		h.sweep(i, now) // as Run does, a shard an interval (the keys are not idle: all kept)
		sh := &h.shards[i]
		sh.mu.Lock()
		onWay, dirty, dirtyCap := sh.onWay, len(sh.dirty), cap(sh.dirty)
		sh.mu.Unlock()
		if onWay != nil {
			t.Errorf("shard %d: its map of units on their way kept after the sync (%d entries)", i, len(onWay))
		}
		if dirtyCap > max(dirtyKeep, 2*dirty) {
			t.Errorf("shard %d: its dirty list kept an array of %d for %d keys", i, dirtyCap, dirty)
		}
	}
	if n := h.Len(); n != keys {
		t.Fatalf("%d keys held after the sync, want %d", n, keys)
	}
}

// A sync makes room for its keys at once (collect): grown by append, the items of a sync
// of 100,000 keys (17.6 MB) took 40 MB of allocations, and syncing a flood of new keys
// that was 86% of what the daemon allocated (a heap profile of BenchmarkMemoryAtMaxKeys'
// daemon), the garbage that took its heap to twice what it held.
func TestHybridCollectAllocatesItsItemsOnce(t *testing.T) {
	rdb := standaloneWait(t, floodCallWait)
	h := NewHybrid(rdb, HybridOptions{MaxKeys: 1_000_000})
	if _, err := h.Heartbeat(context.Background(), "collect", time.Minute); err != nil {
		t.Fatal(err)
	}
	lim := mustLimit(t, localbucket.TokenBucket, 100, time.Hour)
	now := time.Now().UnixNano()
	const keys = 50_000
	for i := range keys {
		take(h, now, "rl:collect~fp:{user="+strconv.Itoa(i)+"}", lim, 1)
	}
	// The maps of units on their way made beforehand (snapshot fills them), so that
	// the count below is the items'.
	for i := range h.shards {
		h.shards[i].onWay = make(map[*hentry]uint64, keys)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	items := h.collect(now, math.MaxInt)
	runtime.ReadMemStats(&after)
	if len(items) != keys {
		t.Fatalf("the sync took %d keys, want %d", len(items), keys)
	}
	need := uint64(len(items)) * uint64(unsafe.Sizeof(syncItem{}))
	if got := after.TotalAlloc - before.TotalAlloc; got > need+need/4 {
		t.Fatalf("a sync of %d keys allocated %.1f MB, its items %.1f MB", keys, float64(got)/1e6, float64(need)/1e6)
	} else {
		t.Logf("a sync of %d keys allocated %.1f MB, its items %.1f MB", keys, float64(got)/1e6, float64(need)/1e6)
	}
	if _, err := h.settle(context.Background(), items, false); err != nil {
		t.Fatal(err)
	}
}

// Once most of a flood's keys are gone (swept, each unused for KeepAlive), the shards'
// key maps are made again at their size: a Go map keeps the memory of its largest size,
// and after 4,000,000 keys were swept about 200 MB of maps holding next to nothing stayed
// for good.
func TestHybridSweepGivesBackTheKeyMap(t *testing.T) {
	rdb := standaloneWait(t, floodCallWait)
	h := NewHybrid(rdb, HybridOptions{MaxKeys: 1_000_000, KeepAlive: time.Second})
	if _, err := h.Heartbeat(context.Background(), "swept", time.Minute); err != nil {
		t.Fatal(err)
	}
	heap := func() int64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return int64(ms.HeapAlloc)
	}
	lim := mustLimit(t, localbucket.TokenBucket, 100, time.Hour)
	now := time.Now().UnixNano()
	key := func(i int) string { return "rl:swept~fp:{user=" + strconv.Itoa(i) + "}" }
	take(h, now, key(-1), lim, 1) // the shards' lazily made parts, made
	if err := h.Flush(context.Background(), now); err != nil {
		t.Fatal(err)
	}
	before := heap()
	const keys, kept = 200_000, 8 // one key in kept used again: not swept
	for i := range keys {
		take(h, now, key(i), lim, 1)
	}
	if err := h.Flush(context.Background(), now); err != nil {
		t.Fatal(err)
	}
	held := heap() - before
	later := now + int64(2*time.Hour) // idle, and full again
	for i := 0; i < keys; i += kept {
		take(h, later, key(i), lim, 1)
	}
	if err := h.Flush(context.Background(), later); err != nil {
		t.Fatal(err)
	}
	for i := range h.shards {
		h.sweep(i, later)
	}
	if n := h.Len(); n != keys/kept {
		t.Fatalf("%d keys held after the sweep, want %d", n, keys/kept)
	}
	after := heap() - before
	runtime.KeepAlive(h)
	t.Logf("%d keys: %.1f MB held; %d of them kept: %.1f MB", keys, float64(held)/1e6, keys/kept, float64(after)/1e6)
	if after > held/kept*3/2 {
		t.Fatalf("%d of %d keys kept, and %.1f MB of the %.1f MB they took, want at most %.1f", keys/kept, keys, float64(after)/1e6, float64(held)/1e6, float64(held/kept*3/2)/1e6)
	}
}
