package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/rlsidecar/rlsidecar/proto"
)

// envoyBenchRules is one Envoy-style rule (what import-envoy writes for a per-user
// descriptor), generous enough that the load is mostly admitted.
const envoyBenchRules = `
rules:
  - name: per-user
    match: { domain: api, descriptor: user }
    key: [domain, user]
    algorithm: fixed_window
    limit: { requests: 1000, per: 1s }
`

// envoyUsers returns n user ids: Zipf over a million users, and every 16th one of four
// hot users.
func envoyUsers(n int) []string {
	r := rand.New(rand.NewPCG(1, 2))
	z := rand.NewZipf(r, 1.1, 1, 1_000_000-1)
	out := make([]string, n)
	for i := range out {
		if i%16 == 0 {
			out[i] = "hot-" + strconv.Itoa(i/16%4)
		} else {
			out[i] = "user-" + strconv.FormatUint(z.Uint64(), 10)
		}
	}
	return out
}

// startEnvoyServer starts the daemon with both listeners, the Envoy one on transport
// (native or grpc-go; its socket named after it), and returns it and a grpc-go client on
// its Envoy socket.
func startEnvoyServer(b *testing.B, transport string) (*server, *grpc.ClientConn) {
	rulesPath := filepath.Join(binDir, "envoy-rules.yaml")
	if err := os.WriteFile(rulesPath, []byte(envoyBenchRules), 0o644); err != nil {
		b.Fatal(err)
	}
	sock := filepath.Join(binDir, "envoy-"+transport+".sock")
	if prof := os.Getenv("RLSIDECAR_BENCH_CPUPROFILE"); prof != "" && transport != "native" {
		b.Setenv("RLSIDECAR_BENCH_CPUPROFILE", prof+"."+transport) // the native daemon's is prof
	}
	s := startServerAt(b, "rlsidecar", "rlsidecar-"+transport+".sock", "--config", rulesPath, "--envoy-rls", "unix:"+sock, "--envoy-rls-transport", transport)
	s.envoy = sock
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	return s, conn
}

func envoyRequests(users []string) []*rlsv3.RateLimitRequest {
	out := make([]*rlsv3.RateLimitRequest, len(users))
	for i, u := range users {
		out[i] = &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{
			{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: u}}}}}
	}
	return out
}

// The same checks as msgpack frames: the attributes the Envoy transport gives the limiter.
func envoyFrames(users []string) [][]byte {
	out := make([][]byte, len(users))
	enc := proto.NewEncoder()
	for i, u := range users {
		enc.Reset()
		enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "domain", Value: "api"}, {Name: "descriptor", Value: "user"}, {Name: "user", Value: u}}})
		out[i] = append([]byte(nil), enc.Bytes()...)
	}
	return out
}

