package limiter

import (
	"errors"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// A deny inline limit refuses its request as a rule's limit: deny does (impossible, no
// retry, the other checks consuming nothing, nothing stored), and reports its own window:
// Limit and Remaining 0, Window its window_ms, Reset the rest of the window aligned to
// the Unix epoch in wall time (the store's wall offset applied).
func TestInlineDeny(t *testing.T) {
	l := newLimiter(t, twoRules)
	const off = int64(7 * time.Second) // wall = now + off
	l.Store().SetWallOffset(off)
	now := t0 - int64(2*time.Second) // wall t0+5s: 25 s into a minute (t0 is 20 s into one)
	var d Decision
	ask := Input{Attrs: attrs("ip=1.2.3.4"), Cost: 0}
	if err := l.Check(now, &ask, &d); err != nil {
		t.Fatal(err)
	}
	keys := l.Store().Len()
	for _, cost := range []uint64{0, 1, 3} {
		in := Input{Attrs: attrs("ip=1.2.3.4"), Cost: cost,
			Limits: []Inline{{Key: "blocked", Name: "block", WindowMs: 60_000, Deny: true, Mode: "global"}}}
		if err := l.Check(now, &in, &d); err != nil {
			t.Fatalf("cost %d: %v", cost, err)
		}
		if d.Allowed || len(d.Results) != 2 {
			t.Fatalf("cost %d: %+v", cost, d)
		}
		r := d.DecidingResult()
		if r == nil || r.Name != "block" || r.Allowed || !r.Impossible || r.Limit != 0 || r.Remaining != 0 ||
			r.RetryAfter != 0 || r.Window != time.Minute || r.Reset != 35*time.Second || r.Rule != nil {
			t.Fatalf("cost %d: deciding %+v, want block refused, 0 per minute, reset 35s", cost, r)
		}
		if ip := d.Results[0]; !ip.Allowed || ip.Remaining != 100 {
			t.Errorf("cost %d: per-ip %+v, want allowed, 100 left (nothing consumed)", cost, ip)
		}
	}
	if n := l.Store().Len(); n != keys {
		t.Errorf("%d keys held after refusals, want %d", n, keys)
	}

	for _, tt := range []struct {
		name string
		il   Inline
	}{
		{"no key", Inline{WindowMs: 1000, Deny: true}},
		{"no window", Inline{Key: "k", Deny: true}},
		{"window past 366 days", Inline{Key: "k", WindowMs: 367 * 24 * 3600 * 1000, Deny: true}},
		{"a limit", Inline{Key: "k", WindowMs: 1000, Limit: 5, Deny: true}},
		{"a burst", Inline{Key: "k", WindowMs: 1000, Burst: 5, Deny: true}},
		{"an algorithm", Inline{Key: "k", WindowMs: 1000, Algorithm: "token_bucket", Deny: true}},
	} {
		in := Input{Attrs: attrs("ip=1.2.3.4"), Cost: 1, Limits: []Inline{tt.il}}
		var ile *InvalidLimitError
		if err := l.Check(now, &in, &d); !errors.As(err, &ile) || ile.Index != 0 {
			t.Errorf("%s: err %v, want an InvalidLimitError for limits[0]", tt.name, err)
		}
	}
	if err := l.Check(now, &ask, &d); err != nil || d.Results[0].Remaining != 100 {
		t.Errorf("per-ip after invalid deny limits: %+v %v, want 100 left", d.Results, err)
	}
}

// A refused check's global rules that no store asked are reported unasked (allowed,
// nothing read); one banned under its own penalty is reported banned, not unasked.
func TestUnaskedKeepsBans(t *testing.T) {
	rdb := unreachable(t)
	l := New(mustRules(t, `
rules:
  - name: exact
    mode: global
    key: user
    limit: { requests: 5, per: 1h }
    on_store_failure: closed
    penalty: { after: 1, within: 1h, ban: 1h }
  - name: other
    mode: global
    key: account
    limit: { requests: 5, per: 1h }
    on_store_failure: open
`), localbucket.NewStore(localbucket.Options{})).WithGlobal(rlsync.NewGlobal(rdb), 50*time.Millisecond)
	var d Decision
	in := Input{Attrs: attrs("user=u", "account=a"), Cost: 1}
	if err := l.Check(t0, &in, &d); err != nil || d.Allowed || !d.Results[0].BanStarted {
		t.Fatalf("closed with Redis away: %+v %v, want refused, a ban started", d, err)
	}
	if err := l.Check(t0+1, &in, &d); err != nil || d.Allowed || !d.Banned {
		t.Fatalf("banned: %+v %v", d, err)
	}
	if r := d.Results[0]; !r.Banned || r.Allowed || r.Unasked || r.RetryAfter <= 0 {
		t.Errorf("the banned rule: %+v, want banned, not unasked", r)
	}
	if r := d.Results[1]; !r.Allowed || !r.Unasked || r.Limit != 5 || r.Window != time.Hour || r.Remaining != 0 || r.RetryAfter != 0 {
		t.Errorf("the rule not asked: %+v, want unasked: allowed, 5 per hour, nothing read", r)
	}
}

// A deny limit refuses before any store is asked: a global rule of the same request
// costs no Redis round trip (here Redis is away: it would time out and its closed
// policy degrade the answer), and is reported unasked.
func TestDenyAsksNoStore(t *testing.T) {
	rdb := unreachable(t)
	l := New(mustRules(t, `
rules:
  - name: exact
    mode: global
    key: user
    limit: { requests: 5, per: 1h }
    on_store_failure: closed
  - name: blocked
    match: { user: bad }
    key: user
    limit: deny
`), localbucket.NewStore(localbucket.Options{})).WithGlobal(rlsync.NewGlobal(rdb), 50*time.Millisecond)
	var d Decision
	for _, in := range []Input{
		{Attrs: attrs("user=bad"), Cost: 1},
		{Attrs: attrs("user=bad"), Cost: 1, Limits: []Inline{{Key: "k", WindowMs: 1000, Deny: true}}},
		{Attrs: attrs("user=ok"), Cost: 1, Limits: []Inline{{Key: "k", WindowMs: 1000, Deny: true}}},
	} {
		if err := l.Check(t0, &in, &d); err != nil || d.Allowed || d.Degraded {
			t.Fatalf("%v: %+v %v, want refused, not degraded", in.Attrs, d, err)
		}
		if r := d.DecidingResult(); r == nil || !r.Impossible {
			t.Errorf("%v: deciding %+v, want the deny limit", in.Attrs, r)
		}
		if r := d.Results[0]; r.Name != "exact" || !r.Allowed || !r.Unasked || r.Degraded {
			t.Errorf("%v: exact %+v, want unasked", in.Attrs, r)
		}
	}
}

// A global rule not asked in a refused check (here a ban refuses before any store),
// whose cost is above its capacity, is reported as the refusal it would be (no store
// need be asked: it never passes), and it decides: the client is told not to retry.
// Before, it said allowed, the client retried after the ban, and was refused for good.
func TestUnaskedCostAboveCapacityRefuses(t *testing.T) {
	rdb := unreachable(t)
	l := New(mustRules(t, `
rules:
  - name: local
    key: user
    limit: { requests: 10, per: 1h }
    penalty: { after: 1, within: 1h, ban: 1m }
  - name: exact
    mode: global
    key: user
    limit: { requests: 5, per: 1h }
    on_store_failure: open
`), localbucket.NewStore(localbucket.Options{})).WithGlobal(rlsync.NewGlobal(rdb), 50*time.Millisecond)
	var d Decision
	for i, cost := range []uint64{5, 5, 1} { // the third is refused, and starts a ban
		in := Input{Attrs: attrs("user=u"), Cost: cost}
		if err := l.Check(t0+int64(i), &in, &d); err != nil {
			t.Fatal(err)
		}
	}
	in := Input{Attrs: attrs("user=u")}
	if !d.Results[0].BanStarted {
		t.Fatalf("%+v: want a ban started", d.Results[0])
	}
	in.Cost = 6
	if err := l.Check(t0+3, &in, &d); err != nil || d.Allowed || !d.Results[0].Banned {
		t.Fatalf("%+v %v, want refused by the ban", d, err)
	}
	if r := d.Results[1]; r.Name != "exact" || r.Allowed || !r.Impossible || r.Unasked || r.RetryAfter != 0 {
		t.Errorf("exact: %+v, want refused for good, not unasked", r)
	}
	if r := d.DecidingResult(); r == nil || r.Name != "exact" {
		t.Errorf("deciding %+v, want exact (it never passes)", r)
	}
	// A cost the global rule can take: still unasked.
	in.Cost = 2
	if err := l.Check(t0+4, &in, &d); err != nil || d.Allowed || !d.Results[1].Unasked || !d.Results[1].Allowed {
		t.Fatalf("cost 2: %+v %v, want exact unasked", d.Results, err)
	}
}
