package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// A master added to the Cluster under a running daemon, and a client's slot resharded to
// it (as `redis-cli --cluster add-node` and `reshard` do): the daemon follows the slot
// to the new master, whose breaker and staleness are its own. Frozen, the new master
// degrades only its own clients (a hybrid and a global `closed` rule); a client of an
// old master is answered as usual throughout; thawed, the new master's client is normal
// again.
func TestFaultClusterAddedMaster(t *testing.T) {
	// Redis's default node timeout: a master frozen for a few seconds is not marked
	// failed (with no replica, every node would answer CLUSTERDOWN).
	cl := redistest.StartCluster(t, redistest.WithClusterNodeTimeout(15*time.Second))
	d := startClusterFaultDaemon(t, cl)
	c := dialFault(t, d.socket)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()
	userOn := func(m int) string {
		for i := 0; ; i++ {
			u := fmt.Sprintf("u%d", i)
			if masterOf(t, cc, cl, "{user="+u+"}") == m {
				return u
			}
		}
	}
	moved, stays := userOn(1), userOn(0)
	for _, u := range []string{moved, stays} {
		waitNormal(t, c, 10*time.Second, "path=/h", "user="+u)
		waitNormal(t, c, 10*time.Second, "path=/g", "user="+u)
	}

	n := cl.AddMaster(t)
	cl.MoveSlot(t, int(rlsync.Slot("{user="+moved+"}")), cl.Nodes[1], n, 10, nil)
	waitFor(t, 10*time.Second, "the moved slot on the new master", func() bool {
		cc.ReloadState(context.Background()) // lazy: a later call sees it
		return cl.Nodes[masterOf(t, cc, cl, "{user="+moved+"}")] == n
	})
	for _, p := range []string{"path=/h", "path=/g"} {
		waitNormal(t, c, 10*time.Second, p, "user="+moved)
	}
	// The keys on the new master: the daemon's writes followed the slot.
	nc := redis.NewClient(&redis.Options{Addr: n.Addr})
	defer nc.Close()
	if keys := nc.Keys(context.Background(), "*{user="+moved+"}").Val(); len(keys) < 2 {
		t.Fatalf("the new master holds %q of the moved client, want its hybrid and global keys", keys)
	}

	n.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			n.Thaw()
		}
	}()
	// usual checks that the old master's client is answered as usual on q: allowed, not
	// degraded. One check can outlive --global-timeout (250 ms) on a loaded machine and be
	// degraded by a timeout of the old master itself; it is checked again. Degraded by the
	// frozen master (a breaker or staleness not its own), it stays so while the freeze lasts.
	usual := func(q string) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for try := 0; ; try++ {
			r, took, err := c.Check(q, "user="+stays)
			if err != nil || !r.Allowed && !r.Degraded {
				t.Fatalf("%s of an old master's client while the new master is frozen: allowed %v degraded %v (%v), want answered as usual", q, r.Allowed, r.Degraded, err)
			}
			if !r.Degraded {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s of an old master's client while the new master is frozen: degraded for 5 s (last after %s), want answered as usual", q, took)
			}
			if try == 0 {
				t.Logf("%s of an old master's client degraded after %s; checking again", q, took)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// The new master's client is degraded on both rules, once its breaker opens or its
	// hybrid keys go stale; the old master's client meanwhile is answered as usual.
	for _, p := range []string{"path=/g", "path=/h"} {
		deadline := time.Now().Add(20 * time.Second)
		for {
			r, _, err := c.Check(p, "user="+moved)
			if err != nil {
				t.Fatal(err)
			}
			if r.Degraded {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s of the frozen new master's client not degraded after 20 s", p)
			}
			for _, q := range []string{"path=/h", "path=/g"} {
				usual(q)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// And once the new master's client is degraded on both.
	for _, q := range []string{"path=/h", "path=/g"} {
		usual(q)
	}
	n.Thaw()
	thawed = true
	for _, p := range []string{"path=/h", "path=/g"} {
		back := waitNormal(t, c, 20*time.Second, p, "user="+moved)
		t.Logf("%s of the new master's client normal again %s after the thaw", p, back.Round(time.Millisecond))
	}
}
