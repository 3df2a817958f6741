package daemon

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

func startServer(t *testing.T, cfg Config) *Server {
	t.Helper()
	return startServerRules(t, cfg, benchRules)
}

// startServerRules is startServer with the rules in rulesYAML.
func startServerRules(t *testing.T, cfg Config, rulesYAML string) *Server {
	t.Helper()
	dir, err := os.MkdirTemp("", "rlsd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg.Socket = filepath.Join(dir, "s.sock")
	set, err := rules.Parse("test.yaml", []byte(rulesYAML))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(cfg, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	go s.Serve()
	return s
}

// dialServer connects to s, closing the connection at the test's end.
func dialServer(t *testing.T, s *Server) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, bufio.NewReader(c)
}

func roundTrip(t *testing.T, c net.Conn, br *bufio.Reader, req *proto.Request) *proto.Response {
	t.Helper()
	enc := proto.NewEncoder()
	enc.EncodeRequest(req)
	if _, err := c.Write(enc.Bytes()); err != nil {
		t.Fatal(err)
	}
	return readResponse(t, br)
}

// readResponse reads and decodes one answer from br.
func readResponse(t *testing.T, br *bufio.Reader) *proto.Response {
	t.Helper()
	body, err := proto.ReadFrame(br, nil, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	var resp proto.Response
	if err := proto.NewDecoder().DecodeResponse(body, &resp); err != nil {
		t.Fatal(err)
	}
	return &resp
}

// Shutdown answers, closes idle and half-sent connections, removes the socket and leaves
// no goroutine behind.
func TestShutdownLeavesNothing(t *testing.T) {
	// Only this test's goroutines: with -count above 1, the servers of the tests after
	// it in the previous round may still be serving.
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	s := startServer(t, Config{IdleTimeout: time.Minute})
	idle, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	resp := roundTrip(t, idle, bufio.NewReader(idle), &proto.Request{ID: 3, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "ip", Value: "a"}}})
	if !resp.Allowed || resp.Rule != "per-ip" {
		t.Fatalf("%+v", resp)
	}
	half, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer half.Close()
	half.Write([]byte{0, 0, 0, 9, 0x81})
	deadline := time.Now().Add(5 * time.Second)
	for s.Connections() != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections", s.Connections())
		}
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("shutdown took %s with an idle and a half-sent connection", el)
	}
	if _, err := os.Stat(s.cfg.Socket); !os.IsNotExist(err) {
		t.Fatalf("socket left: %v", err)
	}
	if s.Connections() != 0 {
		t.Fatalf("%d connections after shutdown", s.Connections())
	}
}

// An idle connection is closed after IdleTimeout; an active one is not. (Its requests
// come 50 ms apart; a cut is the test's failure only when the request it met was sent
// less than IdleTimeout after the one before: a -race run at load average 12 slept past 200 ms
// between two, and its connection was rightly cut, "broken pipe". Such a run is tried
// again, a few times at most.)
func TestIdleTimeout(t *testing.T) {
	const idle = 200 * time.Millisecond
	for try := 0; ; try++ {
		m := NewMetrics("test", 10)
		s := startServer(t, Config{IdleTimeout: idle, Metrics: m})
		c, err := net.Dial("unix", s.cfg.Socket)
		if err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(c)
		enc := proto.NewEncoder()
		var cut error
		var gap time.Duration
		last := time.Now()
		for i := 0; i < 5 && cut == nil; i++ { // active for 5 × 50 ms > the idle timeout
			enc.Reset()
			enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpPing, Cost: 1})
			// Since the last request was sent: the daemon read it after, so its idle
			// time at this one is less.
			gap = time.Since(last)
			last = time.Now()
			if _, cut = c.Write(enc.Bytes()); cut == nil {
				_, cut = proto.ReadFrame(br, nil, 1<<20)
			}
			time.Sleep(50 * time.Millisecond)
		}
		if cut != nil {
			c.Close()
			s.Shutdown(context.Background())
			if gap < idle || try == 4 {
				t.Fatalf("an active connection cut (%v) %v after its last request, with an idle timeout of %v", cut, gap, idle)
			}
			t.Logf("cut after a gap of %v, past the idle timeout (a loaded machine): again", gap)
			continue
		}
		defer s.Shutdown(context.Background())
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := br.ReadByte(); err == nil {
			t.Fatal("idle connection got data instead of being closed")
		}
		waitClosed(t, m, closeIdleTimeout)
		return
	}
}

