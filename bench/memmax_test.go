package bench

import (
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// BenchmarkMemoryAtMaxKeys: the daemon's RSS holding --max-keys' default (4,000,000)
// keys: 2,000,000 clients, each checked once on two rules (per-user and per-ip), in
// local mode and in hybrid mode (a real redis-server; the hybrid table holds a key's
// view and counts beside the local state). The unit's MemoryMax= and GOMEMLIMIT are
// sized on these figures (systemd/rlsidecar.service, docs/operations.md "Memory").
// Runs once: -benchtime 1x. RLSIDECAR_MEM_CLIENTS changes the number of clients.
func BenchmarkMemoryAtMaxKeys(b *testing.B) {
	clients := 2_000_000
	if v, err := strconv.Atoi(os.Getenv("RLSIDECAR_MEM_CLIENTS")); err == nil && v > 0 {
		clients = v
	}
	for _, mode := range []string{"local", "hybrid"} {
		b.Run(mode, func(b *testing.B) {
			cfg := filepath.Join(b.TempDir(), "rules.yaml")
			rules := "rules:\n" +
				"  - { name: per-user, key: user, mode: " + mode + ", limit: { requests: 100, per: 1h } }\n" +
				"  - { name: per-ip, key: ip, mode: " + mode + ", limit: { requests: 1000, per: 1h } }\n"
			if err := os.WriteFile(cfg, []byte(rules), 0o644); err != nil {
				b.Fatal(err)
			}
			args := []string{"--config", cfg}
			if mode == "hybrid" {
				args = append(args, "--redis", "redis://"+redistest.StartStandalone(b).Addr)
			}
			rls := startServer(b, "rlsidecar", args...)
			b.ResetTimer()
			const conns, batch = 4, 50_000
			var wg sync.WaitGroup
			for c := 0; c < conns; c++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					cl := dial(b, rls.socket)
					enc := proto.NewEncoder()
					fr := make([][]byte, 0, batch)
					for i := c; i < clients; {
						fr = fr[:0]
						for ; i < clients && len(fr) < batch; i += conns {
							enc.Reset()
							enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
								{Name: "user", Value: "user-" + strconv.Itoa(i)}, {Name: "ip", Value: "10." + strconv.Itoa(i)}}})
							fr = append(fr, append([]byte(nil), enc.Bytes()...))
						}
						if err := cl.pipelined(fr, len(fr), 256); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			b.ReportMetric(rls.rssMB(b), "RSS-MB")
			b.ReportMetric(rls.anonMB(b), "anon-MB")
			b.ReportMetric(rls.statusMB(b, "VmHWM:"), "peak-RSS-MB")
		})
	}
}
