package limiter

import (
	"slices"
	"strings"
	"testing"
)

const partRules = `
rules:
  - name: per-to
    match: { domain: msg, k: to }
    key: to
    limit: { requests: 3, per: 1m }
  - name: marketing
    match: { domain: msg, k: "type,to", type: marketing }
    key: [type, to]
    limit: { requests: 1, per: 1m }
  - name: free
    match: { domain: msg, k: ldap }
    key: ldap
    limit: unlimited
  - name: blocked
    match: { domain: msg, k: ip, ip: 50.0.0.5 }
    key: ip
    limit: deny
  - name: specific
    match: { domain: msg, k: "a,u", a: "1" }
    key: u
    limit: { requests: 1, per: 1m }
  - name: wider
    match: { domain: msg, k: "b,u", b: "2" }
    key: u
    limit: { requests: 2, per: 1m }
    replaces: [specific]
`

func part(cost uint64, kv ...string) Part { return Part{Attrs: attrs(kv...), Cost: cost} }

// TestParts walks several-part checks through time: each part's rules are charged the
// part's cost, all-or-nothing across parts; replaced rules do not apply; unlimited and
// deny rules report as such.
func TestParts(t *testing.T) {
	l := newLimiter(t, partRules)
	var d Decision
	check := func(parts ...Part) {
		t.Helper()
		if err := l.Check(t0, &Input{Parts: parts}, &d); err != nil {
			t.Fatal(err)
		}
	}
	mk := part(1, "domain=msg", "k=type,to", "type=marketing", "to=555")
	to := part(1, "domain=msg", "k=to", "to=555")

	check(mk, to)
	if !d.Allowed || len(d.Results) != 2 || d.Results[0].Part != 0 || d.Results[0].Name != "marketing" || d.Results[1].Part != 1 || d.Results[1].Remaining != 2 {
		t.Fatalf("first: %+v", d)
	}
	// marketing is spent: the whole check is rejected and per-to is not charged.
	check(mk, to)
	if d.Allowed || d.Results[0].Allowed || !d.Results[1].Allowed || d.Results[1].Remaining != 2 {
		t.Fatalf("all-or-nothing: %+v", d)
	}
	check(to)
	if !d.Allowed || d.Results[0].Remaining != 1 {
		t.Fatalf("per-to after a rejected check: %+v", d.Results)
	}
	// A part's own cost.
	check(part(2, "domain=msg", "k=to", "to=777"))
	if !d.Allowed || d.Results[0].Remaining != 1 {
		t.Fatalf("cost 2: %+v", d.Results)
	}

	check(part(1, "domain=msg", "k=ldap", "ldap=x"), part(1, "domain=msg", "k=to", "to=888"))
	if !d.Allowed || len(d.Unlimited) != 1 || d.Unlimited[0] != 0 || len(d.Results) != 1 || d.Results[0].Part != 1 {
		t.Fatalf("unlimited: %+v", d)
	}

	check(part(1, "domain=msg", "k=ip", "ip=50.0.0.5"))
	if d.Allowed || !d.Results[0].Impossible || d.Results[0].Limit != 0 || d.Results[0].Remaining != 0 || d.Deciding != 0 {
		t.Fatalf("deny: %+v", d)
	}
	check(part(1, "domain=msg", "k=ip", "ip=50.0.0.6"))
	if !d.Allowed || len(d.Results) != 0 {
		t.Fatalf("not denied: %+v", d)
	}

	// replaces: with both matched, only "wider" applies, and "specific" is untouched.
	a := part(1, "domain=msg", "k=a,u", "a=1", "u=bk")
	b := part(1, "domain=msg", "k=b,u", "b=2", "u=bk")
	for range 2 {
		check(a, b)
		if !d.Allowed || len(d.Results) != 1 || d.Results[0].Name != "wider" || d.Results[0].Part != 1 {
			t.Fatalf("replaces: %+v", d)
		}
	}
	check(a)
	if !d.Allowed || d.Results[0].Name != "specific" || d.Results[0].Remaining != 0 {
		t.Fatalf("specific was charged while replaced: %+v", d.Results)
	}

	// An override part: its inline limit alone decides it.
	ov := Part{Attrs: attrs("domain=msg", "k=to", "to=555"), Cost: 1, NoRules: true,
		Limits: []Inline{{Key: "msg|to=555", Limit: 1, WindowMs: 60000, Algorithm: "fixed_window"}}}
	check(ov)
	if !d.Allowed || len(d.Results) != 1 || d.Results[0].Rule != nil || d.Results[0].Limit != 1 {
		t.Fatalf("override: %+v", d.Results)
	}
	check(ov)
	if d.Allowed {
		t.Fatalf("override not enforced: %+v", d.Results)
	}
}

