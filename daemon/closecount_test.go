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
//
// The write timeout (5 s) is far longer than the set-up takes, and the drain's (30 s)
// longer still: every connection is in its state when the drain begins, and the two
// whose answers wait are cut by the write timeout during it. (At 200 ms, a loaded machine
// took longer than that between the unread burst and the shutdown: both had been cut and
// counted write_timeout before it, and "2 connections served after 1s, want 4".)
func TestShutdownCountsNoClose(t *testing.T) {
	m := NewMetrics("test", 10)
	s := startServer(t, Config{Metrics: m, IdleTimeout: time.Hour, WriteTimeout: 5 * time.Second, DrainTimeout: 30 * time.Second})
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
	waitConns(t, s, 4, 5*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = s.Shutdown(ctx) // may close what is still busy after DrainTimeout
	for r := closeReason(1); r < nCloseReasons; r++ {
		if got := m.closed[r].Get(); got != 0 {
			t.Errorf("after a shutdown, rlsidecar_connections_closed_total{reason=%q} = %d, want 0", r, got)
		}
	}
}
