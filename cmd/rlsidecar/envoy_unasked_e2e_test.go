package main

import (
	"strings"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/rlsidecar/rlsidecar/envoyrls"
	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// envoyUnaskedRules: per-ip is hybrid (the default with Redis), decided before the global
// rules, which a call it refuses leaves unasked.
const envoyUnaskedRules = `
rules:
  - name: per-ip
    match: { domain: edge, descriptor: remote_address }
    key: [domain, remote_address]
    algorithm: fixed_window
    limit: { requests: 1, per: 1h }
  - name: per-tenant
    match: { domain: edge, descriptor: tenant }
    key: [domain, tenant]
    mode: global
    algorithm: fixed_window
    limit: { requests: 5, per: 1h }
  - name: per-user
    match: { domain: edge, descriptor: user }
    key: [domain, user]
    mode: global
    algorithm: fixed_window
    limit: { requests: 5, per: 1h }
  - name: per-user-local
    match: { domain: edge, descriptor: user }
    key: [domain, user]
    mode: local
    limit: { requests: 100, per: 1h }
`

// xRateLimit is what Envoy's rate limit filter writes in X-RateLimit-Limit (its first
// figure), X-RateLimit-Remaining and X-RateLimit-Reset under enable_x_ratelimit_headers:
// DRAFT_VERSION_03, from the status of least limit_remaining among those with a
// current_limit (the first of equals), its reset truncated to whole seconds
// (XRateLimitHeaderUtils::populateHeaders); ok false when no status has a current_limit.
func xRateLimit(resp *rlsv3.RateLimitResponse) (limit, remaining uint32, reset int64, ok bool) {
	var min *rlsv3.RateLimitResponse_DescriptorStatus
	for _, st := range resp.Statuses {
		if st.CurrentLimit != nil && (min == nil || st.LimitRemaining < min.LimitRemaining) {
			min = st
		}
	}
	if min == nil {
		return 0, 0, 0, false
	}
	return min.CurrentLimit.RequestsPerUnit, min.LimitRemaining, min.DurationUntilReset.GetSeconds(), true
}

// In a refused call, a descriptor whose global rule was not asked reports no
// current_limit (or the figures of a rule that was asked), not that rule with 0
// remaining and a reset of 0: Envoy's x-ratelimit headers, which take the status of
// least remaining, named the unasked rule and sent X-RateLimit-Reset: 0 on a 429 whose
// deciding rule resets in up to an hour.
func TestE2EEnvoyRLSUnaskedStatus(t *testing.T) {
	srv := redistest.StartStandalone(t)
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) {
			// Redis given long timeouts, as TestE2EUnaskedGlobalRuleNotRefused gives it:
			// a hybrid key's exact sync cut short on a loaded machine falls back to its
			// local bucket, and the global rules are then asked.
			f := startEnvoyDaemon(t, envoyUnaskedRules, "--envoy-rls-transport", tr, "--redis", "redis://"+srv.Addr,
				"--sync-interval", "50ms", "--global-timeout", "2s", "--redis-timeout", "2s")
			clearOfWindowEnd(t, time.Hour, 30*time.Second)
			ip := desc("remote_address=192.0.2.1-" + tr)
			first := f.call(t, "edge", 0, desc("tenant=t1-"+tr), desc("user=u1-"+tr), ip)
			checkStatuses(t, first, ok,
				wantStatus{code: ok, limit: true, name: "per-tenant", rpu: 5, unit: rlsv3.RateLimitResponse_RateLimit_HOUR, remaining: 4},
				wantStatus{code: ok, limit: true, name: "per-user", rpu: 5, unit: rlsv3.RateLimitResponse_RateLimit_HOUR, remaining: 4},
				wantStatus{code: ok, limit: true, name: "per-ip", rpu: 1, unit: rlsv3.RateLimitResponse_RateLimit_HOUR, remaining: 0})

			// per-ip refuses: per-tenant and per-user are not asked; per-user-local is.
			resp := f.call(t, "edge", 0, desc("tenant=t2-"+tr), desc("user=u2-"+tr), ip)
			checkStatuses(t, resp, over,
				wantStatus{code: ok},
				wantStatus{code: ok, limit: true, name: "per-user-local", rpu: 100, unit: rlsv3.RateLimitResponse_RateLimit_HOUR, remaining: 100},
				wantStatus{code: over, limit: true, name: "per-ip", rpu: 1, unit: rlsv3.RateLimitResponse_RateLimit_HOUR, remaining: 0})
			// The unasked rules keep their RateLimit-Policy items, as the clients write
			// them (TestE2EHeadersUnaskedKeptInPolicy): the field is the same on the
			// allowed call and the refused one; they have no RateLimit item, their
			// figures not read. Before, they dropped out of both.
			policy := headerMap(first)["RateLimit-Policy"]
			for _, item := range []string{`"per-ip";q=1;w=3600`, `"per-tenant";q=5;w=3600`, `"per-user";q=5;w=3600`, `"per-user-local";q=100;w=3600`} {
				if !strings.Contains(policy, item) {
					t.Errorf("allowed call: RateLimit-Policy %q, want %s in it", policy, item)
				}
			}
			h := headerMap(resp)
			if h["RateLimit-Policy"] != policy {
				t.Errorf("refused call: RateLimit-Policy %q, want the allowed call's, %q", h["RateLimit-Policy"], policy)
			}
			if r := h["RateLimit"]; !strings.HasPrefix(r, `"per-ip";r=0;t=`) || !strings.Contains(r, `"per-user-local";r=100;t=`) ||
				strings.Contains(r, `"per-tenant";`) || strings.Contains(r, `"per-user";`) {
				t.Errorf("refused call: RateLimit %q, want per-ip first, per-user-local, and no item of the unasked rules", r)
			}
			if st := resp.Statuses[0]; st.DurationUntilReset != nil {
				t.Errorf("unasked status: duration_until_reset %v, want none", st.DurationUntilReset)
			}
			limit, remaining, reset, found := xRateLimit(resp)
			if !found || limit != 1 || remaining != 0 || reset < 1 {
				t.Errorf("Envoy's X-RateLimit-Limit %d…, -Remaining %d, -Reset %d (found %v); want per-ip's: 1, 0, and its reset (at least 1 s)",
					limit, remaining, reset, found)
			}
		})
	}
}
