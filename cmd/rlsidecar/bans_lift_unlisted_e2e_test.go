package main

import (
	"io"
	"net/http"
	"testing"

	"github.com/rlsidecar/rlsidecar/internal/checker"
	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// TestE2ELiftUnlistedSharedBan: two real daemons on one Redis share a global penalty
// rule's bans. Daemon A's checks ban a client; daemon B, which reads the bans' index only
// every 30 s here (--sync-interval), does not list the ban, yet its global checks enforce
// it. DELETE on B lifts it: 204, and A's next check is not banned. Before, B answered
// 404 "no ban" and the ban stayed in force on every daemon (as for a ban past the 10,000
// a read of the index keeps).
func TestE2ELiftUnlistedSharedBan(t *testing.T) {
	_, b, ca, cb := startGlobalBanPair(t, "100ms", "30s")
	banned := func(c *checker.Conn) bool {
		t.Helper()
		r, _, err := c.Check("ip=5.5.5.5")
		if err != nil {
			t.Fatal(err)
		}
		if r.Degraded {
			t.Fatalf("degraded with Redis up: %+v", r)
		}
		return r.Banned
	}
	for i := 0; !banned(ca); i++ {
		if i > 10 {
			t.Fatal("never banned on daemon A")
		}
	}
	if !banned(cb) {
		t.Fatal("daemon B's global check does not enforce the ban")
	}
	req, _ := http.NewRequest(http.MethodDelete, "http://"+adminAddr(t, b)+"/bans/login/ip=5.5.5.5", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("DELETE on daemon B of the ban daemon A started: %d %q, want 204", resp.StatusCode, body)
	}
	if banned(ca) {
		t.Fatal("daemon A still enforces the ban lifted on daemon B")
	}
}

// startGlobalBanPair starts two real daemons on one Redis, sharing a global penalty rule
// login (1 an hour per ip; 2 refusals within the hour ban for 10 minutes), with the sync
// intervals (the rounds that read and write the bans' index) ia and ib, and dials each.
func startGlobalBanPair(t *testing.T, ia, ib string) (a, b *daemonProc, ca, cb *checker.Conn) {
	t.Helper()
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
	a = startDaemon(t, append(args, "--sync-interval", ia)...)
	b = startDaemon(t, append(args, "--sync-interval", ib)...)
	return a, b, dialFault(t, a.socket), dialFault(t, b.socket)
}
