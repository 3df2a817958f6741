package envoyrls

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// A Health/Watch call (grpc-go's client-side health checking) does not hold the drain:
// at Shutdown it gets NOT_SERVING, then its end (UNAVAILABLE), and Shutdown returns at
// once. Before, the call stayed open until the client ended it, and Shutdown waited out
// its deadline (--drain-timeout, 5 s): under systemd, the gap every gateway's checks
// waited through before the next daemon started.
func TestWatchEndsAtShutdown(t *testing.T) {
	s := testServer(t)
	sv := serveTest(t, s, TransportGRPCGo)
	ctx := ctx10(t)
	type watcher struct {
		svc   string
		w     healthpb.Health_WatchClient
		first healthpb.HealthCheckResponse_ServingStatus
	}
	var ws []watcher
	for _, c := range []struct {
		svc   string
		first healthpb.HealthCheckResponse_ServingStatus
	}{{ServiceName, healthpb.HealthCheckResponse_SERVING}, {"", healthpb.HealthCheckResponse_SERVING}, {"nope", healthpb.HealthCheckResponse_SERVICE_UNKNOWN}} {
		w, err := sv.hc.Watch(ctx, &healthpb.HealthCheckRequest{Service: c.svc})
		if err != nil {
			t.Fatal(err)
		}
		if r, err := w.Recv(); err != nil || r.Status != c.first {
			t.Fatalf("Watch(%q): %v %v, want %v", c.svc, r, err, c.first)
		}
		ws = append(ws, watcher{c.svc, w, c.first})
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	if err := s.Shutdown(sctx); err != nil {
		t.Fatalf("Shutdown with Watch calls open: %v (after %v)", err, time.Since(start))
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Shutdown took %v with Watch calls open", d)
	}
	for _, w := range ws {
		want := healthpb.HealthCheckResponse_NOT_SERVING
		if w.first == healthpb.HealthCheckResponse_SERVICE_UNKNOWN {
			want = w.first // unknown then, unknown at the drain: nothing new to say
		}
		var got []healthpb.HealthCheckResponse_ServingStatus
		var err error
		for {
			var r *healthpb.HealthCheckResponse
			if r, err = w.w.Recv(); err != nil {
				break
			}
			got = append(got, r.Status)
		}
		if status.Code(err) != codes.Unavailable {
			t.Errorf("Watch(%q) ended with %v, want UNAVAILABLE", w.svc, err)
		}
		if want == healthpb.HealthCheckResponse_NOT_SERVING && (len(got) == 0 || got[len(got)-1] != want) {
			t.Errorf("Watch(%q) got %v after SERVING, want it to end on NOT_SERVING", w.svc, got)
		}
		if want != healthpb.HealthCheckResponse_NOT_SERVING && len(got) != 0 {
			t.Errorf("Watch(%q) got %v after SERVICE_UNKNOWN, want nothing", w.svc, got)
		}
	}
}
