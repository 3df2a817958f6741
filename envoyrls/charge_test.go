package envoyrls

import (
	"context"
	"fmt"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// With --envoy-charge-refused, a refused call consumes what its descriptors' rules have
// left, up to its hits, as a response's cost sent after the response (Envoy's
// apply_on_stream_done, whose answer Envoy ignores) must count. A budget of 1,000 with
// 600 charged after each response: the second response's cost is refused, and charges
// the 400 left, so the next request is refused (before: still 400 left, for ever). A
// descriptor that fits in a call another descriptor refused is charged its hits, as
// envoyproxy/ratelimit counts every descriptor's hits. Off (the default), a refused call
// charges nothing. Local (decided on the transports' connection loop), global (on a
// goroutine, waiting on Redis) and hybrid rules, over both transports and in process.
func TestChargeRefused(t *testing.T) {
	for _, charge := range []bool{true, false} {
		for _, tr := range append([]string{"in-process"}, Transports...) {
			t.Run(fmt.Sprint(tr, "/charge=", charge), func(t *testing.T) {
				s, _ := globalServer(t)
				s.cfg.ChargeRefused = charge
				call := func(domain string, hits uint64, users ...string) *rlsv3.RateLimitResponse {
					t.Helper()
					req := &rlsv3.RateLimitRequest{Domain: domain, HitsAddend: uint32(hits)}
					for _, u := range users {
						d := desc1(u)
						d.HitsAddend = wrapperspb.UInt64(hits)
						req.Descriptors = append(req.Descriptors, d)
					}
					var resp *rlsv3.RateLimitResponse
					var err error
					if tr == "in-process" {
						resp, err = s.ShouldRateLimit(context.Background(), req)
					} else {
						resp, err = sv(t, s, tr).rls.ShouldRateLimit(ctx10(t), req)
					}
					if err != nil {
						t.Fatal(err)
					}
					return resp
				}
				const ok, over = rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT
				for _, domain := range []string{"api", "g"} {
					want := func(what string, r *rlsv3.RateLimitResponse, code rlsv3.RateLimitResponse_Code, remaining ...uint32) {
						t.Helper()
						if r.OverallCode != code || len(r.Statuses) != len(remaining) {
							t.Fatalf("%s %s: %v, want %v", domain, what, r, code)
						}
						for i, st := range r.Statuses {
							if st.LimitRemaining != remaining[i] {
								t.Fatalf("%s %s: descriptor %d: %d remaining, want %d (%v)", domain, what, i, st.LimitRemaining, remaining[i], r)
							}
						}
					}
					u := "llm-" + domain
					want("asked", call(domain, 0, u), ok, 1000)
					want("first response's 600", call(domain, 600, u), ok, 400)
					want("second response's 600", call(domain, 600, u), over, 400)
					left := uint32(400)
					if charge {
						left = 0
					}
					if left == 0 {
						want("asked after", call(domain, 0, u), over, 0)
					} else {
						want("asked after", call(domain, 0, u), ok, left)
					}
					// The other descriptor of a refused call: charged its hits (the answer,
					// made before, is the same either way).
					f := "free-" + domain
					want("the other descriptor", call(domain, 500, u, f), over, left, 1000)
					free := uint32(1000)
					if charge {
						free = 500
					}
					want("the other descriptor, asked after", call(domain, 0, f), ok, free)
				}
			})
		}
	}
}

// served servers by test, so that a test's calls share one.
var servedBy = map[*Server]*served{}

func sv(t *testing.T, s *Server, tr string) *served {
	if x := servedBy[s]; x != nil {
		return x
	}
	x := serveTest(t, s, tr)
	servedBy[s] = x
	t.Cleanup(func() { delete(servedBy, s) })
	return x
}

// The same in hybrid mode: a refused call's charge is taken as any hybrid check is,
// from the daemon's view (its exact sync when it has none).
func TestChargeRefusedHybrid(t *testing.T) {
	for _, alg := range []string{"fixed_window", "sliding_window", "token_bucket"} {
		t.Run(alg, func(t *testing.T) { chargeRefusedHybrid(t, alg) })
	}
}

func chargeRefusedHybrid(t *testing.T, alg string) {
	_, rdb := standaloneRedis(t)
	set, err := rules.Parse("h.yaml", []byte(`
rules:
  - name: h
    match: { domain: h }
    key: user
    mode: hybrid
    algorithm: `+alg+`
    limit: { requests: 1000, per: 1h }
`))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{})).
		WithHybrid(rlsync.NewHybrid(rdb, rlsync.HybridOptions{FetchWait: time.Second}))
	s, err := New(Config{Addr: "unused:0", ChargeRefused: true}, lim)
	if err != nil {
		t.Fatal(err)
	}
	call := func(hits uint64, users ...string) *rlsv3.RateLimitResponse {
		t.Helper()
		req := &rlsv3.RateLimitRequest{Domain: "h", HitsAddend: uint32(hits)}
		for _, u := range users {
			d := desc1(u)
			d.HitsAddend = wrapperspb.UInt64(hits)
			req.Descriptors = append(req.Descriptors, d)
		}
		resp, err := s.ShouldRateLimit(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	for i, step := range []struct {
		hits      uint64
		code      rlsv3.RateLimitResponse_Code
		remaining uint32
	}{
		{0, rlsv3.RateLimitResponse_OK, 1000},
		{600, rlsv3.RateLimitResponse_OK, 400},
		{600, rlsv3.RateLimitResponse_OVER_LIMIT, 400},
		{0, rlsv3.RateLimitResponse_OVER_LIMIT, 0},
	} {
		r := call(step.hits, "llm")
		if r.OverallCode != step.code || r.Statuses[0].LimitRemaining != step.remaining {
			t.Fatalf("step %d, hits %d: %v, want %v with %d remaining", i, step.hits, r, step.code, step.remaining)
		}
	}
}
