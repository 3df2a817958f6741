package rules

import (
	"strings"
	"testing"
	"time"
)

func TestConcurrencyRule(t *testing.T) {
	set, err := Parse("c.yaml", []byte(`plans:
  gold: { exports: 5 }
rules:
  - name: exports
    match: { path: "/v1/exports/**" }
    key: user
    concurrency: { max: 2, lease: 45s }
  - name: provider
    key: tenant
    concurrency: { max: 50 }
    shadow: true
    split: 2
`))
	if err != nil {
		t.Fatal(err)
	}
	ex, pr := set.Rules[0], set.Rules[1]
	if !ex.Concurrency || ex.Requests != 2 || ex.Per != 45*time.Second {
		t.Errorf("exports: concurrency %v max %d lease %v; want true 2 45s", ex.Concurrency, ex.Requests, ex.Per)
	}
	if lim, _ := ex.LimitFor("", false); lim.Requests() != 2 || lim.Window() != 45*time.Second {
		t.Errorf("exports default limit %d per %v; want 2 per 45s", lim.Requests(), lim.Window())
	}
	if lim, _ := ex.LimitFor("gold", true); lim.Requests() != 5 || lim.Window() != 45*time.Second {
		t.Errorf("exports gold limit %d per %v; want the plan's max 5 per 45s", lim.Requests(), lim.Window())
	}
	if pr.Per != DefaultLease || !pr.Shadow || pr.Split != 2 || pr.Mode != ModeLocal {
		t.Errorf("provider: lease %v shadow %v split %d mode %v; want 30s true 2 local", pr.Per, pr.Shadow, pr.Split, pr.Mode)
	}
	if lim, _ := pr.SplitLimitFor("", false, 2); lim.Requests() != 25 {
		t.Errorf("provider split in 2: max %d; want 25", lim.Requests())
	}
}

// TestConcurrencyRuleModes: a concurrency rule takes every mode (hybrid and the default
// mean global when the daemon has Redis; the limiter resolves them).
func TestConcurrencyRuleModes(t *testing.T) {
	for _, m := range []struct {
		yaml string
		want Mode
	}{{"", ModeDefault}, {"    mode: local\n", ModeLocal}, {"    mode: hybrid\n", ModeHybrid}, {"    mode: global\n", ModeGlobal}} {
		set, err := Parse("c.yaml", []byte("rules:\n  - name: c\n    key: user\n    concurrency: { max: 3 }\n"+m.yaml+"    on_store_failure: closed\n"))
		if err != nil {
			t.Fatalf("%q: %v", m.yaml, err)
		}
		if r := set.Rules[0]; r.Mode != m.want || r.OnStoreFailure != FailClosed {
			t.Errorf("%q: mode %v, on_store_failure %v; want %v, closed", m.yaml, r.Mode, r.OnStoreFailure, m.want)
		}
	}
}

func TestConcurrencyRuleErrors(t *testing.T) {
	const head = "rules:\n  - name: c\n    key: user\n"
	for _, tc := range []struct{ name, rule, want string }{
		{"both", "    limit: { requests: 1, per: 1s }\n    concurrency: { max: 2 }\n", "c.yaml:4: rules[0].limit: a rule has limit or concurrency, not both"},
		{"no max", "    concurrency: { lease: 10s }\n", "c.yaml:4: rules[0].concurrency.max: missing (required)"},
		{"zero max", "    concurrency: { max: 0 }\n", "c.yaml:4: rules[0].concurrency.max: must be at least 1, got 0"},
		{"long lease", "    concurrency: { max: 1, lease: 2h }\n", `c.yaml:4: rules[0].concurrency.lease: "2h" is longer than the longest lease, 1h`},
		{"bad lease", "    concurrency: { max: 1, lease: soon }\n", `c.yaml:4: rules[0].concurrency.lease: "soon" is not a duration`},
		{"unknown field", "    concurrency: { max: 1, ttl: 1s }\n", `c.yaml:4: rules[0].concurrency: unknown field "ttl" (valid: max, lease)`},
		{"not mapping", "    concurrency: 3\n", "c.yaml:4: rules[0].concurrency: expected a mapping"},
		{"algorithm", "    algorithm: fixed_window\n    concurrency: { max: 1 }\n", "c.yaml:4: rules[0].algorithm: a concurrency rule counts leases in flight; it has no algorithm"},
		{"global split", "    concurrency: { max: 4 }\n    mode: global\n    split: 2\n", "rules[0].split: split divides a local limit among daemons; mode global shares one budget already"},
		{"max too large", "    concurrency: { max: 4294967296 }\n", "c.yaml:4: rules[0].concurrency.max: requests 4294967296 exceed the maximum of 4294967295"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse("c.yaml", []byte(head+tc.rule))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v; want it to contain %q", err, tc.want)
			}
		})
	}
}

// TestConcurrencyRuleLargeMax: max is a count of slots, not a rate: any max up to
// 4,294,967,295 is taken whatever the lease, with its plans. Built as a token bucket of
// max per lease, 4,294,967,295 with the default 30s lease (or 200,000,000 for 1s) was
// refused as a rate "too high to keep", and named rules[0].limit, a field the rule has not.
func TestConcurrencyRuleLargeMax(t *testing.T) {
	for _, rule := range []string{
		"    concurrency: { max: 4294967295 }\n",
		"    concurrency: { max: 1000000000, lease: 1ms }\n",
		"    concurrency: { max: 200000000, lease: 1s }\n    plans: { gold: 4000000000 }\n",
	} {
		set, err := Parse("c.yaml", []byte("rules:\n  - name: c\n    key: user\n"+rule))
		if err != nil {
			t.Fatalf("%q: %v", rule, err)
		}
		r := set.Rules[0]
		lim, _ := r.LimitFor("", false)
		if lim.Requests() != r.Requests || lim.Window() != r.Per {
			t.Fatalf("%q: limit %d per %v, want %d per %v", rule, lim.Requests(), lim.Window(), r.Requests, r.Per)
		}
		if gold, _ := r.LimitFor("gold", true); strings.Contains(rule, "gold") && gold.Requests() != 4000000000 {
			t.Fatalf("gold plan: %d", gold.Requests())
		}
	}
}
