package main

import (
	"strings"
	"testing"
	"time"
)

// TestE2EBanOfAKilledDaemonIsListed: daemon A's refusals start a global ban, and A is
// killed (SIGKILL) before its next round adds the ban to the index (its interval is 30 s
// here). Daemon B's global check finds the ban in Redis and answers banned; B then lists
// it in /bans, having added it to the index for every daemon. Before, B enforced the ban
// and never listed it (nor could any daemon's hybrid check of the rule enforce it), for
// the ban's whole hour.
func TestE2EBanOfAKilledDaemonIsListed(t *testing.T) {
	a, b, ca, cb := startGlobalBanPair(t, "30s", "100ms")
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
