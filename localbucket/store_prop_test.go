package localbucket

import (
	"hash/maphash"
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
		// Each shard's latest time decided at: the store decides a take whose clock was
		// read earlier (two connections' clocks read in one order, applied in the other)
		// at it.
		marks := map[uint32]int64{}
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
			sh := uint32(maphash.Bytes(s.seed, []byte(key))) & s.mask
			at := max(now, marks[sh])
			marks[sh] = at
			st2, want := l.Take(ref[key].st, at, cost)
			switch {
			case !want.Allowed:
				// A refusal changes nothing in the store. Take's state may have moved a
				// window on, which changes nothing either: a shard's takes are decided at
				// times that never go back.
			case want.Expires <= at:
				delete(ref, key)
			default:
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

// TestStoreBatchModel checks batches of several ops (keys repeated within a batch,
// shadow ops, limits of every algorithm on one key space) against a plain map applying
// the documented semantics: ops taken in order on a tentative state, each on top of the
// cost of the refused ones before it on its key; if every non-shadow
// op passes, every key keeps its last state (dropped once expired); otherwise nothing
// changes and each op that passed reports a peek of its key's state before the batch.
func TestStoreBatchModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := NewStore(Options{Shards: rapid.SampledFrom([]int{1, 4, 256}).Draw(t, "shards")})
		var lims []*Limit
		for _, alg := range []Algorithm{TokenBucket, SlidingWindow, FixedWindow} {
			l, err := NewLimit(alg, rapid.Uint64Range(1, 4).Draw(t, "requests"), 10*time.Millisecond, 0)
			if err != nil {
				t.Fatal(err)
			}
			lims = append(lims, &l)
		}
		type refEntry struct {
			st      State
			expires int64
		}
		ref := map[string]refEntry{}
		limOf := map[string]*Limit{} // one algorithm per key, as the store asks
		now := base
		for range rapid.IntRange(1, 300).Draw(t, "steps") {
			now += rapid.Int64Range(0, 4*ms).Draw(t, "dt")
			ops := make([]Op, rapid.IntRange(1, 6).Draw(t, "ops"))
			for i := range ops {
				key := strconv.Itoa(rapid.IntRange(0, 5).Draw(t, "key"))
				if limOf[key] == nil {
					limOf[key] = lims[rapid.IntRange(0, len(lims)-1).Draw(t, "alg")]
				}
				ops[i] = Op{Key: []byte(key), Limit: limOf[key], Cost: rapid.Uint64Range(0, 3).Draw(t, "cost"), Shadow: rapid.IntRange(0, 3).Draw(t, "shadow") == 0}
			}
			// The model.
			tent := map[string]State{}
			carry := map[string]uint64{} // the cost of the refused ops before, per key
			want := make([]Result, len(ops))
			ok := true
			for i, op := range ops {
				k := string(op.Key)
				st, seen := tent[k]
				if !seen {
					st = ref[k].st
				}
				tent[k], want[i] = op.Limit.Take(st, now, op.Cost+carry[k])
				if !want[i].Allowed {
					carry[k] += op.Cost
				}
				ok = ok && (want[i].Allowed || op.Shadow)
			}
			if ok {
				for i, op := range ops {
					k := string(op.Key)
					if want[i].Expires <= now {
						delete(ref, k)
					} else {
						ref[k] = refEntry{tent[k], want[i].Expires}
					}
				}
			} else {
				for i, op := range ops {
					if want[i].Allowed {
						_, want[i] = op.Limit.Take(ref[string(op.Key)].st, now, 0)
						want[i].Allowed, want[i].RetryAfter = true, 0
					}
				}
			}
			if got := s.Apply(now, ops); got != ok {
				t.Fatalf("Apply = %v, model %v", got, ok)
			}
			for i := range ops {
				if ops[i].Result != want[i] {
					t.Fatalf("op %d (key %s cost %d shadow %v): store %+v, model %+v", i, ops[i].Key, ops[i].Cost, ops[i].Shadow, ops[i].Result, want[i])
				}
			}
			if s.Len() != len(ref) {
				t.Fatalf("Len %d, model %d", s.Len(), len(ref))
			}
		}
	})
}
