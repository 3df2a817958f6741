package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A key the global mode wrote (field gx: the end of the TTL global.lua gave it) and a
// hybrid daemon then synced and left (the same rule in hybrid mode on another daemon, or
// before a reload; the daemon stopping): the hybrid sync set a shorter TTL of its own,
// and its leave dropped field o, the global mode's only sign that gx no longer told the
// key's TTL. The next global take then trusted gx and left the shorter TTL: the key
// expired with its state still in force (here 14 minutes early, a token forgiven). A
// hybrid sync that sets the TTL of a key the global mode also wrote now drops gx, so the
// global mode sets the TTL again at its next take.
func TestGlobalTTLAfterHybridLeave(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	g := NewGlobal(rdb)
	lim := globalLimit(t, localbucket.TokenBucket, 100, 24*time.Hour, 0) // a token per 14.4 min
	key := "rl:mixedleave:{u}"
	if ok, err := g.Check(ctx, []GlobalOp{{Key: key, Limit: lim, Cost: 50}}); !ok || err != nil {
		t.Fatalf("global take: %v %v", ok, err)
	}
	a := NewHybrid(rdb, HybridOptions{})
	now := time.Now().UnixNano()
	if r := take(a, now, key, lim, 1); !r.Allowed {
		t.Fatalf("hybrid take refused: %+v", r)
	}
	syncAll(t, now, a)
	if err := a.Release(ctx, now); err != nil { // a leaves the key
		t.Fatal(err)
	}
	ops := []GlobalOp{{Key: key, Limit: lim, Cost: 1}}
	if ok, err := g.Check(ctx, ops); !ok || err != nil {
		t.Fatalf("global take: %v %v", ok, err)
	}
	// 52 of 100 taken: the bucket is full again in 52 × 14.4 min, 12 h 29 min.
	want := 52 * 24 * time.Hour / 100
	if ttl := rdb.PTTL(ctx, key).Val(); ttl < want {
		t.Fatalf("PTTL %v after a global take, its state in force for %v", ttl, want)
	}
}
