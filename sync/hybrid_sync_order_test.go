package sync

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A periodic sync of many keys sends first the keys whose next request waits for it (a
// key new here, its one unit on credit spent), and applies each pipeline's replies as
// they come in: a new client's second request, during a long sync, is decided from the
// view its first sync brought, not held for the whole sync and then, FetchWait gone,
// sent to its rule's failure policy. Before, the new key went wherever collection put
// it among 20,000 keys settling credit (40 pipelines), and stayed busy until the last
// pipeline was answered: its request waited for it, and was refused as Redis not
// answering (Unreachable; degraded under a policy) while Redis answered every call.
//
// Redis is frozen once the new key's sync has reached it, with the rest of the sync
// still to go: the request is decided with no Redis to wait on.
func TestHybridLongSyncSendsWaitedOnKeysFirst(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	ctl := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { ctl.Close() })
	ctx := context.Background()
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: 100 * time.Millisecond})
	lim := mustLimit(t, localbucket.TokenBucket, 600, time.Minute)
	const known = 20_000 // about 40 pipelines of callKeys × pipeCalls
	now := time.Now().UnixNano
	for i := range known {
		if r := take(h, now(), "rl:u:{user="+strconv.Itoa(i)+"}", lim, 1); !r.Allowed {
			t.Fatalf("known key %d: a first request refused: %+v", i, r)
		}
	}
	if err := h.Flush(ctx, now()); err != nil {
		t.Fatal(err)
	}
	// Each known key admits a unit on the credit its view brought: a sync to settle,
	// nothing waiting for it. Then one client new here.
	for i := range known {
		if r := take(h, now(), "rl:u:{user="+strconv.Itoa(i)+"}", lim, 1); !r.Allowed {
			t.Fatalf("known key %d: a request on credit refused: %+v", i, r)
		}
	}
	const fresh = "rl:u:{user=new}"
	if r := take(h, now(), fresh, lim, 1); !r.Allowed {
		t.Fatalf("the new key's first request refused: %+v", r)
	}
	// The sync Flush would make, its order looked at before it goes.
	items := h.collect(now(), math.MaxInt)
	at := slices.IndexFunc(items, func(it syncItem) bool { return it.e.key() == fresh })
	if at < 0 || at >= callKeys {
		t.Errorf("the new key is item %d of the sync's %d: not in its first call (%d keys)", at, len(items), callKeys)
	}
	done := make(chan error, 1)
	go func() {
		c, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		_, err := h.settle(c, items, false)
		done <- err
	}()
	for {
		n, err := ctl.Exists(ctx, fresh).Result()
		if err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("the sync ended (%v) and the new key is not in Redis", err)
		default:
		}
	}
	srv.Freeze()
	thawed := false
	thaw := func() {
		if !thawed {
			srv.Thaw()
			thawed = true
		}
	}
	defer thaw()
	// The new key's pipeline answered and applied (or, applied at the end of the sync,
	// not while Redis is frozen).
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if h.synced(fresh) {
			break
		}
	}
	ops := []HybridOp{{Key: []byte(fresh), Limit: lim, Cost: 1}}
	start := time.Now()
	ok := h.Take(now(), ops)
	waited := time.Since(start)
	thaw()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !ok || ops[0].Unreachable {
		t.Fatalf("the new client's second request, with its first sync answered and the sync's other %d keys still to go: allowed %v, unreachable %v, after %v",
			known, ok, ops[0].Unreachable, waited)
	}
}

// synced reports whether a sync of key has been applied, and it is not in one now.
func (h *Hybrid) synced(key string) bool {
	sh := &h.shards[h.shardOf([]byte(key))]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[key]
	return e != nil && e.synced > 0 && e.flags&flagBusy == 0
}

// urgentFirst is a stable partition: the urgent items first, each group in its
// order, against a stable sort by the same key.
func TestUrgentFirstIsAStablePartition(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for round := range 2000 {
		n := r.IntN(40)
		items := make([]syncItem, n)
		for i := range items {
			items[i].token = uint32(i) // its place before
			switch r.IntN(6) {
			case 0:
				items[i].first = true
			case 1:
				items[i].demand = 1
			case 2:
				items[i].mode = modeLeave
			case 3:
				items[i].gone = true
			}
		}
		want := slices.Clone(items)
		slices.SortStableFunc(want, func(a, b syncItem) int {
			switch {
			case a.urgent() == b.urgent():
				return 0
			case a.urgent():
				return -1
			}
			return 1
		})
		urgentFirst(items)
		got, exp := order(items), order(want)
		if got != exp {
			t.Fatalf("round %d: %v, want %v", round, got, exp)
		}
	}
}

func order(items []syncItem) string {
	var b strings.Builder
	for i := range items {
		w := ""
		if items[i].urgent() {
			w = "*"
		}
		fmt.Fprintf(&b, "%d%s ", items[i].token, w)
	}
	return b.String()
}

// On a cluster a sync call declares the keys of its first slot (firstSlotKeys, from its
// start): each call must hold all its keys of that slot there, though byNode puts the
// urgent keys ahead of the others, each group sorted by slot. A call across the two
// groups held keys of its first slot in both, those of the second undeclared (the
// fault firstSlotKeys describes, while the slot migrates). Keys of one hash tag share a
// slot.
func TestCallsKeepTheirFirstSlotTogether(t *testing.T) {
	mk := func(key string, waited bool) syncItem {
		e := &hentry{}
		e.setKey(key)
		return syncItem{e: e, first: waited}
	}
	// As byNode sorts one master's items: urgent first, each group by slot.
	items := []syncItem{mk("rl:a:{x}", true), mk("rl:a:{y}", true), mk("rl:b:{x}", false), mk("rl:c:{z}", false)}
	if Slot("rl:a:{x}") == Slot("rl:a:{y}") || Slot("rl:a:{x}") == Slot("rl:c:{z}") {
		t.Fatal("the test's tags share a slot")
	}
	nodes := []string{"m1", "m1", "m1", "m1"}
	calls, callNode := callsOf(items, nodes, 128)
	for i, c := range calls {
		n := firstSlotKeys(c.items)
		for _, it := range c.items[n:] {
			if Slot(it.e.key()) == Slot(c.items[0].e.key()) {
				t.Errorf("call %d (%s): %s is in its first slot, %d, and not declared (the first %d keys are)", i, callNode[i], it.e.key(), Slot(it.e.key()), n)
			}
		}
	}
	if len(calls) != 2 || len(calls[0].items) != 2 {
		t.Errorf("%d calls, want 2: the urgent keys, then the others", len(calls))
	}
	// Standalone (no nodes): one call, every key declared.
	if calls, _ := callsOf(items, nil, 128); len(calls) != 1 {
		t.Errorf("standalone: %d calls, want 1", len(calls))
	}
}
