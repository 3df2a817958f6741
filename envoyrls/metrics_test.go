package envoyrls

import (
	"sync"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rlsidecar/rlsidecar/limiter"
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
