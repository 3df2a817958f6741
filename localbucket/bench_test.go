package localbucket

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"strconv"
	"testing"
	"time"
)

func BenchmarkTake(b *testing.B) {
	for _, alg := range []Algorithm{TokenBucket, SlidingWindow, FixedWindow} {
		b.Run(alg.String(), func(b *testing.B) {
			l := mustLimit(b, alg, 1_000_000_000, time.Second, 0)
			var s State
			// Warm up so that the sliding window has a previous count to weigh.
			s, _ = l.Take(s, base, 1000)
			now := base + s1 + 300*ms
			b.ReportAllocs()
			for b.Loop() {
				s, _ = l.Take(s, now, 1)
			}
		})
	}
}

func benchOps(b *testing.B) (*Store, []Op) {
	s := NewStore(Options{})
	user := mustLimit(b, TokenBucket, 1_000_000_000, time.Second, 0)
	ip := mustLimit(b, SlidingWindow, 1_000_000_000, time.Minute, 0)
	// Other keys, so that the maps are not trivially small.
	for i := range 100_000 {
		s.Apply(base, []Op{{Key: fmt.Appendf(nil, "user:{id=%d}", i), Limit: user, Cost: 1}})
	}
	ops := []Op{
		{Key: []byte("user:{id=42}"), Limit: user, Cost: 1},
		{Key: []byte("ip:{ip=192.0.2.1}"), Limit: ip, Cost: 1},
	}
	if !s.Apply(base, ops) {
		b.Fatal("rejected")
	}
	return s, ops
}

// BenchmarkStoreApply2 is one request checked against 2 rules on existing keys.
func BenchmarkStoreApply2(b *testing.B) {
	s, ops := benchOps(b)
	now := base + 500*ms
	b.ReportAllocs()
	for b.Loop() {
		s.Apply(now, ops)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "checks/s")
}

func BenchmarkStoreApply2Parallel(b *testing.B) {
	s, _ := benchOps(b)
	user, ip := mustLimit(b, TokenBucket, 1_000_000_000, time.Second, 0), mustLimit(b, SlidingWindow, 1_000_000_000, time.Minute, 0)
	now := base + 500*ms
	keys := make([][]byte, 1024)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "user:{id=%d}", i*97)
	}
	b.ReportAllocs()
	b.ResetTimer() // the set-up's allocations are not the loop's
	b.RunParallel(func(pb *testing.PB) {
		// Existing user keys spread over the shards, and one shared ip key.
		ops := []Op{{Limit: user, Cost: 1}, {Key: []byte("ip:{ip=192.0.2.1}"), Limit: ip, Cost: 1}}
		i := 0
		for pb.Next() {
			ops[0].Key = keys[i%len(keys)]
			s.Apply(now, ops)
			i++
		}
	})
}

func TestApplyAllocs(t *testing.T) {
	s := NewStore(Options{})
	l := mustLimit(t, TokenBucket, 1_000_000_000, time.Second, 0)
	ops := []Op{{Key: []byte("a"), Limit: l, Cost: 1}, {Key: []byte("b"), Limit: l, Cost: 1}}
	s.Apply(base, ops)
	if n := testing.AllocsPerRun(100, func() { s.Apply(base, ops) }); n != 0 {
		t.Errorf("Apply on existing keys allocates %v times", n)
	}
}

// BenchmarkStoreApply4 is one request checked against 4 token-bucket rules on existing
// keys (three user keys spread over the shards and one shared key).
func BenchmarkStoreApply4(b *testing.B) {
	s, _ := benchOps(b)
	l := mustLimit(b, TokenBucket, 1_000_000_000, time.Second, 0)
	ops := []Op{
		{Key: []byte("user:{id=42}"), Limit: l, Cost: 1},
		{Key: []byte("user:{id=4242}"), Limit: l, Cost: 1},
		{Key: []byte("user:{id=77}"), Limit: l, Cost: 1},
		{Key: []byte("global:{}"), Limit: l, Cost: 1},
	}
	now := base + 500*ms
	if !s.Apply(now, ops) {
		b.Fatal("rejected")
	}
	b.ReportAllocs()
	for b.Loop() {
		s.Apply(now, ops)
	}
}

