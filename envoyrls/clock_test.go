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
)

// Calls are decided on the daemon's clock (Config.Clock), the one its socket decides on
// with the same limiter: after the wall clock stepped forward (wall - mono = 2h), a
// bucket the socket spent at mono is not refilled for an Envoy call a second later, as
// it would be at wall time. And the store's wall offset follows the step, so fixed
// windows stay aligned to wall time for calls that arrive only here.
func TestClockIsTheDaemons(t *testing.T) {
	set, err := rules.Parse("t.yaml", []byte(`
rules:
  - name: per-user
    match: { domain: api, descriptor: user }
    key: user
    limit: { requests: 1, per: 1h }
`))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{}))
	const step = int64(2 * time.Hour)
	start := time.Now()
	mono0 := start.UnixNano() - step // the daemon's clock, anchored 2h before the wall clock's step
	clock := func() (int64, int64) {
		t := time.Now()
		return mono0 + int64(t.Sub(start)), t.UnixNano()
	}
	s, err := New(Config{Addr: "unused:0", Clock: clock}, lim)
	if err != nil {
		t.Fatal(err)
	}
	// The socket's request, at mono: per-user's 1 per hour is spent.
	mono, _ := clock()
	in := limiter.Input{Attrs: []rules.Attr{{Name: DomainAttribute, Value: "api"}, {Name: DescriptorAttribute, Value: "user"}, {Name: "user", Value: "u"}}, Cost: 1}
	var d limiter.Decision
	if err := lim.Check(mono, &in, &d); err != nil || !d.Allowed {
		t.Fatalf("the socket's request: %+v %v", d, err)
	}
	resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api",
		Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: "u"}}}}})
	if err != nil {
		t.Fatal(err)
	}
	if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || resp.Statuses[0].DurationUntilReset.AsDuration() < 59*time.Minute {
		t.Errorf("an Envoy call right after the socket spent the bucket: %v, want OVER_LIMIT for about an hour", resp)
	}
	if off := lim.Store().WallOffset(); off < step-int64(time.Second) || off > step+int64(time.Second) {
		t.Errorf("store wall offset %v after an Envoy call, want about %v", time.Duration(off), time.Duration(step))
	}
}

// A refused call's rule that no store asked (limiter.Result.Unasked: a global rule after
// a hybrid refusal) leaves its descriptor OK, and the RateLimit field without it: its
// figures were not read. Its quota, known without asking, stays in RateLimit-Policy, as
// the clients write it (before, the Envoy answer left it out of both fields, and the
// policy field changed from one response to the next).
func TestUnaskedResponse(t *testing.T) {
	s := testServer(t)
	sc := new(scratch)
	sc.d.Allowed, sc.d.Deciding = false, 0
	sc.d.Results = []limiter.Result{
		{Name: "hyb", Limit: 1, Window: time.Hour, Reset: time.Hour, RetryAfter: time.Hour, Part: 0},
		{Name: "glob", Limit: 5, Window: time.Hour, Allowed: true, Unasked: true, Part: 1},
	}
	s.response(2, sc)
	a := &sc.ans
	if !a.over || !a.statuses[0].over || a.statuses[1].over {
		t.Fatalf("statuses %+v, want the first over, the unasked one OK", a.statuses)
	}
	h := map[string]string{}
	for _, hv := range a.headers {
		h[hv.key] = string(hv.value)
	}
	if want := `"hyb";q=1;w=3600, "glob";q=5;w=3600`; h["RateLimit-Policy"] != want {
		t.Errorf("RateLimit-Policy %q, want %q (the unasked rule's quota kept)", h["RateLimit-Policy"], want)
	}
	if want := `"hyb";r=0;t=3600`; h["RateLimit"] != want {
		t.Errorf("RateLimit %q, want %q (the unasked rule left out)", h["RateLimit"], want)
	}
}

// duration_until_reset is whole seconds, rounded up, as envoyproxy/ratelimit answers:
// Envoy's X-RateLimit-Reset is its seconds, rounded down. Before, it was exact: a call
// refused 59.7 s into a minute's window answered 300 ms, and Envoy sent
// X-RateLimit-Reset: 0 on the 429, where Retry-After said 1.
func TestDurationUntilResetWholeSeconds(t *testing.T) {
	for _, into := range []time.Duration{59700 * time.Millisecond, 20 * time.Second, 30*time.Second + time.Nanosecond} {
		now := time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC).Add(into).UnixNano()
		s, _ := stoppedServer(t, now, `
rules:
  - name: per-user
    match: { domain: api, descriptor: user }
    key: user
    algorithm: fixed_window
    limit: { requests: 1, per: 1m }
`)
		user := into.String()
		for call, want := range []rlsv3.RateLimitResponse_Code{rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT} {
			resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api",
				Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: user}}}}})
			if err != nil {
				t.Fatal(err)
			}
			left := time.Minute - into
			whole := (left + time.Second - 1).Truncate(time.Second)
			if got := resp.Statuses[0].DurationUntilReset.AsDuration(); resp.OverallCode != want || got != whole {
				t.Errorf("%v into the window, call %d: %v, reset %v; want %v, reset %v (%v exactly, rounded up)",
					into, call+1, resp.OverallCode, got, want, whole, left)
			}
		}
	}
}
