package sync

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// On a 3-master cluster a sync of many keys in many slots is a few script calls per
// master (callKeys keys a call), not one per slot, and counts exactly what each key
// admitted.
func TestHybridClusterOneCallPerNode(t *testing.T) {
	cl := redistest.StartCluster(t)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	ctx := context.Background()
	nodes := make([]*redis.Client, len(cl.Addrs))
	for i, a := range cl.Addrs {
		nodes[i] = redis.NewClient(&redis.Options{Addr: a})
		defer nodes[i].Close()
	}
	calls := func() int {
		n := 0
		for _, c := range nodes {
			n += evalCalls(t, c)
		}
		return n
	}
	h := NewHybrid(rdb, HybridOptions{})
	lim := mustLimit(t, localbucket.FixedWindow, 50, time.Hour)
	now := time.Now().UnixNano()
	const keys = 300 // about 300 slots, on all three masters
	for i := range keys {
		take(h, now, fmt.Sprintf("rl:pn:{user=%d}", i), lim, 1) // on credit
	}
	before := calls()
	if err := h.Flush(ctx, now); err != nil {
		t.Fatal(err)
	}
	// 300 keys over 3 masters: at most ⌈keys on a master ÷ 128⌉ calls each.
	if got := calls() - before; got > 6 {
		t.Fatalf("a sync of %d keys in %d slots took %d script calls, want at most 6 (a few per master)", keys, keys, got)
	}
	for i := range keys {
		key := fmt.Sprintf("rl:pn:{user=%d}", i)
		if n, err := rdb.HGet(ctx, key, "n").Int(); err != nil || n != 1 {
			t.Fatalf("%s: Redis counts %d (%v), want 1", key, n, err)
		}
	}
}

// A key whose slot the node does not serve (the slot map moved under the daemon) is
// left untouched by a call that reaches the node, and answers grant -1: the daemon keeps
// its units for the next sync rather than writing state where no one will read it.
func TestHybridScriptSkipsKeysNotServed(t *testing.T) {
	cl := redistest.StartCluster(t)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()
	ctx := context.Background()
	master := func(k string) string {
		m, err := cc.MasterForKey(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		return m.Options().Addr
	}
	here := "rl:ns:{user=0}"
	addr := master(here)
	var far string
	for i := 1; far == ""; i++ {
		if k := fmt.Sprintf("rl:ns:{user=%d}", i); master(k) != addr {
			far = k
		}
	}
	node := redis.NewClient(&redis.Options{Addr: addr})
	defer node.Close()
	perKey := []int64{1, 1, 0, 0, 0, int64(modeShare), 0, 1, 0}
	nums := []int64{int64(100 * time.Millisecond / time.Microsecond), 1, 10000, 100, 1, 1, 0, 2, 10, int64(time.Hour / time.Microsecond), 10}
	args := append(hybridArgs("d1", append(append(nums, perKey...), perKey...)...), far)
	v, err := int64s(hybridScript.Eval(ctx, node, []string{here}, args...))
	if err != nil {
		t.Fatal(err)
	}
	if len(v) != 2*replyInts || v[0] < 0 || v[replyInts] != -1 {
		t.Fatalf("reply %v: want the local key synced and the other answering grant -1", v)
	}
	if n := cc.Exists(ctx, far).Val(); n != 0 {
		t.Fatalf("the key not served by the node exists after the call")
	}
	if n, err := cc.HGet(ctx, here, "n").Int(); err != nil || n != 1 {
		t.Fatalf("the local key counts %d (%v), want 1", n, err)
	}
}

// A slot moves to another master under a daemon whose slot map is stale: the sync that
// reaches the old master leaves the key untouched, keeps its units pending without
// counting a failure (the breaker must not open on a reshard), and a later sync, with
// the map reloaded, counts them on the new master, once.
func TestHybridClusterSlotMoved(t *testing.T) {
	cl := redistest.StartCluster(t)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	cc := rdb.(*redis.ClusterClient)
	ctx := context.Background()
	master := func(k string) string {
		m, err := cc.MasterForKey(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		return m.Options().Addr
	}
	// Two keys on one master, the moved one in the higher slot (so it is not the key
	// declared, which routes the call).
	var stay, moved string
	for i := 0; moved == ""; i++ {
		a, b := fmt.Sprintf("rl:mv:{user=%d}", i), fmt.Sprintf("rl:mv:{user=%d}", i+1)
		if master(a) == master(b) && Slot(a) < Slot(b) {
			stay, moved = a, b
		}
	}
	from := master(moved)
	var to string
	for _, a := range cl.Addrs {
		if a != from {
			to = a
			break
		}
	}
	ids := map[string]string{}
	for _, a := range cl.Addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		defer c.Close()
		id, err := c.Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			t.Fatal(err)
		}
		ids[a] = id
	}
	// The slot is empty: hand it to the other master on every node (target first).
	slot := Slot(moved)
	for _, a := range append([]string{to, from}, cl.Addrs...) {
		c := redis.NewClient(&redis.Options{Addr: a})
		if err := c.Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", ids[to]).Err(); err != nil {
			t.Fatalf("SETSLOT on %s: %v", a, err)
		}
		c.Close()
	}
	if master(moved) != from {
		t.Fatal("the client's slot map is not stale: the test cannot tell")
	}

	h := NewHybrid(rdb, HybridOptions{})
	lim := mustLimit(t, localbucket.FixedWindow, 50, time.Hour)
	now := time.Now().UnixNano()
	take(h, now, stay, lim, 1) // on credit
	take(h, now, moved, lim, 1)
	if err := h.Flush(ctx, now); err != nil {
		t.Fatalf("a sync meeting a moved slot failed: %v (it must not count against the breaker)", err)
	}
	target := redis.NewClient(&redis.Options{Addr: to})
	defer target.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, err := target.HGet(ctx, moved, "n").Int()
		if err == nil && n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the moved key counts %d (%v) on its new master, want 1", n, err)
		}
		time.Sleep(50 * time.Millisecond)
		if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
			t.Fatal(err)
		}
	}
	source := redis.NewClient(&redis.Options{Addr: from})
	defer source.Close()
	if n := source.Exists(ctx, moved).Val(); n != 0 {
		t.Fatal("the moved key was written on its old master")
	}
	if n, err := cc.HGet(ctx, stay, "n").Int(); err != nil || n != 1 {
		t.Fatalf("the other key counts %d (%v), want 1", n, err)
	}
}

