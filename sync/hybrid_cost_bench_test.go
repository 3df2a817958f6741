package sync

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// BenchmarkHybridScriptPerKey measures what one key of a sparse load costs Redis's
// script time (INFO commandstats), hybrid against global, on one real redis-server with
// nothing else on it: per round, 2,000 keys that already have state (each used once
// since its last sync: the shape of a key seen about once per 10 s) are synced by one
// hybrid daemon, 128 keys a call, and the same number of global checks run on keys of
// their own, one call each. Rounds alternate; it reports the medians of µs per key and
// their ratio (the target of BenchmarkHybridCost's sparse load is ≤ 0.5), and the same
// ratio of the Redis process's CPU time.
func BenchmarkHybridScriptPerKey(b *testing.B) {
	rdb, node := scriptBenchRedis(b)
	ctx := context.Background()
	usec := func() float64 { return scriptUsec(b, node) }
	// proc is the Redis process's CPU time (µs, INFO cpu, user + sys): unlike script
	// time, not inflated when a long batched call is preempted on a busy machine.
	proc := func() float64 {
		info, err := node.Info(ctx, "cpu").Result()
		if err != nil {
			b.Fatal(err)
		}
		total := 0.0
		for _, line := range strings.Split(info, "\n") {
			line = strings.TrimSpace(line)
			for _, k := range []string{"used_cpu_user:", "used_cpu_sys:"} {
				if v, ok := strings.CutPrefix(line, k); ok {
					f, _ := strconv.ParseFloat(v, 64)
					total += f * 1e6
				}
			}
		}
		return total
	}
	lim, err := localbucket.NewLimit(localbucket.TokenBucket, 600, time.Minute, 0)
	if err != nil {
		b.Fatal(err)
	}
	const keys = 2000
	h := NewHybrid(rdb, HybridOptions{ID: "bench"})
	g := NewGlobal(rdb)
	hkeys := make([]string, keys)
	gops := make([][]GlobalOp, keys)
	for i := range keys {
		hkeys[i] = fmt.Sprintf("rl:h:{user=%d}", i)
		gops[i] = []GlobalOp{{Key: fmt.Sprintf("rl:g:{user=%d}", i), Limit: &lim, Cost: 1}}
	}
	hround := func() {
		now := time.Now().UnixNano()
		for _, k := range hkeys {
			take(h, now, k, &lim, 1)
		}
		if err := h.Flush(ctx, now); err != nil {
			b.Fatal(err)
		}
	}
	ground := func() {
		for _, ops := range gops {
			if _, err := g.Check(ctx, ops); err != nil {
				b.Fatal(err)
			}
		}
	}
	hround() // state and sync records in Redis, scripts loaded
	ground()
	var hs, gs, hp, gp []float64
	for range max(b.N, 5) {
		u0, p0 := usec(), proc()
		hround()
		u1, p1 := usec(), proc()
		ground()
		u2, p2 := usec(), proc()
		hs = append(hs, (u1-u0)/keys)
		gs = append(gs, (u2-u1)/keys)
		hp = append(hp, (p1-p0)/keys)
		gp = append(gp, (p2-p1)/keys)
	}
	med := func(v []float64) float64 { sort.Float64s(v); return v[len(v)/2] }
	mh, mg := med(hs), med(gs)
	b.ReportMetric(mh, "hybrid-µs/key")
	b.ReportMetric(mg, "global-µs/check")
	b.ReportMetric(mh/mg, "hybrid/global")
	b.ReportMetric(med(hp)/med(gp), "process-cpu-hybrid/global")
}

