package main

import (
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// TestE2EBanOfAKilledDaemonIsListed: daemon A's refusals start a global ban, and A is
// killed (SIGKILL) before its next round adds the ban to the index (its interval is 30 s
// here). Daemon B's global check finds the ban in Redis and answers banned; B then lists
// it in /bans, having added it to the index for every daemon. Before, B enforced the ban
// and never listed it (nor could any daemon's hybrid check of the rule enforce it), for
// the ban's whole hour.
func TestE2EBanOfAKilledDaemonIsListed(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 1h }
    mode: global
    penalty: { after: 2, within: 1h, ban: 10m }
`)
	args := []string{"--config", cfg, "--admin", "127.0.0.1:0", "--global-timeout", "3s", "--redis-timeout", "3s", "--redis", "redis://" + srv.Addr}
	a := startDaemon(t, append(args, "--sync-interval", "30s")...)
	b := startDaemon(t, append(args, "--sync-interval", "100ms")...)
	ca, cb := dialFault(t, a.socket), dialFault(t, b.socket)
	for i := 0; ; i++ {
		r, _, err := ca.Check("ip=6.6.6.6")
		if err != nil {
			t.Fatal(err)
		}
		if r.Banned {
			break
		}
		if i > 10 {
			t.Fatal("never banned on daemon A")
		}
	}
	if err := a.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	if r, _, err := cb.Check("ip=6.6.6.6"); err != nil || !r.Banned || r.Degraded {
		t.Fatalf("daemon B's check: banned %v degraded %v (%v), want banned", r.Banned, r.Degraded, err)
	}
	base := "http://" + adminAddr(t, b)
	waitFor(t, 10*time.Second, "the ban in daemon B's /bans", func() bool {
		_, body := httpGet(t, base+"/bans")
		return strings.Contains(body, `"login"`)
	})
}
