package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// A slot holding a client's keys of two hybrid rules resharded to another master, by
// hand as `redis-cli --cluster reshard` does it (IMPORTING on the target, MIGRATING on
// the source, then MIGRATE of the slot's keys, some calls apart), while the client keeps
// checking: the keys' counts must move with them. A cluster sync is one script call
// per master, its first key declared and the others named in ARGV. Once the first rule's
// key had moved, the source answered ASK for a call led by it, and the call ran on the
// target, where (the slot importing, the call ASKING) the second rule's key, not yet
// moved, read as absent and was written afresh: the client had a new budget on that
// rule, and the slot's migration then failed on that key (BUSYKEY: the target holds it).
func TestFaultClusterReshardKeepsCounts(t *testing.T) {
	cl := redistest.StartCluster(t, redistest.WithClusterNodeTimeout(15*time.Second))
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: wide
    match: { path: /h }
    key: user
    limit: { requests: 1000000, per: 1h }
    on_store_failure: closed
  - name: tight
    match: { path: /h }
    key: user
    limit: { requests: 100, per: 1h }
    on_store_failure: closed
`)
	d := startDaemon(t, "--config", cfg, "--redis-cluster", strings.Join(cl.Addrs, ","),
		"--sync-interval", "50ms", "--global-timeout", "250ms", "--redis-timeout", "250ms")
	c := dialFault(t, d.socket)
	ctx := context.Background()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()

	const user = "u1"
	attrs := []string{"path=/h", "user=" + user}
	src := masterOf(t, cc, cl, "{user="+user+"}")
	dst := cl.Nodes[(src+1)%3]
	srcC := redis.NewClient(&redis.Options{Addr: cl.Addrs[src]})
	defer srcC.Close()
	dstC := redis.NewClient(&redis.Options{Addr: dst.Addr})
	defer dstC.Close()

	allowed := 0
	check := func() {
		t.Helper()
		r, _, err := c.Check(attrs...)
		if err != nil {
			t.Fatalf("check: %v", err)
		}
		if r.Allowed {
			allowed++
		}
	}
	// 50 units admitted, all counted by Redis. The key's first check waits for its exact
	// sync, which a loaded machine can make outlive --global-timeout (250 ms): that check
	// is then refused degraded (closed), admits nothing, and is checked again.
	for deadline := time.Now().Add(10 * time.Second); allowed < 50; {
		r, _, err := c.Check(attrs...)
		switch {
		case err != nil:
			t.Fatalf("check: %v", err)
		case r.Allowed:
			allowed++
		case !r.Degraded:
			t.Fatalf("check %d refused by rule %s, Redis up: want the first 50 allowed", allowed+1, r.Rule)
		case time.Now().After(deadline):
			t.Fatalf("still degraded 10 s after the start, Redis up: %d allowed", allowed)
		}
	}
	// Both keys synced to the source master.
	var wideKey, tightKey string
	waitFor(t, 10*time.Second, "the two rules' keys on the source master", func() bool {
		keys, err := srcC.Keys(ctx, "*{user="+user+"}*").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			switch {
			case strings.Contains(k, "wide"):
				wideKey = k
			case strings.Contains(k, "tight"):
				tightKey = k
			}
		}
		return wideKey != "" && tightKey != ""
	})

	s, err := srcC.ClusterKeySlot(ctx, tightKey).Result()
	if err != nil {
		t.Fatal(err)
	}
	srcID, err := cl.Nodes[src].Command("CLUSTER", "MYID")
	if err != nil {
		t.Fatal(err)
	}
	dstID, err := dst.Command("CLUSTER", "MYID")
	if err != nil {
		t.Fatal(err)
	}
	ss := fmt.Sprint(s)
	if _, err := dst.Command("CLUSTER", "SETSLOT", ss, "IMPORTING", srcID); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Nodes[src].Command("CLUSTER", "SETSLOT", ss, "MIGRATING", dstID); err != nil {
		t.Fatal(err)
	}
	host, port, _ := strings.Cut(dst.Addr, ":")
	if err := srcC.Migrate(ctx, host, port, wideKey, 0, 5*time.Second).Err(); err != nil {
		t.Fatalf("MIGRATE %s: %v", wideKey, err)
	}
	// The slot half moved: the client goes on checking, both keys used at each check, over
	// many syncs.
	for range 40 {
		check()
		time.Sleep(25 * time.Millisecond)
	}
	// The rest of the slot moves, and the slot is handed over.
	keys, err := srcC.ClusterGetKeysInSlot(ctx, int(s), 100).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if err := srcC.Migrate(ctx, host, port, k, 0, 5*time.Second).Err(); err != nil {
			t.Errorf("MIGRATE %s: %v (the key was written on the target while the slot migrated)", k, err)
			if err := srcC.Do(ctx, "MIGRATE", host, port, k, 0, 5000, "REPLACE").Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, n := range cl.Nodes {
		if _, err := n.Command("CLUSTER", "SETSLOT", ss, "NODE", dstID); err != nil {
			t.Fatal(err)
		}
	}
	// The client checks until the tight rule refuses: 100 in all, whatever moved.
	waitFor(t, 30*time.Second, "the tight rule refusing, not degraded", func() bool {
		r, _, err := c.Check(attrs...)
		if err != nil {
			t.Fatal(err)
		}
		if r.Allowed {
			allowed++
			return false
		}
		return !r.Degraded && r.Rule == "tight"
	})
	t.Logf("slot %d moved from %s to %s: %d allowed in all under a limit of 100", s, cl.Addrs[src], dst.Addr, allowed)
	if allowed > 100 {
		t.Errorf("%d allowed under a limit of 100 an hour: the tight rule's count was reset by the reshard", allowed)
	}
}

// masterOf returns the index in cl.Nodes of key's master.
func masterOf(t *testing.T, cc *redis.ClusterClient, cl *redistest.Cluster, key string) int {
	t.Helper()
	m, err := cc.MasterForKey(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	for i, a := range cl.Addrs {
		if a == m.Options().Addr {
			return i
		}
	}
	t.Fatalf("%s: master %s is not a node of the cluster", key, m.Options().Addr)
	return -1
}

// waitFor calls cond until it returns true, failing t after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s after %s", what, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
