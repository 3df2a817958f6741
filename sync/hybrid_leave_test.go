package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A daemon stopped cleanly (its last sync, Release) holds no credit: the next daemon to
// use its keys must not reserve any for it. The last sync settled everything, but the
// key still named the stopped daemon its last user, so the next daemon's first sync
// found the key changing hands and reserved the stopped daemon's possible credit (field
// k) for 60 s: a client that used 10 of 20 on one daemon, then moved to another when
// the first stopped, was admitted 5 of its remaining 10 there.
func TestHybridReleaseLeavesNoCreditReserved(t *testing.T) {
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.TokenBucket} {
		t.Run(fmt.Sprint(alg), func(t *testing.T) {
			rdb := standalone(t)
			ctx := context.Background()
			lim := mustLimit(t, alg, 20, time.Hour)
			a, b := NewHybrid(rdb, HybridOptions{}), NewHybrid(rdb, HybridOptions{})
			hs := []*Hybrid{a, b}
			seeEachOther(t, "leave", hs...)
			now := time.Now().UnixNano()
			key := "rl:leave:{user=alice}"
			used := 0
			for i := 0; i < 40 && used < 10; i++ {
				if take(a, now, key, lim, 1).Allowed {
					used++
				}
				if i%3 == 2 {
					syncAll(t, now, a)
				}
			}
			if used != 10 {
				t.Fatalf("daemon a admitted %d, want 10", used)
			}
			syncAll(t, now, a)
			if err := a.Release(ctx, now); err != nil { // a stops
				t.Fatal(err)
			}
			admitted := takeSyncing(t, b, now, key, lim, 30)
			syncAll(t, now, b)
			if err := b.Release(ctx, now); err != nil {
				t.Fatal(err)
			}
			t.Logf("a admitted %d and stopped; b then admitted %d", used, admitted)
			if k := rdb.HGet(ctx, key, "k").Val(); k != "" {
				t.Errorf("credit reserved for a daemon that stopped and settled: k = %q", k)
			}
			if admitted != 20-used {
				t.Fatalf("after a stopped having admitted %d of 20, b admitted %d, want %d", used, admitted, 20-used)
			}
		})
	}
}

// A daemon whose Run ends (a clean stop) leaves the live-daemons set after its last
// sync: the others count it gone at their next heartbeat, a second, not three seconds
// after its last one. Before, its entry stayed until it was stale, and in a blue/green
// switch the daemons that stayed sized their shares (and their local failure policies'
// buckets) by one daemon too many meanwhile.
func TestHybridRunLeavesTheLiveDaemons(t *testing.T) {
	rdb := standalone(t)
	a := NewHybrid(rdb, HybridOptions{ID: "a"})
	b := NewHybrid(rdb, HybridOptions{ID: "b"})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.Run(ctx, "a", func() int64 { return time.Now().UnixNano() }, time.Second, func(error) {})
	}()
	runHybrid(t, b, "b")
	for deadline := time.Now().Add(5 * time.Second); b.Replicas() != 2; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("b counts %d live daemons, want 2", b.Replicas())
		}
	}
	cancel()
	<-done
	if err := rdb.ZScore(context.Background(), DaemonsKey, "a").Err(); err != redis.Nil {
		t.Fatalf("a stopped cleanly and is still in %s (ZSCORE: %v)", DaemonsKey, err)
	}
	stopped := time.Now()
	for b.Replicas() != 1 {
		if time.Since(stopped) > 2*time.Second {
			t.Fatalf("b still counts %d live daemons %v after a stopped, want 1 within its next heartbeat", b.Replicas(), time.Since(stopped))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A reservation of a daemon's credit (k) is made by another daemon's sync up to
// share_epochs after the daemon's own last sync of the key, and lasts a minute: so a
// daemon stopping cleanly leaves the keys it synced within that minute too, not only
// those of the last 11 s. Before, a key it last synced 15 s before it stopped kept a
// reservation for it, and the daemon using the key next was refused those units for up
// to the rest of the minute.
func TestHybridReleaseLiftsOlderReservation(t *testing.T) {
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.TokenBucket} {
		t.Run(fmt.Sprint(alg), func(t *testing.T) {
			rdb := standalone(t)
			ctx := context.Background()
			lim := mustLimit(t, alg, 20, time.Hour)
			a, b := NewHybrid(rdb, HybridOptions{}), NewHybrid(rdb, HybridOptions{})
			seeEachOther(t, "older", a, b)
			now := time.Now().UnixNano()
			key := "rl:older:{user=alice}"
			if !take(a, now, key, lim, 1).Allowed {
				t.Fatal("a's first request refused")
			}
			syncAll(t, now, a)
			if !take(b, now, key, lim, 1).Allowed {
				t.Fatal("b's first request refused")
			}
			syncAll(t, now, b) // the key changes hands: a's possible credit reserved
			if k := rdb.HGet(ctx, key, "k").Val(); k == "" {
				t.Fatal("no credit reserved for a when b took the key: the test sets up nothing")
			}
			// a stops 15 s (by its clock) after its last sync of the key.
			if err := a.Release(ctx, now+int64(15*time.Second)); err != nil {
				t.Fatal(err)
			}
			if k := rdb.HGet(ctx, key, "k").Val(); k != "" {
				t.Errorf("credit still reserved for a daemon that stopped and settled: k = %q", k)
			}
			admitted := 1 + takeSyncing(t, b, now, key, lim, 40)
			if admitted != 19 {
				t.Fatalf("a admitted 1 and stopped; b then admitted %d of the 19 left", admitted)
			}
		})
	}
}

// takeSyncing makes n requests of one unit on key under lim at h, syncing h after every
// third as a daemon's run loop would, and returns how many were admitted.
func takeSyncing(t *testing.T, h *Hybrid, now int64, key string, lim *localbucket.Limit, n int) int {
	t.Helper()
	admitted := 0
	for i := range n {
		if take(h, now, key, lim, 1).Allowed {
			admitted++
		}
		if i%3 == 2 {
			syncAll(t, now, h)
		}
	}
	return admitted
}
