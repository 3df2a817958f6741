package limiter

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// TestCalendarGlobalSkewedDaemons: two daemons on one real Redis count a client's day in
// one key, named by the window's start on each daemon's wall clock. Their clocks differ
// (NTP keeps them close, a boot or a VM migration moves one by seconds): near the day's
// end the daemon ahead sees less of the day left than the one behind, which still counts
// into the day's key. The key must outlive the day as the daemon behind sees it. Before,
// every take PEXPIREd the key to the day's end on its own daemon's clock (+1 s): a take
// on the daemon ahead cut the TTL the daemon behind had set, and the key vanished while
// the daemon behind still counted that day, which then admitted the whole quota again.
func TestCalendarGlobalSkewedDaemons(t *testing.T) {
	rdb := realRedis(t)
	ctx := context.Background()
	end := time.Date(2026, 12, 6, 0, 0, 0, 0, time.UTC).UnixNano() // a day's end (UTC)
	start := end - int64(24*time.Hour)
	for _, tc := range []struct {
		name string
		skew time.Duration // how far the daemon ahead is ahead of the one behind
	}{
		{"3s", 3 * time.Second},
		{"30s", 30 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			yaml := fmt.Sprintf("rules:\n  - name: day%d\n    key: user\n    limit: { requests: 3, per: day }\n", tc.skew/time.Second)
			behind, ahead := policyLimiter(t, rdb, yaml), policyLimiter(t, rdb, yaml)
			lim, _ := behind.Rules().Rules[0].LimitFor("", false)
			key := fmt.Sprintf("rl:day%d%s@%d:{user=ann}", tc.skew/time.Second, AppendFingerprint(nil, lim), start/int64(time.Second))
			// Real time runs on from t0; each daemon's clock is its offset from end plus
			// that: the daemon ahead is 300 ms before the day's end, the one behind skew more.
			t0 := time.Now()
			clock := func(aheadBy time.Duration) int64 {
				return end - int64(300*time.Millisecond) - int64(tc.skew) + int64(aheadBy) + int64(time.Since(t0))
			}
			check := annChecker(t)
			// One take on the daemon behind, then the rest of the day's quota on the one
			// ahead, at the end of the day by its clock.
			if r := check(behind, clock(0)); !r.Allowed {
				t.Fatalf("first take refused: %+v", r)
			}
			for k := range 2 {
				if now := clock(tc.skew); now >= end {
					t.Skipf("the machine was too slow: the day ended by the daemon ahead before its takes")
				} else if r := check(ahead, now); !r.Allowed {
					t.Fatalf("take %d (daemon ahead) refused: %+v", k+2, r)
				}
			}
			// The key must live at least until the day ends by the daemon behind.
			ttl, err := rdb.PTTL(ctx, key).Result()
			if err != nil {
				t.Fatal(err)
			}
			if left := time.Duration(end - clock(0)); ttl < left {
				t.Errorf("key %s: TTL %v, shorter than the day left by the daemon behind (%v)", key, ttl, left)
			}
			// A client whose day only the daemon ahead counted, to its end by its clock:
			// the key must outlive that end by at least the skew, for the daemon behind
			// still counts that day. Wait until the key, had it kept the daemon ahead's TTL,
			// would be gone, within the day by the daemon behind.
			var d Decision
			bob := func(l *Limiter, now int64) *Result {
				t.Helper()
				if err := l.Check(now, &Input{Attrs: attrs("user=bob"), Cost: 1}, &d); err != nil {
					t.Fatal(err)
				}
				return &d.Results[0]
			}
			for k := range 3 {
				if now := clock(tc.skew); now >= end {
					t.Skipf("the machine was too slow: the day ended by the daemon ahead before its takes")
				} else if r := bob(ahead, now); !r.Allowed {
					t.Fatalf("bob's take %d (daemon ahead) refused: %+v", k+1, r)
				}
			}
			for time.Since(t0) < 1500*time.Millisecond {
				time.Sleep(50 * time.Millisecond)
			}
			if now := clock(0); now >= end {
				t.Skipf("the machine was too slow: the day ended by the daemon behind too (%v past)", time.Duration(now-end))
			}
			if r := check(behind, clock(0)); r.Allowed {
				t.Errorf("ann: the daemon behind, within the day, admitted a fourth take of a quota of 3: %+v", r)
			}
			if r := bob(behind, clock(0)); r.Allowed {
				t.Errorf("bob: the daemon behind, within the day, admitted a fourth take of a quota of 3 (%d left)", r.Remaining)
			}
		})
	}
}
