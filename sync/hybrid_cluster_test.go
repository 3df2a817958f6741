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
	lim := mustLimit(t, localbucket.FixedWindow, 50, hourWindow())
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
	sm := newSlotMover(t)
	cl, rdb, cc, ids := sm.cl, sm.rdb, sm.cc, sm.ids
	ctx := context.Background()
	master := func(k string) string { return sm.master(t, k) }
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
	to := sm.otherThan(from)
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
	lim := mustLimit(t, localbucket.FixedWindow, 50, hourWindow())
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
	sm := newSlotMover(t)
	cl, rdb, cc, nodes, ids := sm.cl, sm.rdb, sm.cc, sm.nodes, sm.ids
	ctx := context.Background()
	master := func(k string) string { return sm.master(t, k) }
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
	to := sm.otherThan(from)
	h := NewHybrid(rdb, HybridOptions{})
	lim := mustLimit(t, localbucket.FixedWindow, 50, hourWindow())
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
	sm.setMigrating(t, slot, from, to)
	sm.migrate(t, from, to, moving)
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

// A slot migrating with two keys of one client in it (two rules, one hash tag), one of
// them already moved, and a key of another slot of the same master: a sync call leads
// with the slot's keys. Its declared keys are now every key of that slot, so Redis runs
// it only where all of them are, and answers TRYAGAIN while they are split: the slot's
// keys wait for the next sync, untouched, and the call's other key goes again on its
// own, synced at once. Before, only the first key was declared: led by the moved key,
// the call went by ASK to the target, which read the other key of the slot, not yet
// moved, as absent and wrote it afresh (MIGRATE then refused it: BUSYKEY), and the key
// of the other slot was not served there, its units left pending for the whole
// migration. Each of the two keys is the moved one in turn (which leads the call is
// the daemon's order, not the test's).
func TestHybridClusterSlotMigratingSplitKeys(t *testing.T) {
	sm := newSlotMover(t)
	cl, rdb, nodes, ids := sm.cl, sm.rdb, sm.nodes, sm.ids
	ctx := context.Background()
	master := func(k string) string { return sm.master(t, k) }
	// Two clients whose slots are on one master, low and high below another client's
	// slot on it, which does not move.
	tags := sm.risingTags(t, 3)
	from := master(tags[0])
	to := sm.otherThan(from)
	other := "rl:c:" + tags[2]
	h := NewHybrid(rdb, HybridOptions{})
	lim := mustLimit(t, localbucket.FixedWindow, 50, hourWindow()) // counted across syncs: no window ends meanwhile
	for phase, tag := range tags[:2] {
		keys := []string{"rl:a:" + tag, "rl:b:" + tag}
		moved, left := keys[phase], keys[1-phase]
		all := append(keys, other)
		use := func() {
			now := time.Now().UnixNano()
			for _, k := range all {
				take(h, now, k, lim, 1)
			}
			if err := h.Flush(ctx, now); err != nil {
				t.Fatalf("phase %d: a sync meeting a migrating slot failed: %v", phase, err)
			}
		}
		count := func(c *redis.Client, k string) int {
			n, err := c.HGet(ctx, k, "n").Int()
			if err != nil && err != redis.Nil {
				t.Fatal(err)
			}
			return n
		}
		use()
		base := count(nodes[from], other)
		slot := Slot(tag)
		sm.setMigrating(t, slot, from, to)
		sm.migrate(t, from, to, moved)
		for range 3 { // three syncs while the slot is split
			use()
		}
		// The key not yet moved is on the source only.
		pipe := nodes[to].Pipeline()
		pipe.Do(ctx, "ASKING")
		ex := pipe.Exists(ctx, left)
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
		if ex.Val() != 0 {
			t.Errorf("phase %d: %s, not moved yet, was written on the target while its slot migrated", phase, left)
		}
		if got := count(nodes[from], other); got != base+3 {
			t.Errorf("phase %d: the key of the other slot counts %d on its master after three syncs, want %d", phase, got, base+3)
		}
		sm.migrate(t, from, to, left)
		for _, a := range append([]string{to, from}, cl.Addrs...) {
			if err := nodes[a].Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", ids[to]).Err(); err != nil {
				t.Fatalf("SETSLOT NODE on %s: %v", a, err)
			}
		}
		// Once the slot is handed over, its keys count every unit, once: 4 each.
		deadline := time.Now().Add(10 * time.Second)
		for count(nodes[to], keys[0]) != 4 || count(nodes[to], keys[1]) != 4 {
			if time.Now().After(deadline) {
				t.Fatalf("phase %d: the slot's keys count %d and %d on the target, want 4 each", phase, count(nodes[to], keys[0]), count(nodes[to], keys[1]))
			}
			time.Sleep(50 * time.Millisecond)
			if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// A slot left migrating with all its keys moved (a reshard stopped before it handed the
// slot over: redis-cli interrupted, or an error, until `redis-cli --cluster fix`): a
// sync call led by the slot's keys goes by ASK to the target, which serves them but not
// the call's keys of other slots. Those must still be synced, each sync, not left
// pending for as long as the slot stays so.
func TestHybridClusterSlotMigratingStuck(t *testing.T) {
	sm := newSlotMover(t)
	rdb, nodes := sm.rdb, sm.nodes
	ctx := context.Background()
	master := func(k string) string { return sm.master(t, k) }
	var tags []string
	for i := 0; len(tags) < 2; i++ {
		k := fmt.Sprintf("{user=%d}", i)
		if len(tags) == 0 || master(k) == master(tags[0]) && Slot(k) > Slot(tags[0]) {
			tags = append(tags, k)
		}
	}
	from := master(tags[0])
	to := sm.otherThan(from)
	keys := []string{"rl:a:" + tags[0], "rl:b:" + tags[0]}
	other := "rl:c:" + tags[1]
	h := NewHybrid(rdb, HybridOptions{})
	lim := mustLimit(t, localbucket.FixedWindow, 50, hourWindow()) // counted across syncs: no window ends meanwhile
	use := func() {
		now := time.Now().UnixNano()
		for _, k := range append(keys, other) {
			take(h, now, k, lim, 1)
		}
		if err := h.Flush(ctx, now); err != nil {
			t.Fatalf("a sync meeting a migrating slot failed: %v", err)
		}
	}
	use()
	base, _ := nodes[from].HGet(ctx, other, "n").Int()
	slot := Slot(tags[0])
	sm.setMigrating(t, slot, from, to)
	sm.migrate(t, from, to, keys...)
	for range 3 {
		use()
	}
	if got, _ := nodes[from].HGet(ctx, other, "n").Int(); got != base+3 {
		t.Errorf("the key of the other slot counts %d on its master after three syncs, want %d", got, base+3)
	}
	for _, k := range keys {
		if got := sm.askingCount(t, to, k); got != 4 {
			t.Errorf("%s counts %d on the target, want 4", k, got)
		}
	}
}

// A slot left migrating with its keys moved (a reshard stopped before it handed the
// slot over), the slot not the first of its master's sync call: a call led by a key of
// a lower slot of the same master runs on the source, which serves that slot, and
// answers "not served" for the moved keys (they are on the target). Those keys must
// still be synced, each sync, not left pending for as long as the slot stays so.
func TestHybridClusterSlotMigratingStuckNotFirst(t *testing.T) {
	sm := newSlotMover(t)
	rdb, nodes := sm.rdb, sm.nodes
	ctx := context.Background()
	master := func(k string) string { return sm.master(t, k) }
	// tags[0], which stays, in a lower slot than tags[1], whose slot migrates; tags[2],
	// higher still, stays too.
	tags := sm.risingTags(t, 3)
	from := master(tags[0])
	to := sm.otherThan(from)
	first, last := "rl:c:"+tags[0], "rl:c:"+tags[2]
	keys := []string{"rl:a:" + tags[1], "rl:b:" + tags[1]}
	h := NewHybrid(rdb, HybridOptions{})
	lim := mustLimit(t, localbucket.FixedWindow, 50, hourWindow()) // counted across syncs: no window ends meanwhile
	use := func() {
		now := time.Now().UnixNano()
		for _, k := range append([]string{first, last}, keys...) {
			take(h, now, k, lim, 1)
		}
		if err := h.Flush(ctx, now); err != nil {
			t.Fatalf("a sync meeting a migrating slot failed: %v", err)
		}
	}
	use()
	slot := Slot(tags[1])
	sm.setMigrating(t, slot, from, to)
	sm.migrate(t, from, to, keys...)
	for range 3 {
		use()
	}
	for _, k := range []string{first, last} {
		if got, _ := nodes[from].HGet(ctx, k, "n").Int(); got != 4 {
			t.Errorf("%s, of a slot that stays, counts %d on its master after four syncs, want 4", k, got)
		}
	}
	for _, k := range keys {
		if got := sm.askingCount(t, to, k); got != 4 {
			t.Errorf("%s, of the slot left migrating, counts %d on the target after four syncs, want 4 (its units left pending for as long as the slot stays so)", k, got)
		}
	}
}

// A client new to a slot that migrates (or that a stopped reshard left migrating) has
// its keys, of that slot, synced all the same: Redis answers TRYAGAIN to a call
// declaring several keys of a migrating slot some of which are missing, however long
// the slot migrates, and a call of one key goes where that key is (ASK to the target
// for a key the source lacks).
func TestHybridClusterSlotMigratingNewKeys(t *testing.T) {
	sm := newSlotMover(t)
	rdb := sm.rdb
	ctx := context.Background()
	tag := "{user=7}"
	from := sm.master(t, tag)
	to := sm.otherThan(from)
	slot := Slot(tag)
	sm.setMigrating(t, slot, from, to)
	keys := []string{"rl:a:" + tag, "rl:b:" + tag}
	h := NewHybrid(rdb, HybridOptions{})
	lim := mustLimit(t, localbucket.FixedWindow, 50, hourWindow())
	for range 3 {
		now := time.Now().UnixNano()
		for _, k := range keys {
			take(h, now, k, lim, 1)
		}
		if err := h.Flush(ctx, now); err != nil {
			t.Fatalf("a sync meeting a migrating slot failed: %v", err)
		}
	}
	for _, k := range keys {
		got := 0
		for _, a := range []string{from, to} {
			got += sm.askingCount(t, a, k)
		}
		if got != 3 {
			t.Errorf("%s counts %d in Redis after three syncs, want 3", k, got)
		}
	}
}

// slotMover is a 3-master Cluster and a client of it, for tests that move a slot by hand
// as redis-cli does: a client and the node ID of each master, by address.
type slotMover struct {
	cl    *redistest.Cluster
	rdb   redis.UniversalClient
	cc    *redis.ClusterClient
	nodes map[string]*redis.Client
	ids   map[string]string
}

func newSlotMover(t *testing.T) *slotMover {
	t.Helper()
	cl := redistest.StartCluster(t)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	sm := &slotMover{cl: cl, rdb: rdb, cc: rdb.(*redis.ClusterClient), nodes: map[string]*redis.Client{}, ids: map[string]string{}}
	for _, a := range cl.Addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		t.Cleanup(func() { c.Close() })
		sm.nodes[a] = c
		id, err := c.Do(context.Background(), "CLUSTER", "MYID").Text()
		if err != nil {
			t.Fatal(err)
		}
		sm.ids[a] = id
	}
	return sm
}

// master returns the address of the master that serves key k.
func (sm *slotMover) master(t *testing.T, k string) string {
	t.Helper()
	m, err := sm.cc.MasterForKey(context.Background(), k)
	if err != nil {
		t.Fatal(err)
	}
	return m.Options().Addr
}

// setMigrating marks slot as moving from the master at from to the one at to (IMPORTING
// on to, MIGRATING on from), as redis-cli's reshard does before it moves the keys.
func (sm *slotMover) setMigrating(t *testing.T, slot uint16, from, to string) {
	t.Helper()
	ctx := context.Background()
	if err := sm.nodes[to].Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", sm.ids[from]).Err(); err != nil {
		t.Fatal(err)
	}
	if err := sm.nodes[from].Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", sm.ids[to]).Err(); err != nil {
		t.Fatal(err)
	}
}

