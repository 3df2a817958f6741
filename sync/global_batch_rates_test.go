package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// globalBatchArgs returns the KEYS and ARGV of global.lua's batch form deciding one
// token bucket check of key per request, as mergeCall sends them.
func globalBatchArgs(key string, checks []struct {
	l    *localbucket.Limit
	cost uint64
}) ([]string, []any) {
	keys := make([]string, len(checks))
	args := []any{"batch", len(checks)}
	for i := range checks {
		keys[i] = key
		args = append(args, 1)
	}
	for _, c := range checks {
		l := c.l
		args = append(args, int(l.Algorithm()), l.Requests(), l.Window().Microseconds(), l.Burst(),
			int64(l.Window())/int64(l.Requests()), c.cost, 0)
	}
	return keys, args
}

// Two requests of one client on two plans of a rule (30 and 3 per hour: one key, two
// rates) queued together on a daemon go to Redis in one call of global.lua's batch form
// (the auto-pipeline merges them), as do the calls before and after a reload. Each reads
// the key's units used at its own rate, as it would in a call of its own. Before, only
// the call's first read of a key rescaled it: a later request at the other rate read its
// state as if written at its own rate (the same time, not the same units), so 3 used at
// 3 per hour read at 30 per hour as 30 used (a partner request refused, 27 free), and
// 10 used at 30 per hour read at 3 per hour as 1 used (2 requests of the lower plan
// admitted where a call of their own refuses them). So in one request of two checks of
// the key at the two rates.
func TestGlobalBatchReadsEachRate(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	bk := globalBackend{name: "standalone", g: NewGlobal(rdb), rdb: rdb}
	partner := globalLimit(t, localbucket.TokenBucket, 30, time.Hour, 30)
	free := globalLimit(t, localbucket.TokenBucket, 3, time.Hour, 3)
	type check = struct {
		l    *localbucket.Limit
		cost uint64
	}
	batch := func(key string, checks ...check) []bool {
		t.Helper()
		keys, args := globalBatchArgs(key, checks)
		v, err := rdb.Eval(context.Background(), globalSrc, keys, args...).Slice()
		if err != nil {
			t.Fatal(err)
		}
		out := make([]bool, len(v))
		for i, r := range v {
			out[i] = r.([]any)[0].(int64) == 1
		}
		return out
	}
	use := func(key string, l *localbucket.Limit, n int) {
		t.Helper()
		for range n {
			if _, ok, _, _ := globalCheckOne(t, bk, key, l, 1); !ok {
				t.Fatalf("%s: refused while using %d", key, n)
			}
		}
	}
	for _, first := range []uint64{0, 1} {
		t.Run(fmt.Sprintf("first-cost-%d", first), func(t *testing.T) {
			// 3 used at 3 per hour: 27 of 30 left at 30 per hour.
			key := fmt.Sprintf("rl:gbatch:{low-%d}", first)
			use(key, free, 3)
			if got := batch(key, check{free, first}, check{partner, 1}); got[1] != true {
				t.Errorf("3 used at 3 per hour, then in one batch a check at 3 per hour and one at 30 per hour: %v; the second refused, want allowed", got)
			}
			// The same in one request of two checks of the key (two parts of an Envoy
			// call on the two plans).
			key = fmt.Sprintf("rl:gbatch:{one-%d}", first)
			use(key, free, 3)
			ops := []GlobalOp{{Key: key, Limit: free, Cost: first, Shadow: true}, {Key: key, Limit: partner, Cost: 1}}
			if _, err := bk.g.Check(context.Background(), ops); err != nil {
				t.Fatal(err)
			}
			if !ops[1].Result.Allowed {
				t.Errorf("3 used at 3 per hour, then one request of a shadow check at 3 per hour and one at 30 per hour: the second refused, want allowed")
			}
			// 10 used at 30 per hour: none left at 3 per hour.
			key = fmt.Sprintf("rl:gbatch:{high-%d}", first)
			use(key, partner, 10)
			if got := batch(key, check{partner, first}, check{free, 1}, check{free, 1}); got[1] || got[2] {
				t.Errorf("10 used at 30 per hour, then in one batch a check at 30 per hour and two at 3 per hour: %v; want both at 3 per hour refused", got)
			}
		})
	}
}

