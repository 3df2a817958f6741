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
// The new key's reply must be applied while Redis still has most of the sync's calls to
// run, and its second request then decided from the view, no exact sync made.
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
	calls := func() int64 { // the script calls Redis has run
		info, err := ctl.Info(ctx, "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		_, v, _ := strings.Cut(info, "cmdstat_evalsha:calls=")
		v, _, _ = strings.Cut(v, ",")
		n, _ := strconv.ParseInt(v, 10, 64)
		return n
	}
	before := calls()
	total := int64((len(items) + callKeys - 1) / callKeys)
	done := make(chan error, 1)
	go func() {
		c, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		_, err := h.settle(c, items, false)
		done <- err
	}()
	// The new key's reply applied, and the calls Redis had run by then: applied at the
	// sync's end, all of them.
	for !h.synced(fresh) {
		select {
		case err := <-done:
			t.Fatalf("the sync ended (%v) and the new key's reply is not applied", err)
		default:
		}
	}
	ran := calls() - before
	fetches := h.fetches.Load()
	ops := []HybridOp{{Key: []byte(fresh), Limit: lim, Cost: 1}}
	ok := h.Take(now(), ops)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if ran >= total {
		t.Errorf("the new key's reply was applied once Redis had run %d of the sync's %d script calls: at its end, not as its pipeline came back", ran, total)
	}
	if !ok || ops[0].Unreachable || h.fetches.Load() != fetches {
		t.Errorf("the new client's second request, its first sync applied: allowed %v, unreachable %v, exact syncs %d (want it decided from the view, none)",
			ok, ops[0].Unreachable, h.fetches.Load()-fetches)
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
