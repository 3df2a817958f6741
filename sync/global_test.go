package sync

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	gosync "sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/plural"
	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// globalBackend is one Redis deployment a Global runs on.
type globalBackend struct {
	name string
	g    *Global
	rdb  redis.UniversalClient
	// forEachNode runs fn on every master.
	forEachNode func(ctx context.Context, fn func(ctx context.Context, c *redis.Client) error) error
	cluster     *redis.ClusterClient // nil on a standalone server
}

// globalBackends starts a standalone Redis and a 3-master Redis Cluster and returns Globals on
// them: the standalone twice, once grouping by slot as on a cluster (to exercise the
// pipelined path and the refunds), once sending each check in one call.
func globalBackends(t *testing.T) []globalBackend {
	t.Helper()
	srv := redistest.StartStandalone(t)
	std := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { std.Close() })
	cl := redistest.StartCluster(t)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	t.Cleanup(func() { cc.Close() })
	stdEach := func(ctx context.Context, fn func(ctx context.Context, c *redis.Client) error) error {
		return fn(ctx, std)
	}
	bs := []globalBackend{
		{name: "standalone", g: NewGlobal(std), rdb: std, forEachNode: stdEach},
		{name: "standalone_by_slot", g: &Global{rdb: std, bySlot: true}, rdb: std, forEachNode: stdEach},
		{name: "cluster", g: NewGlobal(cc), rdb: cc, forEachNode: cc.ForEachMaster, cluster: cc},
	}
	if bs[0].g.bySlot || !bs[2].g.bySlot {
		t.Fatalf("NewGlobal: bySlot %v on a standalone client, %v on a cluster client", bs[0].g.bySlot, bs[2].g.bySlot)
	}
	return bs
}

func globalLimit(t testing.TB, alg localbucket.Algorithm, requests uint64, window time.Duration, burst uint64) *localbucket.Limit {
	t.Helper()
	l, err := localbucket.NewLimit(alg, requests, window, burst)
	if err != nil {
		t.Fatal(err)
	}
	return &l
}

var globalAlgs = []localbucket.Algorithm{localbucket.TokenBucket, localbucket.SlidingWindow, localbucket.FixedWindow}

func globalCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// globalRedisNow returns Redis's TIME in ns.
func globalRedisNow(t testing.TB, rdb redis.UniversalClient) int64 {
	t.Helper()
	tm, err := rdb.Time(globalCtx(t)).Result()
	if err != nil {
		t.Fatal(err)
	}
	return tm.UnixMicro() * 1000
}

// globalWriteState stores s as global.lua's state of key for alg.
func globalWriteState(t testing.TB, rdb redis.UniversalClient, key string, alg localbucket.Algorithm, s localbucket.State) {
	t.Helper()
	var err error
	if alg == localbucket.TokenBucket {
		err = rdb.HSet(globalCtx(t), key, "t", s.T/1000, "f", s.T%1000).Err()
	} else {
		err = rdb.HSet(globalCtx(t), key, "t", s.T/1000, "n", s.N&(1<<32-1), "p", s.N>>32).Err()
	}
	if err != nil {
		t.Fatal(err)
	}
}

// globalReadState reads key's state as a localbucket.State; ok is false when the key is missing.
func globalReadState(t testing.TB, rdb redis.UniversalClient, key string) (s localbucket.State, ok bool) {
	t.Helper()
	v, err := rdb.HMGet(globalCtx(t), key, "t", "f", "n", "p").Result()
	if err != nil {
		t.Fatal(err)
	}
	num := func(x any) int64 {
		if x == nil {
			return 0
		}
		n, err := strconv.ParseInt(x.(string), 10, 64)
		if err != nil {
			t.Fatalf("%s: field %q: %v", key, x, err)
		}
		return n
	}
	if v[0] == nil {
		return s, false
	}
	return localbucket.State{T: num(v[0])*1000 + num(v[1]), N: uint64(num(v[2])) | uint64(num(v[3]))<<32}, true
}

// globalMatchAt looks for a µs instant in [t0, t1] (ns, µs-aligned) at which
// l.Take(s, t, cost) gives got, field for field except Expires and LimitedUntil (which
// Check leaves 0), and, when the take consumed, the state stored. Reset and RetryAfter
// may differ by tol ns, and the stored state's T too. It returns that instant and Take's
// results.
func globalMatchAt(l *localbucket.Limit, s localbucket.State, t0, t1 int64, cost uint64, got localbucket.Result, stored localbucket.State, tol int64) (int64, localbucket.State, localbucket.Result, bool) {
	within := func(a, b int64) bool { return max(a-b, b-a) <= tol }
	for t := t0; t <= t1; t += 1000 {
		out, r := l.Take(s, t, cost)
		full := r
		r.Expires, r.LimitedUntil = 0, 0
		if !within(r.Reset, got.Reset) || !within(r.RetryAfter, got.RetryAfter) ||
			!within(out.T, stored.T) && r.Allowed && cost > 0 {
			continue
		}
		r.Reset, r.RetryAfter = got.Reset, got.RetryAfter
		if r == got && (!r.Allowed || cost == 0 || out.N == stored.N) {
			return t, out, full, true
		}
	}
	return 0, localbucket.State{}, localbucket.Result{}, false
}

