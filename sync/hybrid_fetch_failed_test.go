package sync

import (
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A request whose exact sync failed (here: FetchWait passed before the batch was sent)
// waited for Redis in vain: a key only Redis could decide is Unreachable, for the rule's
// failure policy, whatever the master's last answer says. Decided from the view the sync
// never brought, it was refused, not degraded, remaining 0 of a billion and retry 100 ms:
// BenchmarkCapacityHybrid's refusals far from the limit (0-12 a run under load). That took
// the master's failure and its last answer at the same clock reading (a daemon clock
// that did not move between them, as this test's does not), or an answer to another sync
// since; either way the request's own sync had failed.
func TestHybridFailedExactSyncIsUnreachable(t *testing.T) {
	rdb := standalone(t)
	const fixed = int64(1_000_000_000_000)
	h := NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: time.Nanosecond, Clock: func() int64 { return fixed }})
	lim := mustLimit(t, localbucket.TokenBucket, 1_000_000_000, time.Hour)
	now := time.Now().UnixNano()
	// The master answers a sync: its last answer is at the daemon clock's fixed reading.
	if !take(h, now, "rl:ff:{warm}", lim, 1).Allowed {
		t.Fatal("a new key's first unit (its credit) was refused")
	}
	syncAll(t, now, h)
	// A new key: its first unit on credit, the second needs an exact sync, which fails.
	const key = "rl:ff:{new}"
	if !take(h, now, key, lim, 1).Allowed {
		t.Fatal("a new key's first unit (its credit) was refused")
	}
	ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}}
	if ok := h.Take(now, ops); ok {
		t.Skip("the exact sync was answered within a nanosecond")
	}
	if !ops[0].Unreachable {
		t.Fatalf("refused after its exact sync failed, not Unreachable (no failure policy, not degraded): %+v", ops[0].Result)
	}
}
