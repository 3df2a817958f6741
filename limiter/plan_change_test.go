package limiter

import (
	"fmt"
	"testing"
	"time"

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

// TestReloadBurstOnlyKeepsUnitsUsed pins what the README says of a reload that changes
// a token bucket's burst alone in local mode: the units used are not cut to a whole
// bucket, as they are when requests changes (Limit.Rescale: the state's kind holds the
// rate, not the burst). 10 per hour, burst 20, 15 used, burst lowered to 5: the next
// request waits for 11 tokens (66 minutes), not 1. A change that makes the cut here too
// must change the README with this test.
func TestReloadBurstOnlyKeepsUnitsUsed(t *testing.T) {
	rule := func(burst int) string {
		return fmt.Sprintf("rules:\n  - name: api\n    key: user\n    limit: { requests: 10, per: 1h, burst: %d }\n", burst)
	}
	l := newLimiter(t, rule(20))
	var d Decision
	in := Input{Attrs: attrs("user=u"), Cost: 1}
	for i := 0; i < 15; i++ {
		if err := l.Check(t0, &in, &d); err != nil || !d.Allowed {
			t.Fatalf("request %d: %v %+v", i, err, d.Results)
		}
	}
	l.SetRules(mustRules(t, rule(5)))
	if err := l.Check(t0, &in, &d); err != nil || d.Allowed {
		t.Fatalf("after the reload: %v %+v, want refused", err, d.Results)
	}
	if got, want := d.Results[0].RetryAfter, 11*6*time.Minute; got != want {
		t.Fatalf("after the reload: retry after %v, want %v (the units used kept, not cut)", got, want)
	}
}
