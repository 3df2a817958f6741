package localbucket

import (
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// TestFastPathMatchesGeneral drives random batches through Apply and Reject (whose
// batches of one, two, and three or four ops take apply1, apply2 and applySmall) on one store and through
// applyGeneral on an identical one (same seed, same options), and checks that they give
// the same verdicts and results and end in exactly the same state: hash tables, record
// arenas, free lists, fallback states, counters. The batches mix repeated keys (within
// a batch too), keys of one shard, shards too small for their keys (evictions, untracked
// keys on fallback states), expiries, clock steps back, shadow ops, refusals, costs over
// capacity, limits of every algorithm (a reload that changes a key's algorithm), delays,
// a wall offset, and steps of it (back by 2 s or an hour, which move a fixed window's
// count to the wall time's window in stateFor, and forward by 1.5 s).
func TestFastPathMatchesGeneral(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		o := Options{
			Shards:  rapid.SampledFrom([]int{1, 2, 4}).Draw(t, "shards"),
			MaxKeys: rapid.IntRange(1, 24).Draw(t, "maxKeys"),
		}
		fast, general := NewStore(o), NewStore(o)
		general.seed = fast.seed
		if off := rapid.SampledFrom([]int64{0, 7 * ms, -3 * ms}).Draw(t, "wallOffset"); off != 0 {
			fast.SetWallOffset(off)
			general.SetWallOffset(off)
		}
		var lims []*Limit
		for range rapid.IntRange(1, 4).Draw(t, "limits") {
			alg := rapid.SampledFrom([]Algorithm{TokenBucket, SlidingWindow, FixedWindow}).Draw(t, "alg")
			var burst uint64
			if alg == TokenBucket {
				burst = rapid.Uint64Range(0, 5).Draw(t, "burst")
			}
			l, err := NewLimit(alg, rapid.Uint64Range(1, 4).Draw(t, "requests"), time.Duration(rapid.IntRange(1, 20).Draw(t, "windowMs"))*time.Millisecond, burst)
			if err != nil {
				t.Fatal(err)
			}
			if rapid.IntRange(0, 3).Draw(t, "delayed") == 0 {
				l = l.WithDelay(time.Duration(rapid.Int64Range(0, 10*ms).Draw(t, "delay")))
			}
			lims = append(lims, &l)
		}
		nkeys := rapid.IntRange(1, 40).Draw(t, "keys")
		now := base
		for range rapid.IntRange(1, 200).Draw(t, "steps") {
			now += rapid.Int64Range(-ms, 6*ms).Draw(t, "dt")
			if st := rapid.SampledFrom([]int64{0, 0, 0, 0, 0, 0, 0, 0, -2000 * ms, -3600000 * ms, 1500 * ms}).Draw(t, "wallStep"); st != 0 {
				fast.SetWallOffset(fast.WallOffset() + st)
				general.SetWallOffset(general.WallOffset() + st)
			}
			n := rapid.SampledFrom([]int{1, 1, 2, 2, 2, 3, 4, 5}).Draw(t, "ops")
			a, b := make([]Op, n), make([]Op, n)
			for i := range a {
				k := rapid.IntRange(0, nkeys-1).Draw(t, "key")
				a[i] = Op{
					Key:    testKey(k),
					Limit:  lims[rapid.IntRange(0, len(lims)-1).Draw(t, "limit")],
					Cost:   rapid.Uint64Range(0, 6).Draw(t, "cost"),
					Shadow: rapid.IntRange(0, 4).Draw(t, "shadow") == 0,
				}
				// Stale results, which both paths must overwrite.
				a[i].Result = Result{Allowed: true, Remaining: 99, Delay: 1}
			}
			copy(b, a)
			var gotFast, gotGeneral bool
			if veto := rapid.IntRange(0, 5).Draw(t, "veto") == 0; veto {
				fast.Reject(now, a)
				general.applyGeneral(now, b, true)
			} else {
				gotFast, gotGeneral = fast.Apply(now, a), general.applyGeneral(now, b, false)
			}
			if gotFast != gotGeneral {
				t.Fatalf("batch %v: fast path %v, general path %v", opKeys(a), gotFast, gotGeneral)
			}
			for i := range a {
				if a[i].Result != b[i].Result {
					t.Fatalf("batch %v, op %d: fast path %+v, general path %+v", opKeys(a), i, a[i].Result, b[i].Result)
				}
			}
			if d := storeDiff(fast, general); d != "" {
				t.Fatalf("after batch %v: %s", opKeys(a), d)
			}
			if rapid.IntRange(0, 40).Draw(t, "sweep") == 0 {
				if x, y := fast.Sweep(now), general.Sweep(now); x != y {
					t.Fatalf("Sweep removed %d and %d", x, y)
				}
			}
		}
	})
}

// testKey is the differential tests' key k: one of three rules, and every fourth key
// longer than a record holds inline (inlineKey), at lengths around it.
func testKey(k int) []byte {
	key := "r" + strconv.Itoa(k%3) + ":{k=" + strconv.Itoa(k)
	if k%4 == 3 {
		key += ",pad=" + strings.Repeat("x", inlineKey-12+k%9)
	}
	return []byte(key + "}")
}

func opKeys(ops []Op) []string {
	var ks []string
	for _, o := range ops {
		ks = append(ks, string(o.Key)+"/"+strconv.FormatUint(o.Cost, 10))
	}
	return ks
}