// globalCheckOne runs one op through Check and returns its result and Redis's time before and
// after.
func globalCheckOne(t testing.TB, b globalBackend, key string, l *localbucket.Limit, cost uint64) (localbucket.Result, bool, int64, int64) {
	t.Helper()
	t0 := globalRedisNow(t, b.rdb)
	ops := []GlobalOp{{Key: key, Limit: l, Cost: cost}}
	ok, err := b.g.Check(globalCtx(t), ops)
	if err != nil {
		t.Fatalf("Check(%s cost %d): %v", key, cost, err)
	}
	t1 := globalRedisNow(t, b.rdb)
	if ok != ops[0].Result.Allowed {
		t.Fatalf("Check returned %v, but Result.Allowed is %v", ok, ops[0].Result.Allowed)
	}
	return ops[0].Result, ok, t0, t1
}

func TestGlobal(t *testing.T) {
	bs := globalBackends(t)
	for _, b := range bs {
		t.Run(b.name, func(t *testing.T) {
			t.Run("sequences", func(t *testing.T) { testGlobalSequences(t, b) })
			t.Run("random_states", func(t *testing.T) { testGlobalRandomStates(t, b) })
			t.Run("five_then_reject", func(t *testing.T) { testGlobalFiveThenReject(t, b) })
			t.Run("same_slot_all_or_nothing", func(t *testing.T) { testGlobalSameSlot(t, b) })
			t.Run("two_slots_refund", func(t *testing.T) { testGlobalTwoSlots(t, b) })
			t.Run("same_key_twice", func(t *testing.T) { testGlobalSameKeyTwice(t, b) })
			t.Run("shadow", func(t *testing.T) { testGlobalShadow(t, b) })
			t.Run("peek", func(t *testing.T) { testGlobalPeek(t, b) })
			t.Run("impossible", func(t *testing.T) { testGlobalImpossible(t, b) })
			t.Run("race", func(t *testing.T) { testGlobalRace(t, b) })
			t.Run("script_flush", func(t *testing.T) { testGlobalScriptFlush(t, b) })
			t.Run("done_context", func(t *testing.T) { testGlobalDoneContext(t, b) })
			// Last: it checks the keys every earlier subtest wrote.
			t.Run("ttl_on_every_key", func(t *testing.T) { testGlobalTTL(t, b) })
		})
	}
}

// testSequences walks sequences of costs on one key and wants, at every step, exactly
// what localbucket's Take gives at some instant between the Redis times read before and
// after the check, and the same stored state.
func testGlobalSequences(t *testing.T, b globalBackend) {
	for _, tc := range []struct {
		name  string
		limit *localbucket.Limit
		costs []uint64
	}{
		{"token_10_per_hour", globalLimit(t, localbucket.TokenBucket, 10, time.Hour, 0), []uint64{1, 3, 0, 5, 2, 1, 11, 0, 1, 10}},
		{"token_3_per_second_burst_5", globalLimit(t, localbucket.TokenBucket, 3, time.Second, 5), []uint64{2, 2, 1, 1, 0, 6, 1, 2}},
		{"token_7_per_ms", globalLimit(t, localbucket.TokenBucket, 7, time.Millisecond, 0), []uint64{7, 1, 3, 0, 4, 8, 1}},
		{"sliding_10_per_hour", globalLimit(t, localbucket.SlidingWindow, 10, hourWindow(), 0), []uint64{1, 3, 0, 5, 2, 1, 11, 0, 1}},
		{"sliding_3_per_7ms", globalLimit(t, localbucket.SlidingWindow, 3, 7*time.Millisecond, 0), []uint64{3, 1, 1, 2, 0, 3, 1, 1, 1}},
		{"fixed_10_per_hour", globalLimit(t, localbucket.FixedWindow, 10, hourWindow(), 0), []uint64{1, 3, 0, 5, 2, 1, 11, 0, 1}},
		{"fixed_3_per_3ms", globalLimit(t, localbucket.FixedWindow, 3, 3*time.Millisecond, 0), []uint64{3, 1, 2, 0, 1, 1, 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "rl:seq_" + tc.name + ":{" + b.name + "}"
			var s localbucket.State
			for i, cost := range tc.costs {
				got, _, t0, t1 := globalCheckOne(t, b, key, tc.limit, cost)
				stored, _ := globalReadState(t, b.rdb, key)
				at, out, want, found := globalMatchAt(tc.limit, s, t0, t1, cost, got, stored, 0)
				if !found {
					_, w := tc.limit.Take(s, t0, cost)
					t.Fatalf("step %d cost %d: got %+v, which Take gives at no µs in [%d, %d]; at %d it gives %+v", i, cost, got, t0, t1, t0, w)
				}
				globalCheckStored(t, b, key, s, out, want, at, cost)
				if want.Allowed && cost > 0 {
					s = out // else Redis keeps the state as it was, not rolled to now
				}
			}
		})
	}
}

// globalCheckStored wants key to hold out if the take consumed, and before otherwise, with a
// TTL covering the state's information.
func globalCheckStored(t *testing.T, b globalBackend, key string, before, out localbucket.State, r localbucket.Result, at int64, cost uint64) {
	t.Helper()
	stored, exists := globalReadState(t, b.rdb, key)
	if !r.Allowed || cost == 0 {
		if exists && stored != before || !exists && before != (localbucket.State{}) {
			t.Fatalf("%s holds %+v (exists %v), want the unchanged %+v", key, stored, exists, before)
		}
		return
	}
	if !exists || stored != out {
		t.Fatalf("%s holds %+v (exists %v), want %+v", key, stored, exists, out)
	}
	globalCheckTTL(t, b.rdb, key, r.Expires, at)
}

