package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// BenchmarkSpreadZipf is the shape a public API's traffic has, spread as a load balancer
// spreads it: clients drawn from Zipf (s = 1.1) over RLSIDECAR_ZIPF_KEYS clients (default
// 100,000; the figures 1,000,000), beside RLSIDECAR_ZIPF_HOT hot clients (default 10)
// taking a tenth of the checks, RLSIDECAR_ZIPF_RATE checks a second in all (default
// 2,000), paced, for RLSIDECAR_ZIPF_SECONDS (default 3, for scripts/test's one pass; the
// figures 10), each check sent to a daemon
// drawn at random among RLSIDECAR_ZIPF_DAEMONS (comma list, default "4"). The rule:
// RLSIDECAR_ZIPF_LIMIT (default 600/60s; the rule's algorithm RLSIDECAR_ZIPF_ALGORITHM,
// default token_bucket), key user. The global (exact) and hybrid modes run the same
// schedule, the same draws, on fresh daemons and a flushed Redis each.
//
// It reports, per daemon count: what each mode admitted, and per client where they
// differ: over (the sum over clients of what hybrid admitted beyond global) and under
// (what global admitted beyond hybrid), the hot clients apart from the Zipf ones; and the
// Redis work per check of each mode from INFO (script calls, every command run, scripts
// included, script time from commandstats, process CPU from INFO cpu), read 500 ms after
// the load so the hybrid daemons' last syncs are counted. Runs once: use -benchtime 1x.
func BenchmarkSpreadZipf(b *testing.B) {
	keys, _ := strconv.Atoi(spreadEnv("RLSIDECAR_ZIPF_KEYS", "100000"))
	hot, _ := strconv.Atoi(spreadEnv("RLSIDECAR_ZIPF_HOT", "10"))
	rate, _ := strconv.ParseFloat(spreadEnv("RLSIDECAR_ZIPF_RATE", "2000"), 64)
	secs, _ := strconv.ParseFloat(spreadEnv("RLSIDECAR_ZIPF_SECONDS", "3"), 64)
	lim := parseSpreadLimit(b, spreadEnv("RLSIDECAR_ZIPF_LIMIT", "600/60s"))
	alg := spreadEnv("RLSIDECAR_ZIPF_ALGORITHM", "token_bucket")
	if keys < 2 || hot < 0 || rate <= 0 || secs <= 0 {
		b.Fatal("RLSIDECAR_ZIPF_KEYS, _HOT, _RATE, _SECONDS: want keys ≥ 2, hot ≥ 0, rate and seconds > 0")
	}
	load := time.Duration(secs * float64(time.Second))
	srv := redistest.StartStandalone(b)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	b.Cleanup(func() { rdb.Close() })

	// The schedule: Poisson arrivals at rate, a tenth of them from the hot clients (in
	// turn), the rest from Zipf.
	rng := rand.New(rand.NewPCG(7, 8))
	z := rand.NewZipf(rng, 1.1, 1, uint64(keys-1))
	type ev struct {
		at     time.Duration
		client string
		d      uint32 // a draw, the daemon is d mod daemons
	}
	var evs []ev
	for at, i := time.Duration(0), 0; ; i++ {
		at += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		if at >= load {
			break
		}
		c := "z" + strconv.FormatUint(z.Uint64(), 10)
		if hot > 0 && i%10 == 0 {
			c = "hot" + strconv.Itoa(i/10%hot)
		}
		evs = append(evs, ev{at, c, rng.Uint32()})
	}

	type result struct {
		offered, admitted, degraded int
		perClient                   map[string]int
		perWindow                   map[string]int // a window's admissions by client@window, when windows are aligned
		calls, cmds, usec, proc     float64
		lag                         time.Duration
	}
	run := func(mode string, daemons int) result {
		ctx := context.Background()
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			b.Fatal(err)
		}
		cfg := filepath.Join(b.TempDir(), mode+".yaml")
		rule := fmt.Sprintf("rules:\n  - name: zipf\n    key: user\n    algorithm: %s\n    limit: { requests: %d, per: %s }\n    mode: %s\n",
			alg, lim.requests, lim.window, mode)
		if err := os.WriteFile(cfg, []byte(rule), 0o644); err != nil {
			b.Fatal(err)
		}
		ds := startAccDaemons(b, daemons, []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--sync-interval", accSync.String(),
			"--max-keys", "2000000", "--global-timeout", "500ms", "--redis-timeout", "500ms"})
		defer stopAccDaemons(ds)
		deadline := time.Now().Add(10 * time.Second)
		for rdb.ZCard(ctx, "rl:daemons").Val() < int64(daemons) {
			if time.Now().After(deadline) {
				b.Fatalf("%s: only %d of %d daemons heartbeat within 10s", mode, rdb.ZCard(ctx, "rl:daemons").Val(), daemons)
			}
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(1500 * time.Millisecond) // every daemon has counted the others
		if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
			b.Fatal(err)
		}
		perDaemon := make([][]ev, daemons)
		for _, e := range evs {
			perDaemon[e.d%uint32(daemons)] = append(perDaemon[e.d%uint32(daemons)], e)
		}
		before := accRedisStats(b, rdb)
		usec0, proc0 := spreadScriptUsec(b, rdb), costProcUsec(b, rdb)
		const workers = 8 // connections per daemon, so a check waiting on Redis does not hold the schedule
		var mu sync.Mutex
		res := result{perClient: map[string]int{}, perWindow: map[string]int{}}
		var wg sync.WaitGroup
		start := time.Now().Add(20 * time.Millisecond)
		aligned := alg != "token_bucket" && lim.window <= 10*time.Second
		if aligned {
			// Windows are aligned to the Unix epoch: both modes start 10 ms into a window,
			// or one run spans a window more than the other and the ratio measures the phase.
			w := int64(lim.window)
			start = time.Unix(0, (start.UnixNano()/w+1)*w).Add(10 * time.Millisecond)
		}
		for d := range ds {
			for w := 0; w < workers; w++ {
				conn, err := net.Dial("unix", ds[d].socket)
				if err != nil {
					b.Fatal(err)
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer conn.Close()
					a := newAsker(conn)
					enc := proto.NewEncoder()
					var lag time.Duration
					var offered, admitted, degraded int
					mine, mineW := map[string]int{}, map[string]int{}
					for i := w; i < len(perDaemon[d]); i += workers {
						e := perDaemon[d][i]
						time.Sleep(time.Until(start.Add(e.at)))
						sent := time.Since(start) // the window is the one the check was sent in, not scheduled for
						lag = max(lag, sent-e.at)
						enc.Reset()
						enc.EncodeRequest(&proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1,
							Attrs: []proto.Attr{{Name: "user", Value: e.client}}})
						if err := a.ask(enc.Bytes()); err != nil {
							b.Errorf("daemon %s: %v", ds[d].id, err)
							return
						}
						offered++
						if a.resp.Allowed {
							admitted++
							mine[e.client]++
							if aligned {
								mineW[e.client+"@"+strconv.Itoa(int((sent+10*time.Millisecond)/lim.window))]++
							}
						}
						if a.resp.Degraded {
							degraded++
						}
					}
					mu.Lock()
					defer mu.Unlock()
					res.offered += offered
					res.admitted += admitted
					res.degraded += degraded
					res.lag = max(res.lag, lag)
					for c, n := range mine {
						res.perClient[c] += n
					}
					for c, n := range mineW {
						res.perWindow[c] += n
					}
				}()
			}
		}
		wg.Wait()
		time.Sleep(5 * accSync) // the hybrid daemons' last syncs reach Redis
		after := accRedisStats(b, rdb)
		res.calls = (after.calls - before.calls) / float64(res.offered)
		res.cmds = (after.cmds - before.cmds) / float64(res.offered)
		res.usec = (spreadScriptUsec(b, rdb) - usec0) / float64(res.offered)
		res.proc = (costProcUsec(b, rdb) - proc0) / float64(res.offered)
		return res
	}

	for _, s := range strings.Split(spreadEnv("RLSIDECAR_ZIPF_DAEMONS", "4"), ",") {
		daemons, err := strconv.Atoi(s)
		if err != nil || daemons < 1 {
			b.Fatalf("RLSIDECAR_ZIPF_DAEMONS: %q is no daemon count", s)
		}
		g := run("global", daemons)
		h := run("hybrid", daemons)
		var over, under, overHot, underHot, diffClients int
		type diff struct {
			client string
			g, h   int
		}
		var worst []diff
		clients := map[string]bool{}
		for c := range g.perClient {
			clients[c] = true
		}
		for c := range h.perClient {
			clients[c] = true
		}
		for c := range clients {
			dlt := h.perClient[c] - g.perClient[c]
			if dlt == 0 {
				continue
			}
			diffClients++
			worst = append(worst, diff{c, g.perClient[c], h.perClient[c]})
			isHot := strings.HasPrefix(c, "hot")
			if dlt > 0 {
				over += dlt
				if isHot {
					overHot += dlt
				}
			} else {
				under -= dlt
				if isHot {
					underHot -= dlt
				}
			}
		}
		sort.Slice(worst, func(i, j int) bool {
			di, dj := worst[i].h-worst[i].g, worst[j].h-worst[j].g
			return max(di, -di) > max(dj, -dj)
		})
		var ws []string
		for _, w := range worst[:min(5, len(worst))] {
			ws = append(ws, fmt.Sprintf("%s %d/%d", w.client, w.h, w.g))
		}
		// A window's admissions beyond its limit (windows aligned; a check is put in the
		// window it was sent in, so one sent just before a boundary and decided after it
		// may show as one over in either mode): the bound is the limit plus N - 1 first
		// units, plus at a boundary one interval's grant.
		overLimit := func(r result) (windows, units, most int, byWindow map[string]int) {
			byWindow = map[string]int{}
			for cw, n := range r.perWindow {
				if n > lim.requests {
					windows++
					units += n - lim.requests
					most = max(most, n)
					_, w, _ := strings.Cut(cw, "@")
					byWindow["window "+w] += n - lim.requests
				}
			}
			return
		}
		gw, gu, gm, gb := overLimit(g)
		hw, hu, hm, hb := overLimit(h)
		if len(h.perWindow) > 0 {
			b.Logf("windows over the limit of %d: global %d client-windows, %d units beyond, at most %d in one %v; hybrid %d client-windows, %d units beyond, at most %d in one %v",
				lim.requests, gw, gu, gm, gb, hw, hu, hm, hb)
		}
		name := fmt.Sprintf("%dd", daemons)
		b.ReportMetric(float64(h.admitted)/float64(g.admitted), name+"-hybrid/global")
		b.ReportMetric(float64(over)/float64(g.admitted), name+"-over/global")
		b.ReportMetric(float64(under)/float64(g.admitted), name+"-under/global")
		b.ReportMetric(h.calls, name+"-hybrid-calls/check")
		b.ReportMetric(g.calls, name+"-global-calls/check")
		b.ReportMetric(h.proc/g.proc, name+"-redis-cpu-hybrid/global")
		b.Logf("zipf spread: %d checks (%d clients seen, Zipf over %d, %d hot at 10%%) at %.0f/s for %v over %d daemons at random, %s %s: "+
			"global admitted %d (%d degraded), hybrid %d (%d degraded): %.4f; per client, hybrid over global %d (hot %d), under %d (hot %d), %d clients differ (largest, hybrid/global: %s); "+
			"Redis per check: global %.3f calls %.2f commands %.2f µs scripts %.2f µs process CPU; hybrid %.3f calls %.2f commands %.2f µs %.2f µs; hybrid/global: calls %.2f, commands %.2f, script time %.2f, process CPU %.2f (send lag max global %v, hybrid %v)",
			g.offered, len(clients), keys, hot, rate, load, daemons, alg, lim.text,
			g.admitted, g.degraded, h.admitted, h.degraded, float64(h.admitted)/float64(g.admitted), over, overHot, under, underHot, diffClients, strings.Join(ws, ", "),
			g.calls, g.cmds, g.usec, g.proc, h.calls, h.cmds, h.usec, h.proc,
			h.calls/g.calls, h.cmds/g.cmds, h.usec/g.usec, h.proc/g.proc, g.lag.Round(time.Millisecond), h.lag.Round(time.Millisecond))
	}
}