// A take refunded (refund.lua: a later slot group of its request refused) after a check
// of another plan read the key at its rate gives back the units taken, at the key's rate
// now. Before, it took cost × the take's emission off the TAT whatever rate the TAT
// counted in: a unit taken at 3 per hour (20 min) refunded from a key read since at 30
// per hour (2 min a unit) gave back 10 units there, so 9 requests more were admitted.
func TestGlobalRefundAtTheKeysRate(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	bk := globalBackend{name: "standalone", g: NewGlobal(rdb), rdb: rdb}
	partner := globalLimit(t, localbucket.TokenBucket, 30, time.Hour, 30)
	free := globalLimit(t, localbucket.TokenBucket, 3, time.Hour, 3)
	key := "rl:grefund:{u}"
	if _, ok, _, _ := globalCheckOne(t, bk, key, free, 1); !ok { // the take to be refunded
		t.Fatal("the first take at 3 per hour refused")
	}
	for i := range 10 { // read at 30 per hour: 1 used, then 11
		if _, ok, _, _ := globalCheckOne(t, bk, key, partner, 1); !ok {
			t.Fatalf("take %d at 30 per hour refused", i+1)
		}
	}
	if err := rdb.Eval(context.Background(), refundSrc, []string{key},
		int(free.Algorithm()), free.Window().Microseconds(), int64(free.Window())/int64(free.Requests()), 1, 0).Err(); err != nil {
		t.Fatal(err)
	}
	// 10 used at 30 per hour: 20 left.
	admitted := 0
	for range 30 {
		if _, ok, _, _ := globalCheckOne(t, bk, key, partner, 1); ok {
			admitted++
		}
	}
	if admitted != 20 {
		t.Errorf("after the refund of a unit taken at 3 per hour, with 10 more used at 30 per hour: %d admitted at 30 per hour, want 20", admitted)
	}
}

// The units a cut leaves out (gu) are kept in full however long they take to refill:
// 30 used of 30 per 30 days, one check of the lower plan (3 per 30 days: 300 days of
// its refill used, cut to its burst of 30 days), and back at 30 per 30 days none is
// admitted, as in the local mode (localbucket.Limit.Rescale keeps the uncut time
// whole). Before, what a cut kept was capped at 52 days (2^52 ns) of the lower plan's
// refill, 5.2 of its units: read back as 5.2 used, 24 more were admitted; and so at a
// second check of the lower plan, whose units were kept (not cut) to 52 days.
func TestGlobalPlanFlappingKeepsLongUnits(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	bk := globalBackend{name: "standalone", g: NewGlobal(rdb), rdb: rdb}
	for _, cost := range []uint64{1, 0} {
		t.Run(fmt.Sprintf("lower-plan-cost-%d", cost), func(t *testing.T) {
			month := 30 * 24 * time.Hour
			partner := globalLimit(t, localbucket.TokenBucket, 30, month, 30)
			free := globalLimit(t, localbucket.TokenBucket, 3, month, 3)
			key := fmt.Sprintf("rl:glongflap:{%d}", cost)
			admitted := func(l *localbucket.Limit, n int) int { return globalAdmitted(t, bk, key, l, n) }
			if got := admitted(partner, 30); got != 30 {
				t.Fatalf("%d of 30 admitted at 30 per 30 days on a fresh key", got)
			}
			if r, _, _, _ := globalCheckOne(t, bk, key, free, cost); r.Allowed {
				t.Fatalf("a check of cost %d at 3 per 30 days after 30 used: allowed", cost)
			}
			if got := admitted(partner, 30); got != 0 {
				t.Errorf("back at 30 per 30 days after 30 used: %d more admitted, want 0", got)
			}
			// Read at 3 per 30 days again within its window: its units are kept, not cut
			// (a cut at that rate was made), and kept whole past 52 days as well.
			if r, _, _, _ := globalCheckOne(t, bk, key, free, cost); r.Allowed {
				t.Fatalf("a second check of cost %d at 3 per 30 days: allowed", cost)
			}
			if got := admitted(partner, 30); got != 0 {
				t.Errorf("back at 30 per 30 days a second time: %d more admitted, want 0", got)
			}
		})
	}
}