// globalCheckTTL wants key's TTL to cover its state's information (until expires, ns, as
// localbucket computes it at at) plus 1 s, and to exceed that by at most global.lua's
// slack (1 s + 1/8): a key taken from again and again is given a longer TTL only when it
// must grow (see global.lua's commit), so an earlier, longer TTL may still run.
func globalCheckTTL(t *testing.T, rdb redis.UniversalClient, key string, expires, at int64) {
	t.Helper()
	pttl, err := rdb.PTTL(globalCtx(t), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	elapsed := time.Duration(globalRedisNow(t, rdb) - at)
	need := time.Duration(expires-at) + time.Second
	lo := need - elapsed - time.Millisecond // PTTL rounds down to the ms
	// An earlier TTL, given Δ ago, exceeds this bound by Δ/8: 250 ms allows a Δ of 2 s.
	hi := need + time.Second + need/8 + 250*time.Millisecond
	if pttl <= 0 || pttl < lo || pttl > hi {
		t.Fatalf("%s: PTTL %v, want in [%v, %v] (state informative for %v more, %v since)", key, pttl, lo, hi, time.Duration(expires-at), elapsed)
	}
}

// testRandomStates seeds random states (including full, over-full after a limit shrank,
// rolled windows, and states in the future as after a clock step back), takes random
// costs, and wants exactly localbucket's result and next state.
func testGlobalRandomStates(t *testing.T, b globalBackend) {
	rng := rand.New(rand.NewPCG(1, uint64(len(b.name))))
	requestsSet := []uint64{1, 2, 3, 7, 10, 100, 1000, 65535, 1 << 31}
	windows := []time.Duration{time.Millisecond, 3 * time.Millisecond, 7 * time.Millisecond, time.Second,
		time.Minute, time.Hour, 3 * 24 * time.Hour, 30 * 24 * time.Hour, 100 * 24 * time.Hour, 366 * 24 * time.Hour}
	n := 300
	if testing.Short() {
		n = 50
	}
	for i := 0; i < n; i++ {
		alg := globalAlgs[rng.IntN(len(globalAlgs))]
		requests := requestsSet[rng.IntN(len(requestsSet))]
		window := windows[rng.IntN(len(windows))]
		var burst uint64
		if alg == localbucket.TokenBucket && rng.IntN(2) == 0 {
			burst = 1 + rng.Uint64N(2*requests)
		}
		lim, err := localbucket.NewLimit(alg, requests, window, burst)
		if err != nil {
			continue
		}
		l := &lim
		key := fmt.Sprintf("rl:rand:{%s-%d}", b.name, i)
		if err := b.rdb.Del(globalCtx(t), key).Err(); err != nil {
			t.Fatal(err)
		}
		now := globalRedisNow(t, b.rdb)
		w := int64(window)
		var s localbucket.State
		if rng.IntN(8) != 0 {
			switch alg {
			case localbucket.TokenBucket:
				tau := int64(l.Burst()) * (w / int64(requests))
				s.T = max(now+rng.Int64N(4*tau+1)-2*tau, 0)
			default:
				start := now - now%w + int64(rng.IntN(5)-3)*w
				cur := rng.Uint64N(requests + 3)
				var prev uint64
				if alg == localbucket.SlidingWindow {
					prev = rng.Uint64N(requests + 3)
				}
				s = localbucket.State{T: start, N: prev<<32 | cur}
			}
			globalWriteState(t, b.rdb, key, alg, s)
		}
		var cost uint64
		switch rng.IntN(4) {
		case 0:
			cost = 0
		case 1:
			cost = 1
		default:
			cost = rng.Uint64N(l.Capacity() + 2)
		}
		got, _, t0, t1 := globalCheckOne(t, b, key, l, cost)
		stored, _ := globalReadState(t, b.rdb, key)
		// global.lua computes durations exactly below 2^53ns (104 days), and rounds
		// longer ones by a few ns.
		var tol int64
		if bound := 3 * max(w, int64(l.Burst())*(w/int64(requests))); bound >= 1<<53 {
			tol = 1000
		}
		at, out, want, found := globalMatchAt(l, s, t0, t1, cost, got, stored, tol)
		if !found {
			_, w := l.Take(s, t0, cost)
			t.Fatalf("%d: %v %d per %v burst %d, state %+v, cost %d: got %+v, which Take gives at no µs in [%d, %d]; at %d it gives %+v",
				i, alg, requests, window, burst, s, cost, got, t0, t1, t0, w)
		}
		if tol == 0 {
			globalCheckStored(t, b, key, s, out, want, at, cost)
		}
		// The seeded states have no TTL; the TTL subtest checks only what Check wrote.
		if err := b.rdb.Del(globalCtx(t), key).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// testFiveThenReject: a limit of 5 admits exactly 5, then rejects with a retry-after of
// about window/requests for a token bucket, and until the window ends for a fixed window.
func testGlobalFiveThenReject(t *testing.T, b globalBackend) {
	for _, alg := range globalAlgs {
		t.Run(alg.String(), func(t *testing.T) {
			window := time.Second
			if alg != localbucket.TokenBucket {
				window = time.Hour // no window boundary during the test, in practice
			}
			l := globalLimit(t, alg, 5, window, 0)
			// A token bucket of 5 per second refills one every 200 ms from its first
			// take on (full before it): the 6th check's retry is 200 ms less the time
			// between the two takes, which the script reads from Redis's clock, and
			// which Redis's clock around each check bounds. Under load the six checks
			// took 90 ms ("RetryAfter 109.966ms, want about 200ms", when this asked for
			// more than 150 ms). Six checks that took 200 ms or more may find a token
			// back: tried again, with a new key, for up to 10 s.
			var r localbucket.Result
			var t0, firstBefore, firstAfter, sixthAfter int64
			for attempt, deadline := 0, time.Now().Add(10*time.Second); ; attempt++ {
				key := "rl:five_" + alg.String() + ":{" + b.name + "}"
				if attempt > 0 {
					key = fmt.Sprintf("rl:five_%s_%d:{%s}", alg, attempt, b.name)
				}
				for i := range 5 {
					r, ok, before, after := globalCheckOne(t, b, key, l, 1)
					if !ok || r.Remaining != uint64(4-i) {
						t.Fatalf("check %d: %v %+v, want allowed with %d remaining", i, ok, r, 4-i)
					}
					if i == 0 {
						firstBefore, firstAfter = before, after
					}
				}
				var ok bool
				r, ok, t0, sixthAfter = globalCheckOne(t, b, key, l, 1)
				if alg == localbucket.TokenBucket && sixthAfter-firstBefore >= int64(200*time.Millisecond) && time.Now().Before(deadline) {
					t.Logf("six checks took %v of Redis's time: again", time.Duration(sixthAfter-firstBefore))
					continue
				}
				if ok || r.Remaining != 0 || r.Impossible {
					t.Fatalf("6th check: %v %+v, want rejected", ok, r)
				}
				break
			}
			switch alg {
			case localbucket.TokenBucket:
				// Between the takes: at least t0-firstAfter, at most sixthAfter-firstBefore;
				// 1 ms either side for the script's rounding.
				lo := 200*int64(time.Millisecond) - (sixthAfter - firstBefore) - int64(time.Millisecond)
				hi := 200*int64(time.Millisecond) - (t0 - firstAfter) + int64(time.Millisecond)
				if r.RetryAfter <= 0 || r.RetryAfter < lo || r.RetryAfter > hi {
					t.Errorf("RetryAfter %v, want 200ms less the time between the first take and this one: %v to %v",
						time.Duration(r.RetryAfter), time.Duration(lo), time.Duration(hi))
				}
			case localbucket.FixedWindow:
				if end := t0 - t0%int64(time.Hour) + int64(time.Hour); r.RetryAfter > end-t0 || r.RetryAfter < end-t0-int64(time.Second) {
					t.Errorf("RetryAfter %v, want %v (until the window ends)", time.Duration(r.RetryAfter), time.Duration(end-t0))
				}
			default:
				if r.RetryAfter <= 0 || r.RetryAfter > 2*int64(time.Hour) {
					t.Errorf("RetryAfter %v, want in (0, 2h]", time.Duration(r.RetryAfter))
				}
			}
		})
	}
}

// globalExhaust takes the whole capacity of key.
func globalExhaust(t *testing.T, b globalBackend, key string, l *localbucket.Limit) {
	t.Helper()
	ops := []GlobalOp{{Key: key, Limit: l, Cost: l.Capacity()}}
	if ok, err := b.g.Check(globalCtx(t), ops); !ok || err != nil {
		t.Fatalf("exhausting %s: %v %v %+v", key, ok, err, ops[0].Result)
	}
}

// globalPeek returns what key has left, by a cost-0 check.
func globalPeek(t *testing.T, b globalBackend, key string, l *localbucket.Limit) uint64 {
	t.Helper()
	ops := []GlobalOp{{Key: key, Limit: l}}
	if _, err := b.g.Check(globalCtx(t), ops); err != nil {
		t.Fatal(err)
	}
	return ops[0].Result.Remaining
}

func testGlobalSameSlot(t *testing.T, b globalBackend) {
	for _, alg := range globalAlgs {
		t.Run(alg.String(), func(t *testing.T) {
			big, small := globalLimit(t, alg, 10, time.Hour, 0), globalLimit(t, alg, 2, time.Hour, 0)
			a := "rl:same_a_" + alg.String() + ":{" + b.name + "}"
			z := "rl:same_z_" + alg.String() + ":{" + b.name + "}"
			globalExhaust(t, b, z, small)
			ops := []GlobalOp{{Key: a, Limit: big, Cost: 3}, {Key: z, Limit: small, Cost: 1}}
			ok, err := b.g.Check(globalCtx(t), ops)
			if err != nil || ok {
				t.Fatalf("Check: %v %v, want false", ok, err)
			}
			if r := ops[0].Result; !r.Allowed || r.Remaining != 10 || r.RetryAfter != 0 {
				t.Errorf("the passing op: %+v, want Allowed with the peek's 10 remaining", r)
			}
			if r := ops[1].Result; r.Allowed || r.Remaining != 0 || r.RetryAfter <= 0 {
				t.Errorf("the rejecting op: %+v", r)
			}
			if n, _ := b.rdb.Exists(globalCtx(t), a).Result(); n != 0 {
				t.Errorf("%s was written", a)
			}
			// Once the other key has room, both take.
			ops[1].Key += "_fresh"
			if ok, err := b.g.Check(globalCtx(t), ops); !ok || err != nil {
				t.Fatalf("Check with room: %v %v %+v", ok, err, ops)
			}
			if r := globalPeek(t, b, a, big); r != 7 {
				t.Errorf("%s has %d left, want 7", a, r)
			}
		})
	}
}

// testTwoSlots: keys of two hash tags (two slots, on two nodes of the cluster); the one
// that rejects makes the other one's committed take be refunded.
func testGlobalTwoSlots(t *testing.T, b globalBackend) {
	for _, alg := range globalAlgs {
		for _, rejectFirst := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/reject_first_%v", alg, rejectFirst), func(t *testing.T) {
				big, small := globalLimit(t, alg, 10, time.Hour, 0), globalLimit(t, alg, 2, time.Hour, 0)
				sfx := fmt.Sprintf("%s_%v", alg, rejectFirst)
				// Tags u1 and u2 hash to slots 4574 and 8637: two different masters of
				// a 3-master cluster.
				a := "rl:two_a_" + sfx + "_" + b.name + ":{u1}"
				z := "rl:two_z_" + sfx + "_" + b.name + ":{u2}"
				if Slot(a) == Slot(z) {
					t.Fatal("same slot")
				}
				if b.cluster != nil {
					na, err1 := b.cluster.MasterForKey(globalCtx(t), a)
					nz, err2 := b.cluster.MasterForKey(globalCtx(t), z)
					if err1 != nil || err2 != nil || na.Options().Addr == nz.Options().Addr {
						t.Fatalf("want two nodes: %v %v %v", na, nz, errors.Join(err1, err2))
					}
				}
				globalExhaust(t, b, z, small)
				// Take some of a first, so the refund has a state to go back to.
				if ok, err := b.g.Check(globalCtx(t), []GlobalOp{{Key: a, Limit: big, Cost: 2}}); !ok || err != nil {
					t.Fatal(ok, err)
				}
				ops := []GlobalOp{{Key: a, Limit: big, Cost: 3}, {Key: a, Limit: big, Cost: 0}, {Key: z, Limit: small, Cost: 1}}
				if rejectFirst {
					ops[0], ops[2] = ops[2], ops[0]
				}
				before, _ := globalReadState(t, b.rdb, a)
				ok, err := b.g.Check(globalCtx(t), ops)
				if err != nil || ok {
					t.Fatalf("Check: %v %v, want false", ok, err)
				}
				for _, op := range ops {
					r := op.Result
					if op.Key == a && (!r.Allowed || r.Remaining != 8 || r.RetryAfter != 0) {
						t.Errorf("op on %s cost %d: %+v, want Allowed with 8 remaining", a, op.Cost, r)
					}
					if op.Key == z && (r.Allowed || r.RetryAfter <= 0) {
						t.Errorf("op on %s: %+v, want rejected", z, r)
					}
				}
				if r := globalPeek(t, b, a, big); r != 8 {
					t.Errorf("%s has %d left after the refund, want 8", a, r)
				}
				if after, _ := globalReadState(t, b.rdb, a); after != before {
					t.Errorf("%s holds %+v after the refund, want %+v", a, after, before)
				}
				if b.g.RefundErrors() != 0 {
					t.Errorf("RefundErrors %d", b.g.RefundErrors())
				}
			})
		}
	}
}

