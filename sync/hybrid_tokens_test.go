package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A daemon restarted with the same ID (--daemon-id) finds its previous run's sync
// records on the keys. Its syncs must not be taken for replays or resends of those:
// every unit either run admitted is counted once. Tokens used to restart at 1 in every process, so the new run's first sync
// of a key carried the token the old run's first sync had recorded there (a replay:
// nothing counted), or prev_token 0 matching a record the old run left after its first
// sync (a resend: the old run's units taken off again).
func TestHybridSameIDRestartCountsEveryUnit(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	lim := mustLimit(t, localbucket.FixedWindow, 1000, hourWindow())
	keys := []string{"rl:restart:{user=1}", "rl:restart:{user=2}", "rl:restart:{user=3}"}
	now := time.Now().UnixNano()
	admitted := map[string]int{}
	for run := 0; run < 3; run++ {
		h := NewHybrid(rdb, HybridOptions{ID: "gw-1"})
		for _, k := range keys[:run+1] { // the keys' first syncs line up across runs
			if take(h, now, k, lim, 1).Allowed {
				admitted[k]++
			}
		}
		syncAll(t, now, h)
		if err := h.Release(ctx, now); err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range keys {
		n, err := rdb.HGet(ctx, k, "n").Int()
		if err != nil || n != admitted[k] {
			t.Errorf("%s: Redis counts %d (%v), the runs admitted %d", k, n, err, admitted[k])
		}
	}
}

// A key a daemon forgot (evicted, or swept once full again) and sees again starts a new
// entry: its first sync must not be taken for a resend of the forgotten entry's first
// sync, whose record is still on the key. Before, it was (both carried prev_token 0),
// and the forgotten entry's units were taken off the count again.
func TestHybridForgottenKeyCountsEveryUnit(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	lim := mustLimit(t, localbucket.FixedWindow, 1000, hourWindow())
	h := NewHybrid(rdb, HybridOptions{ID: "gw-1"})
	const key = "rl:forget:{user=1}"
	now := time.Now().UnixNano()
	admitted := 0
	forget := func() {
		t.Helper()
		b := []byte(key)
		sh := &h.shards[h.shardOf(b)]
		sh.mu.Lock()
		e := sh.m[key]
		if e == nil || e.holds() {
			sh.mu.Unlock()
			t.Fatalf("entry %+v: want one holding nothing", e)
		}
		delete(sh.m, key) // as sweep or evict would
		e.flags |= flagGone
		sh.mu.Unlock()
	}
	for round := 0; round < 3; round++ {
		// One unit on credit (a new key on a daemon), then the sync that counts it: the
		// entry's only recorded sync is its first.
		if take(h, now, key, lim, 1).Allowed {
			admitted++
		}
		syncAll(t, now, h)
		forget()
	}
	if n, err := rdb.HGet(ctx, key, "n").Int(); err != nil || n != admitted {
		t.Fatalf("Redis counts %d (%v), the daemon admitted %d", n, err, admitted)
	}
}

// A key whose last unit was an exact sync's grant, used (the usual end of a client whose
// requests rotate over the daemons: its units are in Redis, reserved by that sync), holds
// nothing Redis lacks, and is forgotten once unused for KeepAlive and full again, as any
// other key.
func TestHybridSweepForgetsUsedGrant(t *testing.T) {
	rdb := standalone(t)
	lim := mustLimit(t, localbucket.TokenBucket, 1, time.Second) // capacity 1: no first unit on credit
	// The first take waits for its exact sync: FetchWait's default (25 ms) ran out on a
	// loaded machine, and it was refused.
	h := NewHybrid(rdb, HybridOptions{ID: "gw-1", FetchWait: 5 * time.Second})
	const key = "rl:sweep:{user=1}"
	now := time.Now().UnixNano()
	if r := take(h, now, key, lim, 1); !r.Allowed {
		t.Fatalf("first request refused: %+v", r)
	}
	syncAll(t, now, h)
	syncAll(t, now, h)
	later := now + int64(30*time.Second)
	for i := range h.shards {
		h.sweep(i, later)
	}
	if n := h.Len(); n != 0 {
		b := []byte(key)
		sh := &h.shards[h.shardOf(b)]
		sh.mu.Lock()
		e := *sh.m[key]
		sh.mu.Unlock()
		t.Fatalf("%d keys held 30 s after their last use, the key full again: %+v", n, e)
	}
}
