package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A sync whose clock was read before a request's admission (the periodic sync reads it
// before it takes the keys; an exact sync's is its request's, which may have waited on
// another sync) dates the units it carries as of the sync: the admission was no earlier.
// The unsigned difference of the two clocks wrapped to 49 days, capped at maxChargeAge
// (10 s): a key's first sync charged its unit 10 s before Redis's time, before the fixed
// window it was admitted in, which never counted it (n = 0 after an admission), and a
// token bucket not at all. An audit of one daemon on a healthy Redis lost 4 to 38 of
// 48,000 units this way, where request latency spiked.
func TestHybridSyncClockBeforeAdmission(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.TokenBucket} {
		t.Run(alg.String(), func(t *testing.T) {
			lim := mustLimit(t, alg, 100, 10*time.Second)
			key := fmt.Sprintf("rl:seen:{%v}", alg)
			h := NewHybrid(rdb, HybridOptions{Interval: time.Hour, FetchWait: time.Second})
			now := time.Now().UnixNano()
			if !take(h, now+int64(5*time.Millisecond), key, lim, 1).Allowed {
				t.Fatal("a new key's first request was refused")
			}
			syncAll(t, now, h) // its clock read 5 ms before the request's
			switch alg {
			case localbucket.FixedWindow:
				if n, err := rdb.HGet(ctx, key, "n").Int(); err != nil || n != 1 {
					t.Fatalf("redis counts %d (%v) of 1 unit admitted: lost", n, err)
				}
			default:
				// One unit charged: the bucket's time (µs) is one emission interval
				// (100 ms) ahead of Redis's now, less the time since the sync.
				tm, err := rdb.Time(ctx).Result()
				if err != nil {
					t.Fatal(err)
				}
				tat, err := rdb.HGet(ctx, key, "t").Float64()
				if err != nil {
					t.Fatal(err)
				}
				if ahead := time.Duration(tat-float64(tm.UnixMicro())) * time.Microsecond; ahead < 50*time.Millisecond {
					t.Fatalf("the bucket is %v ahead of now; want about 100 ms (one unit charged)", ahead)
				}
			}
		})
	}
}

// Two requests admitted out of the order of their clocks (the second read its clock
// before the first, then waited for the lock): the key's last admission is the later
// one. Recorded as the last to be admitted, the earlier clock dated both units before
// the window the first was admitted in, which never counted it: here, 300 ms into a
// window, the other request's clock 400 ms behind, Redis counted 0 of 2.
func TestHybridAdmissionsOutOfOrder(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	const window = time.Second
	lim := mustLimit(t, localbucket.FixedWindow, 20, window)
	key := "rl:seen-order:{u1}"
	h := NewHybrid(rdb, HybridOptions{Interval: time.Hour, FetchWait: time.Second})
	// The key's view 100 ms into a window, by Redis's clock.
	tm, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	into := time.Duration(tm.UnixNano() % int64(window))
	time.Sleep((window + 100*time.Millisecond - into) % window)
	if !take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
		t.Fatal("the first request was refused")
	}
	syncAll(t, time.Now().UnixNano(), h)
	tm, _ = rdb.Time(ctx).Result()
	next := tm.UnixNano() - tm.UnixNano()%int64(window) + int64(window)
	time.Sleep(time.Duration(next-tm.UnixNano()) + 300*time.Millisecond)
	now := time.Now().UnixNano()
	if !take(h, now, key, lim, 1).Allowed {
		t.Fatal("a request 300 ms into the next window was refused")
	}
	if !take(h, now-int64(400*time.Millisecond), key, lim, 1).Allowed {
		t.Fatal("a request whose clock is 400 ms behind was refused")
	}
	syncAll(t, time.Now().UnixNano(), h)
	if tm, _ := rdb.Time(ctx).Result(); tm.UnixNano() >= next+int64(window) {
		t.Skip("the machine was too slow: the sync came a window later")
	}
	if n, err := rdb.HGet(ctx, key, "n").Int(); err != nil || n != 2 {
		t.Fatalf("the window counts %d (%v); want 2, both charged as of the last admission", n, err)
	}
}