// testSameKeyTwice: ops on one key apply in order on the tentative state, and fail
// together, as localbucket's Store.Apply does.
func testGlobalSameKeyTwice(t *testing.T, b globalBackend) {
	for _, alg := range globalAlgs {
		t.Run(alg.String(), func(t *testing.T) {
			l := globalLimit(t, alg, 7, time.Hour, 0)
			key := "rl:twice_" + alg.String() + ":{" + b.name + "}"
			store := localbucket.NewStore(localbucket.Options{})
			for _, costs := range [][]uint64{{3, 5}, {3, 4}, {0, 1}, {1, 0}} {
				ops := make([]GlobalOp, len(costs))
				lops := make([]localbucket.Op, len(costs))
				for i, c := range costs {
					ops[i] = GlobalOp{Key: key, Limit: l, Cost: c}
					lops[i] = localbucket.Op{Key: []byte(key), Limit: l, Cost: c}
				}
				now := globalRedisNow(t, b.rdb)
				ok, err := b.g.Check(globalCtx(t), ops)
				if err != nil {
					t.Fatal(err)
				}
				if want := store.Apply(now, lops); ok != want {
					t.Fatalf("costs %v: Check %v, Store.Apply %v", costs, ok, want)
				}
				for i := range ops {
					got, want := ops[i].Result, lops[i].Result
					want.Expires, want.LimitedUntil = 0, 0
					if got.Allowed != want.Allowed || got.Impossible != want.Impossible || got.Remaining != want.Remaining ||
						!globalNear(got.Reset, want.Reset) || !globalNear(got.RetryAfter, want.RetryAfter) {
						t.Errorf("costs %v op %d: got %+v, Store.Apply gives %+v", costs, i, got, want)
					}
				}
			}
		})
	}
}

