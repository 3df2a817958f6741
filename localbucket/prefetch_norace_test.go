//go:build !race

package localbucket

import (
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestPrefetchWhileShardsGrow: prefetches read a shard without its lock while batches
// grow its slots (resize) and its chunks, and sweeps empty them: they must never read
// past what they were given (a slot naming a record in a chunk newer than the view the
// prefetch holds; an array with another's length). Not under the race detector, where
// prefetches read nothing (and would be reported: they read slots written under the
// lock, by design).
func TestPrefetchWhileShardsGrow(t *testing.T) {
	if !prefetching {
		t.Skip("no prefetch on this platform")
	}
	s := NewStore(Options{Shards: 1, PrefetchFrom: 1})
	l := mustLimit(t, TokenBucket, 3, time.Minute, 0)
	var done atomic.Bool
	var last atomic.Int64 // the key last stored: readers fetch it and its neighbours
	var wg sync.WaitGroup
	for g := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 9))
			op := Op{Limit: l}
			for !done.Load() {
				op.Key = []byte("k" + strconv.Itoa(int(last.Load())+r.IntN(4)-2))
				s.Prefetch(&op)
				s.PrefetchRecord(&op)
			}
		}()
	}
	now := base
	for round := range 3 {
		for i := range 100_000 {
			s.Apply(now, []Op{{Key: []byte("k" + strconv.Itoa(round*100_000+i)), Limit: l, Cost: 1}})
			last.Store(int64(round*100_000 + i))
		}
		now += int64(2 * time.Minute)
		s.Sweep(now) // every key refilled: all removed, the slots and chunks kept
	}
	done.Store(true)
	wg.Wait()
	if !s.Prefetching() {
		t.Fatal("the store never fetched ahead")
	}
}
