package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

const overlapRules = `
rules:
  - name: global
    match: { path: /g }
    key: user
    limit: { requests: 1000000, per: 1h }
    mode: global
  - name: local
    match: { path: /l }
    key: user
    limit: { requests: 1000000, per: 1h }
    mode: local
`

// Global checks pipelined on one connection overlap their Redis round trips, and the
// answers still come back in request order, local checks and pings among them. Redis is
// reached through a 100 ms latency (toxiproxy), so 12 global checks decided one after
// another take at least 1.2 s; overlapped they take about one round trip. The bound
// asserted, 700 ms, is below what the serial daemon can physically do, and far above
// what the overlapped one needs, so the test does not depend on the machine's speed.
func TestE2EGlobalChecksOverlap(t *testing.T) {
	const latency = 100 * time.Millisecond
	srv := redistest.StartStandalone(t)
	proxy := startToxiproxy(t, srv.Addr)
	addToxic(t, proxy, "latency", "latency", "downstream", fmt.Sprintf(`{"latency":%d}`, latency.Milliseconds()))
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", overlapRules)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+proxy.Listen, "--global-timeout", "5s", "--redis-timeout", "5s")
	c := dialRaw(t, d.socket)

	const globals = 12
	batch := func(first uint64) time.Duration {
		enc := proto.NewEncoder()
		id := first
		var kinds []string
		for i := 0; i < globals; i++ {
			enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "path", Value: "/g"}, {Name: "user", Value: fmt.Sprint("u", i)}}})
			id++
			kinds = append(kinds, "global")
			enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "path", Value: "/l"}, {Name: "user", Value: fmt.Sprint("u", i)}}})
			id++
			kinds = append(kinds, "local")
			if i%4 == 0 {
				enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpPing, Cost: 1})
				id++
				kinds = append(kinds, "ping")
			}
		}
		start := time.Now()
		c.write(enc.Bytes())
		for i, kind := range kinds {
			r := c.recv()
			if r.ID != first+uint64(i) {
				t.Fatalf("answer %d has id %d, want %d: answers out of request order", i, r.ID, first+uint64(i))
			}
			switch kind {
			case "ping":
				if r.Protocol != proto.Version {
					t.Fatalf("answer %d: %+v, want a ping answer", i, r)
				}
			default:
				if r.IsError() || !r.Allowed || r.Degraded || r.Rule != kind {
					t.Fatalf("answer %d: %+v, want allowed by %s, not degraded", i, r, kind)
				}
			}
		}
		return time.Since(start)
	}
	batch(1000) // opens the pool's connections to Redis
	if el := batch(1); el >= 700*time.Millisecond {
		t.Fatalf("%d pipelined global checks behind a %v Redis took %v: decided one after another", globals, latency, el)
	} else {
		t.Logf("%d pipelined global checks behind a %v Redis: %v", globals, latency, el)
	}
}
