package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// A hybrid key's first check waits for its exact sync with Redis up to --global-timeout
// (how long a check may wait for Redis), also when that is longer than the sync client's
// own bound, max(--redis-timeout, --sync-interval). Before, the exact sync went on the
// sync client, whose read timeout cut it there: with --global-timeout 5s, a new key's
// first check during a 300 ms pause of Redis was answered by the rule's failure policy
// (refused, degraded) after 100 ms. The breaker is kept shut (the periodic syncs and
// heartbeats the pause fails would open it), so only the exact sync's bound decides.
func TestFaultHybridExactSyncWaitsGlobalTimeout(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: per-user
    key: user
    limit: { requests: 1, per: 1h } # one unit: a new key's first check is an exact sync
    mode: hybrid
    on_store_failure: closed
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr,
		"--global-timeout", "5s", "--redis-timeout", "50ms", "--sync-interval", "100ms", "--breaker-failures", "1000000")
	c := dialFault(t, d.socket)
	waitNormal(t, c, 10*time.Second, "user=warm")
	for i, user := range []string{"user=first-0", "user=first-1"} {
		srv.Freeze()
		thawed := make(chan struct{})
		go func() {
			defer close(thawed)
			time.Sleep(300 * time.Millisecond)
			srv.Thaw()
		}()
		resp, took, err := c.Check(user)
		<-thawed
		t.Logf("pause %d: allowed %v degraded %v after %s", i, resp.Allowed, resp.Degraded, took)
		if err != nil {
			t.Fatal(err)
		}
		if resp.Degraded || !resp.Allowed {
			t.Fatalf("pause %d: a new key's first check with Redis paused 300 ms, --global-timeout 5s: allowed %v degraded %v after %s; want it to wait for Redis and be allowed",
				i, resp.Allowed, resp.Degraded, took)
		}
		waitNormal(t, c, 10*time.Second, fmt.Sprintf("user=warm-%d", i)) // Redis answering again
	}
}