// BenchmarkEnvoyRLS: p50 of one ShouldRateLimit with one descriptor over a Unix socket
// beside the msgpack socket's check p50 for the same check, on the same daemon,
// alternating in chunks of 100 (the target: a ratio of at most 2.5). The Envoy listener is
// served by the native transport (the default); a second daemon serves it with grpc-go,
// and takes its turn in each chunk. Then the throughput at 64 concurrent streams over one
// connection (grpc-go's client) on each transport, beside msgpack at 64 connections with
// one request outstanding each.
func BenchmarkEnvoyRLS(b *testing.B) {
	s, conn := startEnvoyServer(b, "native")
	sg, gconn := startEnvoyServer(b, "grpc-go")
	users := envoyUsers(1 << 16)
	reqs, fr := envoyRequests(users), envoyFrames(users)
	msgs := make([][]byte, len(reqs))
	for i, r := range reqs {
		msgs[i] = grpcMessage(r)
	}
	ctx := context.Background()
	mc := dial(b, s.socket)
	const method = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
	nc := dialH2(b, s.envoy, method)
	gc := dialH2(b, sg.envoy, method)
	floor := startServer(b, "grpcfloor")
	fc := dialH2(b, floor.socket, method)
	h2floor := startServer(b, "h2floor")
	h2c := dialH2(b, h2floor.socket, method)
	round := func(hc *h2Client, from, n int, lat []time.Duration) []time.Duration {
		for i := range n {
			start := time.Now()
			st, err := hc.call(msgs[(from+i)%len(msgs)])
			if err != nil || st != "0" {
				b.Fatalf("call: status %q, %v", st, err)
			}
			lat = append(lat, time.Since(start))
		}
		return lat
	}
	for _, c := range []*h2Client{nc, gc, fc, h2c} {
		round(c, 0, 2000, nil)
	}
	mc.roundTrips(fr, 2000, nil)

	b.ResetTimer()
	// Alternate in chunks of 100 calls, and take the ratio of the two p50s in each pair
	// of chunks: both sides see the same moment of a shared machine. The claim is the
	// median of those ratios.
	// The daemons' CPU time is summed per side too: unlike a latency, it does not depend
	// on how busy the machine is.
	// The do-nothing grpc-go server (bench/grpcfloor) takes its turn in each chunk too: the
	// floor any grpc-go server has on this machine at this moment; and so does a
	// do-nothing single-goroutine HTTP/2 loop (bench/h2floor): the floor of a hand-written
	// transport, which the native one is.
	var ln, lg, lm, lf, lh []time.Duration
	var ratios, grpcRatios, floorRatios, h2Ratios []float64
	var cpuN, cpuG, cpuM, cpuF, cpuH time.Duration
	const chunk = 100
	for done := 0; done < b.N; done += chunk {
		n := min(chunk, b.N-done)
		n0, g0, m0, f0, h0 := len(ln), len(lg), len(lm), len(lf), len(lh)
		c0 := s.cpu(b)
		ln = round(nc, done, n, ln)
		c1 := s.cpu(b)
		var err error
		if lm, err = mc.roundTrips(fr[done%len(fr):], n, lm); err != nil {
			b.Fatal(err)
		}
		c2 := s.cpu(b)
		cg0 := sg.cpu(b)
		lg = round(gc, done, n, lg)
		cg1 := sg.cpu(b)
		cf0 := floor.cpu(b)
		lf = round(fc, done, n, lf)
		cf1 := floor.cpu(b)
		ch0 := h2floor.cpu(b)
		lh = round(h2c, done, n, lh)
		cpuN, cpuM, cpuG, cpuF, cpuH = cpuN+c1-c0, cpuM+c2-c1, cpuG+cg1-cg0, cpuF+cf1-cf0, cpuH+h2floor.cpu(b)-ch0
		pm := float64(percentile(lm[m0:], 0.5))
		ratios = append(ratios, float64(percentile(ln[n0:], 0.5))/pm)
		grpcRatios = append(grpcRatios, float64(percentile(lg[g0:], 0.5))/pm)
		floorRatios = append(floorRatios, float64(percentile(lf[f0:], 0.5))/pm)
		h2Ratios = append(h2Ratios, float64(percentile(lh[h0:], 0.5))/pm)
	}
	b.StopTimer()
	perCall := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 / float64(b.N) }
	b.ReportMetric(perCall(cpuN), "native-daemon-cpu-µs/call")
	b.ReportMetric(perCall(cpuG), "grpc-daemon-cpu-µs/call")
	b.ReportMetric(perCall(cpuF), "grpcfloor-cpu-µs/call")
	b.ReportMetric(perCall(cpuH), "h2floor-cpu-µs/call")
	b.ReportMetric(perCall(cpuM), "msgpack-daemon-cpu-µs/check")
	pn, pm := percentile(ln, 0.5), percentile(lm, 0.5)
	for _, r := range [][]float64{ratios, grpcRatios, floorRatios, h2Ratios} {
		sort.Float64s(r)
	}
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	b.ReportMetric(us(pm), "msgpack-p50-µs")
	b.ReportMetric(us(pn), "native-p50-µs")
	b.ReportMetric(us(percentile(lg, 0.5)), "grpc-p50-µs")
	b.ReportMetric(us(percentile(lf, 0.5)), "grpcfloor-p50-µs")
	b.ReportMetric(us(percentile(lh, 0.5)), "h2floor-p50-µs")
	b.ReportMetric(us(percentile(ln, 0.99)), "native-p99-µs")
	b.ReportMetric(us(percentile(lg, 0.99)), "grpc-p99-µs")
	b.ReportMetric(float64(pn)/float64(pm), "p50-ratio")
	b.ReportMetric(ratios[len(ratios)/2], "chunk-p50-ratio-median")
	b.ReportMetric(grpcRatios[len(grpcRatios)/2], "grpc-chunk-p50-ratio-median")
	b.ReportMetric(floorRatios[len(floorRatios)/2], "grpcfloor-chunk-p50-ratio-median")
	b.ReportMetric(h2Ratios[len(h2Ratios)/2], "h2floor-chunk-p50-ratio-median")

	// Throughput at 64 concurrent streams: b.N calls each way, alternating twice.
	const streams = 64
	load := func(rls rlsv3.RateLimitServiceClient, n int) time.Duration {
		var wg sync.WaitGroup
		start := time.Now()
		for g := range streams {
			wg.Go(func() {
				for i := g; i < n; i += streams {
					if _, err := rls.ShouldRateLimit(ctx, reqs[i%len(reqs)]); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		return time.Since(start)
	}
	conns := make([]*client, streams)
	for i := range conns {
		conns[i] = dial(b, s.socket)
	}
	nrls, grls := rlsv3.NewRateLimitServiceClient(conn), rlsv3.NewRateLimitServiceClient(gconn)
	var tn, tg, tm time.Duration
	for range 2 {
		tn += load(nrls, b.N)
		tg += load(grls, b.N)
		tm += runPipelined(b, conns, fr, b.N/streams*streams, 1)
	}
	total := float64(2 * (b.N / streams * streams))
	b.ReportMetric(float64(2*b.N)/tn.Seconds(), "native-64-streams-req/s")
	b.ReportMetric(float64(2*b.N)/tg.Seconds(), "grpc-64-streams-req/s")
	b.ReportMetric(total/tm.Seconds(), "msgpack-64-conns-req/s")
}

// cpu returns the CPU time the server's threads have used (/proc/PID/task/*/schedstat,
// nanosecond precision).
func (s *server) cpu(tb testing.TB) time.Duration {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", s.cmd.Process.Pid))
	if err != nil || len(tasks) == 0 {
		tb.Fatalf("no schedstat for pid %d: %v", s.cmd.Process.Pid, err)
	}
	var total time.Duration
	for _, t := range tasks {
		data, err := os.ReadFile(t)
		if err != nil {
			continue // a thread that just exited
		}
		f := strings.Fields(string(data))
		if len(f) == 0 {
			continue
		}
		ns, _ := strconv.ParseInt(f[0], 10, 64)
		total += time.Duration(ns)
	}
	return total
}
