package limiter

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// manyRules is n rules that the benchmark request does not match, of the shapes a large
// API's config has (per-endpoint limits by method and path prefix, per-endpoint uploads
// by glob, per-user overrides), written before benchRules' two rules that it does match,
// so a linear matcher would walk all n first.
func manyRules(n int) string {
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range n {
		switch i % 5 {
		case 0, 1, 2:
			fmt.Fprintf(&b, "  - { name: r%d, match: { method: GET, path: \"/v1/svc%d/**\" }, key: user, limit: { requests: 100, per: 1m } }\n", i, i)
		case 3:
			fmt.Fprintf(&b, "  - { name: r%d, match: { method: [POST, PUT], path: \"/v1/svc%d/*/files/*.png\" }, key: user, limit: { requests: 100, per: 1m } }\n", i, i)
		default:
			fmt.Fprintf(&b, "  - { name: r%d, match: { user: u%d }, key: user, limit: { requests: 100, per: 1m } }\n", i, i)
		}
	}
	return b.String() + strings.TrimPrefix(benchRules, "\nrules:\n")
}

// The rule set of the benchmark matches the same two rules as benchRules alone.
func TestManyRulesMatchesTwo(t *testing.T) {
	l := newLimiter(t, manyRules(5000))
	in := Input{Attrs: attrs("method=POST", "path=/v1/events/7/holds", "user=u-12345", "ip=203.0.113.9"), Cost: 1}
	var d Decision
	if err := l.Check(t0, &in, &d); err != nil || len(d.Results) != 2 || d.Results[0].Name != "per-ip" || d.Results[1].Name != "holds" {
		t.Fatalf("err %v, results %+v", err, d.Results)
	}
	if len(l.Rules().Rules) != 5003 {
		t.Fatalf("%d rules", len(l.Rules().Rules))
	}
}

// BenchmarkCheck: one check matching 2 rules, in a set of those 2 rules (and benchRules'
// third, /login) and in a set of 5,000 more; both 0 allocs. Their ratio is best read
// from BenchmarkCheckRuleCountRatio, which alternates the two in one run.
func BenchmarkCheck(b *testing.B) {
	for _, n := range []int{0, 5000} {
		b.Run(fmt.Sprintf("rules=%d", n+3), func(b *testing.B) {
			l := newLimiter(b, manyRules(n))
			in := Input{Attrs: attrs("method=POST", "path=/v1/events/7/holds", "user=u-12345", "ip=203.0.113.9"), Cost: 1}
			var d Decision
			b.ReportAllocs()
			for b.Loop() {
				if err := l.Check(t0, &in, &d); err != nil || len(d.Results) != 2 || !d.Allowed {
					b.Fatal(err, d)
				}
			}
		})
	}
}

// BenchmarkCheckRuleCountRatio alternates batches of checks on the 5,003-rule limiter and
// the 3-rule one in the same run and reports the median of the per-batch time ratios
// (target ≤ 1.2), robust to a machine shared with other work. One op is one pair of
// batches.
func BenchmarkCheckRuleCountRatio(b *testing.B) {
	const batch = 2000
	small, large := newLimiter(b, manyRules(0)), newLimiter(b, manyRules(5000))
	in := Input{Attrs: attrs("method=POST", "path=/v1/events/7/holds", "user=u-12345", "ip=203.0.113.9"), Cost: 1}
	var d Decision
	run := func(l *Limiter) time.Duration {
		start := time.Now()
		for range batch {
			if err := l.Check(t0, &in, &d); err != nil || len(d.Results) != 2 {
				b.Fatal(err, d)
			}
		}
		return time.Since(start)
	}
	run(small)
	run(large)
	var ratios []float64
	var ts, tl time.Duration
	b.ReportAllocs()
	for b.Loop() {
		s := run(small)
		l := run(large)
		ts += s
		tl += l
		ratios = append(ratios, float64(l)/float64(s))
	}
	slices.Sort(ratios)
	b.ReportMetric(ratios[len(ratios)/2], "ratio-5003/3")
	b.ReportMetric(float64(ts.Nanoseconds())/float64(b.N*batch), "ns/check-3rules")
	b.ReportMetric(float64(tl.Nanoseconds())/float64(b.N*batch), "ns/check-5003rules")
}

// The claim behind validate's "never decides" warning (rules.Set.Warnings): when rule b
// has rule a's match, key, algorithm and per, and a's limit is at least as tight, b never
// rejects a request that a allows. Random limits, costs and times, local mode, every
// algorithm; the warning must be given for each pair drawn.
func TestShadowedRuleNeverDecides(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		alg := rapid.SampledFrom([]string{"token_bucket", "sliding_window", "fixed_window"}).Draw(t, "algorithm")
		per := rapid.SampledFrom([]string{"1s", "10s", "1m"}).Draw(t, "per")
		reqA := rapid.Uint64Range(1, 20).Draw(t, "requests-a")
		reqB := reqA + rapid.Uint64Range(0, 20).Draw(t, "more-b")
		limA := fmt.Sprintf("{ requests: %d, per: %s }", reqA, per)
		limB := fmt.Sprintf("{ requests: %d, per: %s }", reqB, per)
		if alg == "token_bucket" && rapid.Bool().Draw(t, "bursts") {
			burstA := reqA + rapid.Uint64Range(0, 10).Draw(t, "burst-a")
			burstB := max(burstA+rapid.Uint64Range(0, 10).Draw(t, "burst-b"), reqB)
			limA = fmt.Sprintf("{ requests: %d, per: %s, burst: %d }", reqA, per, burstA)
			limB = fmt.Sprintf("{ requests: %d, per: %s, burst: %d }", reqB, per, burstB)
		}
		src := fmt.Sprintf(`rules:
  - { name: a, match: { method: [GET, HEAD] }, key: user, algorithm: %s, limit: %s }
  - { name: b, match: { method: [GET, HEAD] }, key: user, algorithm: %s, limit: %s }
`, alg, limA, alg, limB)
		set, err := rules.Parse("shadow.yaml", []byte(src))
		if err != nil {
			t.Fatalf("%v\n%s", err, src)
		}
		if ws := set.Warnings(); len(ws) != 1 || !strings.Contains(ws[0].Error(), "never decides") {
			t.Fatalf("warnings %v for\n%s", ws, src)
		}
		l := New(set, localbucket.NewStore(localbucket.Options{}))
		var d Decision
		now := t0
		for i := range rapid.IntRange(1, 200).Draw(t, "checks") {
			now += rapid.Int64Range(0, int64(3*time.Second)).Draw(t, "step")
			in := Input{Attrs: attrs("method=GET", "user=u"), Cost: rapid.Uint64Range(1, 3).Draw(t, "cost")}
			if err := l.Check(now, &in, &d); err != nil || len(d.Results) != 2 {
				t.Fatalf("check %d: %v, %+v", i, err, d.Results)
			}
			if a, b := d.Results[0], d.Results[1]; !b.Allowed && a.Allowed {
				t.Fatalf("check %d: b rejects what a allows: a %+v, b %+v\n%s", i, a, b, src)
			}
		}
	})
}
