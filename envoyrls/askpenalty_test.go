package envoyrls

import (
	"context"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// jobAttrs are the attributes of descriptor job=j1 in domain api, as a socket client
// sends them.
var jobAttrs = []rules.Attr{{Name: DomainAttribute, Value: "api"}, {Name: DescriptorAttribute, Value: "job"}, {Name: "job", Value: "j1"}}

// jobServer is a server (not listening) of the rules src, with cfg; its global rules on
// a redis-server of its own when global is set.
func jobServer(t *testing.T, src string, cfg Config, global bool) (*Server, *limiter.Limiter) {
	t.Helper()
	set, err := rules.Parse("c.yaml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{}))
	if global {
		_, rdb := standaloneRedis(t)
		lim = lim.WithGlobal(rlsync.NewGlobal(rdb), 30*time.Second)
	}
	cfg.Addr = "unused:0"
	s, err := New(cfg, lim)
	if err != nil {
		t.Fatal(err)
	}
	return s, lim
}

// holdJob takes, as a socket client, a lease on job j1; its decision holds the token.
func holdJob(t *testing.T, s *Server, lim *limiter.Limiter) *limiter.Decision {
	t.Helper()
	held := &limiter.Decision{Owner: 1}
	if err := lim.Check(s.now(), &limiter.Input{Attrs: jobAttrs, Cost: 1}, held); err != nil || !held.Allowed {
		t.Fatalf("socket acquire: %v allowed=%v", err, held.Allowed)
	}
	return held
}

// callJob is Envoy's call on descriptor job=j1, with hits (0: one).
func callJob(t *testing.T, s *Server, hits uint32) *rlsv3.RateLimitResponse {
	t.Helper()
	resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api", HitsAddend: hits,
		Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "job", Value: "j1"}}}}})
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// A concurrency rule's penalty counts Envoy's refusals: a call asks whether a slot is
// free and takes none (TestConcurrencyAsksTakesNoSlot), but a refused call is a refusal
// of its client all the same, as it was when the call took a slot (README, penalty:
// only a cost: 0 check, which the client itself sent to ask, is not counted). Local and
// global rules alike (a global rule's bans shared in Redis).
func TestConcurrencyAskRefusalsCountTowardBan(t *testing.T) {
	for _, mode := range []string{"local", "global"} {
		t.Run(mode, func(t *testing.T) {
			s, lim := jobServer(t, `
rules:
  - name: jobs
    match: { domain: api, descriptor: job }
    key: job
    mode: `+mode+`
    concurrency: { max: 1, lease: 30s }
    penalty: { after: 2, within: 1m, ban: 10m }
`, Config{}, mode == "global")
			held := holdJob(t, s, lim) // a socket client holds the one slot of job j1
			for i := range 2 {
				if resp := callJob(t, s, 0); resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
					t.Fatalf("call %d with the slot held: %v, want OVER_LIMIT", i+1, resp.OverallCode)
				}
			}
			// The slot is freed: the key is banned all the same (two refusals, after: 2).
			if !lim.ReleaseLease(lim.LeaseToken(held), s.now()) {
				t.Fatal("release: false")
			}
			if resp := callJob(t, s, 0); resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
				t.Fatalf("a call after two refusals (penalty after: 2), the slot free: %v, want OVER_LIMIT (banned)", resp.OverallCode)
			}
		})
	}
}

// With ChargeRefused, a call refused by a full concurrency rule is charged on its rate
// rules by checks of its descriptors again, which that concurrency rule refuses too:
// those checks' refusals are not the client's and count toward no ban. Before, each of
// them (up to three a call) counted: one refused call, with after: 2, banned its key.
func TestConcurrencyChargeRefusalsCountNoBan(t *testing.T) {
	s, lim := jobServer(t, `
rules:
  - name: jobs
    match: { domain: api, descriptor: job }
    key: job
    concurrency: { max: 1, lease: 30s }
    penalty: { after: 2, within: 1m, ban: 10m }
  - name: perjob
    match: { domain: api, descriptor: job }
    key: job
    limit: { requests: 100, per: 1m }
`, Config{ChargeRefused: true}, false)
	held := holdJob(t, s, lim)
	if resp := callJob(t, s, 0); resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("call with the slot held: %v, want OVER_LIMIT", resp.OverallCode)
	}
	s.charging.Wait()
	if !lim.ReleaseLease(lim.LeaseToken(held), s.now()) {
		t.Fatal("release: false")
	}
	// One refusal of the client (after: 2): not banned, the slot free.
	var d limiter.Decision
	if err := lim.Check(s.now(), &limiter.Input{Attrs: jobAttrs, Cost: 0}, &d); err != nil {
		t.Fatal(err)
	}
	for _, r := range d.Results {
		if r.Banned {
			t.Fatalf("rule %s banned the key after one refused call: %+v", r.Name, d.Results)
		}
	}
}

// With ChargeRefused, a call refused by a full concurrency rule is charged on the rate
// rules of its descriptors, what they have left up to its hits (README: a refused call
// consumes, on each of its descriptors, what that descriptor's rules have left; a
// concurrency rule is not charged). Before, the charge's check was refused by the same
// full concurrency rule, and charged nothing.
func TestChargeRefusedPastFullConcurrency(t *testing.T) {
	for _, mode := range []string{"local", "global"} {
		t.Run(mode, func(t *testing.T) {
			s, lim := jobServer(t, `
rules:
  - name: jobs
    match: { domain: api, descriptor: job }
    key: job
    mode: `+mode+`
    concurrency: { max: 1, lease: 30s }
  - name: perjob
    match: { domain: api, descriptor: job }
    key: job
    mode: `+mode+`
    limit: { requests: 100, per: 1h }
`, Config{ChargeRefused: true}, mode == "global")
			holdJob(t, s, lim)
			if resp := callJob(t, s, 10); resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
				t.Fatalf("call with the slot held: %v, want OVER_LIMIT", resp.OverallCode)
			}
			s.charging.Wait()
			var d limiter.Decision
			if err := lim.Check(s.now(), &limiter.Input{Attrs: jobAttrs, Cost: 0}, &d); err != nil {
				t.Fatal(err)
			}
			for _, r := range d.Results {
				if r.Name == "perjob" && r.Remaining != 89 {
					t.Errorf("perjob: %d remaining after the socket's 1 and a refused call of 10 charged, want 89", r.Remaining)
				}
				if r.Name == "jobs" && r.Remaining != 0 {
					t.Errorf("jobs: %d free slots, want 0 (the socket's lease; the charge takes none)", r.Remaining)
				}
			}
		})
	}
}