// BenchmarkCheckParts is one single-part check, as the Envoy transport makes them.
func BenchmarkCheckParts(b *testing.B) {
	l := newLimiter(b, partRules)
	var d Decision
	in := Input{Parts: []Part{part(1, "domain=msg", "k=to", "to=555")}}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		_ = l.Check(t0+int64(i)*int64(1e9), &in, &d)
	}
}

// TestShadowReplacesNothing: a shadow rule that replaces another leaves it deciding (a
// dry run changes no decision); enforced, it replaces it. Before, the narrower rule shipped
// in shadow with its replaces took the broader limit off the requests it matched.
func TestShadowReplacesNothing(t *testing.T) {
	const src = `
rules:
  - name: broad
    match: { path: "/r/**" }
    key: user
    limit: { requests: 3, per: 1m }
  - name: narrow
    match: { path: /r/special }
    key: user
    limit: { requests: 10, per: 1m }
    replaces: [broad]
    shadow: true
`
	for _, shadow := range []bool{true, false} {
		yaml := src
		if !shadow {
			yaml = strings.Replace(src, "    shadow: true\n", "", 1)
		}
		l := newLimiter(t, yaml)
		var d Decision
		for i := range 4 {
			if err := l.Check(t0, &Input{Attrs: attrs("path=/r/special", "user=q"), Cost: 1}, &d); err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, r := range d.Results {
				names = append(names, r.Name)
			}
			switch {
			case shadow && (d.Allowed != (i < 3) || !slices.Equal(names, []string{"broad", "narrow"}) || i == 3 && d.DecidingResult().Name != "broad"):
				t.Fatalf("narrow in shadow, request %d: allowed %v, rules %v, want broad deciding (3 per minute)", i+1, d.Allowed, names)
			case !shadow && (!d.Allowed || !slices.Equal(names, []string{"narrow"})):
				t.Fatalf("narrow enforced, request %d: allowed %v, rules %v, want narrow alone (10 per minute)", i+1, d.Allowed, names)
			}
		}
	}
}

// TestReplacesOnlyWhenApplying: a rule whose key attribute is missing does not apply,
// so it replaces nothing. Before, a client that left out the api_key of a per-key rule
// replacing per-user was limited by neither.
func TestReplacesOnlyWhenApplying(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: per-user
    key: user
    limit: { requests: 2, per: 1h }
  - name: x-per-key
    match: { path: /x }
    key: [api_key, user]
    replaces: [per-user]
    limit: { requests: 100, per: 1h }
`)
	var d Decision
	for _, c := range []struct {
		attrs []string
		want  []string // the rules charged
	}{
		{[]string{"path=/x", "user=m"}, []string{"per-user"}},               // no api_key: per-user decides
		{[]string{"path=/x", "api_key=k"}, nil},                             // no user: neither applies
		{[]string{"path=/x", "user=m", "api_key=k"}, []string{"x-per-key"}}, // both keys: replaced
		{[]string{"path=/y", "user=m", "api_key=k"}, []string{"per-user"}},  // conditions fail
	} {
		if err := l.Check(t0, &Input{Attrs: attrs(c.attrs...), Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, r := range d.Results {
			names = append(names, r.Name)
		}
		if !slices.Equal(names, c.want) {
			t.Errorf("%v: rules %v, want %v", c.attrs, names, c.want)
		}
	}
	// per-user counted the two checks it decided, and refuses the third.
	if err := l.Check(t0, &Input{Attrs: attrs("path=/x", "user=m"), Cost: 1}, &d); err != nil {
		t.Fatal(err)
	}
	if d.Allowed || d.DecidingResult().Name != "per-user" {
		t.Fatalf("the third check of user m without an api_key: allowed %v, want refused by per-user", d.Allowed)
	}
}
