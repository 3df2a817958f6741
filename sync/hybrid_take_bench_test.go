package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// BenchmarkHybridTakeOnCredit is the hybrid mode's common case in process: one key,
// synced once (its view fresh for the benchmark's clock), each Take admitted from this
// daemon's allowance without Redis, per algorithm. Redis only gives the key its view.
func BenchmarkHybridTakeOnCredit(b *testing.B) {
	srv := redistest.StartStandalone(b)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { rdb.Close() })
	for _, alg := range []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow, localbucket.SlidingWindow} {
		b.Run(alg.String(), func(b *testing.B) {
			h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
			lim := mustLimit(b, alg, 1_000_000_000, time.Hour)
			key := "rl:take-bench:{" + alg.String() + "}"
			take(h, time.Now().UnixNano(), key, lim, 1)
			if err := h.Flush(context.Background(), time.Now().UnixNano()); err != nil {
				b.Fatal(err)
			}
			ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: 1}}
			now := time.Now().UnixNano() // one clock reading: the view stays fresh
			b.ReportAllocs()
			for b.Loop() {
				if !h.Take(now, ops) {
					b.Fatal("refused")
				}
			}
		})
	}
}
