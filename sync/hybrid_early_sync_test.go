package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A hot key's share grant survives a sync that comes right after the one that asked it.
// Run syncs early, at most every kickEvery, whenever a key is seen for the first time,
// and such a sync carries every dirty key, so under a stream of new clients (a per-user
// rule beside a per-plan one) it often came a few milliseconds after the periodic sync.
// The per-plan key, hot and holding its share grant, went in it too with the demand of
// those few milliseconds, none: the grant went back, the key cooled (no share grant
// asked), and each of its requests was an exact sync until a shortfall made it hot
// again. 4 real daemons, each request to one at random, a new user and a plan shared by
// all: 0.43 script calls per check, against 0.03 with the per-plan rule alone.
func TestHybridEarlySyncKeepsShareGrant(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	lim := mustLimit(t, localbucket.FixedWindow, 100000, hourWindow())
	const key = "rl:plan:{plan=free}"
	a := NewHybrid(rdb, HybridOptions{ID: "a"})
	b := NewHybrid(rdb, HybridOptions{ID: "b"})
	a.SetReplicas(2)
	b.SetReplicas(2)
	// b uses the key, then a: a's sync finds it shared (no credit, share grants only).
	for _, h := range []*Hybrid{b, a} {
		if !take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
			t.Fatal("a first request was refused")
		}
		if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
			t.Fatal(err)
		}
	}
	// Demand beyond a's allowance (each request an exact sync) makes the key hot: the
	// periodic sync asks a share grant for it.
	for range 3 {
		if !take(a, time.Now().UnixNano(), key, lim, 1).Allowed {
			t.Fatal("a request was refused")
		}
	}
	now := time.Now().UnixNano()
	if err := a.Flush(ctx, now); err != nil {
		t.Fatal(err)
	}
	// An early sync a millisecond later (a new key's), nothing used in between.
	if err := a.Flush(ctx, now+int64(time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	before := a.fetches.Load()
	admitted := 0
	for range 10 {
		if take(a, time.Now().UnixNano(), key, lim, 1).Allowed {
			admitted++
		}
	}
	if exact := a.fetches.Load() - before; admitted != 10 || exact != 0 {
		t.Fatalf("after a sync right after the share grant's, 10 requests on the hot key: %d admitted, %d by exact syncs; want 10 from the share grant, none by exact syncs", admitted, exact)
	}
}