// BenchmarkHybridExactPerCheck measures what one exact sync costs Redis's script time
// (INFO commandstats) against one global check, on one real redis-server with nothing
// else on it: the shape of a client whose requests rotate over the daemons. Per round,
// each of 300 keys gets one request on the next of 5 daemons, whose view of it is stale
// (the daemon clock moves a second a round), so each is an exact sync, one call each;
// and the same number of global checks run on keys of their own, one call each. Rounds
// alternate (the hybrid daemons' periodic syncs between them, not counted); it reports
// the medians of µs per check and their ratio. Two loads: every
// request admitted (a limit of 10^9 per hour), and every request refused (1 per hour).
func BenchmarkHybridExactPerCheck(b *testing.B) {
	for _, c := range []struct {
		name     string
		requests uint64
	}{{"admitted", 1_000_000_000}, {"refused", 1}} {
		b.Run(c.name, func(b *testing.B) {
			rdb, node := scriptBenchRedis(b)
			ctx := context.Background()
			usec := func() float64 { return scriptUsec(b, node) }
			lim, err := localbucket.NewLimit(localbucket.TokenBucket, c.requests, time.Hour, 0)
			if err != nil {
				b.Fatal(err)
			}
			const keys, daemons = 300, 5
			hs := make([]*Hybrid, daemons)
			for i := range hs {
				hs[i] = NewHybrid(rdb, HybridOptions{ID: fmt.Sprint("bench-", i), FetchWait: 5 * time.Second})
				hs[i].SetReplicas(daemons)
			}
			g := NewGlobal(rdb)
			hkeys := make([]string, keys)
			gops := make([][]GlobalOp, keys)
			for i := range keys {
				hkeys[i] = fmt.Sprintf("rl:x:{user=%d}", i)
				gops[i] = []GlobalOp{{Key: fmt.Sprintf("rl:gx:{user=%d}", i), Limit: &lim, Cost: 1}}
			}
			now := time.Now().UnixNano()
			round := 0
			hround := func() {
				fetches := uint64(0)
				for _, h := range hs {
					fetches -= h.Fetches()
				}
				for i, k := range hkeys {
					take(hs[(i+round)%daemons], now, k, &lim, 1)
				}
				for _, h := range hs {
					fetches += h.Fetches()
				}
				if round >= 2*daemons && fetches != keys {
					b.Fatalf("round %d: %d exact syncs for %d requests, want one each", round, fetches, keys)
				}
				round++
			}
			// The periodic syncs, between rounds and not measured: they settle what a
			// key's first user admitted on credit (after which it is shared: no credit).
			flush := func() {
				for _, h := range hs {
					if err := h.Flush(ctx, now); err != nil {
						b.Fatal(err)
					}
				}
				now += int64(time.Second)
			}
			ground := func() {
				for _, ops := range gops {
					if _, err := g.Check(ctx, ops); err != nil {
						b.Fatal(err)
					}
				}
			}
			// Every daemon has a record of every key, scripts are loaded, and the first
			// units admitted on credit are settled (each key is shared).
			for range 2 * daemons {
				hround()
				flush()
				ground()
			}
			var hs2, gs []float64
			for range max(b.N, 5) {
				u0 := usec()
				hround()
				u1 := usec()
				flush()
				u1b := usec()
				ground()
				u2 := usec()
				hs2 = append(hs2, (u1-u0)/keys)
				gs = append(gs, (u2-u1b)/keys)
			}
			med := func(v []float64) float64 { sort.Float64s(v); return v[len(v)/2] }
			mh, mg := med(hs2), med(gs)
			b.ReportMetric(mh, "hybrid-µs/check")
			b.ReportMetric(mg, "global-µs/check")
			b.ReportMetric(mh/mg, "hybrid/global")
		})
	}
}

// scriptUsec returns the time (µs) node has spent in EVAL and EVALSHA calls (INFO
// commandstats).
func scriptUsec(b *testing.B, node *redis.Client) float64 {
	info, err := node.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	total := 0.0
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
		if !ok || (name != "cmdstat_eval" && name != "cmdstat_evalsha") {
			continue
		}
		_, u, _ := strings.Cut(rest, "usec=")
		u, _, _ = strings.Cut(u, ",")
		v, _ := strconv.ParseFloat(u, 64)
		total += v
	}
	return total
}

// scriptBenchRedis starts a redis-server for a script-cost benchmark and returns the
// daemon's client to it and a plain client to the same node (for INFO), both closed when
// b ends.
func scriptBenchRedis(b *testing.B) (redis.UniversalClient, *redis.Client) {
	srv := redistest.StartStandalone(b)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: 5 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { rdb.Close() })
	node := redis.NewClient(&redis.Options{Addr: srv.Addr})
	b.Cleanup(func() { node.Close() })
	return rdb, node
}
