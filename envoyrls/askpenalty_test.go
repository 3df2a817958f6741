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

// A concurrency rule's penalty counts Envoy's refusals: a call asks whether a slot is
// free and takes none (TestConcurrencyAsksTakesNoSlot), but a refused call is a refusal
// of its client all the same, as it was when the call took a slot (README, penalty:
// only a cost: 0 check, which the client itself sent to ask, is not counted).
func TestConcurrencyAskRefusalsCountTowardBan(t *testing.T) {
	set, err := rules.Parse("c.yaml", []byte(`
rules:
  - name: jobs
    match: { domain: api, descriptor: job }
    key: job
    concurrency: { max: 1, lease: 30s }
    penalty: { after: 2, within: 1m, ban: 10m }
`))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{}))
	s, err := New(Config{Addr: "unused:0"}, lim)
	if err != nil {
		t.Fatal(err)
	}
	// A socket client holds the one slot of job j1.
	var held limiter.Decision
	held.Owner = 1
	if err := lim.Check(s.now(), &limiter.Input{Attrs: []rules.Attr{{Name: DomainAttribute, Value: "api"}, {Name: DescriptorAttribute, Value: "job"}, {Name: "job", Value: "j1"}}, Cost: 1}, &held); err != nil || !held.Allowed {
		t.Fatalf("socket acquire: %v allowed=%v", err, held.Allowed)
	}
	call := func() *rlsv3.RateLimitResponse {
		t.Helper()
		resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api",
			Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "job", Value: "j1"}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	for i := range 2 {
		if resp := call(); resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
			t.Fatalf("call %d with the slot held: %v, want OVER_LIMIT", i+1, resp.OverallCode)
		}
	}
	// The slot is freed: the key is banned all the same (two refusals, after: 2).
	if !lim.ReleaseLease(lim.LeaseToken(&held), s.now()) {
		t.Fatal("release: false")
	}
	if resp := call(); resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("a call after two refusals (penalty after: 2), the slot free: %v, want OVER_LIMIT (banned)", resp.OverallCode)
	}
}

// With ChargeRefused, a call refused by a full concurrency rule is charged on its rate
// rules by checks of its descriptors again, which that concurrency rule refuses too:
// those checks' refusals are not the client's and count toward no ban. Before, each of
// them (up to three a call) counted: one refused call, with after: 2, banned its key.
func TestConcurrencyChargeRefusalsCountNoBan(t *testing.T) {
	set, err := rules.Parse("c.yaml", []byte(`
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
`))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{}))
	s, err := New(Config{Addr: "unused:0", ChargeRefused: true}, lim)
	if err != nil {
		t.Fatal(err)
	}
	var held limiter.Decision
	held.Owner = 1
	in := limiter.Input{Attrs: []rules.Attr{{Name: DomainAttribute, Value: "api"}, {Name: DescriptorAttribute, Value: "job"}, {Name: "job", Value: "j1"}}, Cost: 1}
	if err := lim.Check(s.now(), &in, &held); err != nil || !held.Allowed {
		t.Fatalf("socket acquire: %v allowed=%v", err, held.Allowed)
	}
	resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api",
		Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "job", Value: "j1"}}}}})
	if err != nil || resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("call with the slot held: %v %v, want OVER_LIMIT", resp.GetOverallCode(), err)
	}
	s.charging.Wait()
	if !lim.ReleaseLease(lim.LeaseToken(&held), s.now()) {
		t.Fatal("release: false")
	}
	// One refusal of the client (after: 2): not banned, the slot free.
	var d limiter.Decision
	if err := lim.Check(s.now(), &limiter.Input{Attrs: in.Attrs, Cost: 0}, &d); err != nil {
		t.Fatal(err)
	}
	for _, r := range d.Results {
		if r.Banned {
			t.Fatalf("rule %s banned the key after one refused call: %+v", r.Name, d.Results)
		}
	}
}

// The same for a global concurrency rule, its penalty's bans shared in Redis.
func TestGlobalConcurrencyAskRefusalsCountTowardBan(t *testing.T) {
	_, rdb := standaloneRedis(t)
	set, err := rules.Parse("c.yaml", []byte(`
rules:
  - name: jobs
    match: { domain: api, descriptor: job }
    key: job
    mode: global
    concurrency: { max: 1, lease: 30s }
    penalty: { after: 2, within: 1m, ban: 10m }
`))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{})).WithGlobal(rlsync.NewGlobal(rdb), 30*time.Second)
	s, err := New(Config{Addr: "unused:0"}, lim)
	if err != nil {
		t.Fatal(err)
	}
	var held limiter.Decision
	held.Owner = 1
	if err := lim.Check(s.now(), &limiter.Input{Attrs: []rules.Attr{{Name: DomainAttribute, Value: "api"}, {Name: DescriptorAttribute, Value: "job"}, {Name: "job", Value: "j1"}}, Cost: 1}, &held); err != nil || !held.Allowed {
		t.Fatalf("socket acquire: %v allowed=%v", err, held.Allowed)
	}
	call := func() *rlsv3.RateLimitResponse {
		resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api",
			Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "job", Value: "j1"}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	for range 2 {
		if r := call(); r.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
			t.Fatal(r.OverallCode)
		}
	}
	if !lim.ReleaseLease(lim.LeaseToken(&held), s.now()) {
		t.Fatal("release")
	}
	if r := call(); r.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("global: not banned: %v", r.OverallCode)
	}
}

// With ChargeRefused, a call refused by a full concurrency rule is charged on the rate
// rules of its descriptors, what they have left up to its hits (README: a refused call
// consumes, on each of its descriptors, what that descriptor's rules have left; a
// concurrency rule is not charged). Before, the charge's check was refused by the same
// full concurrency rule, and charged nothing.
func TestChargeRefusedPastFullConcurrency(t *testing.T) {
	for _, mode := range []string{"local", "global"} {
		t.Run(mode, func(t *testing.T) { chargeRefusedPastFullConcurrency(t, mode) })
	}
}

func chargeRefusedPastFullConcurrency(t *testing.T, mode string) {
	set, err := rules.Parse("c.yaml", []byte(`
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
`))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{}))
	if mode == "global" {
		_, rdb := standaloneRedis(t)
		lim = lim.WithGlobal(rlsync.NewGlobal(rdb), 30*time.Second)
	}
	s, err := New(Config{Addr: "unused:0", ChargeRefused: true}, lim)
	if err != nil {
		t.Fatal(err)
	}
	attrs := []rules.Attr{{Name: DomainAttribute, Value: "api"}, {Name: DescriptorAttribute, Value: "job"}, {Name: "job", Value: "j1"}}
	var held limiter.Decision
	held.Owner = 1
	if err := lim.Check(s.now(), &limiter.Input{Attrs: attrs, Cost: 1}, &held); err != nil || !held.Allowed {
		t.Fatalf("socket acquire: %v allowed=%v", err, held.Allowed)
	}
	resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api", HitsAddend: 10,
		Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "job", Value: "j1"}}}}})
	if err != nil || resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("call with the slot held: %v %v, want OVER_LIMIT", resp.GetOverallCode(), err)
	}
	s.charging.Wait()
	var d limiter.Decision
	if err := lim.Check(s.now(), &limiter.Input{Attrs: attrs, Cost: 0}, &d); err != nil {
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
}
