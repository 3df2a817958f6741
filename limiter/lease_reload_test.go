package limiter

import (
	"context"
	"strings"
	"testing"
	"time"
)

// A global lease whose rule a reload removes, or makes local, is still released by the
// daemon that acquired it, by the parts it was taken with: its slots are held in Redis
// until then, and a reload putting the rule back reads that sorted set again. Before,
// its token no longer decoded (its rule was not a global concurrency rule in force),
// the release answered false and freed nothing: the 3 slots of a max 3 rule stayed held
// for their 10 s lease after the rule came back, every check of the client refused, and
// rlsidecar_inflight showed them held until the sweep counted them expired.
func TestGlobalLeaseReleasedAfterItsRuleIsReloadedAway(t *testing.T) {
	rdb := realRedis(t)
	for _, c := range []struct{ name, from, to string }{
		{"made-local", "    mode: global\n", "    mode: local\n"},
		{"renamed", "  - name: exports\n", "  - name: exports2\n"},
	} {
		t.Run(c.name, func(t *testing.T) {
			prefix := "lr-" + c.name + ":"
			l := globalLimiter(t, rdb, globalLeaseRules, prefix)
			in := exportInput("ann")
			var toks []string
			for i := range 3 {
				ok, tok, _ := acquire(t, l, in, uint64(i+1))
				if !ok || !strings.HasPrefix(tok, "g") {
					t.Fatalf("lease %d: allowed %v token %q", i, ok, tok)
				}
				toks = append(toks, tok)
			}
			changed := strings.Replace(globalLeaseRules, c.from, c.to, 1)
			if changed == globalLeaseRules {
				t.Fatal("the rules did not change")
			}
			l.SetRules(mustRules(t, changed))
			for i, tok := range toks {
				if !l.ReleaseLease(tok, nowNs()) {
					t.Errorf("release %d after the reload: false, want true", i)
				}
				if l.ReleaseLease(tok, nowNs()) {
					t.Errorf("release %d again: true", i)
				}
			}
			key := prefix + "exports:{user=ann}"
			if n := rdb.ZCard(context.Background(), key).Val(); n != 0 {
				t.Errorf("%s holds %d members after every lease was released, want 0", key, n)
			}
			if s := stats(l, "exports"); s.InFlight != 0 || s.Released != 3 {
				t.Errorf("exports stats %+v, want none in flight, 3 released", s)
			}
			l.SetRules(mustRules(t, globalLeaseRules))
			for i := range 3 {
				if ok, _, d := acquire(t, l, in, 9); !ok {
					t.Fatalf("lease %d with the rule back: refused (%+v)", i, d.Results[0])
				}
			}
		})
	}
}

// A global lease whose rule a reload made local, or renamed, is renewed by the daemon
// that took it, with the lease it was taken for unless the renew names one: its request
// still runs, and holds its slot should the rule come back. Before, the renew answered
// false and the slot ran out under a request still running.
func TestGlobalLeaseRenewedAfterItsRuleIsReloadedAway(t *testing.T) {
	rdb := realRedis(t)
	for _, c := range []struct{ name, from, to string }{
		{"made-local", "    mode: global\n", "    mode: local\n"},
		{"renamed", "  - name: exports\n", "  - name: exports2\n"},
	} {
		t.Run(c.name, func(t *testing.T) {
			prefix := "lrn-" + c.name + ":"
			l := globalLimiter(t, rdb, globalLeaseRules, prefix)
			ok, tok, _ := acquire(t, l, exportInput("ann"), 1)
			if !ok {
				t.Fatal("refused")
			}
			l.SetRules(mustRules(t, strings.Replace(globalLeaseRules, c.from, c.to, 1)))
			if ok, in := l.RenewLease(tok, 0, nowNs()); !ok || in != 10*time.Second {
				t.Errorf("renew after the reload: %v %v, want true 10s", ok, in)
			}
			if ok, in := l.RenewLease(tok, time.Minute, nowNs()); !ok || in != time.Minute {
				t.Errorf("renew for a minute after the reload: %v %v, want true 1m0s", ok, in)
			}
			key := prefix + "exports:{user=ann}"
			if ttl := rdb.PTTL(context.Background(), key).Val(); ttl < 50*time.Second {
				t.Errorf("%s expires in %v after a renew for a minute", key, ttl)
			}
			if !l.ReleaseLease(tok, nowNs()) {
				t.Error("release: false")
			}
		})
	}
}
