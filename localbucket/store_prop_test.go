package localbucket

import (
	"strconv"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// TestStoreModel checks the store's hash table against a plain map running the same
// takes: same results, same keys kept, through inserts, updates, deletions, sweeps and
// resizes.
func TestStoreModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := NewStore(Options{Shards: rapid.SampledFrom([]int{1, 2, 8}).Draw(t, "shards")})
		lim, err := NewLimit(rapid.SampledFrom([]Algorithm{TokenBucket, SlidingWindow, FixedWindow}).Draw(t, "alg"), 3, 10*time.Millisecond, 0)
		if err != nil {
			t.Fatal(err)
		}
		l := &lim
		type refEntry struct {
			st      State
			expires int64
		}
		ref := map[string]refEntry{}
		now := base
		nkeys := rapid.IntRange(1, 400).Draw(t, "keys")
		for range rapid.IntRange(1, 2000).Draw(t, "steps") {
			now += rapid.Int64Range(-ms, 3*ms).Draw(t, "dt")
			if rapid.IntRange(0, 50).Draw(t, "sweep") == 0 {
				want := 0
				for k, e := range ref {
					if e.expires <= now {
						delete(ref, k)
						want++
					}
				}
				if got := s.Sweep(now); got != want {
					t.Fatalf("Sweep removed %d, want %d", got, want)
				}
				continue
			}
			key := strconv.Itoa(rapid.IntRange(0, nkeys-1).Draw(t, "key"))
			cost := rapid.Uint64Range(0, 2).Draw(t, "cost")
			st2, want := l.Take(ref[key].st, now, cost)
			if want.Expires <= now {
				delete(ref, key)
			} else {
				ref[key] = refEntry{st2, want.Expires}
			}
			ops := []Op{{Key: []byte(key), Limit: l, Cost: cost}}
			s.Apply(now, ops)
			if ops[0].Result != want {
				t.Fatalf("key %s: store gives %+v, model %+v", key, ops[0].Result, want)
			}
			if s.Len() != len(ref) {
				t.Fatalf("Len %d, model %d", s.Len(), len(ref))
			}
		}
	})
}
