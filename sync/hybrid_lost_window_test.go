package sync

import (
	"context"
	"testing"
	"time"
)

// TestHybridLostReplyAcrossWindowCountsUnits: a daemon's sync of a window key reserves
// a grant, and its reply is lost; the daemon admits units on its own allowance, and its
// resend reaches Redis in the next window. The daemon never had that grant, so the
// units are not drawn from it: they count in the window they were admitted in, and the
// grant goes back to its window (a sliding window's previous count) if that still
// counts. Before, the resend netted them against the grant as a grant used across a
// boundary is, and they went with the grant's window: 3 units admitted, 0 counted.
func TestHybridLostReplyAcrossWindowCountsUnits(t *testing.T) {
	for _, tc := range []struct {
		name string
		alg  int64 // scripts/hybrid.lua's: 1 sliding_window, 2 fixed_window
	}{{"fixed", 2}, {"sliding", 1}} {
		t.Run(tc.name, func(t *testing.T) {
			rdb := standalone(t)
			ctx := context.Background()
			const key = "rl:lostwin:{user=1}"
			w := int64(3 * time.Second / time.Microsecond)
			call := func(used, demand, prevTok, tok int64) []int64 {
				t.Helper()
				cmd := hybridScript.Run(ctx, rdb, []string{key}, hybridArgs("d1",
					int64(100*time.Millisecond/time.Microsecond), 1, 10000, 100, 0, 1, 0,
					tc.alg, 100, w, 0,
					1, used, 0, 0, demand, int64(modeShare), prevTok, tok, 0)...)
				v, err := int64s(cmd)
				if err != nil {
					t.Fatal(err)
				}
				return v
			}
			for time.Now().UnixMicro()%w > w/5 { // early in a window
				time.Sleep(10 * time.Millisecond)
			}
			// 2 units admitted before a first view; the sync settles them and reserves a
			// share grant. Its reply is lost.
			a := call(2, 5, 7, 8)
			if a[0] < 1 {
				t.Fatalf("the lost sync granted %d, want a grant to lose", a[0])
			}
			for time.Now().UnixMicro()/w == a[4]/w {
				time.Sleep(10 * time.Millisecond)
			}
			// The resend, in the next window: 3 more units admitted since, just now.
			b := call(5, 0, 7, 9)
			if b[4] != a[4]+w {
				t.Fatalf("the resend's window starts at %d, want the next one, %d (the host stalled a window)", b[4], a[4]+w)
			}
			if n, _ := rdb.HGet(ctx, key, "n").Int(); n != 3 {
				t.Errorf("after a lost reply's grant of %d in the window before: the window counts %d of the 3 units admitted in it", a[0], n)
			}
			if tc.alg == 1 {
				if p, _ := rdb.HGet(ctx, key, "p").Int(); p != 2 {
					t.Errorf("the previous window counts %d, want the 2 units admitted in it (its lost grant of %d given back)", p, a[0])
				}
			}
		})
	}
}
