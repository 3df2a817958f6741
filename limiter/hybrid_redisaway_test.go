package limiter

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// With Redis away long enough that the hybrid allowances no longer stand (Healthy
// false), a client this daemon last saw over its limit is still refused, by its view, and
// not degraded; a client it holds no view of follows the rule's policy (local: a bucket
// of its own). Before, both went to the policy, and local admitted the limited client
// its whole limit again from a fresh bucket: a login rule of 3 an hour gave a client
// that had used its 3 three more while Redis was away.
func TestHybridLimitedClientRefusedWhileRedisAway(t *testing.T) {
	rdb := realRedis(t)
	h := rlsync.NewHybrid(rdb, rlsync.HybridOptions{Interval: 100 * time.Millisecond})
	if _, err := h.Heartbeat(context.Background(), "d1", time.Minute); err != nil {
		t.Fatal(err)
	}
	l := New(mustRules(t, `
rules:
  - name: login
    key: user
    limit: { requests: 3, per: 1h }
    mode: hybrid
    on_store_failure: local
`), localbucket.NewStore(localbucket.Options{})).WithHybrid(h)
	var d Decision
	check := func(now int64, user string) {
		t.Helper()
		if err := l.Check(now, &Input{Attrs: attrs("user=" + user), Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now().UnixNano()
	for i := range 4 {
		check(now, "u")
		if want := i < 3; d.Allowed != want || d.Degraded {
			t.Fatalf("check %d with Redis up: allowed %v degraded %v, want allowed %v", i+1, d.Allowed, d.Degraded, want)
		}
		if err := h.Flush(context.Background(), now); err != nil {
			t.Fatal(err)
		}
	}
	// Redis answers nothing from here on (its last answer is 5 s old by the check's clock).
	away := now + int64(5*time.Second)
	if h.Healthy(away) {
		t.Fatal("the hybrid store still healthy 5 s after Redis's last answer")
	}
	for i := range 5 {
		check(away, "u")
		if d.Allowed || d.Degraded || d.Results[0].RetryAfter <= 0 {
			t.Fatalf("the client over its limit, Redis away, check %d: allowed %v degraded %v retry %v: want refused by its view, not degraded",
				i+1, d.Allowed, d.Degraded, d.Results[0].RetryAfter)
		}
	}
	check(away, "new")
	if !d.Allowed || !d.Degraded {
		t.Fatalf("a client with no view, Redis away: allowed %v degraded %v, want allowed by the local policy, degraded", d.Allowed, d.Degraded)
	}
}