// A connection is cut once it has been idle for IdleTimeout since its last request, not
// before: the daemon moves the read deadline only when more than half of it is used, so a
// deadline set for an earlier request can come while the connection has been idle for
// less. Before, one whose request came a quarter of IdleTimeout after the previous one
// was cut three quarters of IdleTimeout after it (a CI run of TestIdleTimeout, whose
// requests come 50 ms apart, saw its connection cut at 150 ms with a 150 ms timeout).
func TestIdleTimeoutCountsFromLastRequest(t *testing.T) {
	const idle = 400 * time.Millisecond
	m := NewMetrics("test", 10)
	s := startServer(t, Config{IdleTimeout: idle, Metrics: m})
	defer s.Shutdown(context.Background())
	c, br := dialServer(t, s)
	roundTrip(t, c, br, &proto.Request{ID: 1, Op: proto.OpPing})
	time.Sleep(idle / 4) // the deadline set for the first request is more than half left
	last := time.Now()
	roundTrip(t, c, br, &proto.Request{ID: 2, Op: proto.OpPing})
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := br.ReadByte(); err == nil {
		t.Fatal("idle connection got data instead of being closed")
	}
	if el := time.Since(last); el < idle {
		t.Fatalf("cut %v after its last request; the idle timeout is %v", el.Round(time.Millisecond), idle)
	}
	waitClosed(t, m, closeIdleTimeout)
}

// A connection idle past IdleTimeout but holding a lease stays open (its gateway holds it
// for a request still running: closing it would free the slot); once the lease has run
// out, or was released (through another connection), it is closed as idle.
func TestIdleTimeoutSparesLeaseHolders(t *testing.T) {
	for _, how := range []string{"expired", "released"} {
		t.Run(how, func(t *testing.T) {
			s := startServerRules(t, Config{IdleTimeout: 100 * time.Millisecond},
				"rules:\n  - { name: exports, key: user, concurrency: { max: 1, lease: 700ms } }\n")
			defer s.Shutdown(context.Background())
			dial := func() (net.Conn, *bufio.Reader) { return dialServer(t, s) }
			c, br := dial()
			start := time.Now()
			r := roundTrip(t, c, br, &proto.Request{ID: 1, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "ann"}}})
			if !r.Allowed || r.Lease == "" {
				t.Fatalf("check: %+v; want allowed with a lease", r)
			}
			// 300 ms idle (three idle timeouts): still open, the slot still held.
			time.Sleep(300 * time.Millisecond)
			c2, br2 := dial()
			if r2 := roundTrip(t, c2, br2, &proto.Request{ID: 1, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "ann"}}}); r2.Allowed {
				t.Fatalf("300 ms in, under a 700 ms lease, another check was allowed: the idle timeout freed the slot")
			}
			if how == "released" {
				if rr := roundTrip(t, c2, br2, &proto.Request{ID: 2, Op: proto.OpRelease, Lease: r.Lease}); !rr.Released {
					t.Fatalf("release: %+v", rr)
				}
			}
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := br.ReadByte(); err == nil {
				t.Fatal("the lease holder's connection got data instead of being closed")
			}
			el := time.Since(start)
			if how == "released" && el > 650*time.Millisecond {
				t.Errorf("released at ~300 ms, closed after %v: want within an idle timeout or two", el)
			}
			if how == "expired" && el < 700*time.Millisecond {
				t.Errorf("closed after %v, before its 700 ms lease ran out", el)
			}
		})
	}
}

// waitClosed waits until m has counted one connection closed by the daemon, for r, and
// fails if it counts any other reason or more than one.
func waitClosed(t *testing.T, m *Metrics, r closeReason) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for m.closed[r].Get() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	for q := closeReason(1); q < nCloseReasons; q++ {
		want := uint64(0)
		if q == r {
			want = 1
		}
		if got := m.closed[q].Get(); got != want {
			t.Errorf("rlsidecar_connections_closed_total{reason=%q} = %d, want %d", q, got, want)
		}
	}
}

