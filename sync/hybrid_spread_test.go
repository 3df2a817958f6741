package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A unit admitted on credit is charged to the key from when it was admitted, not from
// when the next sync carries it. Charging it at the sync lost the refill of the time in
// between on a full bucket: a client whose requests rotate over two daemons at 3× a
// limit of 5 per minute had every refill delayed by up to a sync interval after its
// first (credit) unit, and lost the request that came exactly as the refill did (0.954
// of the exact mode). Here the first unit is admitted on credit, synced 300 ms later:
// the key's theoretical arrival time must be its admission plus one emission interval,
// not the sync's.
func TestHybridCreditChargedWhenAdmitted(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	lim := mustLimit(t, localbucket.TokenBucket, 5, time.Minute) // T = 12 s
	const key = "rl:credit:{user=1}"
	for _, c := range []struct {
		name  string
		fetch bool // the unit travels with an exact sync instead of the periodic one
	}{{"periodic sync", false}, {"exact sync", true}} {
		t.Run(c.name, func(t *testing.T) {
			if err := rdb.Del(ctx, key).Err(); err != nil {
				t.Fatal(err)
			}
			a := NewHybrid(rdb, HybridOptions{ID: "a"})
			a.SetReplicas(2) // C = 5 >= 2N: a first unit on credit
			tm, err := rdb.Time(ctx).Result()
			if err != nil {
				t.Fatal(err)
			}
			admitted := tm.UnixMicro()
			if !take(a, time.Now().UnixNano(), key, lim, 1).Allowed {
				t.Fatal("the first request was refused")
			}
			const delay = 300 * time.Millisecond
			time.Sleep(delay)
			if c.fetch {
				// The next request: the first unit's sync has not run, the allowance is
				// spent, the view stale: an exact sync carries the first unit too.
				if !take(a, time.Now().UnixNano(), key, lim, 1).Allowed {
					t.Fatal("the second request was refused")
				}
			} else if err := a.Flush(ctx, time.Now().UnixNano()); err != nil {
				t.Fatal(err)
			}
			tat, err := rdb.HGet(ctx, key, "t").Float64()
			if err != nil {
				t.Fatal(err)
			}
			if !c.fetch {
				want := float64(admitted) + 12e6 // one unit charged at its admission
				if got := tat - want; got > 100_000 || got < -100_000 {
					t.Fatalf("the key's TAT is %.0f ms off its admission + one unit: a credit unit was charged late", got/1000)
				}
				return
			}
			// The first unit travels with the second request's exact sync: it is dated
			// by the key's last check (the second request), never earlier than the exact
			// mode would charge it, so no refill is credited twice.
			want := float64(admitted+delay.Microseconds()) + 2*12e6
			if got := tat - want; got < -100_000 {
				t.Fatalf("the key's TAT is %.0f ms before the second request + two units: refill credited that the exact mode would not give", -got/1000)
			}
		})
	}
}
