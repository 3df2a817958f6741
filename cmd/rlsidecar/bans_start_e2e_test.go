package main

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// TestE2EHybridBanEnforcedFromStart: a daemon that starts (a restart, an upgrade, a new
// replica) enforces the shared bans Redis holds from its first check. It learned them at
// its first round of the shared bans, one sync interval after its start, and a hybrid
// rule's check before that did not see them: a banned client's first request to a
// restarted daemon was admitted (on the credit a key new on a daemon gets), though the
// README says every check of a banned key is refused before any limit is consulted.
// The second daemon runs with a 10 s sync interval, so that its first round is far off.
func TestE2EHybridBanEnforcedFromStart(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: login
    key: ip
    mode: hybrid
    limit: { requests: 5, per: 1h }
    penalty: { after: 1, within: 1m, ban: 1h }
`)
	common := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--global-timeout", "3s", "--redis-timeout", "3s"}
	d1 := startDaemon(t, append(common, "--sync-interval", "50ms")...)
	c1 := dialRaw(t, d1.socket)
	id := uint64(0)
	banned := false
	for i := 0; !banned; i++ {
		if i > 200 {
			t.Fatal("daemon 1 never banned the client")
		}
		id++
		banned = c1.check(id, 1, "ip=203.0.113.9").Banned
		time.Sleep(10 * time.Millisecond)
	}
	// Wait until the ban is in the index every daemon reads.
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
		n, err := rdb.ZCard(context.Background(), "rl:~bans").Result()
		if err == nil && n == 1 {
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatalf("the ban never reached rl:~bans: %d, %v", n, err)
		}
	}

	d2 := startDaemon(t, append(common, "--sync-interval", "10s")...)
	r := dialRaw(t, d2.socket).check(1, 1, "ip=203.0.113.9")
	if r.Allowed || !r.Banned {
		t.Fatalf("a new daemon's first check of a banned client: allowed %v banned %v (rule %q, retry %d ms), want refused as banned",
			r.Allowed, r.Banned, r.Rule, r.RetryAfterMs)
	}
	if r.RetryAfterMs < 3_500_000 {
		t.Fatalf("retry after %d ms, want the ban's remaining hour", r.RetryAfterMs)
	}
}