func TestListenRefusesLiveSocket(t *testing.T) {
	s := startServer(t, Config{})
	defer s.Shutdown(context.Background())
	set, _ := rules.Parse("x", []byte("rules: []"))
	other, _ := New(Config{Socket: s.cfg.Socket}, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
	if err := other.Listen(); err == nil {
		t.Fatal("a second server listened on a live socket")
	}
}

// waitConns waits until the server serves want connections, or fails after bound.
func waitConns(t *testing.T, s *Server, want int64, bound time.Duration) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for s.Connections() != want {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections served after %s, want %d", s.Connections(), bound, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A frame longer than the read buffer, begun and never finished, is cut off by the frame
// timeout like any other (before, that path read with no deadline and held the
// connection forever).
func TestFrameTimeoutLargeFrame(t *testing.T) {
	for _, tc := range []struct {
		name string
		size int // announced body length
	}{
		{"small", 200},
		{"large", readBufSize + 1000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := NewMetrics("test", 10)
			s := startServer(t, Config{FrameTimeout: 100 * time.Millisecond, Metrics: m})
			defer s.Shutdown(context.Background())
			c, err := net.Dial("unix", s.cfg.Socket)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			// A header and part of the body in one write, then nothing.
			frame := make([]byte, proto.HeaderSize+100)
			frame[0], frame[1], frame[2], frame[3] = byte(tc.size>>24), byte(tc.size>>16), byte(tc.size>>8), byte(tc.size)
			if _, err := c.Write(frame); err != nil {
				t.Fatal(err)
			}
			waitConns(t, s, 1, time.Second)
			waitConns(t, s, 0, 3*time.Second)
			waitClosed(t, m, closeFrameTimeout)
		})
	}
}

// A client that sends and never reads its answers is cut off once a write has waited
// WriteTimeout: its goroutine and connection slot are freed.
func TestWriteTimeoutFreesSlot(t *testing.T) {
	m := NewMetrics("test", 10)
	s := startServer(t, Config{WriteTimeout: 200 * time.Millisecond, Metrics: m})
	defer s.Shutdown(context.Background())
	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ping := frameOf(proto.Request{ID: 1, Op: proto.OpPing, Cost: 1})
	batch := bytes.Repeat(ping, 1000)
	wrote := make(chan struct{})
	go func() { // writes until the server stops reading (then blocks) or closes
		defer close(wrote)
		_ = c.SetWriteDeadline(time.Now().Add(10 * time.Second))
		for {
			if _, err := c.Write(batch); err != nil {
				return
			}
		}
	}()
	waitConns(t, s, 1, time.Second)
	waitConns(t, s, 0, 5*time.Second)
	c.Close()
	<-wrote
	waitClosed(t, m, closeWriteTimeout)
}

// A client that takes its answers slowly but steadily is never cut off, however long it
// takes them all: the write timeout counts from the last bytes it took, not from when the
// daemon began to write what it holds. It used to cover a whole write of up to
// Config.HeldPerConn bytes (then 2 MiB): a client reading 160 KB/s was cut 5 s into a 2 MB pipeline, its answers lost.
// And one that stops reading, partway, is still cut off.
func TestSlowSteadyReaderNotCut(t *testing.T) {
	// A write timeout a loaded machine does not reach between two reads of the client
	// (with 300 ms, the longest gap seen under -race at load average 11 was 133 ms), and
	// one that a write-behind of these answers, taken at the client's pace, exceeds.
	const wt = 800 * time.Millisecond
	m := NewMetrics("test", 10)
	s := startServer(t, Config{WriteTimeout: wt, Metrics: m})
	defer s.Shutdown(context.Background())
	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const n = 60_000
	enc := proto.NewEncoder()
	for i := range n {
		enc.EncodeRequest(&proto.Request{ID: uint64(i + 1), Op: proto.OpPing})
	}
	go func() {
		c.SetWriteDeadline(time.Now().Add(30 * time.Second))
		c.Write(enc.Bytes())
	}()
	// Read 16 KiB each 20 ms (~800 KB/s): well over the write timeout for them all.
	buf := make([]byte, 16<<10)
	var got []byte
	start := time.Now()
	for answers := 0; answers < n; {
		time.Sleep(20 * time.Millisecond)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		k, err := c.Read(buf)
		if err != nil {
			t.Fatalf("after %d answers, %d bytes, %v: %v", answers, len(got), time.Since(start), err)
		}
		got = append(got, buf[:k]...)
		for len(got) >= proto.HeaderSize && len(got) >= proto.HeaderSize+int(proto.FrameLength(got)) {
			l := proto.HeaderSize + int(proto.FrameLength(got))
			var r proto.Response
			if err := proto.NewDecoder().DecodeResponse(got[proto.HeaderSize:l], &r); err != nil || r.ID != uint64(answers+1) {
				t.Fatalf("answer %d: %+v, %v", answers, r, err)
			}
			got = got[l:]
			answers++
		}
	}
	if d := time.Since(start); d < 2*wt {
		t.Fatalf("the answers took %v to read: not long enough to test the write timeout", d)
	}
	if v := m.closed[closeWriteTimeout].Get(); v != 0 {
		t.Fatalf("a client reading steadily was cut off: write_timeout %d", v)
	}
	// Now the same client stops reading partway through a second pipeline: cut off.
	go c.Write(enc.Bytes())
	waitConns(t, s, 0, 5*time.Second)
	waitClosed(t, m, closeWriteTimeout)
}

// The daemon counts the connections it refuses past MaxConns and those it closes after
// answering frame_too_large; a client's own close and a shutdown are not counted.
func TestConnectionsClosedCounted(t *testing.T) {
	m := NewMetrics("test", 10)
	s := startServer(t, Config{MaxConns: 1, Metrics: m})
	a, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	waitConns(t, s, 1, time.Second)
	b, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	r := readResponse(t, bufio.NewReader(b))
	if r.Err.Code != proto.CodeTooManyConnections {
		t.Fatalf("past MaxConns: %+v", r)
	}
	// The count reads right in the singular ("1 connections" before).
	if want := "the daemon serves at most 1 connection; close idle ones or raise --max-conns"; r.Err.Message != want {
		t.Fatalf("past MaxConns 1: message %q, want %q", r.Err.Message, want)
	}
	if got, want := tooManyConnections(2), "the daemon serves at most 2 connections; close idle ones or raise --max-conns"; got != want {
		t.Fatalf("MaxConns 2: message %q, want %q", got, want)
	}
	waitClosed(t, m, closeTooManyConnections)

	a.Close() // the client's own close: not counted
	waitConns(t, s, 0, time.Second)
	m.closed[closeTooManyConnections].Set(0)
	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte{0x7f, 0xff, 0xff, 0xff}); err != nil {
		t.Fatal(err)
	}
	if r := readResponse(t, bufio.NewReader(c)); r.Err.Code != proto.CodeFrameTooLarge {
		t.Fatalf("a frame too large: %+v", r)
	}
	waitClosed(t, m, closeFrameTooLarge)
	c.Close() // the code read: the server's linger for it (up to 1 s) ends at once

	m.closed[closeFrameTooLarge].Set(0)
	waitConns(t, s, 0, time.Second)
	d, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	waitConns(t, s, 1, time.Second)
	if err := s.Shutdown(context.Background()); err != nil { // closes d, idle: not counted
		t.Fatal(err)
	}
	for r := closeReason(1); r < nCloseReasons; r++ {
		if got := m.closed[r].Get(); got != 0 {
			t.Errorf("after a client's close and a shutdown, reason %q counted %d", r, got)
		}
	}
}

