package localbucket

import (
	"math"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"
)

// TestPrefetchDecidesNothing: a store that fetches ahead from its first key, each batch
// fetched (Prefetch, then PrefetchRecord) before it is applied, decides every batch as a
// store that never fetches: the same results, the same keys held. Under the race
// detector nothing is fetched (prefetching); scripts/test runs this test without it too.
func TestPrefetchDecidesNothing(t *testing.T) {
	on := NewStore(Options{Shards: 4, PrefetchFrom: 1})
	off := NewStore(Options{Shards: 4, PrefetchFrom: -1})
	lims := []*Limit{
		mustLimit(t, TokenBucket, 3, time.Minute, 0),
		mustLimit(t, SlidingWindow, 5, time.Second, 0),
		mustLimit(t, FixedWindow, 2, time.Second, 0),
	}
	r := rand.New(rand.NewPCG(7, 8))
	now := base
	batch := func(n int) []Op {
		ops := make([]Op, n)
		for j := range ops {
			k := r.IntN(5000)
			ops[j] = Op{Key: []byte("key-" + strconv.Itoa(k)), Limit: lims[k%len(lims)], Cost: uint64(r.IntN(3))}
		}
		return ops
	}
	for i := range 50_000 {
		a := batch(1 + r.IntN(5))
		b := append([]Op(nil), a...)
		for j := range a {
			on.Prefetch(&a[j])
		}
		for j := range a {
			on.PrefetchRecord(&a[j])
		}
		if okA, okB := on.Apply(now, a), off.Apply(now, b); okA != okB {
			t.Fatalf("batch %d: fetched ahead %v, not %v", i, okA, okB)
		}
		for j := range a {
			if a[j].Result != b[j].Result {
				t.Fatalf("batch %d op %d: fetched ahead %+v, not %+v", i, j, a[j].Result, b[j].Result)
			}
		}
		now += r.Int64N(int64(50 * time.Millisecond))
	}
	if on.Len() != off.Len() {
		t.Fatalf("%d keys held fetching ahead, %d not", on.Len(), off.Len())
	}
	if on.Prefetching() != prefetching || off.Prefetching() {
		t.Fatalf("Prefetching: %v and %v, want %v and false", on.Prefetching(), off.Prefetching(), prefetching)
	}
}

// TestPrefetchingFrom: a store fetches ahead once a shard holds its share of
// Options.PrefetchFrom keys, not before.
func TestPrefetchingFrom(t *testing.T) {
	if !prefetching {
		t.Skip("no prefetch on this platform or under the race detector")
	}
	s := NewStore(Options{Shards: 2, PrefetchFrom: 200})
	l := mustLimit(t, TokenBucket, 3, time.Minute, 0)
	for i := 0; !s.Prefetching(); i++ {
		if i > 200 {
			t.Fatalf("not fetching ahead at %d keys", s.Len())
		}
		s.Apply(base, []Op{{Key: []byte("k" + strconv.Itoa(i)), Limit: l, Cost: 1}})
	}
	if n := max(s.shards[0].n, s.shards[1].n); n != 100 {
		t.Fatalf("fetching ahead from %d keys in a shard, want 100 (200 over 2 shards)", n)
	}
}

// TestHugeOptionsAreNotNegativeShares: PrefetchFrom and MaxKeys near math.MaxInt (a
// flag given as "as many as you like") are shares that large, not overflowed negative
// ones: before, such a PrefetchFrom made the store fetch ahead from its first key, and
// such a MaxKeys held no key past the first (a shard's cap below zero).
func TestHugeOptionsAreNotNegativeShares(t *testing.T) {
	l := mustLimit(t, TokenBucket, 3, time.Minute, 0)
	fill := func(s *Store) {
		for i := range 100 {
			s.Apply(base, []Op{{Key: []byte("k" + strconv.Itoa(i)), Limit: l, Cost: 1}})
		}
	}
	s := NewStore(Options{PrefetchFrom: math.MaxInt})
	fill(s)
	if s.big.Load() {
		t.Errorf("fetching ahead at %d keys, PrefetchFrom %d", s.Len(), math.MaxInt)
	}
	s = NewStore(Options{MaxKeys: math.MaxInt})
	fill(s)
	if s.Len() != 100 {
		t.Errorf("%d keys held of 100, MaxKeys %d", s.Len(), math.MaxInt)
	}
}
