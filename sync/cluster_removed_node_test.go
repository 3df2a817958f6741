package sync

import (
	"context"
	"fmt"
	"os/exec"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// A node removed from the Cluster with `redis-cli --cluster del-node` (the usual way to
// shrink a Cluster, after moving its slots away) is reset and keeps running until its
// operator stops it: it answers CLUSTER SLOTS with no slot, and every key with
// `CLUSTERDOWN Hash slot not served`. go-redis reads the slot map from a node it picks
// at random among those it knows, and took that empty map as the Cluster's: it then
// sent each command to a random node, the removed one among them, whose refusal the
// daemon took as a failure (a probe of the daemon on a 3-master Cluster, two daemons, a
// fourth master drained and removed under load: 56 degraded answers over 15 clients and
// 13 lease releases failed, their slots held for the lease). The daemon's clients now
// take an empty reply for an error, and go-redis asks another node.
func TestClusterClientSkipsRemovedNode(t *testing.T) {
	cl := redistest.StartCluster(t)
	removed := cl.AddMaster(t) // no slot, as after a drain
	id, err := removed.Command("CLUSTER", "MYID")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "redis-cli", "--cluster", "del-node", cl.Addrs[0], id).CombinedOutput()
	if err != nil {
		t.Fatalf("redis-cli --cluster del-node: %v\n%s", err, out)
	}
	if slots, err := removed.Strings("CLUSTER", "SLOTS"); err != nil || len(slots) != 0 {
		t.Fatalf("CLUSTER SLOTS on the removed node: %q, %v; want an empty array", slots, err)
	}
	// The removed node is one of the two the client knows: a reload reads it half the time.
	rdb, err := Open(Config{Cluster: []string{removed.Addr, cl.Addrs[0]}, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	cc := rdb.(*redis.ClusterClient)
	const reloads = 40
	empty, failed := 0, 0
	var firstErr error
	for i := range reloads {
		// ForEachMaster reloads the slot map first, waits for it, then calls its function
		// for each master of the map it read: none for an empty map.
		var masters atomic.Int32
		if err := cc.ForEachMaster(ctx, func(context.Context, *redis.Client) error {
			masters.Add(1)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if masters.Load() == 0 {
			empty++
		}
		if err := cc.Set(ctx, fmt.Sprintf("{user=u%d}", i), "1", time.Minute).Err(); err != nil {
			failed++
			if firstErr == nil {
				firstErr = err
			}
		}
	}
	t.Logf("%d reloads: %d read an empty slot map; %d SETs failed (first: %v)", reloads, empty, failed, firstErr)
	if empty != 0 || failed != 0 {
		t.Errorf("%d of %d reloads read an empty slot map and %d SETs failed (first: %v); want 0 and 0", empty, reloads, failed, firstErr)
	}
}