// TestIsClosedKnowsRawIOErrors: the errors internal/rawio documents for a connection that
// ended (the peer closed, Shutdown closed it, a deadline passed, a reset) are the ones the
// connection loop treats as a close, not a failure to log.
func TestIsClosedKnowsRawIOErrors(t *testing.T) {
	for _, err := range []error{io.EOF, net.ErrClosed, os.ErrDeadlineExceeded, syscall.ECONNRESET, syscall.EPIPE,
		fmt.Errorf("read: %w", syscall.ECONNRESET)} {
		if !isClosed(err) {
			t.Errorf("isClosed(%v) = false", err)
		}
	}
	if isClosed(syscall.EBADF) {
		t.Error("isClosed(EBADF) = true: a real failure would go unlogged")
	}
}

// A value longer than rules.MaxKeyValue, up to what a frame holds, is matched and limited
// like any other, by a key of its own: a gateway passes paths and headers its end users
// choose, and a refusal (bad_request) would hand the request to the gateway's failure
// policy, open by default, which is a way around every limit.
func TestLongValuesAreLimited(t *testing.T) {
	s := startServer(t, Config{})
	defer s.Shutdown(context.Background())
	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	long := strings.Repeat("x", 20_000)
	ipA, ipB := long+"a", long+"b" // differ in their last byte only
	check := func(ip, path string) *proto.Response {
		t.Helper()
		return roundTrip(t, c, br, &proto.Request{Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "method", Value: "POST"}, {Name: "path", Value: path}, {Name: "ip", Value: ip}, {Name: "user", Value: long}}})
	}
	for i := range 10 {
		r := check(ipA, "/login")
		if r.IsError() || !r.Allowed || r.Rule != "login" || r.Remaining != uint64(9-i) {
			t.Fatalf("check %d with a long ip: %+v, want allowed by login, %d left", i+1, r, 9-i)
		}
	}
	if r := check(ipA, "/login"); r.IsError() || r.Allowed || r.Rule != "login" {
		t.Fatalf("11th check with a long ip: %+v, want refused by login", r)
	}
	if r := check(ipB, "/login"); r.IsError() || !r.Allowed || r.Remaining != 9 {
		t.Fatalf("another long ip: %+v, want a budget of its own (allowed, 9 left)", r)
	}
	// A long path still matches its rule's glob, and the long user is keyed.
	r := check(ipB, "/v1/events/"+long+"/holds")
	if r.IsError() || !r.Allowed || len(r.Rules) != 2 || r.Rules[1].Name != "holds" {
		t.Fatalf("a long path: %+v, want per-ip and holds matched", r)
	}
}