// A slot being resharded (MIGRATING on its master, IMPORTING on the target) whose key
// has already moved: the sync that reaches the source, which still serves the slot,
// must not count the key as one with no state nor create it again there (MIGRATE would
// then refuse to finish the slot); Redis refuses the script's read of a key of a
// migrating slot that is not on the node, so the key answers grant -1, its units stay
// pending, and once the slot is handed over they are counted on the target, once.
func TestHybridClusterSlotMigrating(t *testing.T) {
	cl := redistest.StartCluster(t)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	cc := rdb.(*redis.ClusterClient)
	ctx := context.Background()
	master := func(k string) string {
		m, err := cc.MasterForKey(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		return m.Options().Addr
	}
	// Two keys on one master, the migrating one in the higher slot (not the key the call
	// declares, which routes it).
	var stay, moving string
	for i := 0; moving == ""; i++ {
		a, b := fmt.Sprintf("rl:mig:{user=%d}", i), fmt.Sprintf("rl:mig:{user=%d}", i+1)
		if master(a) == master(b) && Slot(a) < Slot(b) {
			stay, moving = a, b
		}
	}
	from := master(moving)
	var to string
	for _, a := range cl.Addrs {
		if a != from {
			to = a
			break
		}
	}
	nodes := map[string]*redis.Client{}
	ids := map[string]string{}
	for _, a := range cl.Addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		defer c.Close()
		nodes[a] = c
		id, err := c.Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			t.Fatal(err)
		}
		ids[a] = id
	}
	h := NewHybrid(rdb, HybridOptions{})
	lim := mustLimit(t, localbucket.FixedWindow, 50, time.Hour)
	now := time.Now().UnixNano()
	take(h, now, stay, lim, 1)
	take(h, now, moving, lim, 1)
	if err := h.Flush(ctx, now); err != nil {
		t.Fatal(err)
	}
	if n, err := nodes[from].HGet(ctx, moving, "n").Int(); err != nil || n != 1 {
		t.Fatalf("before the reshard the key counts %d (%v), want 1", n, err)
	}

	slot := Slot(moving)
	if err := nodes[to].Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[from]).Err(); err != nil {
		t.Fatal(err)
	}
	if err := nodes[from].Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[to]).Err(); err != nil {
		t.Fatal(err)
	}
	host, port, _ := strings.Cut(to, ":")
	if err := nodes[from].Do(ctx, "MIGRATE", host, port, moving, 0, 5000).Err(); err != nil {
		t.Fatalf("MIGRATE: %v", err)
	}
	for i := 0; i < 3; i++ { // three syncs while the slot migrates
		now = time.Now().UnixNano()
		take(h, now, stay, lim, 1)
		take(h, now, moving, lim, 1)
		if err := h.Flush(ctx, now); err != nil {
			t.Fatalf("a sync meeting a migrating slot failed: %v", err)
		}
	}
	if n, err := nodes[from].Do(ctx, "CLUSTER", "COUNTKEYSINSLOT", slot).Int(); err != nil || n != 0 {
		t.Fatalf("the source holds %d keys (%v) of the migrating slot: the moved key was created again there", n, err)
	}
	for _, a := range append([]string{to, from}, cl.Addrs...) {
		if err := nodes[a].Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", ids[to]).Err(); err != nil {
			t.Fatalf("SETSLOT NODE on %s: %v", a, err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
			t.Fatal(err)
		}
		n, err := nodes[to].HGet(ctx, moving, "n").Int()
		if err == nil && n == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the moved key counts %d (%v) on its new master, want 4", n, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for i := 0; i < 3; i++ {
		if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := nodes[to].HGet(ctx, moving, "n").Int(); err != nil || n != 4 {
		t.Fatalf("the moved key counts %d (%v) after more syncs, want 4", n, err)
	}
	if n, err := cc.HGet(ctx, stay, "n").Int(); err != nil || n != 4 {
		t.Fatalf("the other key counts %d (%v), want 4", n, err)
	}
}