// globalNear reports whether two durations differ by less than what Redis time moves during a
// test step.
func globalNear(a, b int64) bool { return max(a-b, b-a) < int64(time.Second) }

func testGlobalShadow(t *testing.T, b globalBackend) {
	for _, alg := range globalAlgs {
		t.Run(alg.String(), func(t *testing.T) {
			l, small := globalLimit(t, alg, 10, time.Hour, 0), globalLimit(t, alg, 1, time.Hour, 0)
			a := "rl:shadow_a_" + alg.String() + ":{" + b.name + "}"
			s := "rl:shadow_s_" + alg.String() + ":{" + b.name + "}"
			globalExhaust(t, b, s, small)
			before, _ := globalReadState(t, b.rdb, s)
			ops := []GlobalOp{{Key: a, Limit: l, Cost: 2}, {Key: s, Limit: small, Cost: 1, Shadow: true}}
			ok, err := b.g.Check(globalCtx(t), ops)
			if err != nil || !ok {
				t.Fatalf("Check: %v %v, want true: a shadow never rejects", ok, err)
			}
			if r := ops[1].Result; r.Allowed || r.RetryAfter <= 0 {
				t.Errorf("shadow op: %+v, want the rejection it would have been", r)
			}
			if r := ops[0].Result; !r.Allowed || r.Remaining != 8 {
				t.Errorf("op: %+v, want allowed, 8 remaining", r)
			}
			if after, _ := globalReadState(t, b.rdb, s); after != before {
				t.Errorf("the rejecting shadow key changed: %+v, was %+v", after, before)
			}
			// A shadow that passes counts.
			s2 := "rl:shadow_s2_" + alg.String() + ":{" + b.name + "}"
			ops = []GlobalOp{{Key: s2, Limit: l, Cost: 4, Shadow: true}}
			if ok, err := b.g.Check(globalCtx(t), ops); !ok || err != nil {
				t.Fatal(ok, err)
			}
			if r := globalPeek(t, b, s2, l); r != 6 {
				t.Errorf("passing shadow: %d left, want 6", r)
			}
		})
	}
}

