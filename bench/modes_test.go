package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/proto"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// modeRules is the benchmark's two-rule shape with both rules in one mode.
func modeRules(tb testing.TB, mode string) string {
	path := filepath.Join(tb.TempDir(), mode+".yaml")
	body := "rules:\n" +
		"  - name: per-ip\n    key: ip\n    limit: { requests: 1000000000, per: 1h }\n    mode: " + mode + "\n" +
		"  - name: holds\n    match: { method: POST, path: \"/v1/events/*/holds\" }\n    key: user\n    limit: { requests: 1000000000, per: 1h }\n    mode: " + mode + "\n"
	if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
		tb.Fatal(err)
	}
	return path
}

// BenchmarkSocketModes compares, in one run, a daemon deciding locally with one in hybrid
// mode (same rules, a real Redis behind it) and one in global mode:
//
//   - hybrid-vs-local: throughput at 4 connections × 32 in flight, and p50 at one
//     connection. Hybrid mode has no network on the hot path, so both ratios should be ~1.
//   - global-extra-µs: a global check's p50 minus a local check's p50 (the socket round
//     trip) minus a Redis PING's p50 (the Redis round trip): what global mode adds on
//     top of one Redis round trip. Target: ≤ 50 µs.
func BenchmarkSocketModes(b *testing.B) {
	srv := redistest.StartStandalone(b)
	redisURL := "redis://" + srv.Addr
	local := startServerNamed(b, "local", "--config", modeRules(b, "local"))
	hybrid := startServerNamed(b, "hybrid", "--config", modeRules(b, "hybrid"), "--redis", redisURL)
	global := startServerNamed(b, "global", "--config", modeRules(b, "global"), "--redis", redisURL, "--global-timeout", "100ms")
	// 256 clients (512 keys): the hybrid daemon syncs each every 100 ms, a load Redis on
	// this same 2-core machine carries without taking the cores the benchmark measures.
	fr := frames(8192, 256)

	// Latency at one connection, alternating.
	cl, ch, cg := dial(b, local.socket), dial(b, hybrid.socket), dial(b, global.socket)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	var ll, lh, lg, lp []time.Duration
	for _, c := range []*client{cl, ch, cg} {
		if _, err := c.roundTrips(fr, 1000, nil); err != nil {
			b.Fatal(err)
		}
	}
	n := max(b.N, 2000)
	for done := 0; done < n; done += 500 {
		var err error
		if ll, err = cl.roundTrips(fr, 500, ll); err != nil {
			b.Fatal(err)
		}
		if lh, err = ch.roundTrips(fr, 500, lh); err != nil {
			b.Fatal(err)
		}
		if lg, err = cg.roundTrips(fr, 500, lg); err != nil {
			b.Fatal(err)
		}
		for i := 0; i < 500; i++ {
			start := time.Now()
			if err := rdb.Ping(ctx).Err(); err != nil {
				b.Fatal(err)
			}
			lp = append(lp, time.Since(start))
		}
	}
	pl, ph, pg, pp := percentile(ll, 0.5), percentile(lh, 0.5), percentile(lg, 0.5), percentile(lp, 0.5)
	b.ReportMetric(float64(pl.Nanoseconds())/1e3, "local-p50-µs")
	b.ReportMetric(float64(ph.Nanoseconds())/1e3, "hybrid-p50-µs")
	b.ReportMetric(float64(pg.Nanoseconds())/1e3, "global-p50-µs")
	b.ReportMetric(float64(pp.Nanoseconds())/1e3, "redis-ping-p50-µs")
	b.ReportMetric(float64(ph)/float64(pl), "hybrid-vs-local-p50")
	b.ReportMetric(float64((pg-pl-pp).Nanoseconds())/1e3, "global-extra-µs")

	// Throughput at 4 × 32, local vs hybrid, alternating.
	const conns, inflight = 4, 32
	run := func(cs []*client, total int) time.Duration { return runPipelined(b, cs, fr, total, inflight) }
	var csl, csh []*client
	for i := 0; i < conns; i++ {
		csl = append(csl, dial(b, local.socket))
		csh = append(csh, dial(b, hybrid.socket))
	}
	var tl, th time.Duration
	total := 0
	for total < max(b.N, 40000) {
		tl += run(csl, 20000)
		th += run(csh, 20000)
		total += 20000
	}
	b.ReportMetric(float64(tl)/float64(th), "hybrid-vs-local-throughput")
}

// startServerNamed starts the rlsidecar binary under its own socket name, so several run
// side by side.
func startServerNamed(tb testing.TB, name string, args ...string) *server {
	s := startServer(tb, "rlsidecar", append(args, "--socket", filepath.Join(binDir, name+".sock"))...)
	s.name = name
	s.socket = filepath.Join(binDir, name+".sock")
	return s
}