// storeDiff describes the first difference between the states of x and y, "" if none.
func storeDiff(x, y *Store) string {
	if a, b := x.Evictions(), y.Evictions(); a != b {
		return "evictions " + strconv.FormatUint(a, 10) + " and " + strconv.FormatUint(b, 10)
	}
	if a, b := x.Untracked(), y.Untracked(); a != b {
		return "untracked " + strconv.FormatUint(a, 10) + " and " + strconv.FormatUint(b, 10)
	}
	for i := range x.shards {
		p, q := &x.shards[i], &y.shards[i]
		if p.n != q.n || p.used != q.used || p.allLimitedUntil != q.allLimitedUntil {
			return "shard " + strconv.Itoa(i) + ": counts differ"
		}
		if !reflect.DeepEqual(p.slots, q.slots) {
			return "shard " + strconv.Itoa(i) + ": slots differ"
		}
		if len(p.free) != len(q.free) || (len(p.free) > 0 && !reflect.DeepEqual(p.free, q.free)) {
			return "shard " + strconv.Itoa(i) + ": free lists differ"
		}
		for j := range p.used {
			if *p.rec(j) != *q.rec(j) {
				return "shard " + strconv.Itoa(i) + ": record " + strconv.Itoa(int(j)) + " differs"
			}
		}
		if !reflect.DeepEqual(p.long, q.long) {
			return "shard " + strconv.Itoa(i) + ": long keys differ"
		}
		if len(p.fallback) != len(q.fallback) {
			return "shard " + strconv.Itoa(i) + ": fallback states differ"
		}
		for k, e := range p.fallback {
			if f := q.fallback[k]; f == nil || *f != *e {
				return "shard " + strconv.Itoa(i) + ": fallback state of " + k + " differs"
			}
		}
	}
	return ""
}

// TestTakeTokenFastPath checks takeToken (whose first branch handles a cost that passes at
// once) against takeTokenAll, which handles every case, on random token buckets (with
// delays, and limits that shrank under a state), states, instants and costs.
func TestTakeTokenFastPath(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l, err := NewLimit(TokenBucket, rapid.Uint64Range(1, 1<<32-1).Draw(t, "requests"),
			time.Duration(rapid.Int64Range(1, 3_600_000).Draw(t, "windowMs"))*time.Millisecond, rapid.Uint64Range(0, 1<<20).Draw(t, "burst"))
		if err != nil {
			t.Skip(err)
		}
		if rapid.Bool().Draw(t, "delayed") {
			l = l.WithDelay(time.Duration(rapid.Int64Range(0, int64(time.Hour)).Draw(t, "delay")))
		}
		now := base + rapid.Int64Range(-int64(time.Hour), int64(time.Hour)).Draw(t, "now")
		st := State{T: base + rapid.Int64Range(-2*l.tau, 2*l.tau).Draw(t, "tat")}
		cost := rapid.SampledFrom([]uint64{0, 1, 2, l.burst - 1, l.burst, l.burst + 1, rapid.Uint64().Draw(t, "any")}).Draw(t, "cost")
		var fast, all Result
		fast.Remaining, all.Remaining = 7, 9 // stale fields, overwritten by both
		if a, b := l.takeToken(st, now, cost, &fast), l.takeTokenAll(st, now, cost, &all); a != b || fast != all {
			t.Fatalf("cost %d on %+v at %d: fast path %+v %+v, every case %+v %+v", cost, st, now, a, fast, b, all)
		}
	})
}

// TestFastPathsConcurrentExact runs batches of one to six ops (every path: apply1,
// apply2, applySmall, applyGeneral), all on one hot key among others, from goroutines in
// parallel, on one shard and on many: the hot key admits exactly its limit, and every
// admitted batch is counted once on each of its other keys.
func TestFastPathsConcurrentExact(t *testing.T) {
	const limit = 500
	for _, shards := range []int{1, 16} {
		t.Run(strconv.Itoa(shards), func(t *testing.T) {
			s := NewStore(Options{Shards: shards})
			hot := mustLimit(t, FixedWindow, limit, time.Hour, 0)
			wide := mustLimit(t, FixedWindow, 1_000_000, time.Hour, 0)
			var admitted [12]atomic.Int64 // by goroutine
			var wg sync.WaitGroup
			for g := range 12 {
				wg.Go(func() {
					n := g%6 + 1
					ops := make([]Op, n)
					for i := range ops {
						ops[i] = Op{Key: []byte("k" + strconv.Itoa(g) + "-" + strconv.Itoa(i)), Limit: wide, Cost: 1}
					}
					ops[g%n] = Op{Key: []byte("hot"), Limit: hot, Cost: 1} // at every position
					for range 100 {
						if s.Apply(base, ops) {
							admitted[g].Add(1)
						}
					}
				})
			}
			wg.Wait()
			total := int64(0)
			for i := range admitted {
				total += admitted[i].Load()
			}
			if total != limit {
				t.Errorf("admitted %d, want %d", total, limit)
			}
			// Each goroutine's own keys count its admitted batches exactly (none for a
			// batch that failed).
			for g := range 12 {
				n := g%6 + 1
				for i := range n {
					if i == g%n {
						continue
					}
					used := 1_000_000 - int64(peekStore(t, s, base, "k"+strconv.Itoa(g)+"-"+strconv.Itoa(i), wide).Remaining)
					if want := admitted[g].Load(); used != want {
						t.Errorf("key k%d-%d counted %d times, its batch admitted %d times", g, i, used, want)
					}
				}
			}
		})
	}
}
