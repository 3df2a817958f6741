package bench

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// BenchmarkIdleConnections: what an idle served connection costs the daemon. It opens
// 4,000 connections (RLSIDECAR_BENCH_CONNS changes the number), makes one check on each
// and leaves them open and idle, as HAProxy's and Envoy's connections wait between
// requests, then reads the daemon's memory: the growth of its RSS and of its own
// (anonymous) memory, in KB per connection. The figure behind the Lua README's
// --max-conns advice for HAProxy hosts. Runs once: -benchtime 1x.
func BenchmarkIdleConnections(b *testing.B) {
	conns := 4000
	if v, err := strconv.Atoi(os.Getenv("RLSIDECAR_BENCH_CONNS")); err == nil && v > 0 {
		conns = v
	}
	cfg := filepath.Join(b.TempDir(), "rules.yaml")
	if err := os.WriteFile(cfg, []byte("rules:\n  - { name: per-user, key: user, limit: { requests: 100, per: 1h } }\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	rls := startServer(b, "rlsidecar", "--config", cfg, "--max-conns", strconv.Itoa(conns+64))
	enc := proto.NewEncoder()
	check := func(cl *client, i int) {
		enc.Reset()
		enc.EncodeRequest(&proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1,
			Attrs: []proto.Attr{{Name: "user", Value: "user-" + strconv.Itoa(i)}}})
		if _, err := cl.c.Write(enc.Bytes()); err != nil {
			b.Fatal(err)
		}
		if err := cl.readOne(); err != nil {
			b.Fatal(err)
		}
	}
	// One connection first, so that the code a check runs is paged in before the
	// baseline is read.
	check(dial(b, rls.socket), -1)
	settle := func() { time.Sleep(500 * time.Millisecond) }
	settle()
	rss0, anon0 := rls.rssMB(b), rls.anonMB(b)
	b.ResetTimer()
	for i := 0; i < conns; i++ {
		check(dial(b, rls.socket), i)
	}
	b.StopTimer()
	settle()
	rss1, anon1 := rls.rssMB(b), rls.anonMB(b)
	b.ReportMetric(rss0, "idle-RSS-MB")
	b.ReportMetric(rss1, "RSS-MB")
	b.ReportMetric((rss1-rss0)*1024/float64(conns), "RSS-KB/conn")
	b.ReportMetric((anon1-anon0)*1024/float64(conns), "anon-KB/conn")
	b.ReportMetric(float64(conns), "conns")
}