func testGlobalPeek(t *testing.T, b globalBackend) {
	for _, alg := range globalAlgs {
		t.Run(alg.String(), func(t *testing.T) {
			l := globalLimit(t, alg, 3, time.Hour, 0)
			key := "rl:peek_" + alg.String() + ":{" + b.name + "}"
			r, ok, _, _ := globalCheckOne(t, b, key, l, 0)
			if !ok || r.Remaining != 3 || r.Reset != 0 {
				t.Errorf("peek on a fresh key: %v %+v", ok, r)
			}
			if n, _ := b.rdb.Exists(globalCtx(t), key).Result(); n != 0 {
				t.Errorf("a peek created %s", key)
			}
			globalExhaust(t, b, key, l)
			before, _ := globalReadState(t, b.rdb, key)
			r, ok, _, _ = globalCheckOne(t, b, key, l, 0)
			if ok || r.Remaining != 0 || r.RetryAfter <= 0 {
				t.Errorf("peek on an exhausted key: %v %+v, want rejected as cost 1", ok, r)
			}
			if after, _ := globalReadState(t, b.rdb, key); after != before {
				t.Errorf("a peek changed %s", key)
			}
		})
	}
}

func testGlobalImpossible(t *testing.T, b globalBackend) {
	for _, alg := range globalAlgs {
		t.Run(alg.String(), func(t *testing.T) {
			l := globalLimit(t, alg, 3, time.Hour, 0)
			key := "rl:impossible_" + alg.String() + ":{" + b.name + "}"
			for _, cost := range []uint64{4, 1 << 40, 1<<64 - 1} {
				r, ok, _, _ := globalCheckOne(t, b, key, l, cost)
				if ok || !r.Impossible || r.Allowed || r.RetryAfter != 0 || r.Remaining != 3 {
					t.Errorf("cost %d: %v %+v, want Impossible with 3 remaining", cost, ok, r)
				}
			}
			if n, _ := b.rdb.Exists(globalCtx(t), key).Result(); n != 0 {
				t.Errorf("an impossible cost wrote %s", key)
			}
		})
	}
}

