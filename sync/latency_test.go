package sync

import (
	"context"
	"sort"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// BenchmarkGlobalP50 measures, alternating in one run, the p50 of a global check of a
// two-rule request (one script call) against the p50 of a PING on the same client: the
// Redis round trip. global-extra-µs is what global mode adds to one round trip
// (target ≤ 50 µs).
func BenchmarkGlobalP50(b *testing.B) {
	srv := redistest.StartStandalone(b)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		b.Fatal(err)
	}
	defer rdb.Close()
	g := NewGlobal(rdb)
	l := mustLimit(b, localbucket.TokenBucket, 1_000_000_000, time.Hour)
	ctx := context.Background()
	n := max(b.N, 2000)
	lg := make([]time.Duration, 0, n)
	lp := make([]time.Duration, 0, n)
	ops := make([]GlobalOp, 2)
	for i := 0; i < n; i++ {
		ops[0] = GlobalOp{Key: "rl:per-ip:{ip=10.0.0.1}", Limit: l, Cost: 1}
		ops[1] = GlobalOp{Key: "rl:holds:{user=u1}", Limit: l, Cost: 1}
		start := time.Now()
		c, cancel := context.WithTimeout(ctx, time.Second)
		ok, err := g.Check(c, ops)
		cancel()
		if !ok || err != nil {
			b.Fatal(ok, err)
		}
		lg = append(lg, time.Since(start))
		start = time.Now()
		if err := rdb.Ping(ctx).Err(); err != nil {
			b.Fatal(err)
		}
		lp = append(lp, time.Since(start))
	}
	p50 := func(d []time.Duration) time.Duration {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return d[len(d)/2]
	}
	pg, pp := p50(lg), p50(lp)
	b.ReportMetric(float64(pg.Nanoseconds())/1e3, "global-p50-µs")
	b.ReportMetric(float64(pp.Nanoseconds())/1e3, "ping-p50-µs")
	b.ReportMetric(float64((pg-pp).Nanoseconds())/1e3, "global-extra-µs")
}