// BenchmarkStoreApply2Zipf is real traffic's shape: each check is a user key drawn from
// a Zipf distribution over a million users (s = 1.1; most draws hit hot users, the
// tail inserts new keys and, as the store fills, finds shards with long probe runs)
// beside one shared key, at 100 per minute per user and 10^9 per hour for the shared
// key, the clock advancing 1µs per check.
func BenchmarkStoreApply2Zipf(b *testing.B) {
	s := NewStore(Options{})
	user := mustLimit(b, TokenBucket, 100, time.Minute, 0)
	shared := mustLimit(b, TokenBucket, 1_000_000_000, time.Hour, 0)
	z := rand.NewZipf(rand.New(rand.NewPCG(1, 2)), 1.1, 1, 1_000_000-1)
	keys := make([][]byte, 1<<16)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "per-user:{user=u%d}", z.Uint64())
	}
	ops := []Op{{Limit: user, Cost: 1}, {Key: []byte("global:{}"), Limit: shared, Cost: 1}}
	now := base
	for _, k := range keys { // the keys exist, as after a warm-up
		ops[0].Key = k
		s.Apply(now, ops)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		now += 1000
		ops[0].Key = keys[i&(len(keys)-1)]
		s.Apply(now, ops)
		i++
	}
}

// BenchmarkStoreApply2Uniform is the store in situ under many live keys: each check is
// a user key drawn uniformly from n stored keys (16,384: the socket benchmark's 8,192
// users × 2 rules; 262,144; 1,048,576), so that most lookups miss the CPU caches, beside
// one shared key, the clock advancing 1µs per check. The draws are precomputed; each
// key is written into one buffer, as the daemon builds a request's keys, so that the
// misses measured are the store's. The pairs=n cases check two keys of one client each
// time, per-user and per-ip, both drawn (2n live keys: pairs=8192 is the socket
// benchmark's shape), so that both lookups miss.
func BenchmarkStoreApply2Uniform(b *testing.B) {
	for _, n := range []int{1 << 14, 1 << 18, 1 << 20} {
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) { benchUniform(b, n, false) })
	}
	for _, n := range []int{1 << 13, 1 << 19} {
		b.Run(fmt.Sprintf("pairs=%d", n), func(b *testing.B) { benchUniform(b, n, true) })
	}
}

func benchUniform(b *testing.B, n int, pairs bool) {
	s := NewStore(Options{})
	user := mustLimit(b, TokenBucket, 100, time.Minute, 0)
	shared := mustLimit(b, TokenBucket, 1_000_000_000, time.Hour, 0)
	ops := []Op{{Limit: user, Cost: 1}, {Key: []byte("global:{}"), Limit: shared, Cost: 1}}
	key := func(buf []byte, i uint32) []byte {
		buf = append(buf[:0], "per-user:{user=user-"...)
		return append(strconv.AppendUint(buf, uint64(i), 10), '}')
	}
	ipKey := func(buf []byte, i uint32) []byte {
		buf = append(buf[:0], "per-ip:{ip=10."...)
		buf = strconv.AppendUint(buf, uint64(i>>16), 10)
		buf = strconv.AppendUint(append(buf, '.'), uint64(i>>8&0xff), 10)
		buf = strconv.AppendUint(append(buf, '.'), uint64(i&0xff), 10)
		return append(buf, '}')
	}
	var buf, buf2 []byte
	want := n + 1
	if pairs {
		ops[1].Limit, want = user, 2*n
	}
	now := base
	for i := range n {
		buf = key(buf, uint32(i))
		ops[0].Key = buf
		if pairs {
			buf2 = ipKey(buf2, uint32(i))
			ops[1].Key = buf2
		}
		s.Apply(now, ops)
	}
	if s.Len() != want {
		b.Fatalf("%d keys stored, want %d", s.Len(), want)
	}
	r := rand.New(rand.NewPCG(3, 4))
	draws := make([]uint32, 1<<20)
	for i := range draws {
		draws[i] = uint32(r.IntN(n))
	}
	runtime.GC() // the set-up's garbage collected before timing, not during
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		now += 1000
		d := draws[i&(len(draws)-1)]
		buf = key(buf, d)
		ops[0].Key = buf
		if pairs {
			buf2 = ipKey(buf2, d)
			ops[1].Key = buf2
		}
		s.Apply(now, ops)
		i++
	}
}
