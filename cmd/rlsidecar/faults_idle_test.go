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

// A global rule's breaker, opened by checks while Redis was frozen, closes once Redis is
// back with no check coming: the daemon probes it in the background. Before, only a
// global check could close it, so an idle daemon reported it open
// (rlsidecar_breaker_open 1, the critical RlsidecarBreakerOpen alert) for as long as
// its global rules got no traffic, Redis long healthy.
func TestFaultGlobalBreakerClosesWhileIdle(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: login
    key: user
    mode: global
    limit: { requests: 1000000, per: 1h }
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--admin", "127.0.0.1:0",
		"--breaker-failures", "1", "--breaker-cooldown", "200ms", "--global-timeout", "50ms")
	base := "http://" + adminAddr(t, d)
	c := dialFault(t, d.socket)
	waitNormal(t, c, 5*time.Second, "user=idle")

	srv.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	for range 3 { // timed out: the breaker opens
		if _, _, err := c.Check("user=idle"); err != nil {
			t.Fatal(err)
		}
	}
	if got := scrapeSamples(t, base)["rlsidecar_breaker_open"]; got != 1 {
		t.Fatalf("rlsidecar_breaker_open %v with Redis frozen after 3 global checks; the test cannot tell", got)
	}
	srv.Thaw()
	thawed = true
	start := time.Now()
	for scrapeSamples(t, base)["rlsidecar_breaker_open"] != 0 {
		if time.Since(start) > 10*time.Second {
			t.Fatal("rlsidecar_breaker_open still 1, 10 s after SIGCONT, with no check sent")
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("closed %s after SIGCONT, no check sent", time.Since(start).Round(time.Millisecond))
}
