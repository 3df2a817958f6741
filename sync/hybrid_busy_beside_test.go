package sync

import (
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A request with two keys new here, one of them in a sync on its way (a new key's early
// sync), the other needing an exact sync: it waits for the one on its way, then syncs
// what it still needs, and is admitted, as the exact mode admits it. Before, the other
// key's exact sync went alone, and the key on its way was then decided with no view and
// nothing to wait with: refused, not degraded, remaining 0 of a billion and retry 100 ms
// (BenchmarkCapacityHybrid's refusals far from the limit, a few a run under load).
func TestHybridBusyKeyBesideAnExactSyncIsWaitedFor(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: 10 * time.Second})
	lim := mustLimit(t, localbucket.TokenBucket, 1_000_000_000, time.Hour)
	now := time.Now().UnixNano()
	const ip, user = "rl:busy:{ip=1}", "rl:busy:{user=1}"
	// Each key's first unit, on credit: the next request on either needs Redis.
	for _, k := range []string{ip, user} {
		if !take(h, now, k, lim, 1).Allowed {
			t.Fatalf("%s: a new key's first unit (its credit) was refused", k)
		}
	}
	// The ip key's sync is on its way (as a new key's early sync is), and comes back
	// 200 ms later.
	e := entryOf(h, ip)
	sh := &h.shards[h.shardOf([]byte(ip))]
	sh.mu.Lock()
	e.flags |= flagBusy
	sh.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		time.Sleep(200 * time.Millisecond)
		sh.mu.Lock()
		e.flags &^= flagBusy
		sh.mu.Unlock()
	}()
	ops := []HybridOp{{Key: []byte(ip), Limit: lim, Cost: 1}, {Key: []byte(user), Limit: lim, Cost: 1}}
	ok := h.Take(now, ops)
	<-done
	if !ok {
		t.Fatalf("refused beside a sync on its way, a billion an hour: ip %+v (unreachable %v), user %+v",
			ops[0].Result, ops[0].Unreachable, ops[1].Result)
	}
}
