package limiter

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
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
