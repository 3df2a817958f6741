package rlclient

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// BenchmarkCheck measures a Check through the pool against the in-process fake sidecar.
// "serial" has one goroutine per CPU (mostly one request in flight per connection);
// "pipelined" has 16 per CPU, so requests share writes and reads.
//
// allocs/op counts the whole process: besides the client's one (the Decision's Rules),
// proto.Decoder.DecodeResponse allocates every string it reads, map keys included
// (19 for a one-rule answer), and proto.ReadFrame's header escapes (once per frame, on
// each side).
func BenchmarkCheck(b *testing.B) {
	path := socketPath(b)
	startFake(b, path, func(req *proto.Request, resp *proto.Response) {
		resp.Allowed = true
		resp.Rule = "per-user"
		resp.Limit = 100
		resp.Remaining = 99
		resp.ResetMs = 600
		resp.Rules = append(resp.Rules, proto.RuleResult{Name: "per-user", Limit: 100, WindowMs: 60000, Remaining: 99, ResetMs: 600, Allowed: true})
	})
	c := newClient(b, Options{Socket: path, Timeout: time.Second})
	ctx := context.Background()
	if _, err := c.Ping(ctx); err != nil {
		b.Fatal(err)
	}
	for _, bc := range []struct {
		name        string
		parallelism int
	}{{"serial", 1}, {"pipelined", 16}} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetParallelism(bc.parallelism)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				attrs := map[string]string{"user": "u-123456", "method": "POST", "path": "/v1/holds", "ip": "203.0.113.9"}
				for pb.Next() {
					d, err := c.Check(ctx, attrs, nil)
					if err != nil || !d.Allowed || d.Unreachable {
						b.Fatalf("%+v, %v", d, err)
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "checks/s")
		})
	}
}
