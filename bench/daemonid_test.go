package bench

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// BenchmarkSharedDaemonID measures what docs/reliability.md's "Two live daemons must not
// share a --daemon-id" warns of: hybrid daemons started under one ID count as one daemon
// in Redis, and each takes the other's syncs of a key for its own.
//
// Clients (RLSIDECAR_BENCH_DAEMONID_CLIENTS, default 20) each send
// RLSIDECAR_BENCH_DAEMONID_REQUESTS checks (default 150), one every
// RLSIDECAR_BENCH_DAEMONID_PERIOD (default 20ms; the clients' phases spread over it),
// rotating over the daemons (RLSIDECAR_BENCH_DAEMONID_DAEMONS, default 3): client c's
// k-th check goes to daemon (c+k) mod daemons. The rule is a hybrid fixed window of
// RLSIDECAR_BENCH_DAEMONID_LIMIT (default 30/1h) per client, on_store_failure: closed.
// The schedule runs twice, each time on fresh daemons and a flushed Redis: first each
// daemon under its own --daemon-id, then all under one (started one after another, so
// each after the first logs "another live daemon uses this daemon id"). It reports each
// run's admitted per client (mean), and fails if the distinct run admitted a client more
// than the limit + (daemons − 1), the hybrid bound per window (docs/accuracy.md), when
// the run fell within one window. It runs once whatever b.N is: use -benchtime 1x. The two shapes
// docs/reliability.md quotes:
//
//	go test -count=1 -run '^$' -bench 'BenchmarkSharedDaemonID$' -benchtime 1x -v ./bench
//	RLSIDECAR_BENCH_DAEMONID_CLIENTS=1 RLSIDECAR_BENCH_DAEMONID_DAEMONS=2 RLSIDECAR_BENCH_DAEMONID_LIMIT=100/1h RLSIDECAR_BENCH_DAEMONID_REQUESTS=300 go test -count=1 -run '^$' -bench 'BenchmarkSharedDaemonID$' -benchtime 1x -v ./bench
func BenchmarkSharedDaemonID(b *testing.B) {
	clients := benchEnvCount(b, "RLSIDECAR_BENCH_DAEMONID_CLIENTS", 20)
	daemons := benchEnvCount(b, "RLSIDECAR_BENCH_DAEMONID_DAEMONS", 3)
	requests := benchEnvCount(b, "RLSIDECAR_BENCH_DAEMONID_REQUESTS", 150)
	lim := parseSpreadLimit(b, spreadEnv("RLSIDECAR_BENCH_DAEMONID_LIMIT", "30/1h"))
	period := benchEnvDuration(b, "RLSIDECAR_BENCH_DAEMONID_PERIOD", 20*time.Millisecond)
	srv := redistest.StartStandalone(b)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	b.Cleanup(func() { rdb.Close() })

	shape := fmt.Sprintf("%d clients, %d checks each one every %v, rotating over %d daemons, fixed window %s (hybrid)",
		clients, requests, period, daemons, lim.text)
	means := map[string]float64{}
	for _, mode := range []string{"distinct", "shared"} {
		r := daemonIDRun(b, srv.Addr, rdb, mode == "shared", daemons, clients, requests, period, lim)
		total, lo, hi := 0, r.admitted[0], r.admitted[0]
		for _, n := range r.admitted {
			total += n
			lo, hi = min(lo, n), max(hi, n)
		}
		means[mode] = float64(total) / float64(clients)
		b.ReportMetric(means[mode], mode+"-admitted/client")
		b.Logf("%s IDs: %s: admitted %.2f per client (min %d, max %d), %d degraded; %d of %d daemons logged the shared-ID warning; checks fell in %d window(s); send lag max %v",
			mode, shape, means[mode], lo, hi, r.degraded, r.warned, daemons, r.windows, r.lag.Round(time.Millisecond))
		if mode != "distinct" {
			continue
		}
		bound := lim.requests + daemons - 1
		if r.windows != 1 {
			b.Logf("distinct IDs: the run spans %d windows: the bound of %d per window is not checked", r.windows, bound)
		} else if hi > bound {
			b.Errorf("distinct IDs: a client was admitted %d, past the limit + (daemons − 1) = %d", hi, bound)
		}
	}
	b.Logf("shared ÷ distinct: %.3f", means["shared"]/means["distinct"])
}

// daemonIDResult is what one run of BenchmarkSharedDaemonID measured.
type daemonIDResult struct {
	admitted []int // per client
	degraded int
	warned   int // daemons that logged that another live daemon uses their ID
	windows  int // the limit's windows the checks fell in
	lag      time.Duration
}

