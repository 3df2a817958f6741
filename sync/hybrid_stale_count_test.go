package sync

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A daemon's count of the live daemons is up to a heartbeat old: one that still counts
// itself alone (the others just started: a scale-up, a blue/green switch) takes credit
// of ⌊V ÷ 2⌋. The daemon that takes the key over reserved that credit by its own count,
// ⌊C ÷ 2N⌋ with N = 3: 3 of a's 9. b then drained the key by exact syncs, a spent its
// credit unseen: 26 admitted of 20 (3 daemons just started, 8 of 5 in
// cmd/rlsidecar's TestE2EHybridBurstSpreadRetriedGetsTheLimit, 1 run in about 70). The
// reservation is now sized by the count the last user synced with, which Redis records
// with it.
func TestHybridStaleLiveCountCreditReserved(t *testing.T) {
	staleCountHandover(t, "rl:stale-count:{user=grace}", nil)
}

// staleDaemons returns two daemons on rdb: a, whose count of the live daemons is a
// heartbeat old (alone: the others just started), and b, which counts 3.
func staleDaemons(rdb redis.UniversalClient) (a, b *Hybrid) {
	opts := HybridOptions{FetchWait: 10 * time.Second}
	opts.ID = "a"
	a = NewHybrid(rdb, opts)
	opts.ID = "b"
	b = NewHybrid(rdb, opts)
	a.SetReplicas(1)
	b.SetReplicas(3)
	return a, b
}

// staleCountHandover runs, for each algorithm and a limit of 20: a (staleDaemons) uses
// key once and syncs, alone by Redis's record, so it holds credit of ⌊19 ÷ 2⌋; rewrite,
// if not nil, then changes what Redis holds of the key; b takes every unit it can by
// exact syncs; a spends what credit it still has. The two must admit 20, or 21 (b's
// first unit, before its first sync, is the one allowed beyond the limit).
func staleCountHandover(t *testing.T, key string, rewrite func(t *testing.T, rdb redis.UniversalClient)) {
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow, localbucket.TokenBucket} {
		t.Run(fmt.Sprint(alg), func(t *testing.T) {
			rdb := standalone(t)
			lim := mustLimit(t, alg, 20, hourWindow())
			a, b := staleDaemons(rdb)
			now := time.Now().UnixNano()
			admitted := 0
			if take(a, now, key, lim, 1).Allowed {
				admitted++
			}
			syncAll(t, now, a)
			if rewrite != nil {
				rewrite(t, rdb)
			}
			o := rdb.HGet(context.Background(), key, "o").Val()
			admitted += takeSyncing(t, b, now, key, lim, 40)
			if k := rdb.HGet(context.Background(), key, "k").Val(); !strings.HasPrefix(k, "a ") {
				t.Errorf("b took a key a had just used: nothing reserved for a (k = %q)", k)
			}
			onCredit := 0
			for range 20 {
				if take(a, now, key, lim, 1).Allowed {
					onCredit++
				}
			}
			admitted += onCredit
			syncAll(t, now, a, b)
			syncAll(t, now, a, b)
			t.Logf("admitted %d of 20 (a %d on credit after b's)", admitted, onCredit)
			if admitted > 20+1 {
				t.Errorf("two daemons admitted %d of 20 (bound 21): a, counting itself alone (o = %q), spent %d on credit the reservation b made did not cover",
					admitted, o, onCredit)
			}
			if admitted < 20 {
				t.Errorf("two daemons admitted %d of 20: units withheld", admitted)
			}
		})
	}
}

// Credit is sized by the most live daemons counted within creditPeak: a count that
// falls (a daemon gone) does not grow the credit of a view a sync made by the higher
// count, which a reservation made by that count must cover.
func TestCreditCountKeepsThePeak(t *testing.T) {
	var c creditCount
	sec := int64(time.Second)
	steps := []struct {
		at      int64
		n, want int
	}{
		{0, 1, 1},
		{1 * sec, 3, 3},
		{2 * sec, 2, 3},  // fell: the peak holds
		{30 * sec, 1, 3}, // still within a minute of the 3
		{62 * sec, 1, 2}, // the 3 is past creditPeak; the 2, at 2 s, is not yet
		{63 * sec, 1, 1},
		{64 * sec, 4, 4},
		{65 * sec, 4, 4},
		{125 * sec, 2, 4}, // the 4 of 65 s is within a minute
		{126 * sec, 2, 2},
	}
	for _, s := range steps {
		if got, most := c.add(s.at, s.n), c.most.Load(); got != s.want || most != int64(s.want) {
			t.Fatalf("at %ds count %d: credit sized by %d (most %d), want %d", s.at/sec, s.n, got, most, s.want)
		}
	}
	if len(c.q) > 2 {
		t.Errorf("kept %d counts, want at most 2 (a peak and the latest)", len(c.q))
	}
}
