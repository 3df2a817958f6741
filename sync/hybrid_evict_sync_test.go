package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A key the cap evicts before a sync carried what it admitted has those units synced
// all the same, by the next sync (or the release, as the daemon stops): a flood of new
// keys past the cap costs Redis no more than the keys would have, and loses nothing from
// the shared budget. One key a shard, 600 new keys of one unit each: Redis counts every
// unit admitted. Before, the first key evicted in each shard lost its unit (admitted on
// credit, not yet synced), counted in Dropped: 64 of 600, each one a unit the key's
// client could spend again.
func TestHybridEvictedKeySyncsItsUnits(t *testing.T) {
	for _, release := range []bool{false, true} {
		t.Run(map[bool]string{false: "sync", true: "release"}[release], func(t *testing.T) {
			rdb := standalone(t)
			ctx := context.Background()
			h := NewHybrid(rdb, HybridOptions{MaxKeys: hybridShards, FetchWait: 5 * time.Second})
			lim := mustLimit(t, localbucket.FixedWindow, 10, hourWindow())
			now := time.Now().UnixNano()
			const keys = 600
			admitted := 0
			for i := range keys {
				if take(h, now, fmt.Sprintf("rl:ev:{k=%d}", i), lim, 1).Allowed {
					admitted++
				}
			}
			if h.Evicted() == 0 {
				t.Fatal("nothing evicted: the test no longer tests the cap")
			}
			if release { // the daemon's last sync, as it stops
				if err := h.Release(ctx, now); err != nil {
					t.Fatal(err)
				}
			} else {
				syncAll(t, now, h)
			}
			counted := 0
			for i := range keys {
				n, err := rdb.HGet(ctx, fmt.Sprintf("rl:ev:{k=%d}", i), "n").Int()
				if err != nil && err != redis.Nil {
					t.Fatal(err)
				}
				counted += n // a key Redis never saw: 0
			}
			if counted != admitted || h.Dropped() != 0 {
				t.Fatalf("%d admitted, %d counted in Redis, %d dropped (%d evicted): want every unit counted, none dropped",
					admitted, counted, h.Dropped(), h.Evicted())
			}
		})
	}
}

// A key evicted holding units, that comes back before the next sync carries them, is
// counted once: the sync of the evicted entry leaves the daemon's record of the key
// (the new entry's, whose grant the record names) alone. One key a shard: A admits a
// unit on credit, B evicts it, A comes back (an exact sync: its shard forgot a key not
// full) and evicts B. Written by the evicted entry's sync, the record was not the new
// entry's, whose next sync then counted its used grant again: 3 counted of 2 admitted.
func TestHybridEvictedKeyBackCountsOnce(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	h := NewHybrid(rdb, HybridOptions{MaxKeys: hybridShards, FetchWait: 5 * time.Second})
	lim := mustLimit(t, localbucket.FixedWindow, 10, hourWindow())
	now := time.Now().UnixNano()
	var keys []string // two keys of one shard
	for i := 0; len(keys) < 2; i++ {
		k := fmt.Sprintf("rl:back:{k=%d}", i)
		if len(keys) == 0 || h.shardOf([]byte(k)) == h.shardOf([]byte(keys[0])) {
			keys = append(keys, k)
		}
	}
	a, b := keys[0], keys[1]
	admitted := 0
	for _, k := range []string{a, b, a} {
		if take(h, now, k, lim, 1).Allowed {
			admitted++
		}
	}
	if h.Evicted() < 2 {
		t.Fatalf("%d evicted, want 2: the test no longer tests the cap", h.Evicted())
	}
	for range 3 { // the evicted entries' sync, then the new entry's
		syncAll(t, now, h)
		if take(h, now, a, lim, 1).Allowed {
			admitted++
		}
	}
	syncAll(t, now, h)
	counted := 0
	for _, k := range keys {
		n, err := rdb.HGet(ctx, k, "n").Int()
		if err != nil && err != redis.Nil {
			t.Fatal(err)
		}
		counted += n
	}
	if counted != admitted {
		t.Fatalf("%d admitted, %d counted in Redis (%d dropped, %d evicted): want each unit counted once",
			admitted, counted, h.Dropped(), h.Evicted())
	}
}
