package sync

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A daemon's credit lasts creditLife (50 s) from its view, but a key that changed hands
// reserved it (field k) only when the last user's use was within share_epochs
// (KeepAlive, 10 s by default): a daemon that used a key 11 s before another daemon took
// every unit by exact syncs then spent its credit unseen, 24 admitted of 20. Now the
// reservation is made for a last user within its credit's life too. Here KeepAlive is
// 1 s, so a real wait of 1.5 s puts a's use past share_epochs and well within its
// credit's life.
func TestHybridOldUsersCreditReserved(t *testing.T) {
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow, localbucket.TokenBucket} {
		t.Run(fmt.Sprint(alg), func(t *testing.T) {
			rdb := standalone(t)
			ctx := context.Background()
			lim := mustLimit(t, alg, 20, hourWindow())
			opts := HybridOptions{FetchWait: 10 * time.Second, KeepAlive: time.Second}
			opts.ID = "a"
			a := NewHybrid(rdb, opts)
			opts.ID = "b"
			b := NewHybrid(rdb, opts)
			seeEachOther(t, "old", a, b)
			key := "rl:old-user:{user=frank}"
			admitted := 0
			now := time.Now().UnixNano()
			if take(a, now, key, lim, 1).Allowed {
				admitted++
			}
			syncAll(t, now, a)
			time.Sleep(1500 * time.Millisecond) // Redis's clock: a's use is past share_epochs
			seeEachOther(t, "old", a, b)
			later := time.Now().UnixNano()
			admitted += takeSyncing(t, b, later, key, lim, 40)
			if k := rdb.HGet(ctx, key, "k").Val(); !strings.HasPrefix(k, "a ") {
				t.Errorf("b took a key a used 1.5 s before, within a's credit's life: nothing reserved for a (k = %q)", k)
			}
			onCredit := 0
			for range 10 {
				if take(a, later, key, lim, 1).Allowed {
					onCredit++
				}
			}
			admitted += onCredit
			syncAll(t, later, a, b)
			syncAll(t, later, a, b)
			t.Logf("admitted %d of 20 (a %d on credit after b's)", admitted, onCredit)
			if admitted > 20+1 {
				t.Errorf("two daemons admitted %d of 20 (bound 21): a spent %d on credit no reservation left it", admitted, onCredit)
			}
		})
	}
}