// Shutdown answers what each client sent before it, in process and under the race
// detector: a connection with a thousand frames pipelined (most still in its socket),
// connections that connected and wrote but that Serve may not have accepted yet, and
// one that connected and wrote nothing. Each gets every answer in order.
func TestShutdownAnswersWhatWasSent(t *testing.T) {
	for round := range 5 {
		s := startServer(t, Config{})
		enc := proto.NewEncoder()
		const n = 1000
		for i := 1; i <= n; i++ {
			enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "ip", Value: "drain"}}})
		}
		dial := func() *net.UnixConn {
			c, err := net.Dial("unix", s.cfg.Socket)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			_ = c.SetDeadline(time.Now().Add(20 * time.Second))
			return c.(*net.UnixConn)
		}
		deep := dial()
		_ = deep.SetWriteBuffer(1 << 20)
		late := make([]*net.UnixConn, 8)
		for i := range late {
			late[i] = dial()
		}
		silent := dial()
		if _, err := deep.Write(enc.Bytes()); err != nil {
			t.Fatal(err)
		}
		for i, c := range late {
			one := proto.NewEncoder()
			one.EncodeRequest(&proto.Request{ID: uint64(i + 1), Op: proto.OpPing})
			if _, err := c.Write(one.Bytes()); err != nil {
				t.Fatal(err)
			}
		}
		done := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			done <- s.Shutdown(ctx)
		}()
		br := bufio.NewReader(deep)
		for i := 1; i <= n; i++ {
			if r := readResponse(t, br); r.ID != uint64(i) || r.Err.Code != "" {
				t.Fatalf("round %d: answer %d: id %d, error %q", round, i, r.ID, r.Err.Code)
			}
		}
		for i, c := range late {
			if r := readResponse(t, bufio.NewReader(c)); r.ID != uint64(i+1) || r.Err.Code != "" {
				t.Fatalf("round %d: late client %d: id %d, error %q", round, i, r.ID, r.Err.Code)
			}
		}
		// A client that sent nothing is closed: at once if it was being served, after a
		// shutting_down error if the drain accepted it.
		if body, err := proto.ReadFrame(bufio.NewReader(silent), nil, 1<<20); err == nil {
			var r proto.Response
			if err := proto.NewDecoder().DecodeResponse(body, &r); err != nil || r.Err.Code != proto.CodeShuttingDown {
				t.Fatalf("round %d: a client that sent nothing got %+v (%v)", round, r, err)
			}
		} else if !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("round %d: a client that sent nothing: %v", round, err)
		}
		if err := <-done; err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if s.Connections() != 0 {
			t.Fatalf("round %d: %d connections after shutdown", round, s.Connections())
		}
	}
}

