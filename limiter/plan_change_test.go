package limiter

import (
	"fmt"
	"testing"

	"github.com/rlsidecar/rlsidecar/rules"
)

// TestPlanChangeKeepsUnitsUsed pins what the README says of a client whose plan changes:
// the plan is not part of its key, so the units it used count against the new plan's
// limit (3 per hour, partner 10x: 3 used on the free plan leave 27 as partner, and none
// back on free); a request without a plan, or with a plan the rule does not have, gets
// the rule's requests; one exempted as unlimited uses nothing.
func TestPlanChangeKeepsUnitsUsed(t *testing.T) {
	for _, alg := range []string{"token_bucket", "sliding_window", "fixed_window"} {
		t.Run(alg, func(t *testing.T) {
			l := newLimiter(t, fmt.Sprintf(`
plans:
  partner: 10x
  internal: unlimited
rules:
  - name: r
    key: user
    algorithm: %s
    limit: { requests: 3, per: 1h }
`, alg))
			now := t0
			admitted := func(user, plan string, n int) int {
				t.Helper()
				got := 0
				for i := 0; i < n; i++ {
					in := Input{Attrs: attrs("user=" + user), Cost: 1}
					if plan != "" {
						in.Attrs = append(in.Attrs, rules.Attr{Name: "plan", Value: plan})
					}
					var d Decision
					if err := l.Check(now, &in, &d); err != nil {
						t.Fatal(err)
					}
					if d.Allowed {
						got++
					}
					now += 1e6 // 1 ms apart
				}
				return got
			}
			if got := admitted("a", "", 5); got != 3 {
				t.Fatalf("no plan: %d admitted, want the rule's 3", got)
			}
			if got := admitted("a", "partner", 40); got != 27 {
				t.Fatalf("free plan's 3 used, then partner: %d admitted, want 27 more", got)
			}
			if got := admitted("a", "", 3); got != 0 {
				t.Fatalf("back on the free plan after 30 used: %d admitted, want 0", got)
			}
			if got := admitted("b", "gold", 5); got != 3 {
				t.Fatalf("a plan the rule does not have: %d admitted, want the rule's 3", got)
			}
			if got := admitted("c", "internal", 5); got != 5 {
				t.Fatalf("unlimited: %d admitted, want all 5", got)
			}
			if got := admitted("c", "", 5); got != 3 {
				t.Fatalf("after unlimited requests, free: %d admitted, want 3 (unlimited uses nothing)", got)
			}
		})
	}
}
