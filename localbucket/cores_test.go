package localbucket

import (
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// BenchmarkStoreApply2Cores is the socket benchmarks' store load without the sockets: two
// rules' keys per check (bench/rules.yaml's per-ip and holds over 8,192 users), applied
// by goroutines on both cores, each walking the users a few checks behind the other, as
// pipelined connections do (bench.runPipelined). It reports the CPU per check, which is
// what a shared store costs when two cores take turns at its lines:
//
//   - 1-core: one goroutine, the baseline;
//   - 2-cores: two goroutines on one store;
//   - 2-cores-private: two goroutines, each on a store of its own (the same keys in each):
//     the cost with nothing shared between the cores.
//
// 2-cores against 2-cores-private is the cost of sharing (docs/performance.md).
func BenchmarkStoreApply2Cores(b *testing.B) {
	b.Run("1-core", func(b *testing.B) { benchCores(b, 1, false) })
	b.Run("2-cores", func(b *testing.B) { benchCores(b, 2, false) })
	b.Run("2-cores-private", func(b *testing.B) { benchCores(b, 2, true) })
}

func benchCores(b *testing.B, workers int, private bool) {
	const users = 8192
	l := mustLimit(b, TokenBucket, 1_000_000_000, time.Hour, 0)
	user, ip := make([][]byte, users), make([][]byte, users)
	for i := range users {
		user[i] = []byte("holds:{user=user-" + strconv.Itoa(i) + "}")
		ip[i] = []byte("per-ip:{ip=10.0." + strconv.Itoa(i/256%256) + "." + strconv.Itoa(i%256) + "}")
	}
	stores := make([]*Store, workers)
	for w := range stores {
		if w == 0 || private {
			stores[w] = NewStore(Options{})
			for i := range users {
				stores[w].Apply(base, []Op{{Key: user[i], Limit: l, Cost: 1}, {Key: ip[i], Limit: l, Cost: 1}})
			}
		} else {
			stores[w] = stores[0]
		}
	}
	per := max(b.N/workers, 1)
	b.ResetTimer()
	cpu := processCPU(b)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, ops := stores[w], []Op{{Limit: l, Cost: 1}, {Limit: l, Cost: 1}}
			for i := range per {
				k := (i + 7*w) % users // 7 checks apart, as runPipelined's connections start
				ops[0].Key, ops[1].Key = user[k], ip[k]
				s.Apply(base+int64(i)*1000, ops)
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(float64((processCPU(b)-cpu).Nanoseconds())/float64(per*workers), "cpu-ns/check")
}

// processCPU is the process's user and system time so far.
func processCPU(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
