package envoyrls

import (
	"maps"
	"sync"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// latencyRecorder is a Recorder with Answered, as daemon.Metrics has: it keeps the calls
// observed and their durations.
type latencyRecorder struct {
	mu       sync.Mutex
	recorded int
	answered int
	durs     []time.Duration
}

func (r *latencyRecorder) Record(*limiter.Decision) { r.mu.Lock(); r.recorded++; r.mu.Unlock() }

func (r *latencyRecorder) Answered(n int, arrived, now int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.answered += n
	r.durs = append(r.durs, time.Duration(now-arrived))
}

func (r *latencyRecorder) counts() (recorded, answered int, durs []time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.recorded, r.answered, append([]time.Duration(nil), r.durs...)
}

// Every ShouldRateLimit call answered, on either transport, is observed in the daemon's
// check latency (rlsidecar_check_duration_seconds, through Recorder's Answered) as the
// socket's checks are: a decided call, a malformed one, and one that waited on Redis
// (decided on a goroutine of its own), whose time includes that wait. Without it, a
// gateway asking only over Envoy's API left the histogram, and the dashboard's latency
// panels, empty.
func TestTransportCallsObserveLatency(t *testing.T) {
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) {
			g, frozen := globalServer(t)
			rec := new(latencyRecorder)
			s, err := New(Config{Addr: "unused:0", Recorder: rec}, g.lim)
			if err != nil {
				t.Fatal(err)
			}
			sv := serveTest(t, s, tr)
			ctx := ctx10(t)
			if _, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{desc1("u")}}); err != nil {
				t.Fatal(err)
			}
			if _, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "", Descriptors: []*commonrl.RateLimitDescriptor{desc1("u")}}); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("an empty domain: %v, want INVALID_ARGUMENT", err)
			}
			frozen.Freeze()
			const wait = 50 * time.Millisecond
			time.AfterFunc(wait, frozen.Thaw)
			if _, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "g", Descriptors: []*commonrl.RateLimitDescriptor{desc1("x")}}); err != nil {
				t.Fatal(err)
			}
			// A call is observed once its answer is written, which its client may read
			// first: wait a little for the last one.
			recorded, answered, durs := rec.counts()
			for deadline := time.Now().Add(2 * time.Second); (recorded != 2 || answered != 3) && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond)
				recorded, answered, durs = rec.counts()
			}
			if recorded != 2 || answered != 3 {
				t.Fatalf("recorded %d decisions and observed %d answers, want 2 and 3 (durations %v)", recorded, answered, durs)
			}
			if last := durs[len(durs)-1]; last < wait/2 {
				t.Errorf("the call that waited %v on Redis was observed taking %v", wait, last)
			}
		})
	}
}

// errRecorder is a Recorder with EnvoyErrorAnswered, as daemon.Metrics has.
type errRecorder struct {
	mu     sync.Mutex
	byCode map[string]int
}

func (r *errRecorder) Record(*limiter.Decision) {}

func (r *errRecorder) EnvoyErrorAnswered(code string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.byCode[code]++
}

func (r *errRecorder) counts() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.byCode)
}

// Every rate limit call answered with an error, on either transport, is counted by its
// gRPC code (rlsidecar_envoy_error_answers_total): Envoy lets such a request through
// unless its filter sets failure_mode_deny, and nothing in the daemon showed it. Calls
// answered normally, and health checks, are not counted.
func TestTransportErrorAnswersCounted(t *testing.T) {
	set, err := rules.Parse("e.yaml", []byte(`
rules:
  - name: per-user
    match: { domain: api, descriptor: user }
    key: user
    limit: { requests: 1000, per: 1m }
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) {
			rec := &errRecorder{byCode: map[string]int{}}
			s, err := New(Config{Addr: "unused:0", Recorder: rec}, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
			if err != nil {
				t.Fatal(err)
			}
			sv := serveTest(t, s, tr)
			ctx := ctx10(t)
			if _, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{desc1("u")}}); err != nil {
				t.Fatal(err)
			}
			if _, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "", Descriptors: []*commonrl.RateLimitDescriptor{desc1("u")}}); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("an empty domain: %v, want INVALID_ARGUMENT", err)
			}
			many := make([]*commonrl.RateLimitDescriptor, 65)
			for i := range many {
				many[i] = desc1("u")
			}
			if _, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "api", Descriptors: many}); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("65 descriptors: %v, want INVALID_ARGUMENT", err)
			}
			if _, err := sv.hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "nope"}); status.Code(err) != codes.NotFound {
				t.Fatalf("health of an unknown service: %v, want NOT_FOUND", err)
			}
			// Counted as the answer is written, which the client may read first.
			want := map[string]int{"InvalidArgument": 2}
			got := rec.counts()
			for deadline := time.Now().Add(2 * time.Second); !maps.Equal(got, want) && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond)
				got = rec.counts()
			}
			if !maps.Equal(got, want) {
				t.Fatalf("error answers counted %v, want %v", got, want)
			}
		})
	}
}
