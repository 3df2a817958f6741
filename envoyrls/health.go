package envoyrls

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// drainingHealth is grpc.health.v1.Health as the grpc-go transport serves it: the health
// server's Check and List, and a Watch that ends when the server drains. grpc-go's own
// Watch sends NOT_SERVING at Shutdown and then waits for the client to end the call, so
// one watching client (grpc-go's client-side health checking) held GracefulStop, and the
// daemon's exit, until --drain-timeout: under systemd the next daemon starts only then,
// and every gateway's check, on the msgpack socket too, waited the 5 s out in the
// sockets' backlog.
type drainingHealth struct {
	*health.Server
	draining <-chan struct{} // closed when Shutdown begins
}

// watchSend is the stream the health server's Watch writes to: its context ends with the
// call or at the drain, and it remembers the last status sent.
type watchSend struct {
	healthpb.Health_WatchServer
	ctx  context.Context
	last healthpb.HealthCheckResponse_ServingStatus // read once Watch has returned
	sent bool
}

func (w *watchSend) Context() context.Context { return w.ctx }

func (w *watchSend) Send(r *healthpb.HealthCheckResponse) error {
	w.last, w.sent = r.Status, true
	return w.Health_WatchServer.Send(r)
}

// Watch sends the service's status and each change, as the health server does, until the
// call ends or the server drains; then it sends the status at the drain (NOT_SERVING, or
// SERVICE_UNKNOWN), unless that was the last one sent, and ends the call with UNAVAILABLE,
// so that GracefulStop need not wait for the client.
func (h drainingHealth) Watch(in *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	ws := &watchSend{Health_WatchServer: stream, ctx: ctx}
	done := make(chan error, 1)
	go func() { done <- h.Server.Watch(in, ws) }()
	select {
	case err := <-done:
		return err
	case <-h.draining:
	}
	cancel()
	<-done
	if stream.Context().Err() != nil {
		return status.Error(codes.Canceled, "the call ended")
	}
	final := healthpb.HealthCheckResponse_SERVICE_UNKNOWN
	if r, err := h.Server.Check(context.Background(), in); err == nil {
		final = r.Status
	}
	if !ws.sent || ws.last != final {
		if err := stream.Send(&healthpb.HealthCheckResponse{Status: final}); err != nil {
			return err
		}
	}
	return status.Error(codes.Unavailable, "the rate limit service is shutting down")
}
