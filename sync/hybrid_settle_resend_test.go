package sync

import (
	"context"
	"testing"
	"time"
)

// A sync that reports a window's grant used exactly (it settles no unit and reserves
// none, but gives the grant's reservation back: g) is recorded, so that its resend (its
// reply lost, the daemon sends the same units again) is not applied twice. Before, the
// record was written only by a sync that changed the count: the resend took the grant
// off g a second time, and with it another daemon's reservation (b's 3 units: g 3, then
// 0 after a's resend), so refusals while b held them said the window's end.
func TestHybridSettleOnlySyncResentOnce(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	key := "rl:settle-resend:{x}"
	call := func(id string, used, prevGrant, window, demand int64, mode uint8, prevToken, token int64) []int64 {
		t.Helper()
		v, err := int64s(hybridScript.Run(ctx, rdb, []string{key}, hybridArgs(id,
			int64(100*time.Millisecond/time.Microsecond), 2, 10000, 100, 0, 1, 0,
			2, 10, int64(time.Hour/time.Microsecond), 0,
			1, used, prevGrant, window, demand, int64(mode), prevToken, token, 0)...))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	g := func() string { return rdb.HGet(ctx, key, "g").Val() }
	// a: an exact sync of 4 units (the daemon's first, naming a token of its own).
	v := call("a", 0, 0, 0, 4, modeExact+modeFirst, 100, 7)
	if v[0] != 4 {
		t.Fatalf("a's exact grant %d, want 4", v[0])
	}
	// b: an exact sync of 3, its units held.
	w := call("b", 0, 0, 0, 3, modeExact+modeFirst, 200, 20)
	if w[0] != 3 || g() != "7" {
		t.Fatalf("b's grant %d, g %s; want 3 and 7", w[0], g())
	}
	// a used its 4 exactly and reports them: its reply is lost, and it sends again.
	call("a", 4, 4, v[4], 0, modeShare, 7, 8)
	if g() != "3" {
		t.Fatalf("after a reported its grant: g = %s, want 3 (b's)", g())
	}
	call("a", 4, 4, v[4], 0, modeShare, 7, 9)
	if g() != "3" {
		t.Fatalf("after a's resend: g = %s, want 3 (b's): the grant was given back twice", g())
	}
	if n := rdb.HGet(ctx, key, "n").Val(); n != "7" {
		t.Fatalf("n = %s, want 7", n)
	}
}
