package sync

import (
	"context"
	"fmt"
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

// batchRequest is one request of TestGlobalBatchMatchesSequential: its ops, as Check
// would get them.
type batchRequest struct{ ops []GlobalOp }

// evalshaCalls returns how many EVALSHA calls rdb has run (INFO commandstats).
func evalshaCalls(t *testing.T, rdb *redis.Client) int {
	t.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:calls="); ok {
			n, _, _ := strings.Cut(rest, ",")
			v, err := strconv.Atoi(n)
			if err != nil {
				t.Fatalf("commandstats %q: %v", line, err)
			}
			return v
		}
	}
	return 0
}

// The auto-pipeline's merged call (global.lua's batch form, one EVALSHA for a batch of
// requests on a standalone Redis) decides exactly as the same requests checked one after
// another: same Allowed, Impossible and Remaining for every op, Reset and RetryAfter
// within the time between the two runs, and the same states left in Redis. Random
// requests of 1-3 ops on a small pool of keys with small limits, so that requests reject,
// repeat keys, and depend on what the earlier requests of the batch committed; peeks and
// shadow ops included; some batches longer than mergeMax (several merged calls, in one
// pipeline), and lease slots (LeaseCheck) beside them. The sequential run is on one
// server, the batch on another.
func TestGlobalBatchMatchesSequential(t *testing.T) {
	seqSrv, batSrv := redistest.StartStandalone(t), redistest.StartStandalone(t)
	seqRdb := redis.NewClient(&redis.Options{Addr: seqSrv.Addr})
	batRdb := redis.NewClient(&redis.Options{Addr: batSrv.Addr})
	t.Cleanup(func() { seqRdb.Close(); batRdb.Close() })
	seq := NewGlobal(seqRdb)
	ap := &autoPipe{rediser: batRdb, merge: true}
	// Load the script on the batch server: the first merged call must not be a NOSCRIPT
	// (that path is TestGlobalBatchNoScript's).
	if err := globalScript.Load(globalCtx(t), batRdb).Err(); err != nil {
		t.Fatal(err)
	}

	limits := []*localbucket.Limit{
		globalLimit(t, localbucket.TokenBucket, 5, time.Hour, 0),
		globalLimit(t, localbucket.TokenBucket, 3, time.Hour, 6),
		globalLimit(t, localbucket.SlidingWindow, 6, 2*time.Hour, 0),
		globalLimit(t, localbucket.FixedWindow, 7, 24*time.Hour, 0),
	}
	rng := rand.New(rand.NewPCG(9, 32))
	for round := 0; round < 60; round++ {
		// A deadline per round, not one for the whole test: under -race on a loaded
		// 2-core machine the 60 rounds take longer than globalCtx's 5 s, and a PTTL on
		// the expired context read 0 ("has PTTL 0s"; a ZRange read nil on both servers).
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		n := 2 + rng.IntN(40)
		if round%10 == 9 {
			n = mergeMax + 1 + rng.IntN(2*mergeMax) // more than one merged call
		}
		reqs := make([]batchRequest, n)
		for i := range reqs {
			k := 1 + rng.IntN(3)
			for j := range k {
				if rng.IntN(4) == 0 { // a lease slot (LeaseCheck), max 2 per key
					lo := &LeaseOp{Key: fmt.Sprintf("rl:b%d_L:{c%d}", round, rng.IntN(4)), Part: j, Max: 2,
						Lease: time.Hour, Take: rng.IntN(4) != 0, Shadow: rng.IntN(8) == 0}
					reqs[i].ops = append(reqs[i].ops, LeaseCheck(fmt.Sprintf("r%di%d", round, i), lo))
					continue
				}
				li := rng.IntN(len(limits))
				op := GlobalOp{
					Key:    fmt.Sprintf("rl:b%d_%d:{c%d}", round, li, rng.IntN(4)),
					Limit:  limits[li],
					Cost:   uint64(rng.IntN(4)),
					Shadow: rng.IntN(8) == 0,
				}
				reqs[i].ops = append(reqs[i].ops, op)
			}
		}

		// Sequential: one Check after another.
		t0 := globalRedisNow(t, seqRdb)
		seqOps := make([][]GlobalOp, n)
		for i, r := range reqs {
			seqOps[i] = cloneOps(r.ops)
			if _, err := seq.Check(ctx, seqOps[i]); err != nil {
				t.Fatal(err)
			}
		}

		// Batched: every request queued, then one send, as the auto-pipeline does when
		// they arrive while a batch is on the wire.
		calls0 := evalshaCalls(t, batRdb)
		batOps := make([][]GlobalOp, n)
		calls := make([]*apCall, n)
		for i, r := range reqs {
			batOps[i] = cloneOps(r.ops)
			var args []any
			keys := make([]string, 0, len(r.ops))
			for j := range batOps[i] {
				keys = append(keys, batOps[i][j].Key)
				args = appendScriptArgs(args, &batOps[i][j])
			}
			calls[i] = ap.newCall(ctx, globalScript.Hash(), keys, args)
		}
		ap.send(calls)
		t1 := globalRedisNow(t, batRdb)
		if got, want := evalshaCalls(t, batRdb)-calls0, (n+mergeMax-1)/mergeMax; got != want {
			t.Fatalf("round %d: %d requests took %d EVALSHA calls, want %d merged calls", round, n, got, want)
		}
		tol := t1 - t0 + 1000 // ns: the batch ran at most this much later

		window := make([]int64, 3)
		for i := range reqs {
			if err := calls[i].cmd.Err(); err != nil {
				t.Fatalf("round %d request %d: %v", round, i, err)
			}
			idx := make([]int, len(batOps[i]))
			for j := range idx {
				idx[j] = j
			}
			if err := parseReply(calls[i].cmd.Val(), batOps[i], idx, window); err != nil {
				t.Fatalf("round %d request %d: %v", round, i, err)
			}
			for j := range batOps[i] {
				s, b := seqOps[i][j].Result, batOps[i][j].Result
				if s.Allowed != b.Allowed || s.Impossible != b.Impossible || s.Remaining != b.Remaining || s.Limit != b.Limit ||
					max(s.Reset-b.Reset, b.Reset-s.Reset) > tol || max(s.RetryAfter-b.RetryAfter, b.RetryAfter-s.RetryAfter) > tol {
					t.Fatalf("round %d request %d op %d (%s cost %d shadow %v): batched %+v, sequential %+v (tolerance %d ns)",
						round, i, j, batOps[i][j].Key, batOps[i][j].Cost, batOps[i][j].Shadow, b, s, tol)
				}
			}
		}

		// The states left: windows exactly, a token bucket's TAT within the time between.
		for li, l := range limits {
			for c := range 4 {
				key := fmt.Sprintf("rl:b%d_%d:{c%d}", round, li, c)
				ss, sok := globalReadState(t, seqRdb, key)
				bs, bok := globalReadState(t, batRdb, key)
				same := sok == bok && ss.N == bs.N
				if l.Algorithm() == localbucket.TokenBucket {
					same = same && max(ss.T-bs.T, bs.T-ss.T) <= tol
				} else {
					same = same && ss.T == bs.T
				}
				if !same {
					t.Fatalf("round %d: %s holds %+v (exists %v) batched, %+v (exists %v) sequential", round, key, bs, bok, ss, sok)
				}
				if bok {
					if ttl, err := batRdb.PTTL(ctx, key).Result(); err != nil || ttl <= 0 {
						t.Fatalf("round %d: %s has PTTL %v (%v)", round, key, ttl, err)
					}
				}
			}
		}
		// The lease slots held: the same members.
		for c := range 4 {
			key := fmt.Sprintf("rl:b%d_L:{c%d}", round, c)
			sm, err := seqRdb.ZRange(ctx, key, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			bm, err := batRdb.ZRange(ctx, key, 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			slices.Sort(sm)
			slices.Sort(bm)
			if !slices.Equal(sm, bm) || len(bm) > 2 {
				t.Fatalf("round %d: %s holds %v batched, %v sequential (max 2)", round, key, bm, sm)
			}
		}
		cancel()
	}
}

// cloneOps copies ops, each lease slot's LeaseOp too (Check writes its result there).
func cloneOps(ops []GlobalOp) []GlobalOp {
	out := append([]GlobalOp(nil), ops...)
	for i := range out {
		if lo := out[i].Lease; lo != nil {
			c := *lo
			out[i].Lease = &c
		}
	}
	return out
}

// A merged call that meets an empty script cache (NOSCRIPT) runs nothing; each request
// is then sent again on its own with EVAL by Global, and decided once.
func TestGlobalBatchNoScript(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	g := NewGlobal(rdb).WithAutoPipeline()
	ap := g.rdb.(*autoPipe)
	if !ap.merge {
		t.Fatal("auto-pipeline on a standalone client does not merge")
	}
	ctx := globalCtx(t)
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	lim := globalLimit(t, localbucket.FixedWindow, 10, hourWindow(), 0)
	const n = 8
	opsOf := make([][]GlobalOp, n)
	calls := make([]*apCall, n)
	for i := range calls {
		opsOf[i] = []GlobalOp{{Key: "rl:ns:{u}", Limit: lim, Cost: 1}}
		calls[i] = ap.newCall(ctx, globalScript.Hash(), []string{"rl:ns:{u}"}, appendScriptArgs(nil, &opsOf[i][0]))
	}
	ap.send(calls)
	for i, c := range calls {
		if !isNoScript(c.cmd.Err()) {
			t.Fatalf("call %d: %v, want NOSCRIPT", i, c.cmd.Err())
		}
	}
	if n, err := rdb.Exists(ctx, "rl:ns:{u}").Result(); err != nil || n != 0 {
		t.Fatalf("a NOSCRIPT batch wrote the key (%d, %v)", n, err)
	}
	// Through Global: the NOSCRIPT is answered by EVAL, each check counted once.
	for i := range 3 {
		if ok, err := g.Check(ctx, []GlobalOp{{Key: "rl:ns:{u}", Limit: lim, Cost: 1}}); !ok || err != nil {
			t.Fatalf("check %d: %v %v", i, ok, err)
		}
	}
	if s, _ := globalReadState(t, rdb, "rl:ns:{u}"); s.N != 3 {
		t.Fatalf("count %d after 3 checks, want 3", s.N)
	}
}

// global.lua skips PEXPIRE while the TTL it last set (field gx) covers the state; a key
// that a hybrid daemon has written since (the same rule in hybrid mode elsewhere, or
// before a reload: field o) may have a shorter TTL, so global.lua sets it again. Without
// that, the key would expire at the hybrid daemon's TTL with the global takes in it.
func TestGlobalTTLAfterHybridWrite(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	g := NewGlobal(rdb)
	ctx := globalCtx(t)
	for _, alg := range globalAlgs {
		t.Run(alg.String(), func(t *testing.T) {
			key := "rl:mixed_" + alg.String() + ":{u}"
			l := globalLimit(t, alg, 10, 24*time.Hour, 0)
			take := func() {
				t.Helper()
				if ok, err := g.Check(ctx, []GlobalOp{{Key: key, Limit: l, Cost: 1}}); !ok || err != nil {
					t.Fatalf("check: %v %v", ok, err)
				}
			}
			take()
			// A hybrid daemon's sync: its fields and its own, shorter TTL.
			if err := rdb.HSet(ctx, key, "o", "d2 7", "x", 0).Err(); err != nil {
				t.Fatal(err)
			}
			if err := rdb.PExpire(ctx, key, 2*time.Second).Err(); err != nil {
				t.Fatal(err)
			}
			take()
			// The state now holds 2 takes, informative for over an hour whatever the
			// algorithm (24 h window, 10 per window), but a fixed window's only until it
			// ends, at midnight UTC (in the last hour of the day this asked for more).
			want := time.Hour
			if alg == localbucket.FixedWindow {
				left := 24*time.Hour - time.Duration(time.Now().UnixNano()%int64(24*time.Hour))
				if left < 10*time.Second {
					t.Skip("the fixed window ends within 10 s")
				}
				want = min(want, left-5*time.Second)
			}
			if ttl := rdb.PTTL(ctx, key).Val(); ttl < want {
				t.Fatalf("PTTL %v after a global take on a key a hybrid daemon wrote, want over %v", ttl, want)
			}
		})
	}
}
