package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// withEntry calls f with h's entry of key, if it holds one, under its shard's lock: for
// fields h's syncs (Run) write meanwhile, which entryOf's caller reads unlocked.
func withEntry(h *Hybrid, key string, f func(e *hentry)) {
	sh := &h.shards[h.shardOf([]byte(key))]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if e := sh.m[key]; e != nil {
		f(e)
	}
}

// entryOf returns h's entry of key (nil if it holds none).
func entryOf(h *Hybrid, key string) *hentry {
	sh := &h.shards[h.shardOf([]byte(key))]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.m[key]
}

// Redis restarted empty (no persistence) while two daemons held share grants of a hot
// key: the grants are forgotten with the state that held them, and each daemon's next
// sync counts everything it admitted. The first daemon's sync made the key again; the
// second's then found a key, took the grant it held from the old Redis for one of this
// key's, and took it off the count: the units the first had just counted, budget made
// from nothing (here Redis counted 3 of the 11 units the two daemons had admitted since
// their last syncs: the second daemon's used grant of 8 was taken off).
func TestHybridRedisRestartedEmptyForgetsGrants(t *testing.T) {
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow, localbucket.TokenBucket} {
		t.Run(fmt.Sprint(alg), func(t *testing.T) {
			srv := redistest.StartStandalone(t)
			rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { rdb.Close() })
			ctx := context.Background()
			lim := mustLimit(t, alg, 100, time.Hour)
			a, b := NewHybrid(rdb, HybridOptions{}), NewHybrid(rdb, HybridOptions{})
			hs := []*Hybrid{a, b}
			seeEachOther(t, "restart", hs...)
			now := time.Now().UnixNano()
			key := "rl:restart:{user=hot}"
			// The key hot on both: each asks a share grant, and holds one.
			for round := 0; round < 4; round++ {
				for _, h := range hs {
					for i := 0; i < 8; i++ {
						take(h, now, key, lim, 1)
					}
				}
				syncAll(t, now, hs...)
			}
			for i, h := range hs {
				if e := entryOf(h, key); e == nil || e.grant == 0 {
					t.Fatalf("daemon %d holds no grant", i)
				}
			}
			// Admitted from here on, within the grants; then what each daemon admitted
			// since its last sync, grant or not, is what the restarted Redis must count.
			for _, h := range hs {
				for i := 0; i < 3; i++ {
					take(h, now, key, lim, 1)
				}
			}
			unsynced := 0
			for _, h := range hs {
				unsynced += int(entryOf(h, key).pending)
			}
			srv.Restart(t) // empty: the test servers save nothing
			// Both sync (the first makes the key again), then stop: every grant back.
			for _, h := range hs {
				if err := h.Flush(ctx, now); err != nil {
					t.Logf("a sync after the restart: %v", err) // a connection the restart closed
				}
			}
			syncAll(t, now, hs...)
			for _, h := range hs {
				if err := h.Release(ctx, now); err != nil {
					t.Fatal(err)
				}
			}
			var counted float64
			if alg == localbucket.TokenBucket {
				tt, err := rdb.HGet(ctx, key, "t").Float64()
				if err != nil {
					t.Fatal(err)
				}
				tm, err := rdb.Time(ctx).Result()
				if err != nil {
					t.Fatal(err)
				}
				nowUs := float64(tm.UnixMicro())
				T := float64(time.Hour.Microseconds()) / 100
				counted = (tt - nowUs) / T
			} else {
				counted, err = rdb.HGet(ctx, key, "n").Float64()
				if err != nil {
					t.Fatal(err)
				}
			}
			t.Logf("admitted since the last sync before the restart %d, Redis counts %.3f", unsynced, counted)
			if counted < float64(unsynced)-0.01 {
				t.Fatalf("Redis counts %.3f units after the restart; the daemons admitted %d since their last sync: a grant of the old Redis was taken off the new one's count", counted, unsynced)
			}
			if counted > float64(unsynced)+0.01 {
				t.Fatalf("Redis counts %.3f units after the restart; the daemons admitted %d: a grant was not given back", counted, unsynced)
			}
		})
	}
}
