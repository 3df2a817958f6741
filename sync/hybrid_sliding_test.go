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

// A hybrid sliding window's reset is a local one's, counting the units admitted here
// that Redis has not seen: it said the end of the next window whenever any were (1.82 s
// for a first unit that a local window resets in 0.82 s; reset_ms and the RateLimit
// header's reset a window late).
func TestHybridSlidingResetMatchesLocal(t *testing.T) {
	rdb := standalone(t)
	lim := mustLimit(t, localbucket.SlidingWindow, 10, time.Second)
	h := NewHybrid(rdb, HybridOptions{})
	s := localbucket.NewStore(localbucket.Options{})
	// Within one window (Redis's clock is this one): across a window's end the two count
	// a grant's units in different windows, by design (the share grant's window).
	for time.Now().UnixNano()%int64(time.Second) > int64(100*time.Millisecond) {
		time.Sleep(5 * time.Millisecond)
	}
	// Redis dates what it counts by its own clock, read while a call to it runs, and the
	// view reads its window from that: the hybrid reset may run late by up to the
	// longest call so far (37 ms once on a loaded machine), besides 10 ms of slack. The
	// fault this guards put it a whole window late.
	var slowest time.Duration
	for i := range 8 {
		now := time.Now().UnixNano()
		r := take(h, now, "rl:swreset:{user=1}", lim, 1)
		slowest = max(slowest, time.Duration(time.Now().UnixNano()-now))
		ops := []localbucket.Op{{Key: []byte("k"), Limit: lim, Cost: 1}}
		s.Apply(now, ops)
		l := ops[0].Result
		if r.Allowed != l.Allowed || r.Reset < l.Reset-int64(time.Millisecond) || r.Reset > l.Reset+int64(10*time.Millisecond+slowest) {
			t.Fatalf("check %d: hybrid allowed %v reset %v, local allowed %v reset %v (the slowest call so far %v)", i, r.Allowed, time.Duration(r.Reset), l.Allowed, time.Duration(l.Reset), slowest)
		}
		if i == 4 {
			start := time.Now()
			syncAll(t, now, h)
			slowest = max(slowest, time.Since(start))
		}
		time.Sleep(30 * time.Millisecond)
	}
}