// testRace: 50 goroutines racing on one key admit exactly the limit.
func testGlobalRace(t *testing.T, b globalBackend) {
	for _, alg := range globalAlgs {
		t.Run(alg.String(), func(t *testing.T) {
			l := globalLimit(t, alg, 37, time.Hour, 0)
			key := "rl:race_" + alg.String() + ":{" + b.name + "}"
			var admitted atomic.Int64
			var wg gosync.WaitGroup
			errs := make(chan error, 50)
			for range 50 {
				wg.Go(func() {
					for range 2 {
						ops := []GlobalOp{{Key: key, Limit: l, Cost: 1}}
						ok, err := b.g.Check(context.Background(), ops)
						if err != nil {
							errs <- err
							return
						}
						if ok {
							admitted.Add(1)
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			if n := admitted.Load(); n != 37 {
				t.Errorf("admitted %d, want 37", n)
			}
		})
	}
}

// testScriptFlush: after SCRIPT FLUSH on every node, EVALSHA fails with NOSCRIPT; Check
// falls back to EVAL, for one call, for a pipeline of calls and for the refunds.
func testGlobalScriptFlush(t *testing.T, b globalBackend) {
	flush := func() {
		t.Helper()
		err := b.forEachNode(globalCtx(t), func(ctx context.Context, c *redis.Client) error {
			return c.ScriptFlush(ctx).Err()
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	l, small := globalLimit(t, localbucket.TokenBucket, 10, time.Hour, 0), globalLimit(t, localbucket.TokenBucket, 1, time.Hour, 0)
	a, z := "rl:flush_a_"+b.name+":{u1}", "rl:flush_z_"+b.name+":{u2}"
	flush()
	if ok, err := b.g.Check(globalCtx(t), []GlobalOp{{Key: a, Limit: l, Cost: 1}}); !ok || err != nil {
		t.Fatalf("one call after SCRIPT FLUSH: %v %v", ok, err)
	}
	flush()
	if ok, err := b.g.Check(globalCtx(t), []GlobalOp{{Key: a, Limit: l, Cost: 1}, {Key: z, Limit: small, Cost: 1}}); !ok || err != nil {
		t.Fatalf("two slots after SCRIPT FLUSH: %v %v", ok, err)
	}
	flush()
	ops := []GlobalOp{{Key: a, Limit: l, Cost: 1}, {Key: z, Limit: small, Cost: 1}}
	if ok, err := b.g.Check(globalCtx(t), ops); ok || err != nil {
		t.Fatalf("a rejection after SCRIPT FLUSH: %v %v %+v", ok, err, ops)
	}
	if r := globalPeek(t, b, a, l); r != 8 {
		t.Errorf("%s has %d left, want 8: the refund after SCRIPT FLUSH was lost", a, r)
	}
	if b.g.RefundErrors() != 0 {
		t.Errorf("RefundErrors %d", b.g.RefundErrors())
	}
}

func testGlobalDoneContext(t *testing.T, b globalBackend) {
	l := globalLimit(t, localbucket.TokenBucket, 10, time.Hour, 0)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	ops := []GlobalOp{{Key: "rl:ctx:{u1}", Limit: l, Cost: 1}, {Key: "rl:ctx:{u2}", Limit: l, Cost: 1}}
	start := time.Now()
	ok, err := b.g.Check(ctx, ops)
	if ok || !errors.Is(err, context.Canceled) {
		t.Errorf("Check with a canceled ctx: %v %v", ok, err)
	}
	dctx, dcancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
	defer dcancel()
	ok, err = b.g.Check(dctx, ops)
	if ok || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Check with an expired deadline: %v %v", ok, err)
	}
	if d := time.Since(start); d > 20*time.Millisecond {
		t.Errorf("took %v", d)
	}
}

// testTTL: every key the earlier subtests wrote expires.
func testGlobalTTL(t *testing.T, b globalBackend) {
	var n atomic.Int64
	err := b.forEachNode(globalCtx(t), func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, "rl:*", 1000).Iterator()
		for iter.Next(ctx) {
			key := iter.Val()
			pttl, err := c.PTTL(ctx, key).Result()
			if err != nil {
				return err
			}
			if pttl == -2*time.Nanosecond { // expired since SCAN listed it
				continue
			}
			if pttl < 0 { // -1: no TTL (0 is a TTL under a millisecond: about to expire)
				return fmt.Errorf("%s: PTTL %v", key, pttl)
			}
			n.Add(1)
		}
		return iter.Err()
	})
	if err != nil {
		t.Fatal(err)
	}
	if n.Load() < 20 {
		t.Errorf("only %d keys found", n.Load())
	}
}

// TestGlobalFrozenServer: a server that answers nothing makes Check return an error by
// the ctx deadline.
func TestGlobalFrozenServer(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	g := NewGlobal(rdb)
	l := globalLimit(t, localbucket.TokenBucket, 10, time.Hour, 0)
	if ok, err := g.Check(globalCtx(t), []GlobalOp{{Key: "rl:frozen:{u}", Limit: l, Cost: 1}}); !ok || err != nil {
		t.Fatal(ok, err)
	}
	srv.Freeze()
	defer srv.Thaw()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	start := time.Now()
	ok, err := g.Check(ctx, []GlobalOp{{Key: "rl:frozen:{u}", Limit: l, Cost: 1}})
	if ok || err == nil {
		t.Errorf("Check on a frozen server: %v %v, want an error", ok, err)
	}
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Errorf("took %v for a 20ms deadline", d)
	}
}

func TestGlobalToInt64(t *testing.T) {
	for _, tc := range []struct {
		in   any
		want int64
		ok   bool
	}{
		{int64(42), 42, true},
		{float64(42), 42, true},
		{42.5, 0, false},
		{"42", 42, true},
		{"42.0", 42, true},
		{"x", 0, false},
		{nil, 0, false},
		{[]any{int64(1)}, 0, false},
		{1e300, 0, false},
	} {
		got, err := toInt64(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("toInt64(%#v) = %d, %v", tc.in, got, err)
		}
	}
}

func TestGlobalParseReplyTypes(t *testing.T) {
	l := globalLimit(t, localbucket.TokenBucket, 10, time.Second, 0)
	ops := []GlobalOp{{Key: "k", Limit: l}}
	window := make([]int64, 1)
	for _, bad := range []any{
		"OK",
		int64(1),
		[]any{int64(1)},
		[]any{int64(1), int64(0), int64(3), int64(0), int64(0), "x"},
		[]any{int64(2), int64(0), int64(3), int64(0), int64(0), int64(0)},
		[]any{int64(1), int64(0), int64(-3), int64(0), int64(0), int64(0)},
	} {
		if err := parseReply(bad, ops, []int{0}, window); err == nil {
			t.Errorf("parseReply(%#v) accepted it", bad)
		}
	}
	// Floats, as a Redis-compatible server might send them.
	good := []any{1.0, 0.0, 9.0, 1e8, 0.0, "0"}
	if err := parseReply(good, ops, []int{0}, window); err != nil {
		t.Fatal(err)
	}
	want := localbucket.Result{Allowed: true, Limit: 10, Remaining: 9, Reset: 1e8}
	if ops[0].Result != want {
		t.Errorf("got %+v, want %+v", ops[0].Result, want)
	}
}

// BenchmarkGlobalCheck is one check of one op against a standalone Redis on loopback:
// one EVALSHA round trip.
func BenchmarkGlobalCheck(b *testing.B) {
	srv := redistest.StartStandalone(b)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	b.Cleanup(func() { rdb.Close() })
	g := NewGlobal(rdb)
	l := globalLimit(b, localbucket.TokenBucket, 1<<32-1, 100*time.Hour, 0)
	ctx := context.Background()
	b.Run("serial", func(b *testing.B) {
		ops := []GlobalOp{{Key: "rl:bench:{user=alice}", Limit: l, Cost: 1}}
		b.ReportAllocs()
		start := time.Now()
		for b.Loop() {
			if ok, err := g.Check(ctx, ops); !ok || err != nil {
				b.Fatal(ok, err)
			}
		}
		b.ReportMetric(float64(time.Since(start).Microseconds())/float64(b.N), "µs/check")
	})
	// The floor: one PING round trip on the same connection pool.
	b.Run("ping_baseline", func(b *testing.B) {
		b.ReportAllocs()
		start := time.Now()
		for b.Loop() {
			if err := rdb.Ping(ctx).Err(); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(time.Since(start).Microseconds())/float64(b.N), "µs/check")
	})
	b.Run("two_slots", func(b *testing.B) {
		g := &Global{rdb: rdb, bySlot: true} // as on a cluster: two calls, one pipeline
		ops := []GlobalOp{{Key: "rl:bench:{user=alice}", Limit: l, Cost: 1}, {Key: "rl:bench:{ip=10.0.0.1}", Limit: l, Cost: 1}}
		b.ReportAllocs()
		start := time.Now()
		for b.Loop() {
			if ok, err := g.Check(ctx, ops); !ok || err != nil {
				b.Fatal(ok, err)
			}
		}
		b.ReportMetric(float64(time.Since(start).Microseconds())/float64(b.N), "µs/check")
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		var id atomic.Int64
		start := time.Now()
		b.RunParallel(func(pb *testing.PB) {
			ops := []GlobalOp{{Key: fmt.Sprintf("rl:bench:{user=%d}", id.Add(1)), Limit: l, Cost: 1}}
			for pb.Next() {
				if ok, err := g.Check(ctx, ops); !ok || err != nil {
					b.Fatal(ok, err)
				}
			}
		})
		b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "checks/s")
	})
}

// cancelAfterPipeline is a Redis client whose pipelines cancel a context once they have
// run: the check's deadline passing just after Redis answered it.
type cancelAfterPipeline struct {
	rediser
	cancel context.CancelFunc
}

func (c cancelAfterPipeline) Pipeline() redis.Pipeliner {
	return cancelPipe{c.rediser.Pipeline(), c.cancel}
}

type cancelPipe struct {
	redis.Pipeliner
	cancel context.CancelFunc
}

func (p cancelPipe) Exec(ctx context.Context) ([]redis.Cmder, error) {
	defer p.cancel()
	return p.Pipeliner.Exec(ctx)
}

// A refund does not share the check's context: when the check's deadline passes just
// after Redis answered, the committed groups are still given back (before, the refund
// ran on the dead context, failed, and the capacity leaked).
func TestGlobalRefundOutlivesCheckContext(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	b := globalBackend{name: "standalone_by_slot", g: &Global{rdb: rdb, bySlot: true}, rdb: rdb}
	big, small := globalLimit(t, localbucket.TokenBucket, 10, time.Hour, 0), globalLimit(t, localbucket.TokenBucket, 2, time.Hour, 0)
	a, z := "rl:refund_a:{u1}", "rl:refund_z:{u2}"
	globalExhaust(t, b, z, small)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	g := &Global{rdb: cancelAfterPipeline{rdb, cancel}, bySlot: true}
	ok, err := g.Check(ctx, []GlobalOp{{Key: z, Limit: small, Cost: 1}, {Key: a, Limit: big, Cost: 3}})
	if ok || err != nil {
		t.Fatalf("Check: %v %v, want false, nil", ok, err)
	}
	if ctx.Err() == nil {
		t.Fatal("the check's context was not cancelled: the test does not test anything")
	}
	if n := g.RefundErrors(); n != 0 {
		t.Errorf("RefundErrors %d, want 0", n)
	}
	if r := globalPeek(t, b, a, big); r != 10 {
		t.Errorf("%s has %d left after the refund, want 10", a, r)
	}
}

// A failed global check's error counts its keys in the singular too: "global check of 1
// keys in slot 1006: i/o timeout" was an audit's log line (masters_test.go).
func TestGlobalCheckErrorCountsKeys(t *testing.T) {
	rdb, err := Open(Config{URL: "redis://127.0.0.1:1"}) // refused
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	lim := globalLimit(t, localbucket.FixedWindow, 10, hourWindow(), 0)
	key := "rl:one:{u}"
	_, err = NewGlobal(rdb).Check(globalCtx(t), []GlobalOp{{Key: key, Limit: lim, Cost: 1}})
	if want := fmt.Sprintf("global check of 1 key in slot %d: ", Slot(key)); err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("a check of one key against a refusing Redis: %v, want %q in it", err, want)
	}
	if got := plural.Count(2, "key"); got != "2 keys" {
		t.Fatalf("plural.Count(2, key) = %q", got)
	}
}
