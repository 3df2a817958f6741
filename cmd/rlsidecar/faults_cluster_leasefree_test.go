package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// Leases of a global concurrency rule (max 2, lease 10 minutes) taken before a Cluster
// master is killed, and given up while it is down: one released by its holder, the other
// by its connection closing. Neither release reaches Redis (the master is dead, its
// replica not yet promoted), yet both holders are done with their slots, and the replica
// promoted holds both members (replicated before the kill). Once Redis answers again the
// daemon must free them. Before, it answered the release `released: false` and kept the
// closed connection's lease tracked without an owner, and nothing sent either release
// again: both slots stayed held for the whole lease, and the client was refused (not
// degraded) for 10 minutes after a failover of a few seconds.
func TestFaultClusterFailoverLeasesGivenUpDuringOutageFreed(t *testing.T) {
	cl := redistest.StartCluster(t) // node timeout 2 s: a quick failover
	replica := cl.AddReplica(t, 0)
	d := startClusterLeaseDaemon(t, cl, "{ max: 2, lease: 10m }")
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()
	var user string
	for i := 0; user == ""; i++ {
		if u := fmt.Sprintf("u%d", i); masterOf(t, cc, cl, "{user="+u+"}") == 0 {
			user = u
		}
	}
	attrs := []string{"path=/l", "user=" + user}
	var first *proto.Response
	waitFor(t, 10*time.Second, "a first lease", func() bool {
		c := dialRaw(t, d.socket)
		r := c.check(1, 1, attrs...)
		if r.Allowed && !r.Degraded && r.Lease != "" {
			first = r // c stays open: it holds the lease
			return true
		}
		c.c.Close()
		return false
	})
	holder := dialRaw(t, d.socket) // keeps its connection, releases its lease
	closer := dialRaw(t, d.socket) // closes its connection
	r1 := holder.check(2, 1, attrs...)
	if !r1.Allowed || r1.Lease == "" {
		t.Fatalf("second lease: allowed %v, degraded %v, lease %q", r1.Allowed, r1.Degraded, r1.Lease)
	}
	// The first lease freed: the two held are the holder's and the closer's.
	if rel := holder.leaseOp(3, proto.OpRelease, first.Lease, 0); !rel.Released {
		t.Fatal("the first lease was not released")
	}
	r2 := closer.check(4, 1, attrs...)
	if !r2.Allowed || r2.Lease == "" {
		t.Fatalf("third lease: allowed %v, degraded %v, lease %q", r2.Allowed, r2.Degraded, r2.Lease)
	}
	if r := holder.check(5, 1, attrs...); r.Allowed || r.Degraded {
		t.Fatalf("a lease past max 2: allowed %v, degraded %v; want refused", r.Allowed, r.Degraded)
	}
	// Both members on the replica before the master goes.
	if out, err := cl.Nodes[0].Command("WAIT", "1", "5000"); err != nil || out != "1" {
		t.Fatalf("WAIT 1: %q %v", out, err)
	}

	cl.Nodes[0].Stop()
	killed := time.Now()
	rel := holder.leaseOp(6, proto.OpRelease, r1.Lease, 0)
	t.Logf("release with the master down: released %v (%s after the kill)", rel.Released, time.Since(killed).Round(time.Millisecond))
	closer.c.Close()

	rc := redis.NewClient(&redis.Options{Addr: replica.Addr})
	defer rc.Close()
	waitFor(t, time.Minute, "the replica promoted", func() bool {
		info, err := rc.Info(context.Background(), "replication").Result()
		return err == nil && strings.Contains(info, "role:master")
	})
	promoted := time.Now()
	t.Logf("replica promoted %s after the kill", promoted.Sub(killed).Round(time.Millisecond))
	// Once Redis answers, both slots come free: two leases taken on one connection.
	var last string
	for {
		c := dialRaw(t, d.socket)
		a, b := c.check(10, 1, attrs...), c.check(11, 1, attrs...)
		c.c.Close() // frees what it took
		last = fmt.Sprintf("allowed %v/%v, degraded %v/%v", a.Allowed, b.Allowed, a.Degraded, b.Degraded)
		if a.Allowed && !a.Degraded && b.Allowed && !b.Degraded {
			break
		}
		if time.Since(promoted) > 30*time.Second {
			t.Fatalf("30 s after the promotion, two leases on a fresh connection: %s; want both allowed (the slots given up during the outage freed)", last)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("both slots free %s after the promotion (last: %s)", time.Since(promoted).Round(time.Millisecond), last)
}