// migrate moves keys, of a slot setMigrating marked, from the master at from to the one
// at to.
func (sm *slotMover) migrate(t *testing.T, from, to string, keys ...string) {
	t.Helper()
	host, port, _ := strings.Cut(to, ":")
	args := []any{"MIGRATE", host, port, "", 0, 5000, "KEYS"}
	for _, k := range keys {
		args = append(args, k)
	}
	if err := sm.nodes[from].Do(context.Background(), args...).Err(); err != nil {
		t.Fatalf("MIGRATE %v: %v", keys, err)
	}
}

// askingCount returns key k's count (field n) on the master at addr, asked with ASKING
// (a slot it imports): 0 when the key is not there (missing, or ASK: on the target).
func (sm *slotMover) askingCount(t *testing.T, addr, k string) int {
	t.Helper()
	pipe := sm.nodes[addr].Pipeline()
	pipe.Do(context.Background(), "ASKING")
	n := pipe.HGet(context.Background(), k, "n")
	if _, err := pipe.Exec(context.Background()); err != nil && err != redis.Nil && !redis.HasErrorPrefix(err, "ASK") {
		t.Fatal(err)
	}
	v, _ := n.Int()
	return v
}

// risingTags returns n hash tags {user=i} of one master, in rising slot order.
func (sm *slotMover) risingTags(t *testing.T, n int) []string {
	t.Helper()
	var tags []string
	for i := 0; len(tags) < n; i++ {
		k := fmt.Sprintf("{user=%d}", i)
		if len(tags) == 0 || sm.master(t, k) == sm.master(t, tags[0]) && Slot(k) > Slot(tags[len(tags)-1]) {
			tags = append(tags, k)
		}
	}
	return tags
}

// otherThan returns a master's address other than from.
func (sm *slotMover) otherThan(from string) string {
	for _, a := range sm.cl.Addrs {
		if a != from {
			return a
		}
	}
	return ""
}
