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

// A script before this one (a daemon not yet upgraded, beside upgraded ones in a
// blue/green switch) records a key's last user as "id epoch", without the count of live
// daemons its credit was sized by. The taker reserved that credit by its own count, as
// before: an old daemon still counting itself alone (the new ones just started) held
// ⌊V ÷ 2⌋, the new daemon taking the key over reserved ⌊C ÷ 6⌋ of it, and 26 were admitted
// of 20, as TestHybridStaleLiveCountCreditReserved found before the count was recorded.
// (An audit's harness, not in this repository, with the real binaries: an old daemon
// warm on keys and two new ones started beside it, the burst spread over the three, a
// key past limit + 2 in 9 of 17 runs, by up to 13.) A last
// user whose count is not recorded is reserved for as if it counted itself alone: the
// most credit it can hold.
func TestHybridLegacyLastUserCreditReserved(t *testing.T) {
	const key = "rl:legacy-owner:{user=grace}"
	staleCountHandover(t, key, func(t *testing.T, rdb redis.UniversalClient) {
		// What a script before "id/N epoch" wrote for a's sync: "a epoch".
		ctx := context.Background()
		o := rdb.HGet(ctx, key, "o").Val()
		epoch, ok := strings.CutPrefix(o, "a/1 ")
		if !ok {
			t.Fatalf("a's sync recorded o = %q, want \"a/1 epoch\"", o)
		}
		rdb.HSet(ctx, key, "o", "a "+epoch)
	})
}

// The other way: a script before this one, taking over a key whose last user this one
// recorded ("a/1 epoch"), reads "a/1" as that daemon's id and reserves its credit under
// it (k = "a/1 units until"). a's next sync must find the reservation its own and drop
// it, as it drops one under "a": it did not, and the reservation stood for a minute,
// against a's own views too. (The audit's harness, real binaries: a new daemon warm on
// 36 keys, two old ones started beside it, the burst spread over the three: 11 to 20
// keys short of their limits, by 110 to 206 units in all; none with every daemon old.)
func TestHybridLegacyTakersReservationDroppedByItsOwner(t *testing.T) {
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow, localbucket.TokenBucket} {
		t.Run(fmt.Sprint(alg), func(t *testing.T) {
			rdb := standalone(t)
			ctx := context.Background()
			lim := mustLimit(t, alg, 20, hourWindow())
			a, b := staleDaemons(rdb)
			key := "rl:legacy-taker:{user=grace}"
			now := time.Now().UnixNano()
			admitted := 0
			if take(a, now, key, lim, 1).Allowed {
				admitted++
			}
			syncAll(t, now, a)
			admitted += takeSyncing(t, b, now, key, lim, 3)
			// What a script before this one wrote for b's takeover: a's id as it read it.
			k := rdb.HGet(ctx, key, "k").Val()
			rest, ok := strings.CutPrefix(k, "a ")
			if !ok {
				t.Fatalf("b took a key a had just used: k = %q, want a reservation for a", k)
			}
			rdb.HSet(ctx, key, "k", "a/1 "+rest)
			if take(a, now, key, lim, 1).Allowed {
				admitted++
			}
			syncAll(t, now, a)
			if k := rdb.HGet(ctx, key, "k").Val(); k != "" {
				t.Errorf("a synced the key again: its credit is counted, but the reservation for it stands (k = %q)", k)
			}
			admitted += takeSyncing(t, b, now, key, lim, 40)
			syncAll(t, now, a, b)
			if admitted < 20 {
				t.Errorf("two daemons admitted %d of 20: units withheld", admitted)
			}
			if admitted > 20+1 {
				t.Errorf("two daemons admitted %d of 20 (bound 21)", admitted)
			}
		})
	}
}
