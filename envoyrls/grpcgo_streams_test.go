package envoyrls

import (
	"testing"

	"golang.org/x/net/http2"
)

// The grpc-go transport holds at most h2MaxStreams calls of one connection at once, as the
// native one does, and refuses a stream past it (RST_STREAM REFUSED_STREAM). Before,
// grpc-go's default was no limit: one connection opened stream after stream with HEADERS
// and no body, each a goroutine waiting for its request for as long as the connection
// lived (a call without grpc-timeout has no deadline), without end.
func TestGRPCGoStreamsCapped(t *testing.T) {
	sv := serveTest(t, testServer(t), TransportGRPCGo)
	r := dialRaw(t, sv.sock)
	const extra = 8
	for i := range h2MaxStreams + extra {
		r.headers(uint32(2*i+1), false, grpcHeaders(pathShouldRateLimit)...)
	}
	for {
		f := r.next() // fails the test after 10 s without a frame
		if rst, ok := f.(*http2.RSTStreamFrame); ok && rst.ErrCode == http2.ErrCodeRefusedStream {
			if id := rst.StreamID; id < 2*h2MaxStreams+1 {
				t.Fatalf("stream %d refused, within the first %d", id, h2MaxStreams)
			}
			return
		}
	}
}
