package daemon

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// A check that takes a lease, written as the idle timeout fires and answered after the
// read side is shut (shutIdle), keeps its slot: the connection that took the lease stays
// open (unreadable) until the lease is released or runs out, as an idle connection
// holding leases does. Before, it closed once the answer was written, and its close
// freed the slot the client had just been granted: another request took it while the
// first still ran.
//
// A global lease (mode: global, a real redis-server) is decided by a goroutine of its
// own: the connection reached the shut read side's end before Redis answered, found no
// lease held yet, and closed once the answer was written, freeing the slot just granted.
func TestIdleShutKeepsALeaseTakenAsItFired(t *testing.T) {
	for _, mode := range []string{"local", "global"} {
		for _, end := range []string{"released", "client closed"} {
			t.Run(mode+"/"+end, func(t *testing.T) { testIdleShutKeepsALease(t, mode, end) })
		}
	}
}

// testIdleShutKeepsALease ends the lease by end: released through another connection, or
// the client closing the connection that took it (a gateway that died: its slot is freed
// then, as on a connection not shut). mode is the concurrency rule's.
func testIdleShutKeepsALease(t *testing.T, mode, end string) {
	m := NewMetrics("test", 10)
	// Long enough for the second connection's check and release (in global mode, on
	// Redis) to come within it: with 100 ms a -race run at load average 10 cut that one
	// idle too ("idle_timeout = 2, want 1").
	cfg := Config{IdleTimeout: time.Second, Metrics: m}
	yaml := "rules:\n  - { name: exports, key: user, mode: " + mode + ", concurrency: { max: 1, lease: 30s } }\n"
	var s *Server
	if mode == "global" {
		s = startGlobalServerConfig(t, yaml, false, cfg)
	} else {
		s = startServerRules(t, cfg, yaml)
		defer s.Shutdown(context.Background())
	}
	m.SetRules(s.lim.Rules(), time.Now())
	c, br := dialServer(t, s)
	roundTrip(t, c, br, &proto.Request{ID: 1, Op: proto.OpPing})
	enc := proto.NewEncoder()
	enc.EncodeRequest(&proto.Request{ID: 2, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "ann"}}})
	writeAsIdleShut(t, c, enc.Bytes()) // the client's check arrives as the timeout fires
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	r := readResponse(t, br)
	if r.ID != 2 || !r.Allowed || r.Lease == "" {
		t.Fatalf("check: %+v; want allowed with a lease", r)
	}
	// Give the old code's close its time: the connection gone, the slot was freed. The
	// slot is held for 30 s, so this wait decides nothing by itself.
	for deadline := time.Now().Add(2 * time.Second); s.Connections() != 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	c2, br2 := dialServer(t, s)
	if r2 := roundTrip(t, c2, br2, &proto.Request{ID: 1, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "ann"}}}); r2.Allowed {
		t.Fatal("another check took the slot of a lease the client holds: the idle cut freed it")
	}
	if end == "client closed" {
		c.Close()
		// The slot is freed with the connection; within a second or so (awaitLeasesEvery),
		// well before the lease's 30 s.
		for deadline := time.Now().Add(15 * time.Second); ; {
			if r2 := roundTrip(t, c2, br2, &proto.Request{ID: 3, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "ann"}}}); r2.Allowed {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the client closed the connection that took the lease: its slot is still held")
			}
			time.Sleep(20 * time.Millisecond)
		}
		c2.Close() // not left to idle out itself: one connection counted idle_timeout
		waitClosed(t, m, closeIdleTimeout)
		return
	}
	if rr := roundTrip(t, c2, br2, &proto.Request{ID: 2, Op: proto.OpRelease, Lease: r.Lease}); !rr.Released {
		t.Fatalf("release: %+v", rr)
	}
	c2.Close() // not left to idle out itself: one connection counted idle_timeout
	// Released: the shut connection ends, counted as idle.
	if _, err := br.ReadByte(); err != io.EOF {
		t.Fatalf("after the release: %v, want the end of the connection", err)
	}
	waitClosed(t, m, closeIdleTimeout)
}

// A frame too large that arrives as the idle timeout fires is refused as one that comes
// at any other time: its client reads frame_too_large (the connection lingers for it),
// and the connection counts as closed for frame_too_large. Before, the shut had already
// marked the connection idle_timeout: it was closed at once with the frame's bytes
// unread, which can reset the connection before the client reads the answer (lingerClose),
// and it was counted as idle.
func TestIdleShutFrameTooLarge(t *testing.T) {
	m := NewMetrics("test", 10)
	s := startServer(t, Config{IdleTimeout: 100 * time.Millisecond, Metrics: m})
	defer s.Shutdown(context.Background())
	c, br := dialServer(t, s)
	roundTrip(t, c, br, &proto.Request{ID: 1, Op: proto.OpPing})
	n := proto.DefaultMaxFrame + 1
	part := make([]byte, proto.HeaderSize+4096) // the header and the start of its body
	binary.BigEndian.PutUint32(part, uint32(n))
	part[proto.HeaderSize] = 0x80
	writeAsIdleShut(t, c, part) // the oversized frame's start arrives as the timeout fires
	if code, err := readError(c); err != nil || code != proto.CodeFrameTooLarge {
		t.Fatalf("got %q, %v; want %s", code, err, proto.CodeFrameTooLarge)
	}
	waitClosed(t, m, closeFrameTooLarge)
}

// A client that writes a pipeline whose answers fill the socket, then neither reads nor
// writes, is cut off once a write has waited WriteTimeout, also with --idle-timeout set:
// the write's failure wakes the connection's goroutine from its wait for the next frame
// (a read deadline in the past). Before, that wait took the wake-up for an idle
// deadline come early and waited again, for the rest of IdleTimeout: the connection and
// its goroutine were held that long past the write timeout (or for as long as it held
// leases).
func TestWriteTimeoutCutsAnIdleWaitingConnection(t *testing.T) {
	m := NewMetrics("test", 10)
	s := startServer(t, Config{WriteTimeout: 200 * time.Millisecond, IdleTimeout: time.Minute, Metrics: m})
	defer s.Shutdown(context.Background())
	m.SetRules(s.lim.Rules(), time.Now())
	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// 8,000 checks that match no rule: 144 kB, which the socket takes whole (its default
	// 208 KiB), so the write is done whatever the daemon's pace; their answers (85 bytes
	// each, 680 kB) are more than the socket holds and less than a connection may hold
	// queued (HeldPerConn), so the connection's goroutine reads on, and waits for a frame.
	// (It wrote 30,000 pings, 690 kB, and its write failed (EPIPE) whenever the daemon,
	// on a loaded machine, had not read them all before the write timeout cut it.)
	batch := bytes.Repeat(frameOf(proto.Request{ID: 1, Op: proto.OpCheck, Cost: 1}), 8000)
	if _, err := c.Write(batch); err != nil {
		t.Fatal(err)
	}
	// The connection ends, counted by its reason as it does, well before the minute's
	// idle timeout. (Waited for by its count: the write returns before the daemon may
	// have accepted the connection, and no connection served says nothing until then.)
	for deadline := time.Now().Add(20 * time.Second); m.closed[closeWriteTimeout].Get() == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the connection did not end (write_timeout) within 20 s of a 200 ms write timeout")
		}
		time.Sleep(5 * time.Millisecond)
	}
	waitConns(t, s, 0, 20*time.Second)
	waitClosed(t, m, closeWriteTimeout)
}
