package main

import (
	"fmt"
	"testing"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// A lease holds its slots "until released, expired, or its connection closed"
// (PROTOCOL.md): a client that closes the connection holding every slot of a key and
// checks again at once, on a new connection, finds them free. The daemon sees the close
// on the old connection's goroutine a few tens of microseconds later; before, the check
// on the new one often came first and was refused (a scratch client in Python: 580 of
// 2,000 rounds refused on a concurrency rule of max 2, 305 of 2,000 with the rule in
// Redis). Now a check that finds a slot full first frees the leases of the holders whose
// clients have closed their connections. Without a wait: the client's close has
// happened, as the kernel sees it, before its next check is written.
func TestE2ELeaseFreedByCloseBeforeTheNextCheck(t *testing.T) {
	dir := shortTempDir(t)
	d := startDaemon(t, "--config", writeFile(t, dir, "rules.yaml", leaseRulesYAML))
	closeThenCheck(t, d, 1000)
}

// The same with the concurrency rule in Redis (global leases, the default of a daemon
// with Redis): a check refused because the slots are full frees this daemon's global
// leases of that key held by connections their clients have closed, in Redis as their
// close would, and asks again (before, 135 of 2,000 rounds refused once the local leases
// were fixed).
func TestE2EGlobalLeaseFreedByCloseBeforeTheNextCheck(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	d := startDaemon(t, "--config", writeFile(t, dir, "rules.yaml", leaseRulesYAML),
		"--redis", "redis://"+srv.Addr, "--redis-prefix", "e2e:", "--global-timeout", "2s", "--redis-timeout", "1s")
	closeThenCheck(t, d, 1000)
}

// closeThenCheck runs rounds of: take both slots of exports (max 2) on one connection,
// close it, check at once on a new one; and fails if any such check was refused.
func closeThenCheck(t *testing.T, d *daemonProc, rounds int) {
	t.Helper()
	id := uint64(0)
	refused := 0
	for round := range rounds {
		// A user a round: per-user allows 8 an hour.
		exp := []string{"path=/v1/exports/1", fmt.Sprintf("user=closer-%d", round)}
		a := dialRaw(t, d.socket)
		for range 2 { // both slots of exports (max 2)
			id++
			if r := a.check(id, 1, exp...); !r.Allowed || r.Lease == "" {
				t.Fatalf("round %d: %+v; want allowed with a lease", round, r)
			}
		}
		a.c.Close()
		b := dialRaw(t, d.socket)
		id++
		if r := b.check(id, 1, exp...); !r.Allowed || r.Lease == "" || r.Rules[0].Remaining != 1 {
			refused++
			if refused == 1 {
				t.Logf("round %d, right after the close: %+v", round, r)
			}
		}
		b.c.Close()
	}
	if refused > 0 {
		t.Fatalf("%d of %d checks right after the holder's connection closed found its slots held", refused, rounds)
	}
}
