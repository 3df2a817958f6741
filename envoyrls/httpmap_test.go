package envoyrls

import (
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// envoyHeaderVector is one entry of clients/testdata/http_headers.json, the fields the
// Envoy answer's headers depend on.
type envoyHeaderVector struct {
	Name     string `json:"name"`
	Decision struct {
		Allowed      bool   `json:"allowed"`
		Rule         string `json:"rule"`
		Limit        uint64 `json:"limit"`
		Remaining    uint64 `json:"remaining"`
		ResetMs      uint64 `json:"reset_ms"`
		RetryAfterMs uint64 `json:"retry_after_ms"`
		Reason       string `json:"reason"`
		Rules        []struct {
			Name         string `json:"name"`
			Limit        uint64 `json:"limit"`
			WindowMs     uint64 `json:"window_ms"`
			Remaining    uint64 `json:"remaining"`
			ResetMs      uint64 `json:"reset_ms"`
			RetryAfterMs uint64 `json:"retry_after_ms"`
			Allowed      bool   `json:"allowed"`
			Shadow       bool   `json:"shadow"`
			Warning      bool   `json:"warning"`
			Unasked      bool   `json:"unasked"`
			Concurrency  bool   `json:"concurrency"`
		} `json:"rules"`
	} `json:"decision"`
	Headers map[string]string `json:"headers"`
}

// decision is the vector's decision as the limiter would give it, each rule the result
// of its own descriptor, and whether it can: a vector whose deciding rule is not among
// its rules (the clients then write the top-level figures) has no limiter.Decision.
func (v *envoyHeaderVector) decision() (limiter.Decision, bool) {
	vd := &v.Decision
	d := limiter.Decision{Allowed: vd.Allowed, Deciding: -1}
	ms := func(n uint64) time.Duration { return time.Duration(n) * time.Millisecond }
	for i, r := range vd.Rules {
		res := limiter.Result{Name: r.Name, Limit: r.Limit, Window: ms(r.WindowMs), Remaining: r.Remaining,
			Reset: ms(r.ResetMs), RetryAfter: ms(r.RetryAfterMs), Allowed: r.Allowed, Shadow: r.Shadow,
			Warning: r.Warning, Unasked: r.Unasked, Part: i}
		if r.Concurrency {
			res.Rule = &rules.Rule{Name: r.Name, Concurrency: true}
		}
		d.Results = append(d.Results, res)
	}
	// The deciding rule as the clients find it (decidingRule): the first non-shadow
	// result of its name with the top-level figures, else the first of its name.
	for i := range d.Results {
		r := &d.Results[i]
		if r.Shadow || r.Name != vd.Rule {
			continue
		}
		if r.Allowed == vd.Allowed && r.Limit == vd.Limit && r.Remaining == vd.Remaining &&
			limiter.CeilMs(r.Reset) == vd.ResetMs && limiter.CeilMs(r.RetryAfter) == vd.RetryAfterMs {
			d.Deciding = i
			break
		}
		if d.Deciding < 0 {
			d.Deciding = i
		}
	}
	if vd.Rule != "" && d.Deciding < 0 {
		return d, false
	}
	// Nor does a vector of two rules of one name (deciding-rule-shares-its-name): the
	// clients write each rule the daemon lists, where the Envoy answer writes one item
	// per name, a rule that several descriptors hit (TestHeadersOneItemPerRule).
	for i := range d.Results {
		for j := range i {
			if d.Results[j].Name == d.Results[i].Name && !d.Results[i].Shadow && !d.Results[j].Shadow {
				return d, false
			}
		}
	}
	if dr := d.DecidingResult(); dr != nil && vd.Reason == proto.ReasonCostExceedsCapacity {
		dr.Impossible = true
	}
	return d, true
}

// The Envoy answer's RateLimit headers (response_headers_to_add) are those the clients
// write for the same decision: every vector of clients/testdata/http_headers.json whose
// deciding rule is among its rules, each rule from its own descriptor. Before, the Envoy
// answer left an unasked rule out of RateLimit-Policy too
// (rejected-unasked-kept-in-policy) and listed rules tied on remaining in rules order,
// per-second before per-day (allowed-tie-longer-reset-first, allowed-tie-keeps-order).
func TestHeaderVectors(t *testing.T) {
	b, err := os.ReadFile("../clients/testdata/http_headers.json")
	if err != nil {
		t.Fatal(err)
	}
	var vs []envoyHeaderVector
	if err := json.Unmarshal(b, &vs); err != nil {
		t.Fatalf("http_headers.json: %v", err)
	}
	s := testServer(t)
	ran := 0
	for _, v := range vs {
		d, ok := v.decision()
		if !ok {
			continue
		}
		ran++
		sc := new(scratch)
		sc.d = d
		s.response(len(d.Results), sc)
		got := map[string]string{}
		for _, h := range sc.ans.headers {
			got[h.key] = string(h.value)
		}
		for _, k := range []string{"RateLimit-Policy", "RateLimit", "RateLimit-Warning", "Retry-After"} {
			if got[k] != v.Headers[k] {
				t.Errorf("%s: %s %q, want %q", v.Name, k, got[k], v.Headers[k])
			}
		}
	}
	if ran < 20 {
		t.Fatalf("%d of %d vectors mapped", ran, len(vs))
	}
}

// A rule that several descriptors hit is one item, also with the mapping's newer
// choices: allowed, when a later descriptor's per-day key ties on remaining with the
// deciding per-second key and resets later, per-day comes first, and per-second is its
// deciding key's item (not its other key's, as many left); an unasked rule that two
// descriptors hit keeps one RateLimit-Policy item, and a rule asked for one descriptor
// and unasked for another is its asked result's item.
func TestHeadersOneItemPerRuleTiesAndUnasked(t *testing.T) {
	s := testServer(t)
	run := func(d limiter.Decision) (pol, cur string) {
		t.Helper()
		sc := new(scratch)
		sc.d = d
		s.response(len(d.Results), sc)
		for _, h := range sc.ans.headers {
			switch h.key {
			case "RateLimit-Policy":
				pol = string(h.value)
			case "RateLimit":
				cur = string(h.value)
			}
		}
		return pol, cur
	}
	pol, cur := run(limiter.Decision{Allowed: true, Deciding: 0, Results: []limiter.Result{
		{Name: "per-second", Limit: 10, Window: time.Second, Remaining: 1, Reset: 900 * time.Millisecond, Allowed: true, Part: 0},
		{Name: "per-second", Limit: 10, Window: time.Second, Remaining: 1, Reset: 200 * time.Millisecond, Allowed: true, Part: 1},
		{Name: "per-day", Limit: 1000, Window: 24 * time.Hour, Remaining: 5, Reset: 12 * time.Hour, Allowed: true, Part: 0},
		{Name: "per-day", Limit: 1000, Window: 24 * time.Hour, Remaining: 1, Reset: 6 * time.Hour, Allowed: true, Part: 1},
	}})
	if want := `"per-day";q=1000;w=86400, "per-second";q=10;w=1`; pol != want {
		t.Errorf("allowed tie: RateLimit-Policy %q, want %q", pol, want)
	}
	if want := `"per-day";r=1;t=21600, "per-second";r=1;t=1`; cur != want {
		t.Errorf("allowed tie: RateLimit %q, want %q", cur, want)
	}

	pol, cur = run(limiter.Decision{Allowed: false, Deciding: 1, Results: []limiter.Result{
		{Name: "glob", Limit: 5, Window: time.Hour, Allowed: true, Unasked: true, Part: 0},
		{Name: "hyb", Limit: 1, Window: time.Minute, Reset: time.Minute, RetryAfter: time.Minute, Part: 0},
		{Name: "glob", Limit: 5, Window: time.Hour, Allowed: true, Unasked: true, Part: 1},
		{Name: "mixed", Limit: 7, Window: time.Hour, Allowed: true, Unasked: true, Part: 0},
		{Name: "mixed", Limit: 7, Window: time.Hour, Remaining: 3, Reset: time.Hour, Allowed: true, Part: 1},
	}})
	if want := `"hyb";q=1;w=60, "glob";q=5;w=3600, "mixed";q=7;w=3600`; pol != want {
		t.Errorf("unasked: RateLimit-Policy %q, want %q", pol, want)
	}
	if want := `"hyb";r=0;t=60, "mixed";r=3;t=3600`; cur != want {
		t.Errorf("unasked: RateLimit %q, want %q", cur, want)
	}
	if strings.Count(pol, "glob") != 1 {
		t.Errorf("unasked: RateLimit-Policy %q, want glob once", pol)
	}
}