// daemonIDRun runs the schedule once on fresh daemons, under one --daemon-id if shared,
// and a flushed Redis.
func daemonIDRun(b *testing.B, addr string, rdb *redis.Client, shared bool, daemons, clients, requests int, period time.Duration, lim spreadLimit) daemonIDResult {
	ctx := context.Background()
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	cfg := filepath.Join(b.TempDir(), "daemonid.yaml")
	// closed: a check that waited on Redis in vain (a busy machine) is refused, not
	// decided from a local bucket that may admit past the bound the benchmark checks,
	// which holds only while Redis answers.
	rule := fmt.Sprintf("rules:\n  - name: daemonid\n    key: user\n    algorithm: fixed_window\n    limit: { requests: %d, per: %s }\n    mode: hybrid\n    on_store_failure: closed\n",
		lim.requests, lim.window)
	if err := os.WriteFile(cfg, []byte(rule), 0o644); err != nil {
		b.Fatal(err)
	}
	// One after another: a daemon asks, as it starts, whether its ID is live, and the one
	// before has sent its first heartbeat before it listens.
	ds := make([]*accDaemon, daemons)
	for i := range ds {
		name := fmt.Sprint("sid", i)
		id := name
		if shared {
			id = "shared"
		}
		d, err := startAccDaemon(name, id, []string{"--config", cfg, "--redis", "redis://" + addr})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(d.stop)
		ds[i] = d
	}
	defer stopAccDaemons(ds)
	live := int64(daemons)
	if shared {
		live = 1
	}
	deadline := time.Now().Add(10 * time.Second)
	for rdb.ZCard(ctx, "rl:daemons").Val() < live {
		if time.Now().After(deadline) {
			b.Fatalf("only %d of %d daemon IDs heartbeat within 10s", rdb.ZCard(ctx, "rl:daemons").Val(), live)
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(1500 * time.Millisecond) // every daemon has counted the others
	res := daemonIDResult{admitted: make([]int, clients)}
	for _, d := range ds {
		if strings.Contains(d.stderr.String(), "another live daemon uses this daemon id") {
			res.warned++
		}
	}

	// Windows are aligned to the Unix epoch: a run that would cross a window's end waits
	// for the next one, or the count took in a second window's limit.
	load := time.Duration(requests) * period
	start := time.Now().Add(10 * time.Millisecond)
	if w := lim.window; w > load+time.Second {
		if end := time.Unix(0, (start.UnixNano()/int64(w)+1)*int64(w)); end.Sub(start) < load+time.Second {
			start = end.Add(10 * time.Millisecond)
		}
	}
	// Each client has a connection to each daemon, all dialled before any sends.
	askers := make([][]*asker, clients)
	for c := range askers {
		for _, d := range ds {
			conn, err := net.Dial("unix", d.socket)
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			_ = conn.SetDeadline(start.Add(load + 30*time.Second))
			askers[c] = append(askers[c], newAsker(conn))
		}
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for c := 0; c < clients; c++ {
		enc := proto.NewEncoder()
		enc.EncodeRequest(&proto.Request{ID: 1, Op: proto.OpCheck, Cost: 1,
			Attrs: []proto.Attr{{Name: "user", Value: "c" + strconv.Itoa(c)}}})
		frame := enc.Bytes()
		wg.Add(1)
		go func() {
			defer wg.Done()
			phase := period * time.Duration(c) / time.Duration(clients)
			admitted, degraded := 0, 0
			var lag time.Duration
			for k := 0; k < requests; k++ {
				at := phase + time.Duration(k)*period
				time.Sleep(time.Until(start.Add(at)))
				lag = max(lag, time.Since(start)-at)
				a := askers[c][(c+k)%daemons]
				if err := a.ask(frame); err != nil {
					b.Errorf("client %d, daemon %s: %v", c, ds[(c+k)%daemons].id, err)
					return
				}
				if a.resp.Allowed {
					admitted++
				}
				if a.resp.Degraded {
					degraded++
				}
			}
			mu.Lock()
			res.admitted[c] = admitted
			res.degraded += degraded
			res.lag = max(res.lag, lag)
			mu.Unlock()
		}()
	}
	wg.Wait()
	w := int64(lim.window)
	last := start.Add(period + time.Duration(requests-1)*period + res.lag)
	res.windows = int(last.UnixNano()/w - start.UnixNano()/w + 1)
	return res
}
