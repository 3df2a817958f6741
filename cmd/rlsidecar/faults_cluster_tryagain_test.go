package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// A slot resharded while its client checks a global rate rule and a global concurrency
// rule (two keys of its slot in one script call): while the slot's keys are split
// between the two masters, Redis answers that call TRYAGAIN, and the client is decided by
// its rules' policy (docs/reliability.md, "A slot being resharded"). Another client of the
// same master, on a slot not moving, must be answered as usual: its master is up and
// answering. Before, each TRYAGAIN counted as a failure of the master, three opened its
// breaker, and every global check of every client of that master was refused by its
// policy (degraded) until a probe closed it: a migration of a slot degraded the whole
// master.
func TestFaultClusterReshardTryAgainDegradesOnlyItsSlot(t *testing.T) {
	cl := redistest.StartCluster(t, redistest.WithClusterNodeTimeout(15*time.Second))
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: glob
    match: { path: /g }
    key: user
    limit: { requests: 1000000, per: 1h }
    mode: global
    on_store_failure: closed
  - name: inflight
    match: { path: /g }
    key: user
    concurrency: { max: 1000, lease: 10m }
    mode: global
    on_store_failure: closed
`)
	d := startDaemon(t, "--config", cfg, "--redis-cluster", strings.Join(cl.Addrs, ","),
		"--sync-interval", "50ms", "--global-timeout", "250ms", "--redis-timeout", "250ms")
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()
	// moving: the client whose slot moves; other: a client of the same master, another slot.
	var moving, other string
	for i := 0; other == ""; i++ {
		u := fmt.Sprintf("u%d", i)
		if masterOf(t, cc, cl, "{user="+u+"}") != 0 {
			continue
		}
		switch {
		case moving == "":
			moving = u
		case rlsync.Slot("{user="+u+"}") != rlsync.Slot("{user="+moving+"}"):
			other = u
		}
	}
	c := dialFault(t, d.socket) // holds the leases its checks take: the slot keeps both keys
	waitNormal(t, c, 10*time.Second, "path=/g", "user="+moving)
	waitNormal(t, c, 10*time.Second, "path=/g", "user="+other)

	var movingDegraded, otherChecks, otherDegraded int
	var firstBad string
	phase := 0
	slot := int(rlsync.Slot("{user=" + moving + "}"))
	cl.MoveSlot(t, slot, cl.Nodes[0], cl.Nodes[1], 1, func() {
		phase++
		if phase > 1 {
			return
		}
		// One of the slot's two keys moved: the moving client's calls are refused
		// (TRYAGAIN), then the other client checks.
		for range 10 {
			r, _, err := c.Check("path=/g", "user="+moving)
			if err != nil {
				t.Fatal(err)
			}
			if r.Degraded {
				movingDegraded++
			}
		}
		for i := range 20 {
			r, took, err := c.Check("path=/g", "user="+other)
			if err != nil {
				t.Fatal(err)
			}
			otherChecks++
			if r.Degraded || !r.Allowed {
				otherDegraded++
				if firstBad == "" {
					firstBad = fmt.Sprintf("check %d: allowed %v, degraded %v (took %s)", i+1, r.Allowed, r.Degraded, took)
				}
			}
		}
	})
	t.Logf("while slot %d migrated: the moving client %d of 10 checks degraded; the other client %d of %d", slot, movingDegraded, otherDegraded, otherChecks)
	if movingDegraded == 0 {
		t.Fatal("the moving client's checks were never refused by Redis while its keys were split: this test needs TRYAGAIN")
	}
	if otherDegraded != 0 {
		t.Errorf("a client of the migrating slot's master, on another slot: %d of %d checks not answered normally (first: %s); want 0", otherDegraded, otherChecks, firstBad)
	}
	// Afterwards, both are answered normally.
	waitNormal(t, c, 10*time.Second, "path=/g", "user="+moving)
	waitNormal(t, c, 10*time.Second, "path=/g", "user="+other)
}
