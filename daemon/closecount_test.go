package daemon

import (
	"bytes"
	"context"
	"net"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// A shutdown's drain ends connections in every state without counting any of them in
// rlsidecar_connections_closed_total: one idle under an idle timeout, one holding half a
// header, one whose client pipelined checks and reads none of their answers (which wait
// for room past the write timeout, and are then cut off by it during the drain), one
// whose client shut its read side.
func TestShutdownCountsNoClose(t *testing.T) {
	m := NewMetrics("test", 10)
	s := startServer(t, Config{Metrics: m, IdleTimeout: time.Hour, WriteTimeout: 200 * time.Millisecond, DrainTimeout: 2 * time.Second})
	idle, br := dialServer(t, s)
	roundTrip(t, idle, br, &proto.Request{ID: 1, Op: proto.OpPing})
	half, _ := dialServer(t, s)
	if _, err := half.Write([]byte{0, 0, 0}); err != nil {
		t.Fatal(err)
	}
	unread, _ := dialServer(t, s)
	burst := bytes.Repeat(frameOf(proto.Request{ID: 1, Op: proto.OpPing}), 20000)
	if _, err := unread.Write(burst); err != nil {
		t.Fatal(err)
	}
	shut, _ := dialServer(t, s)
	if _, err := shut.Write(burst[:len(burst)/2]); err != nil {
		t.Fatal(err)
	}
	if err := shut.(*net.UnixConn).CloseRead(); err != nil {
		t.Fatal(err)
	}
	waitConns(t, s, 4, time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.Shutdown(ctx) // may close what is still busy after DrainTimeout
	for r := closeReason(1); r < nCloseReasons; r++ {
		if got := m.closed[r].Get(); got != 0 {
			t.Errorf("after a shutdown, rlsidecar_connections_closed_total{reason=%q} = %d, want 0", r, got)
		}
	}
}
