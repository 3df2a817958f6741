package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/hostile"
	"github.com/rlsidecar/rlsidecar/proto"
)

// BenchmarkHostile: a well-behaved client (sequential checks on its own key, and pings)
// beside 20 connections writing random frames, 200 connections holding half a header and
// 400,000 never-repeating keys against --max-keys 100000; the daemon runs with
// --frame-timeout 500ms --max-conns 512. It reports the good client's p50/p99 (target
// p99 < 5 ms), the errors it saw (target 0) and the daemon's peak RSS sampled every
// 100 ms (target < 512 MB). One scenario per run: use -benchtime 1x. Without
// RLSIDECAR_HOSTILE_FULL set it runs a smaller scenario, for the CI smoke pass.
//
//	RLSIDECAR_HOSTILE_FULL=1 go test ./bench -run '^$' -bench Hostile -benchtime 1x
func BenchmarkHostile(b *testing.B) {
	dir := b.TempDir()
	cfg := filepath.Join(dir, "rules.yaml")
	if err := os.WriteFile(cfg, []byte(hostile.Rules), 0o644); err != nil {
		b.Fatal(err)
	}
	const frameTimeout = 500 * time.Millisecond
	rls := startServer(b, "rlsidecar", "--config", cfg, "--frame-timeout", frameTimeout.String(), "--max-conns", "512", "--max-keys", "100000")
	s := &hostile.Scenario{Socket: rls.socket, PID: rls.cmd.Process.Pid, FrameTimeout: frameTimeout, MaxFrame: proto.DefaultMaxFrame,
		GarbageConns: 20, HalfOpen: 200, FloodKeys: 400_000, FloodConns: 4, MinDuration: 10 * time.Second}
	if os.Getenv("RLSIDECAR_HOSTILE_FULL") == "" {
		s.GarbageConns, s.HalfOpen, s.FloodKeys, s.MinDuration = 5, 50, 40_000, 2*time.Second
	}
	b.ResetTimer()
	var res *hostile.Result
	for range b.N {
		res = s.Run()
	}
	b.StopTimer()
	if res.RSSErr != nil {
		b.Fatalf("sampling the daemon's RSS: %v", res.RSSErr)
	}
	if len(res.FloodErrs) > 0 || len(res.HalfErrs) > 0 {
		b.Errorf("flood: %s; half-open: %s", strings.Join(res.FloodErrs, "; "), strings.Join(res.HalfErrs, "; "))
	}
	if res.NGoodErrs > 0 {
		b.Logf("the good client's errors: %s", strings.Join(res.GoodErrs, "; "))
	}
	var halfMax time.Duration
	for _, d := range res.HalfClose {
		halfMax = max(halfMax, d)
	}
	b.ReportMetric(float64(hostile.Percentile(res.Lat, 0.5).Nanoseconds())/1e3, "good-p50-µs")
	b.ReportMetric(float64(hostile.Percentile(res.Lat, 0.99).Nanoseconds())/1e3, "good-p99-µs")
	b.ReportMetric(float64(hostile.Percentile(res.Lat, 1).Nanoseconds())/1e3, "good-max-µs")
	b.ReportMetric(float64(len(res.Lat)), "good-requests")
	b.ReportMetric(float64(res.NGoodErrs), "good-errors")
	b.ReportMetric(res.PeakRSSMB, "peak-RSS-MB")
	b.ReportMetric(float64(res.FloodN)/res.FloodTime.Seconds(), "flood-keys/s")
	b.ReportMetric(float64(res.GarbageOut.Load()), "garbage-frames")
	b.ReportMetric(float64(halfMax.Milliseconds()), "half-open-close-max-ms")
}