// A client may write its whole pipeline before reading any answer: 10,000 checks (far
// more answers than the socket holds) are all answered, in order. The daemon used to stop
// reading once the socket was full of answers the client had not read yet, while the
// client, still writing, had not started to read: each waited on the other until the
// write timeout cut the connection, about 1,100 answers in.
func TestLongPipelineWrittenBeforeReading(t *testing.T) {
	// The client's deadlines (10 s) bound the test, not the write timeout: the client
	// reads only once the daemon has read all it wrote, so the daemon's first answers
	// wait for room until it has decided the 10,000 checks. With a 2 s write timeout,
	// under -race at load 16-23 that took longer: the daemon cut the connection as a
	// client that takes no answers ("write: broken pipe" 2.3 s in). A daemon that stops
	// reading still fails it, on the client's write deadline.
	s := startServer(t, Config{WriteTimeout: time.Minute})
	c, br := dialServer(t, s)
	const n = 10_000
	enc := proto.NewEncoder()
	for i := range n {
		enc.EncodeRequest(&proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1,
			Attrs: []proto.Attr{{Name: "ip", Value: "10.0.0." + strconv.Itoa(i%256)}}})
	}
	c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(enc.Bytes()); err != nil {
		t.Fatalf("writing %d checks (%d bytes) before reading: %v", n, len(enc.Bytes()), err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for i := range n {
		if r := readResponse(t, br); r.ID != uint64(i+1) || r.Err.Code != "" || !r.Allowed {
			t.Fatalf("answer %d: %+v", i, r)
		}
	}
}

// Connections whose clients write and never read each hold their answers up to
// Config.HeldPerConn;
// together they are held to Config.HeldBudget (plus minHeld and a batch each), a client
// that reads is answered meanwhile, and what they held is freed with them.
func TestHeldBudget(t *testing.T) {
	const budget, conns = 1 << 20, 8
	// The write timeout outlasts the wait below: a connection whose answers wait for
	// room is not cut (freeing them) before the budget is reached.
	s := startServer(t, Config{WriteTimeout: time.Minute, HeldBudget: budget})
	batch := bytes.Repeat(frameOf(proto.Request{ID: 1, Op: proto.OpPing}), 1000)
	var cs []net.Conn
	var wg sync.WaitGroup
	for range conns {
		c, err := net.Dial("unix", s.cfg.Socket)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.(*net.UnixConn).SetReadBuffer(4096)
		cs = append(cs, c)
		wg.Add(1)
		go func() { // writes until the server stops reading, never reads
			defer wg.Done()
			_ = c.SetWriteDeadline(time.Now().Add(time.Minute))
			for {
				if _, err := c.Write(batch); err != nil {
					return
				}
			}
		}()
	}
	waitConns(t, s, conns, time.Second)
	var peak int64
	rc, br := dialServer(t, s)
	// Until the connections that do not read hold half the budget (a -race run of the
	// package at load 6 held only 110,360 bytes after the one second this loop was
	// given), then for a second more: a reading client is answered throughout.
	var reached time.Time
	for deadline := time.Now().Add(20 * time.Second); reached.IsZero() || time.Since(reached) < time.Second; {
		peak = max(peak, s.held.Load())
		if reached.IsZero() && peak >= budget/2 {
			reached = time.Now()
		}
		if reached.IsZero() && time.Now().After(deadline) {
			break
		}
		if _, err := rc.Write(frameOf(proto.Request{ID: 7, Op: proto.OpPing})); err != nil {
			t.Fatal(err)
		}
		_ = rc.SetReadDeadline(time.Now().Add(time.Second))
		if r := readResponse(t, br); r.ID != 7 || r.Err.Code != "" {
			t.Fatalf("a reading client, beside %d that do not read: %+v", conns, r)
		}
		time.Sleep(time.Millisecond)
	}
	if bound := int64(budget + conns*(minHeld+flushAt+len(batch))); peak > bound {
		t.Fatalf("connections not reading held %d bytes of answers, over the budget's bound %d", peak, bound)
	}
	if peak < budget/2 {
		t.Fatalf("connections not reading held only %d bytes of answers: the test did not reach the budget (%d)", peak, budget)
	}
	for _, c := range cs {
		c.Close()
	}
	wg.Wait()
	rc.Close()
	waitConns(t, s, 0, 5*time.Second)
	if h := s.held.Load(); h != 0 {
		t.Fatalf("%d bytes counted as held after every connection closed", h)
	}
}

// A frame longer than the read buffer is read into a buffer that grows as its bytes
// arrive: a header announcing 64 MiB, then ten bytes, costs the daemon what was sent, not
// 64 MiB per connection (it used to allocate the whole length at the header). The frame
// completed is still answered.
func TestBigFrameGrowsAsItArrives(t *testing.T) {
	const announced, conns = 64 << 20, 4
	s := startServer(t, Config{MaxFrame: announced, FrameTimeout: 10 * time.Second})
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	for range conns {
		c, err := net.Dial("unix", s.cfg.Socket)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		head := []byte{announced >> 24, announced >> 16 & 0xff, announced >> 8 & 0xff, announced & 0xff}
		if _, err := c.Write(append(head, make([]byte, 10)...)); err != nil {
			t.Fatal(err)
		}
	}
	waitConns(t, s, conns, time.Second)
	time.Sleep(100 * time.Millisecond) // the daemon reads the ten bytes
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if d := after.TotalAlloc - before.TotalAlloc; d > announced/2 {
		t.Fatalf("%d connections that sent a %d-byte frame's header and ten bytes: %d bytes allocated", conns, announced, d)
	}

	// A frame of 200,000 bytes, in pieces: answered.
	c, br := dialServer(t, s)
	const pad = 200_000 // an unknown field's string, which the daemon skips
	msg := append([]byte{0x83, 0xa2, 'i', 'd', 9, 0xa2, 'o', 'p', 0xa4, 'p', 'i', 'n', 'g', 0xa3, 'p', 'a', 'd', 0xdb, 0, pad >> 16, pad >> 8 & 0xff, pad & 0xff}, strings.Repeat("x", pad)...)
	body := append([]byte{0, byte(len(msg) >> 16), byte(len(msg) >> 8), byte(len(msg))}, msg...)
	for p := body; len(p) > 0; {
		n := min(len(p), 30_000)
		if _, err := c.Write(p[:n]); err != nil {
			t.Fatal(err)
		}
		p = p[n:]
		time.Sleep(time.Millisecond)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if r := readResponse(t, br); r.ID != 9 || r.Err.Code != "" {
		t.Fatalf("a 200,000-byte frame sent in pieces: %+v", r)
	}
}

// readError reads, from a connection the server closes after an error answer, that
// answer and then end of file, and returns the answer's code; a client that wrote
// before it reads, as every client does, must get it. Before, the server closed at once
// with the client's request unread: the client's write failed (EPIPE) or its read did
// (ECONNRESET), and no code arrived (0 of 300 past MaxConns, 0 of 100 frames too large).
func readError(c net.Conn) (string, error) {
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	all, err := io.ReadAll(c)
	if err != nil {
		return "", fmt.Errorf("after %d bytes: %w", len(all), err)
	}
	if len(all) < proto.HeaderSize {
		return "", fmt.Errorf("%d bytes, no answer", len(all))
	}
	var r proto.Response
	if err := proto.NewDecoder().DecodeResponse(all[proto.HeaderSize:], &r); err != nil {
		return "", err
	}
	return r.Err.Code, nil
}

// Past MaxConns, a client that writes its request and then reads gets
// too_many_connections, however soon after connecting it writes.
func TestRefusedClientReadsTheError(t *testing.T) {
	s := startServer(t, Config{MaxConns: 1})
	a, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	waitConns(t, s, 1, time.Second)
	enc := proto.NewEncoder()
	enc.EncodeRequest(&proto.Request{ID: 9, Op: proto.OpPing})
	for i := range 60 {
		c, err := net.Dial("unix", s.cfg.Socket)
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 1 {
			time.Sleep(time.Millisecond) // the refusal is written first
		}
		if _, err := c.Write(enc.Bytes()); err != nil {
			t.Fatalf("round %d: writing a request to a refused connection: %v", i, err)
		}
		code, err := readError(c)
		c.Close()
		if err != nil || code != proto.CodeTooManyConnections {
			t.Fatalf("round %d: got %q, %v; want %s", i, code, err, proto.CodeTooManyConnections)
		}
	}
}

// A frame too large, sent whole, is answered frame_too_large, which its client reads
// before end of file: the frame's body, unread, does not reset the connection.
func TestFrameTooLargeReadByTheClient(t *testing.T) {
	s := startServer(t, Config{})
	for _, n := range []int{proto.DefaultMaxFrame + 1, 1 << 20} {
		frame := make([]byte, proto.HeaderSize+n)
		binary.BigEndian.PutUint32(frame, uint32(n))
		frame[proto.HeaderSize] = 0x80
		for i := range 10 {
			c, err := net.Dial("unix", s.cfg.Socket)
			if err != nil {
				t.Fatal(err)
			}
			wrote := make(chan error, 1)
			go func() { // a body larger than the socket's buffers waits for the server
				_, err := c.Write(frame)
				wrote <- err
			}()
			code, err := readError(c)
			if werr := <-wrote; werr != nil {
				t.Fatalf("%d bytes, round %d: writing the frame: %v", n, i, werr)
			}
			c.Close()
			if err != nil || code != proto.CodeFrameTooLarge {
				t.Fatalf("%d bytes, round %d: got %q, %v; want %s", n, i, code, err, proto.CodeFrameTooLarge)
			}
		}
	}
}

// writeAsIdleShut writes b on c as the idle timeout fires, from the hook run just before
// the server shuts the connection's read side (beforeIdleShut), and waits for the write.
func writeAsIdleShut(t *testing.T, c net.Conn, b []byte) {
	t.Helper()
	wrote := make(chan error, 1)
	hook := func() {
		_, err := c.Write(b)
		wrote <- err
	}
	beforeIdleShut.Store(&hook)
	defer beforeIdleShut.Store(nil)
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
}

// A request the client writes as the idle timeout fires is answered before the
// connection ends, not closed unread (a Unix socket closed with bytes unread resets the
// connection, and a client that had pipelined several could not tell which were read).
func TestIdleTimeoutAnswersWhatCameAsItFired(t *testing.T) {
	m := NewMetrics("test", 10)
	s := startServer(t, Config{IdleTimeout: 100 * time.Millisecond, Metrics: m})
	defer s.Shutdown(context.Background())
	c, br := dialServer(t, s)
	roundTrip(t, c, br, &proto.Request{ID: 1, Op: proto.OpPing})
	enc := proto.NewEncoder()
	enc.EncodeRequest(&proto.Request{ID: 2, Op: proto.OpPing})
	enc.EncodeRequest(&proto.Request{ID: 3, Op: proto.OpPing})
	writeAsIdleShut(t, c, enc.Bytes()) // the client's pipelined requests arrive as the timeout fires
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	for _, id := range []uint64{2, 3} {
		if r := readResponse(t, br); r.ID != id {
			t.Fatalf("answer id %d, want %d", r.ID, id)
		}
	}
	if _, err := br.ReadByte(); err != io.EOF {
		t.Fatalf("after the answers: %v, want the end of the connection", err)
	}
	// Written after the shut, a request fails at once: the client knows it was not read.
	if _, err := c.Write(enc.Bytes()); !errors.Is(err, syscall.EPIPE) {
		t.Fatalf("a write after the idle cut: %v, want EPIPE", err)
	}
	waitClosed(t, m, closeIdleTimeout)
}
