package main

import (
	"testing"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// unaskedRules: a hybrid rule, a global rule and a local penalty rule, so that a request
// can be refused before its global rule is asked (the hybrid store comes first; a ban
// refuses before any store).
const unaskedRules = `
rules:
  - name: per-user
    mode: hybrid
    key: user
    limit: { requests: 1, per: 1h }
  - name: per-account
    mode: global
    key: account
    limit: { requests: 5, per: 1h }
  - name: login
    mode: local
    match: { path: /login }
    key: ip
    limit: { requests: 1, per: 1h }
    penalty: { after: 1, within: 1h, ban: 1h }
`

// A global rule that a refused request never asked (its refusal came first, from a
// hybrid rule or a ban, and no Redis call is spent on a refused request) refused
// nothing: its rules[] entry says allowed: true, as PROTOCOL.md's all-or-nothing says of
// every rule that would have admitted, not allowed: false with figures it did not read.
// And it is not charged: the account's 5 per hour stay as they were. The same of a
// hybrid rule, after a ban, on a key this daemon does not hold.
func TestE2EUnaskedGlobalRuleNotRefused(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", unaskedRules)
	// A hybrid key's exact sync waits for max(--global-timeout, 25 ms) (before d54c3d1 it
	// was cut at the syncs' client timeout, max(--redis-timeout, --sync-interval)), and a
	// failed periodic sync or heartbeat, bounded by the latter, marks Redis not answering:
	// 50 ms ran out on a loaded machine, the hybrid rule fell back to its local bucket,
	// and the global rule was asked. Both are long here: Redis answers, and the test is
	// not about when.
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--sync-interval", "50ms", "--global-timeout", "2s", "--redis-timeout", "2s")
	c := dialRaw(t, d.socket)
	entry := func(r *proto.Response, name string) *proto.RuleResult {
		t.Helper()
		for i := range r.Rules {
			if r.Rules[i].Name == name {
				return &r.Rules[i]
			}
		}
		t.Fatalf("no rules[] entry %q in %+v", name, r)
		return nil
	}
	id := uint64(0)
	check := func(cost uint64, attrs ...string) *proto.Response {
		id++
		return c.check(id, cost, attrs...)
	}
	for _, tt := range []struct {
		name   string
		attrs  []string // one request admitted, then the next refused by decider
		refuse int      // how many more requests until the one whose global rule is unasked
		want   string   // the deciding rule of that one
	}{
		// The hybrid rule refuses the second request: the global store, after it, is
		// not asked.
		{"after a hybrid refusal", []string{"user=u1", "account=a1"}, 1, "per-user"},
		// The local rule refuses the second request (the global rule was asked then, and
		// given back) and bans the ip: the third is refused by the ban, no store asked.
		{"after a ban", []string{"path=/login", "ip=192.0.2.1", "account=a2"}, 2, "login"},
	} {
		if r := check(1, tt.attrs...); !r.Allowed || entry(r, "per-account").Remaining != 4 {
			t.Fatalf("%s: first request: %+v", tt.name, r)
		}
		var r *proto.Response
		for range tt.refuse {
			r = check(1, tt.attrs...)
		}
		if r.Allowed || r.Rule != tt.want {
			t.Fatalf("%s: %+v, want refused by %s", tt.name, r, tt.want)
		}
		if g := entry(r, "per-account"); !g.Allowed || !g.Unasked || g.RetryAfterMs != 0 || g.Limit != 5 || g.WindowMs != 3600_000 {
			t.Errorf("%s: per-account's entry %+v, want allowed and unasked (it refused nothing), 5 per hour, no retry", tt.name, *g)
		}
		// Asked now (the account alone), it has its 4 left: the refused requests took
		// nothing from it.
		acct := tt.attrs[len(tt.attrs)-1]
		if r := check(0, acct); !r.Allowed || entry(r, "per-account").Remaining != 4 || entry(r, "per-account").Unasked {
			t.Errorf("%s: %s afterwards: %+v, want 4 left", tt.name, acct, r)
		}
	}

	// A hybrid rule is reported from this daemon's view after a ban (nothing charged);
	// a key the view does not hold refused nothing either: allowed, not read.
	r := check(1, "path=/login", "ip=192.0.2.1", "user=fresh")
	if r.Allowed || r.Rule != "login" || !r.Banned {
		t.Fatalf("a banned ip: %+v", r)
	}
	if h := entry(r, "per-user"); !h.Allowed || h.RetryAfterMs != 0 || h.Limit != 1 {
		t.Errorf("per-user's entry for a key not held, after a ban: %+v, want allowed", *h)
	}
	if r := check(1, "user=fresh"); !r.Allowed {
		t.Errorf("user fresh after a refusal that did not ask its rule: %+v, want its 1 request", r)
	}
}

// TestE2EUnaskedRuleNotCounted: through the real daemon, a global rule that refused
// requests never asked is in neither result of rlsidecar_checks_total: it decided
// nothing (before, each counted as allowed). The hybrid rule that refused them counts
// them as rejected.
func TestE2EUnaskedRuleNotCounted(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", unaskedRules)
	// Long timeouts, as in TestE2EUnaskedGlobalRuleNotRefused: a hybrid exact sync or a
	// periodic sync that runs out of time makes the hybrid rule fall back, degraded.
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0", "--redis", "redis://"+srv.Addr, "--sync-interval", "50ms", "--global-timeout", "2s", "--redis-timeout", "2s")
	c := dialRaw(t, d.socket)
	for i := uint64(1); i <= 3; i++ {
		r := c.check(i, 1, "user=u9", "account=a9")
		if r.Allowed != (i == 1) || r.Degraded {
			t.Fatalf("request %d: %+v, want only the first allowed", i, r)
		}
	}
	s := scrapeSamples(t, "http://"+adminAddr(t, d))
	for series, want := range map[string]float64{
		`rlsidecar_checks_total{rule="per-user",result="allowed"}`:     1,
		`rlsidecar_checks_total{rule="per-user",result="rejected"}`:    2,
		`rlsidecar_checks_total{rule="per-account",result="allowed"}`:  1, // the refused two: unasked, not counted
		`rlsidecar_checks_total{rule="per-account",result="rejected"}`: 0,
	} {
		if got := s[series]; got != want {
			t.Errorf("%s = %v, want %v", series, got, want)
		}
	}
}
