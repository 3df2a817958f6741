package sync

import (
	"context"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A key whose view a reload forgot (ForgetRuleViews: a rule made hybrid again after
// another mode) and that no check asks for again is swept once idle for the keep-alive
// and its limit has had the time to come back full, as a key never forgotten is: holding nothing, it is as a
// new key would be (its next check syncs exactly). Before, forgetView left its view short
// of the limit with synced 0, which project took as the key's state for good: it was
// never full again and never swept. A soak reloading a rule between hybrid, global and
// local every few seconds left 216,324 such keys held by an idle daemon (Redis held 1),
// growing with every reload for as long as the daemon ran.
func TestHybridSweepForgetsForgottenViews(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{KeepAlive: time.Second})
	now := time.Now().UnixNano()
	for _, alg := range []localbucket.Algorithm{localbucket.TokenBucket, localbucket.FixedWindow, localbucket.SlidingWindow} {
		lim := mustLimit(t, alg, 10, time.Minute)
		key := "rl:forgot-" + alg.String() + "~fp:{u}"
		take(h, now, key, lim, 3)
		if err := h.Flush(context.Background(), now); err != nil {
			t.Fatal(err)
		}
		if n := h.ForgetRuleViews("rl:", map[string]struct{}{"forgot-" + alg.String(): {}}); n != 1 {
			t.Fatalf("%v: ForgetRuleViews found %d keys, want 1", alg, n)
		}
		sh := &h.shards[h.shardOf([]byte(key))]
		sh.mu.Lock()
		e := sh.m[key]
		if e == nil || e.holds() || e.flags&(flagDirty|flagBusy) != 0 {
			sh.mu.Unlock()
			t.Fatalf("%v: after the sync the key holds something; the test cannot tell", alg)
		}
		sh.mu.Unlock()
	}
	// Within its window a forgotten key is kept: its client, limited maybe, is not
	// given a first unit on credit as a new key would be.
	soon := now + int64(3*time.Second)
	for i := range hybridShards {
		h.sweep(i, soon)
	}
	if n := h.Len(); n != 3 {
		t.Fatalf("%d keys whose views a reload forgot held 3 s after their last use, want all 3", n)
	}
	later := now + int64(time.Hour)
	for i := range hybridShards {
		h.sweep(i, later)
	}
	if n := h.Len(); n != 0 {
		t.Fatalf("%d keys whose views a reload forgot held an hour after their last use, want 0", n)
	}
}
