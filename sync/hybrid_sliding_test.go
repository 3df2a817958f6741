package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A share grant never puts a sliding window's count above its limit. Near a window's
// end the script sized the grant by the estimate one interval later, in the next window,
// where this window's count weighs less; but it reserved the grant in this window's count,
// and the daemon spends it at once. A hot client got limit × (1 + interval ÷ window) a
// window, every window, even alone on one daemon: 22 of 20 a second at a 100 ms interval.
func TestHybridSlidingGrantAtWindowEnd(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	const key = "rl:swend:{user=1}"
	const window, interval = 2 * time.Second, time.Second
	const requests = 20
	// Wait until Redis's clock is in the last interval of a window, with a margin
	// either side: the grant's interval then reaches into the next window.
	var now time.Time
	for deadline := time.Now().Add(10 * time.Second); ; {
		tm, err := rdb.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		if e := time.Duration(tm.UnixNano() % int64(window)); e >= 1200*time.Millisecond && e <= 1700*time.Millisecond {
			now = tm
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Redis's clock never reached the window's last interval")
		}
		time.Sleep(20 * time.Millisecond)
	}
	start := now.UnixMicro() - now.UnixMicro()%window.Microseconds()
	// The window is full: 20 counted, nothing before it.
	if err := rdb.HSet(ctx, key, "t", start, "n", requests, "p", 0).Err(); err != nil {
		t.Fatal(err)
	}
	cmd := hybridScript.Run(ctx, rdb, []string{key}, hybridArgs("d1",
		interval.Microseconds(), 1, 10000, 100, 0, 1, 0,
		int64(localbucket.SlidingWindow), requests, window.Microseconds(), requests,
		1, 0, 0, 0, 5, int64(modeShare), 1, 2, 0)...)
	v, err := int64s(cmd)
	if err != nil {
		t.Fatal(err)
	}
	n, err := rdb.HGet(ctx, key, "n").Int()
	if err != nil {
		t.Fatal(err)
	}
	if v[0] != 0 || n > requests {
		t.Fatalf("a full sliding window's last interval granted %d; its count is %d of %d", v[0], n, requests)
	}
}
