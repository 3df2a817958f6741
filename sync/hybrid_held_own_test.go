package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// An exact sync's grant used exactly (a key new here, its first request's cost all that
// the grant gives) is reported at the key's next periodic sync, so Redis stops counting
// it as reserved (field g); and a daemon's last sync (Release) reports it whenever the
// key was last synced. A refusal at the limit, with nothing reserved anywhere, then says
// the window's end.
//
// Before, such a key had nothing to tell Redis (needsSync: its units used, its grant
// used exactly) and was never synced again: g kept its grant until the window ended, and
// Release left it too once the key was synced longer ago than KeepAlive. One daemon, 4
// per hour, cost 4: g stayed 4 after the periodic syncs and after Release; the next
// daemon on the key (the same one restarted) took those 4 units for another daemon's
// and answered a refusal at the limit with a retry of 100 ms (its next sync), then 1 ms,
// where nothing frees before the window's end: a client that waited it was refused
// again, for up to the whole window.
func TestHybridUsedGrantReleasesReservation(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow} {
		t.Run(alg.String(), func(t *testing.T) {
			lim := mustLimit(t, alg, 4, hourWindow())
			const interval = 100 * time.Millisecond
			g := func(key string) string {
				t.Helper()
				v, err := rdb.HGet(ctx, key, "g").Result()
				if err != nil && err.Error() != "redis: nil" {
					t.Fatal(err)
				}
				if v == "" {
					v = "0"
				}
				return v
			}
			atLimit := func(h *Hybrid, now int64, key, when string) {
				t.Helper()
				r := take(h, now, key, lim, 1)
				if r.Allowed {
					t.Fatalf("%s: admitted past the limit: %+v", when, r)
				}
				if r.RetryAfter < int64(time.Minute) {
					t.Errorf("%s: refused at the limit of a window of an hour, nothing held anywhere (g=%s): retry %v; want the window's end",
						when, g(key), time.Duration(r.RetryAfter))
				}
			}

			// The periodic syncs report the grant.
			h := NewHybrid(rdb, HybridOptions{ID: "d", Interval: interval, FetchWait: time.Second})
			key := "rl:usedgrant:{" + alg.String() + "-a}"
			now := time.Now().UnixNano()
			if r := take(h, now, key, lim, 4); !r.Allowed {
				t.Fatalf("a key new here, its limit's worth: refused %+v", r)
			}
			for i := range 3 {
				now += int64(interval)
				syncAll(t, now, h)
				if i == 0 && g(key) != "0" {
					t.Errorf("after the first periodic sync since the grant was used: g = %s, want 0", g(key))
				}
			}
			atLimit(h, now, key, "after the periodic syncs")

			// So does the last sync, the key's last sync well past KeepAlive (10 s) ago.
			key2 := "rl:usedgrant:{" + alg.String() + "-b}"
			if r := take(h, now, key2, lim, 4); !r.Allowed {
				t.Fatalf("a key new here, its limit's worth: refused %+v", r)
			}
			now += int64(12 * time.Second)
			if err := h.Release(ctx, now); err != nil {
				t.Fatal(err)
			}
			if g(key) != "0" || g(key2) != "0" {
				t.Errorf("after Release: g = %s and %s, want 0: the daemon holds nothing", g(key), g(key2))
			}

			// The daemon restarted (one daemon on the keys): at the limit, it says the
			// window's end, not its next sync. (A key new here may admit one unit on
			// credit before its first sync: docs/accuracy.md.)
			h2 := NewHybrid(rdb, HybridOptions{ID: "d", Interval: interval, FetchWait: time.Second})
			for _, k := range []string{key, key2} {
				for i := 0; i < 3 && take(h2, now, k, lim, 1).Allowed; i++ {
				}
				now += int64(time.Millisecond)
				atLimit(h2, now, k, "restarted, "+k)
				now += int64(interval)
				syncAll(t, now, h2)
				atLimit(h2, now, k, "restarted, after a sync, "+k)
			}
		})
	}
}
