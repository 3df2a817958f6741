package sync

import (
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// BenchmarkHybridMemoryPerKey: heap bytes per hybrid key held, at
// RLSIDECAR_MEMORY_KEYS keys (default 100,000; the figure 1,000,000), each key
// "rl:per-user:{user=user-N}" with one check admitted on credit (no Redis reached, so
// every key is also on its shard's list of keys to sync). Target ≤ 200 bytes at
// 1,000,000. Runs once whatever b.N is: use -benchtime 1x.
func BenchmarkHybridMemoryPerKey(b *testing.B) {
	keys := 100_000
	if v, err := strconv.Atoi(os.Getenv("RLSIDECAR_MEMORY_KEYS")); err == nil && v > 0 {
		keys = v
	}
	rdb, err := Open(Config{URL: "redis://127.0.0.1:1"})
	if err != nil {
		b.Fatal(err)
	}
	defer rdb.Close()
	lim := mustLimit(b, localbucket.TokenBucket, 600, time.Minute)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	h := NewHybrid(rdb, HybridOptions{MaxKeys: 2 * keys})
	now := time.Now().UnixNano()
	ops := []HybridOp{{Limit: lim, Cost: 1}}
	key := make([]byte, 0, 64)
	for i := 0; i < keys; i++ {
		key = append(append(key[:0], "rl:per-user:{user=user-"...), strconv.Itoa(i)...)
		key = append(key, '}')
		ops[0].Key = key
		h.Take(now, ops)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(keys)
	b.ReportMetric(per, "bytes/key")
	b.Logf("%d hybrid keys held: %.0f heap bytes per key (target ≤ 200)", h.Len(), per)
	runtime.KeepAlive(h)
}

// TestHentrySize: a hybrid entry fits the 96-byte size class. At 112 a million keys took
// 209 heap bytes each (BenchmarkHybridMemoryPerKey), over the 200 the README gives.
func TestHentrySize(t *testing.T) {
	if n := unsafe.Sizeof(hentry{}); n > 96 {
		t.Fatalf("hentry is %d bytes, want at most 96", n)
	}
}

func TestCeilNsNeverEarly(t *testing.T) {
	for _, ns := range []int64{0, 1, 999, 1_000_000, 16_777_217, 1_500_000_001, 366 * 2 * 24 * int64(time.Hour), 123_456_789_123} {
		f := ceilNs(ns)
		if got := int64(f); got < ns || float64(got-ns) > float64(ns)/(1<<23)+1 {
			t.Errorf("ceilNs(%d) = %d", ns, got)
		}
	}
	if ceilNs(-5) != 0 {
		t.Error("a negative time is not 0")
	}
}

// TestLagCode: a sync's lag in a byte decodes to no less (a view's times are never
// early) and not much more.
func TestLagCode(t *testing.T) {
	for _, lag := range []int64{1, 999, 1000, 1001, 12_345, 100_000, 2_500_000, int64(time.Second) + 7, int64(time.Minute)} {
		got := lagNs(lagCode(lag))
		if got < lag || float64(got) > 1.1*float64(lag)+1000 {
			t.Errorf("lag %d ns decodes to %d", lag, got)
		}
	}
	if lagCode(0) != 0 || lagNs(0) != 0 {
		t.Error("no lag is not 0")
	}
}

// TestSetTimesLag: a view's reset and retry count from when Redis read the key, up to
// the sync's lag after the view's time, so the lag is added; but a 0 (full, or a fixed
// window with nothing counted; one more fits) stays 0 whenever it was read. Adding it
// there made an empty hourly window's reset 0.4 ms, which the Envoy API answered as
// the time to the window's end.
func TestSetTimesLag(t *testing.T) {
	lag := int64(5 * time.Millisecond)
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.TokenBucket} {
		e := &hentry{lim: mustLimit(t, alg, 10, time.Hour)}
		e.setTimes(0, 0, lag)
		if e.resetNs() != 0 || e.retryNs() != 0 {
			t.Errorf("%v: zeros read as reset %d, retry %d", alg, e.resetNs(), e.retryNs())
		}
		e.setTimes(1000, 2000, lag)
		if e.resetNs() < int64(time.Millisecond)+lag || e.retryNs() < 2*int64(time.Millisecond)+lag {
			t.Errorf("%v: reset %d, retry %d: the lag not added", alg, e.resetNs(), e.retryNs())
		}
	}
}