// BenchmarkSocketMetrics: the same daemon with metrics recorded (the admin endpoint on)
// and without (off), alternating in one run: what recording costs the hot path.
func BenchmarkSocketMetrics(b *testing.B) {
	rules := modeRules(b, "local")
	off := startServerNamed(b, "nometrics", "--config", rules)
	on := startServerNamed(b, "metrics", "--config", rules, "--admin", "127.0.0.1:0")
	fr := frames(8192, 8192)
	const conns, inflight = 4, 32
	run := func(cs []*client, total int) time.Duration { return runPipelined(b, cs, fr, total, inflight) }
	var coff, con []*client
	for i := 0; i < conns; i++ {
		coff = append(coff, dial(b, off.socket))
		con = append(con, dial(b, on.socket))
	}
	run(coff, 8000)
	run(con, 8000)
	var toff, ton time.Duration
	for total := 0; total < max(b.N, 40000); total += 20000 {
		toff += run(coff, 20000)
		ton += run(con, 20000)
	}
	b.ReportMetric(float64(toff)/float64(ton), "with-vs-without-metrics-throughput")
}

// BenchmarkGlobalPipelined: one connection to a daemon whose rules are all global (a real
// redis-server behind it), with 1 and with 32 checks in flight, alternating in one run.
// Global checks wait on Redis; the daemon overlaps those of one connection (answers
// still in request order), so depth 32 must give at least 4× the checks/s of depth 1.
// Reported: depth1-checks/s, depth32-checks/s and their ratio (medians of the rounds), and
// Redis script time, CPU and script calls per check at depth 32.
// Timeouts are 1 s: on a loaded machine a 50 ms Redis timeout trips the breaker, and
// answers decided by policy (degraded, which fails the benchmark) would flatter depth 32.
func BenchmarkGlobalPipelined(b *testing.B) {
	srv := redistest.StartStandalone(b)
	global := startServerNamed(b, "global-pipelined", "--config", modeRules(b, "global"), "--redis", "redis://"+srv.Addr, "--global-timeout", "1s", "--redis-timeout", "1s")
	fr := frames(8192, 1024)
	c := dial(b, global.socket)
	// Every answer must come from Redis: a degraded one (a timeout, the breaker open) is
	// decided by policy without a round trip and would flatter the figure.
	dec, degraded := proto.NewDecoder(), 0
	var resp proto.Response
	c.verify = func(body []byte) error {
		if err := dec.DecodeResponse(body, &resp); err != nil {
			return err
		}
		if resp.IsError() || !resp.Allowed {
			return fmt.Errorf("answer %+v, want allowed", resp)
		}
		if resp.Degraded {
			degraded++
		}
		return nil
	}
	if err := c.pipelined(fr, 2000, 32); err != nil { // warm: Redis connections, keys
		b.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	const perRound = 2000
	var r1, r32 []float64
	var usec32, cpu32, calls32 float64 // Redis script time, process CPU and script calls over the depth-32 rounds
	rounds := max(b.N/perRound, 5)
	for i := 0; i < rounds; i++ {
		for _, depth := range []int{1, 32} {
			u0, p0, c0 := spreadScriptUsec(b, rdb), costProcUsec(b, rdb), accRedisStats(b, rdb).calls
			start := time.Now()
			if err := c.pipelined(fr[i*97%len(fr):], perRound, depth); err != nil {
				b.Fatal(err)
			}
			rate := perRound / time.Since(start).Seconds()
			if depth == 1 {
				r1 = append(r1, rate)
			} else {
				r32 = append(r32, rate)
				usec32 += spreadScriptUsec(b, rdb) - u0
				cpu32 += costProcUsec(b, rdb) - p0
				calls32 += accRedisStats(b, rdb).calls - c0
			}
		}
	}
	if degraded > 0 {
		b.Fatalf("%d answers degraded (decided without Redis): the figures would not measure global checks", degraded)
	}
	m1, m32 := median(r1), median(r32)
	b.ReportMetric(m1, "depth1-checks/s")
	b.ReportMetric(m32, "depth32-checks/s")
	b.ReportMetric(m32/m1, "depth32-vs-depth1")
	// What Redis spends per check at depth 32: script time (INFO commandstats, EVALSHA and
	// EVAL) and its whole process CPU (INFO cpu, user + sys, which also counts the reads,
	// writes and parsing of the batches).
	b.ReportMetric(usec32/float64(rounds*perRound), "redis-script-µs/check")
	b.ReportMetric(cpu32/float64(rounds*perRound), "redis-cpu-µs/check")
	// Script calls per check: 1 when each check is its own EVALSHA, less when the
	// auto-pipeline merges a batch's checks into one call (standalone Redis).
	b.ReportMetric(calls32/float64(rounds*perRound), "redis-calls/check")
}
