package main

import (
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// Redis frozen while the daemon is idle (no hybrid key to sync): the breaker opens on the
// failed heartbeats; after SIGCONT the daemon's answers are normal again within seconds.
// Before, the periodic sync took the open breaker's probe with nothing to send and never
// gave it back: the breaker stayed open and every hybrid check was the policy's, degraded,
// for as long as the daemon ran.
func TestFaultRedisFrozenWhileIdle(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: api
    key: user
    limit: { requests: 1000000, per: 1h }
    on_store_failure: closed
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--sync-interval", "50ms",
		"--breaker-failures", "1", "--breaker-cooldown", "200ms")
	c := dialFault(t, d.socket)
	waitNormal(t, c, 5*time.Second, "user=idle")
	time.Sleep(300 * time.Millisecond) // synced: nothing left to send

	srv.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	// Idle through failed heartbeats (one a second, each failing after --redis-timeout),
	// the breaker opening, and several cool-downs.
	time.Sleep(2500 * time.Millisecond)
	r, _, err := c.Check("user=idle")
	if err != nil {
		t.Fatal(err)
	}
	if !r.Degraded {
		t.Fatalf("with Redis frozen 2.5 s: answer not degraded (%+v); the test cannot tell", r)
	}
	srv.Thaw()
	thawed = true
	back := waitNormal(t, c, 10*time.Second, "user=idle")
	t.Logf("normal again %s after SIGCONT", back.Round(time.Millisecond))
}
