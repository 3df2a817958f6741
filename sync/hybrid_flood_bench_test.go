package sync

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	gosync "sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// BenchmarkHybridNewKeyFlood measures what a flood of new keys that each need an exact
// sync does to one daemon's answers with a healthy Redis (a real redis-server of its
// own): RLSIDECAR_FLOOD_RATE new keys a second (default 5,000), paced over
// RLSIDECAR_FLOOD_WORKERS requests in flight at most (default 512), for
// RLSIDECAR_FLOOD_SECONDS (default 3), each a first request of cost RLSIDECAR_FLOOD_COST
// (default 10; above the one unit a new key may have on credit) on a fixed window of
// 100,000 a day, with the default FetchWait (25ms). It reports the share of checks that
// were Unreachable (decided by the rule's failure policy: degraded), the exact-sync
// batches that ran over FetchWait, and the batches' sizes and durations.
//
// An exact sync that runs over FetchWait makes every key that needs one Unreachable
// until Redis next answers (Master.answering): the batch after a slow one is then not
// tried. Runs once: use -benchtime 1x, e.g.
//
//	go test ./sync/ -run '^$' -bench BenchmarkHybridNewKeyFlood -benchtime 1x -v
func BenchmarkHybridNewKeyFlood(b *testing.B) {
	env := func(name string, def int) int {
		if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
			return v
		}
		return def
	}
	rate, workers := env("RLSIDECAR_FLOOD_RATE", 5000), env("RLSIDECAR_FLOOD_WORKERS", 512)
	secs, cost := env("RLSIDECAR_FLOOD_SECONDS", 3), env("RLSIDECAR_FLOOD_COST", 10)
	srv := redistest.StartStandalone(b)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { rdb.Close() })
	var mu gosync.Mutex
	var durs []time.Duration
	var sizes []uint64
	var slow int
	var h *Hybrid
	var last uint64
	fetchWait := 25 * time.Millisecond
	h = NewHybrid(rdb, HybridOptions{ID: "flood", FetchWait: fetchWait}).WithObserver(func(op string, d time.Duration, err error) {
		if op != "hybrid_fetch" {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		durs = append(durs, d)
		f := h.fetches.Load() // batches go one at a time: the keys since the last one's
		sizes = append(sizes, f-last)
		last = f
		if err != nil {
			slow++
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.Run(ctx, "flood", func() int64 { return time.Now().UnixNano() }, time.Second, func(error) {})
	}()
	defer func() { cancel(); <-done }()
	for !h.Healthy(time.Now().UnixNano()) {
		time.Sleep(time.Millisecond)
	}
	lim, err := localbucket.NewLimit(localbucket.FixedWindow, 100000, 24*time.Hour, 0)
	if err != nil {
		b.Fatal(err)
	}
	var unreachable, allowed, n atomic.Int64
	var slotMu gosync.Mutex
	slots := map[int64]bool{} // 10 ms slots with an Unreachable answer
	var wg gosync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	end := start.Add(time.Duration(secs) * time.Second)
	pace := time.Second * time.Duration(workers) / time.Duration(rate)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			next := start.Add(pace * time.Duration(w) / time.Duration(workers))
			for i := 0; ; i++ {
				next = next.Add(pace)
				if next.After(end) {
					return
				}
				time.Sleep(time.Until(next))
				ops := []HybridOp{{Key: []byte(fmt.Sprintf("rl:bulk:{ip=%d.%d}", w, i)), Limit: &lim, Cost: uint64(cost)}}
				ok := h.Take(time.Now().UnixNano(), ops)
				n.Add(1)
				switch {
				case ok:
					allowed.Add(1)
				case ops[0].Unreachable:
					unreachable.Add(1)
					slotMu.Lock()
					slots[int64(time.Since(start)/(10*time.Millisecond))] = true
					slotMu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	mu.Lock()
	defer mu.Unlock()
	if len(durs) == 0 {
		b.Fatal("no exact sync was made")
	}
	sort.Slice(durs, func(i, j int) bool { return durs[i] < durs[j] })
	sort.Slice(sizes, func(i, j int) bool { return sizes[i] < sizes[j] })
	b.ReportMetric(float64(unreachable.Load())/float64(n.Load()), "unreachable/check")
	b.ReportMetric(float64(slow)/float64(len(durs)), "slow-batches/batch")
	b.Logf("%d new keys a second at cost %d for %ds, %d in flight at most, FetchWait %v: %d checks, %d admitted, %d Unreachable (in %d of %d slots of 10 ms); "+
		"exact-sync batches %d, %d over FetchWait; keys a batch p50 %d p99 %d max %d; duration p50 %v p99 %v max %v",
		rate, cost, secs, workers, fetchWait, n.Load(), allowed.Load(), unreachable.Load(), len(slots), secs*100,
		len(durs), slow, sizes[len(sizes)/2], sizes[len(sizes)*99/100], sizes[len(sizes)-1],
		durs[len(durs)/2], durs[len(durs)*99/100], durs[len(durs)-1])
}
