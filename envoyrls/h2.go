package envoyrls

// The native transport: gRPC over HTTP/2 in cleartext with prior knowledge (h2c, what
// Envoy's gRPC client speaks to a rate limit service), for the unary calls Envoy makes:
// ShouldRateLimit and grpc.health.v1.Health/Check (Health/Watch, a server stream, is
// answered UNIMPLEMENTED). One goroutine per connection reads frames and answers each call
// inline when its request ends, as the msgpack socket's loop does: no handoff between a
// reader, a handler and a writer goroutine (grpc-go's three). A call that waits on Redis
// (a global rule, or a hybrid key that needs an exact sync) is decided on a goroutine of
// its own, which writes its answer under the connection's lock, so the connection's other
// streams go on.
//
// Frames and header compression are golang.org/x/net/http2's Framer and hpack; this file
// keeps the connection's state: settings, streams, flow control in both directions,
// GOAWAY. Answers are written into a buffer that is flushed once no input is buffered (a
// burst of calls costs one write), or at once by a deciding goroutine.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	gproto "google.golang.org/protobuf/proto"

	"github.com/rlsidecar/rlsidecar/internal/rawio"
)

// Transports the Envoy listener can be served with (Config.Transport).
const (
	// TransportNative is this package's own HTTP/2 server (h2.go).
	TransportNative = "native"
	// TransportGRPCGo is google.golang.org/grpc's server.
	TransportGRPCGo = "grpc-go"
	// DefaultTransport is the transport of a Config that names none.
	DefaultTransport = TransportNative
)

// Transports lists the transports, the default first.
var Transports = []string{TransportNative, TransportGRPCGo}

// The methods the native transport serves.
const (
	pathShouldRateLimit = "/" + ServiceName + "/ShouldRateLimit"
	pathHealthCheck     = "/grpc.health.v1.Health/Check"
	pathHealthWatch     = "/grpc.health.v1.Health/Watch"
)

// The native transport's limits, advertised in its SETTINGS where HTTP/2 has one.
const (
	// h2MaxStreams is SETTINGS_MAX_CONCURRENT_STREAMS: a stream opened past it is refused
	// (RST_STREAM REFUSED_STREAM, which a client retries).
	h2MaxStreams = 1024
	// h2Window is the receive window of each stream (SETTINGS_INITIAL_WINDOW_SIZE) and of
	// the connection, given back once half of it is consumed.
	h2Window = 1 << 20
	// h2MaxMessage is the largest request message, grpc-go's default: a larger one is
	// answered RESOURCE_EXHAUSTED as soon as its length prefix arrives.
	h2MaxMessage = 4 << 20
	// h2MaxBuffered bounds the request bytes a connection holds across its streams: a
	// call that would pass it is answered RESOURCE_EXHAUSTED (1,024 streams of 4 MiB
	// messages would otherwise be 4 GiB).
	h2MaxBuffered = 16 << 20
	// h2MaxBufferedAll bounds the request bytes every connection together holds (Envoy's
	// calls are a few hundred bytes, whole in one frame, and never held): 1,024
	// connections of 16 MiB would otherwise be 16 GiB.
	h2MaxBufferedAll = 64 << 20
	// h2MaxHeaderList is SETTINGS_MAX_HEADER_LIST_SIZE.
	h2MaxHeaderList = 16 << 10
	// h2PrefaceTimeout bounds the wait for a new connection's client preface.
	h2PrefaceTimeout = 10 * time.Second
	// h2MaxGRPCMessage bounds the grpc-message trailer, so that trailers fit one frame.
	h2MaxGRPCMessage = 1024
)

// h2GoAwayWait bounds the wait, in a graceful close, between the first GOAWAY (which
// names the highest stream ID possible) and the one naming the last stream the client
// opened: the client's acknowledgement of the PING sent with the first ends it sooner. A
// variable for tests.
var h2GoAwayWait = time.Second

// goAwayPing is the PING sent with a graceful close's first GOAWAY.
var goAwayPing = [8]byte{'r', 'l', 's', '-', 'g', 'o', 'n', 'e'}

// h2Linger bounds how long a connection closed gracefully (GOAWAY sent and its last call
// answered) still reads, and drops, what its client sends, waiting for the client to close
// (x/net's HTTP/2 server waits the same second). A variable for tests.
var h2Linger = time.Second

// method is what a stream calls.
type method uint8

const (
	methodUnknown method = iota
	methodShouldRateLimit
	methodHealthCheck
	methodHealthWatch
)

// serveNative accepts connections on s.ln until Shutdown, one goroutine each. A
// connection accepted as Shutdown begins is served like the others, and closed with
// them in the graceful close's two steps: shutdownNative waits for this loop to end
// before it sends its GOAWAYs.
func (s *Server) serveNative() error {
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return nil
	}
	s.accepting.Add(1)
	s.mu.Unlock()
	defer s.accepting.Done()
	var backoff time.Duration
	for {
		nc, err := s.ln.Accept()
		if err != nil {
			s.mu.Lock()
			stopped := s.stopped
			s.mu.Unlock()
			if stopped {
				return nil
			}
			if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, syscall.ECONNABORTED) {
				// Out of descriptors for now: wait (5 ms doubling to 1 s), as net/http does.
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.cfg.Logger.Warn("envoy rls: accepting", "err", err, "retry_in", backoff)
				time.Sleep(backoff)
				continue
			}
			return fmt.Errorf("envoy rls: accepting: %w", err)
		}
		backoff = 0
		// Accepted as Shutdown began (stopped already), it is served all the same: its
		// client may have written calls on it, which closed unread failed, to Envoy's
		// failure mode, calls that under socket activation the next daemon would have
		// served from the backlog. Shutdown's GOAWAY reaches it (shutdownNative waits
		// for this loop).
		s.serveConn(nc)
	}
}

// serveConn serves nc on a goroutine of its own, among s.conns until it ends. Called by
// the accept loop, or by Shutdown for the backlog, before shutdownNative waits for
// connWG.
func (s *Server) serveConn(nc net.Conn) {
	cn := newH2Conn(s, nc)
	s.mu.Lock()
	if s.conns == nil {
		s.conns = make(map[*h2conn]struct{})
	}
	s.conns[cn] = struct{}{}
	s.connWG.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.connWG.Done()
		cn.serve()
		s.mu.Lock()
		delete(s.conns, cn)
		s.mu.Unlock()
	}()
}

// acceptBacklog serves, without waiting, the connections waiting in the listen backlog
// of a socket the server made (at most maxConns open in all): closing the listener
// would reset them, and their clients (Envoy writes its preface and first call as it
// connects) may have written calls already. A socket systemd passed (Config.Listener) is
// left alone: systemd keeps it, and its backlog, for the next daemon. Called by Shutdown
// before it closes the listener.
func (s *Server) acceptBacklog() {
	sc, ok := s.own.(syscall.Conn)
	if !ok {
		return
	}
	s.mu.Lock()
	room := maxConns - len(s.conns)
	s.mu.Unlock()
	conns, errs := rawio.AcceptPending(sc, room)
	for _, err := range errs {
		s.cfg.Logger.Warn("envoy rls: drain: taking a connection from the backlog", "err", err)
	}
	for _, nc := range conns {
		s.serveConn(nc)
	}
}

// shutdownNative sends every connection GOAWAY, lets the calls in flight finish until ctx
// ends, then closes what is left.
func (s *Server) shutdownNative(ctx context.Context) error {
	// The accept loop ends at the listener's close (Shutdown closed it): a connection it
	// accepted meanwhile is among those sent GOAWAY below.
	s.accepting.Wait()
	s.mu.Lock()
	conns := make([]*h2conn, 0, len(s.conns))
	for cn := range s.conns {
		conns = append(conns, cn)
	}
	s.mu.Unlock()
	done := make(chan struct{})
	go func() {
		// A connection whose client does not read holds its lock in a write: its GOAWAY
		// (and the later connections') waits until the write timeout or the deadline
		// below closes it.
		for _, cn := range conns {
			cn.goAway()
		}
		s.connWG.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		for cn := range s.conns {
			cn.nc.Close()
		}
		s.mu.Unlock()
		<-done
		return fmt.Errorf("envoy rls: calls still in flight at the deadline were cut: %w", ctx.Err())
	}
}

// closeIdlest closes the native transport's connection that has had no call in flight
// for longest (or has not yet sent its preface for longest), if any, else the one whose
// client has held up a call longest (late), and reports whether it did: a new connection
// past maxConns takes its place. A connection busy (its lock held) is passed over.
// Before, a new connection past maxConns was always closed: a process holding 1,024
// connections idle after their preface (which no timeout closes) kept Envoy out for as
// long as it liked, every new connection reset; and until the frame timeout, so did one
// holding 1,024 each with a call whose request never ended, dialing again at each close.
// Envoy opens a new connection when it finds one closed.
func (s *Server) closeIdlest() bool {
	var idle, late *h2conn
	var idleAt, lateAt time.Time
	s.mu.Lock()
	for cn := range s.conns {
		if !cn.mu.TryLock() {
			continue
		}
		if !cn.closed {
			if len(cn.streams) == 0 {
				if idle == nil || cn.idleSince.Before(idleAt) {
					idle, idleAt = cn, cn.idleSince
				}
			} else if t, ok := cn.late(); ok && (late == nil || t.Before(lateAt)) {
				late, lateAt = cn, t
			}
		}
		cn.mu.Unlock()
	}
	s.mu.Unlock()
	cn := idle
	if cn == nil {
		cn = late
	}
	if cn == nil {
		return false
	}
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if _, ok := cn.late(); cn.closed || cn == idle && len(cn.streams) > 0 || cn == late && !ok {
		return false // a call came, or ended, meanwhile; the new connection is refused this time
	}
	cn.closeLocked()
	return true
}

// late returns since when cn's client has held up a call: the oldest request begun and
// not finished while the connection waited for more of it (reqDL), or the oldest answer
// waiting for its window (stalled); ok false when neither. The timeouts close such a
// connection (FrameTimeout, WriteTimeout), but a process dialing again at each close
// keeps the connections it holds so. Called with mu held.
func (cn *h2conn) late() (since time.Time, ok bool) {
	since, ok = cn.stalled, !cn.stalled.IsZero()
	if !cn.reqDL.IsZero() {
		if t := cn.reqDL.Add(-cn.s.cfg.FrameTimeout); !ok || t.Before(since) {
			since, ok = t, true
		}
	}
	return since, ok
}

// h2conn is one client connection. Its read loop (serve) is the only reader; mu guards
// the writer and every stream's state, shared with the goroutines deciding calls that
// wait on Redis.
type h2conn struct {
	s    *Server
	nc   net.Conn
	br   *bufio.Reader
	rfr  *http2.Framer  // reads only
	hdec *hpack.Decoder // the client's header blocks, into hdr
	hdr  hdrs

	mu       sync.Mutex
	bw       *bufio.Writer
	wfr      *http2.Framer // writes only
	henc     *hpack.Encoder
	hbuf     bytes.Buffer
	streams  map[uint32]*h2stream
	free     []*h2stream
	lastID   uint32      // the highest stream the client opened
	goneAway bool        // GOAWAY sent: no stream is opened past lastID
	draining bool        // the first GOAWAY of a graceful close sent (goAway), the final one not yet
	goAwayT  *time.Timer // sends the final GOAWAY if the PING is not acknowledged first
	closed   bool        // the connection is closed or closing: nothing more is written
	prefaced bool        // the server's preface (its SETTINGS) written: prefaceLocked
	linger   bool        // closed gracefully: only the write side is shut, serve drains the read side
	sendConn int64       // what the connection's send window still allows
	peerInit int64       // the peer's SETTINGS_INITIAL_WINDOW_SIZE
	peerMax  int         // the peer's SETTINGS_MAX_FRAME_SIZE
	blocked  []*h2stream
	// unended counts the streams whose request has not ended (no END_STREAM yet), which
	// bodyDeadline times: without one, it does not walk the streams.
	unended int
	// idleSince is when the connection was accepted, or when its last call in flight
	// ended (closeIdlest).
	idleSince time.Time
	sc        *scratch // the inline path's
	out       []byte   // the inline path's answer

	// tableMax is the size of henc's dynamic table: hpack's 4,096 until the client's
	// SETTINGS_HEADER_TABLE_SIZE lowers it. sizeUpdate: the client lowered it, and the
	// next header block must begin with a dynamic table size update (RFC 7541 §4.2),
	// which henc writes before its next field but the OK answers' blocks, encoded once
	// (okHeaders, okTrailers), do not.
	tableMax   uint32
	sizeUpdate bool

	buffered int       // request bytes held in the streams' bodies
	readDL   bool      // a read deadline is set: a request begun is not finished, or an answer stalled (setDeadline)
	dlAt     time.Time // the read deadline set, while readDL
	reqDL    time.Time // FrameTimeout after the oldest request begun and not finished (bodyDeadline); zero: none
	// stalled is when the answers waiting for send window (blocked) last moved: when the
	// first of them began waiting, or a window the client opened last sent some of their
	// bytes; zero while none waits. WriteTimeout after it the connection is closed.
	stalled     time.Time
	recvConn    int64 // what the client may still send on the connection
	recvUnacked int64 // consumed and not yet given back in a WINDOW_UPDATE
	deciding    sync.WaitGroup
}

// h2stream is one call.
type h2stream struct {
	id          uint32
	method      method
	ended       bool  // the client's END_STREAM arrived
	deciding    bool  // handed to a goroutine that answers it
	done        bool  // answered, or reset: no more is written
	deadline    int64 // from grpc-timeout, Unix nanoseconds; 0: none
	encoding    string
	body        []byte
	since       time.Time // when its body began, or its headers-only wait did (bodyDeadline)
	recvAvail   int64
	recvUnacked int64
	sendWin     int64
	out         []byte // answer bytes waiting for send window
	outOff      int
	queued      bool // in cn.blocked, waiting for send window
	// refused: the call is answered with this error once its request ends (refuse).
	refused     bool
	refusedHTTP int
	refusedCode codes.Code
	refusedMsg  string
}

func newH2Conn(s *Server, nc net.Conn) *h2conn {
	// Reads and writes go through raw system calls where the socket allows (internal/rawio):
	// through net.Conn, the first read after an idle moment wakes the runtime's sysmon
	// thread on the call's path.
	var rw io.ReadWriter = nc
	if rc, ok := nc.(rawio.Conn); ok {
		rw = rawio.New(rc, nil)
	}
	dw := &deadlineWriter{w: rw, nc: nc, timeout: s.cfg.WriteTimeout}
	cn := &h2conn{s: s, nc: nc, br: bufio.NewReaderSize(rw, 32<<10), bw: bufio.NewWriterSize(dw, 32<<10),
		streams: make(map[uint32]*h2stream), sendConn: 65535, peerInit: 65535, peerMax: 16384,
		recvConn: h2Window, sc: new(scratch), tableMax: 4096, idleSince: time.Now()}
	cn.rfr = http2.NewFramer(io.Discard, cn.br)
	cn.hdec = hpack.NewDecoder(4096, cn.emit)
	cn.hdec.SetMaxStringLength(h2MaxHeaderList)
	cn.rfr.SetReuseFrames()
	cn.rfr.SetMaxReadFrameSize(16384) // SETTINGS_MAX_FRAME_SIZE's default, which we keep
	cn.wfr = http2.NewFramer(cn.bw, nil)
	cn.henc = hpack.NewEncoder(&cn.hbuf)
	return cn
}

// deadlineWriter keeps a write deadline ahead of every write to the connection's socket,
// so that a client that stops reading its answers is cut off once its socket's buffer has
// stayed full for timeout: the write fails and the connection closes with it. Without
// it, the write waited for as long as the client stayed connected, holding the
// connection's lock, and with it the reading loop, every stream and every deciding
// goroutine. The deadline moves only once more than half used: one timer update per
// timeout/2, not per write. Used under the connection's mu.
type deadlineWriter struct {
	w        io.Writer
	nc       net.Conn
	timeout  time.Duration
	deadline time.Time
}

func (d *deadlineWriter) Write(p []byte) (int, error) {
	if now := time.Now(); d.deadline.Sub(now) < d.timeout/2 {
		d.deadline = now.Add(d.timeout)
		if err := d.nc.SetWriteDeadline(d.deadline); err != nil {
			return 0, err
		}
	}
	return d.w.Write(p)
}

// serve runs the connection until it closes, then waits for its deciding goroutines.
func (cn *h2conn) serve() {
	defer func() {
		cn.mu.Lock()
		cn.closeLocked()
		linger := cn.linger
		cn.mu.Unlock()
		if linger {
			// The answers and a FIN are on their way; what the client still sends (a
			// WINDOW_UPDATE, a PING, a stream it opened before it read the GOAWAY) is read
			// and dropped. Closed with those bytes unread, a TCP socket would answer them
			// with a reset, and the client's kernel drops the answers it has not read yet.
			cn.nc.SetReadDeadline(time.Now().Add(h2Linger))
			io.Copy(io.Discard, cn.br)
			cn.nc.Close()
		}
		cn.deciding.Wait()
	}()
	cn.nc.SetReadDeadline(time.Now().Add(h2PrefaceTimeout))
	var preface [len(http2.ClientPreface)]byte
	if _, err := io.ReadFull(cn.br, preface[:]); err != nil || string(preface[:]) != http2.ClientPreface {
		return
	}
	cn.mu.Lock()
	if cn.closed {
		// Closed gracefully while the preface came (Shutdown, the client sending
		// nothing before the final GOAWAY): the read deadline that woke this read or
		// would wake the next is the close's.
		cn.mu.Unlock()
		return
	}
	cn.nc.SetReadDeadline(time.Time{})
	err := cn.prefaceLocked()
	if err == nil {
		err = cn.bw.Flush()
	}
	cn.mu.Unlock()
	if err != nil {
		return
	}
	for {
		if cn.br.Buffered() == 0 {
			cn.mu.Lock()
			if cn.bw.Buffered() > 0 && !cn.closed {
				if err := cn.bw.Flush(); err != nil {
					cn.mu.Unlock()
					return
				}
			}
			cn.mu.Unlock()
		}
		f, err := cn.rfr.ReadFrame()
		cn.mu.Lock()
		if cn.closed {
			// Closed while this read waited (a graceful close by the last answer or by
			// Shutdown): what was read is not handled.
			cn.mu.Unlock()
			return
		}
		if err != nil && cn.readDL && errors.Is(err, os.ErrDeadlineExceeded) {
			if !cn.stalled.IsZero() && time.Since(cn.stalled) >= cn.s.cfg.WriteTimeout {
				cn.s.cfg.Logger.Warn("envoy rls: closing a connection whose client gives its answers no window",
					"write_timeout", cn.s.cfg.WriteTimeout, "waiting", len(cn.blocked))
			} else {
				cn.s.cfg.Logger.Warn("envoy rls: closing a connection whose call's request was begun and not finished in time",
					"frame_timeout", cn.s.cfg.FrameTimeout, "buffered", cn.buffered)
			}
			cn.closeLocked()
			cn.mu.Unlock()
			return
		}
		if err == nil {
			err = cn.handle(f)
		}
		if err != nil {
			err = cn.streamError(err)
		}
		if err != nil {
			cn.fail(err)
			cn.mu.Unlock()
			return
		}
		if cn.closed {
			cn.mu.Unlock()
			return
		}
		cn.bodyDeadline() // for the next read, under the lock this frame already took
		cn.mu.Unlock()
	}
}

// prefaceLocked writes the server's connection preface, its SETTINGS and the
// connection's window, unless written already: by serve once the client's preface came,
// or by goAway first, when Shutdown finds a connection whose client has not sent its
// preface yet (RFC 9113 3.4: the server's first frame is its SETTINGS). Called with mu
// held; the caller flushes.
func (cn *h2conn) prefaceLocked() error {
	if cn.prefaced {
		return nil
	}
	cn.prefaced = true
	err := cn.wfr.WriteSettings(
		http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: h2MaxStreams},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: h2Window},
		http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: h2MaxHeaderList},
	)
	if err == nil {
		err = cn.wfr.WriteWindowUpdate(0, h2Window-65535)
	}
	return err
}

// bodyDeadline sets the connection's read deadline to FrameTimeout after the oldest
// request begun and not finished, or clears it when none is. A call's request held
// unfinished was held for as long as the client stayed connected: 16 MiB a connection
// (h2MaxBuffered), and 200 connections each sending four 4 MiB messages but their last
// byte held 2.7 GB, past the unit's MemoryMax. A request whose headers came and no byte
// of its body is timed too, from when the connection is first about to wait with it
// (its read buffer holds no whole frame: waits), so that a call whose headers and body
// arrive together costs no clock reading: before, it had no deadline, and 1,024
// connections each holding such a call (never idle, so never closed to make room) kept
// every Envoy out. The streams are
// walked only while one has not ended (unended) or a body is held: calls ended and
// waiting on Redis cost nothing here, where walking them after each frame cost 4.5 µs
// with 512 in flight (TestNativeBodyDeadlineSkipsEndedCalls). Called with mu held, after
// each frame.
func (cn *h2conn) bodyDeadline() {
	var oldest time.Time
	if cn.buffered > 0 || (cn.unended > 0 && cn.waits()) {
		var now time.Time
		for _, st := range cn.streams {
			if st.ended {
				continue
			}
			if st.since.IsZero() { // headers only so far
				if now.IsZero() {
					now = time.Now()
				}
				st.since = now
			}
			if oldest.IsZero() || st.since.Before(oldest) {
				oldest = st.since
			}
		}
	}
	// No body unfinished: the bytes held, if any, are ended calls' waiting for their
	// decision (a global rule's) or their answer's window (stalled), and but for the
	// latter the connection may idle as long as its client likes.
	cn.reqDL = time.Time{}
	if !oldest.IsZero() {
		cn.reqDL = oldest.Add(cn.s.cfg.FrameTimeout)
	}
	cn.setDeadline()
}

// setDeadline sets the connection's read deadline to the earlier of reqDL and
// WriteTimeout after stalled, or clears it when neither is set. It does not read br: a
// deciding goroutine calls it (answer) while serve reads. Called with mu held.
func (cn *h2conn) setDeadline() {
	at := cn.reqDL
	if !cn.stalled.IsZero() {
		if w := cn.stalled.Add(cn.s.cfg.WriteTimeout); at.IsZero() || w.Before(at) {
			at = w
		}
	}
	if at.IsZero() {
		if cn.readDL {
			cn.nc.SetReadDeadline(time.Time{})
			cn.readDL = false
		}
		return
	}
	if !cn.readDL || !at.Equal(cn.dlAt) {
		cn.nc.SetReadDeadline(at)
		cn.readDL, cn.dlAt = true, at
	}
}

// waits reports whether the next frame's read waits on the socket: the read buffer does
// not hold that frame whole. Before, bodyDeadline took an empty buffer for it, and a
// call's headers followed in one write by the first bytes of a frame whose rest never
// came left the connection waiting inside that frame with no deadline.
func (cn *h2conn) waits() bool {
	n := cn.br.Buffered()
	if n < 9 { // a frame header's size
		return true
	}
	h, _ := cn.br.Peek(9) // buffered already: it does not read
	return n < 9+int(h[0])<<16|int(h[1])<<8|int(h[2])
}

// streamError resets the stream when err is a stream's fault only (a StreamError), and
// then reports the reset's outcome; any other err is returned as is.
func (cn *h2conn) streamError(err error) error {
	var se http2.StreamError
	if errors.As(err, &se) {
		return cn.resetStream(se.StreamID, se.Code)
	}
	return err
}

// fail ends the connection on err: a protocol error is told the client in a GOAWAY.
// Called with mu held.
func (cn *h2conn) fail(err error) {
	if cn.closed {
		return
	}
	code, debug := http2.ErrCode(0xff), ""
	var ce http2.ConnectionError
	var he h2Error
	switch {
	case errors.As(err, &ce):
		code = http2.ErrCode(ce)
		if d := cn.rfr.ErrorDetail(); d != nil {
			debug = d.Error()
		}
	case errors.Is(err, http2.ErrFrameTooLarge):
		code = http2.ErrCodeFrameSize
	case errors.As(err, &he):
		code, debug = he.code, he.reason
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		cn.s.cfg.Logger.Warn("envoy rls: closing a connection whose client does not take its answers",
			"write_timeout", cn.s.cfg.WriteTimeout, "streams", len(cn.streams))
	}
	if code != 0xff {
		cn.nc.SetWriteDeadline(time.Now().Add(time.Second))
		if cn.wfr.WriteGoAway(cn.lastID, code, []byte(debug)) == nil {
			cn.bw.Flush()
		}
	}
	cn.closeLocked()
}

// h2Error is a connection error this file finds (the Framer finds the others).
type h2Error struct {
	code   http2.ErrCode
	reason string
}

func (e h2Error) Error() string { return "http2: " + e.code.String() + ": " + e.reason }

func connErr(code http2.ErrCode, reason string) error { return h2Error{code, reason} }

// closeLocked closes the connection: every stream is done, nothing more is written.
func (cn *h2conn) closeLocked() {
	if cn.closed {
		return
	}
	cn.endLocked()
	cn.nc.Close()
}

// closeGracefullyLocked ends a connection that sent GOAWAY and has no call left: it
// writes what is buffered and shuts the write side down, so the client reads every
// answer and then the end; serve reads on until the client closes (h2Linger at most), and
// then closes. A connection that cannot shut only its write side is closed.
func (cn *h2conn) closeGracefullyLocked() {
	if cn.closed {
		return
	}
	cw, ok := cn.nc.(interface{ CloseWrite() error })
	if !ok || cn.bw.Flush() != nil || cw.CloseWrite() != nil {
		cn.closeLocked()
		return
	}
	cn.endLocked()
	cn.linger = true
	// Wake serve if it waits in a read that no more bytes may end: its deferred drain
	// sets the linger's own deadline.
	cn.nc.SetReadDeadline(time.Now())
}

// endLocked marks the connection closed: every stream is done, nothing more is written.
func (cn *h2conn) endLocked() {
	cn.closed = true
	if cn.goAwayT != nil {
		cn.goAwayT.Stop()
	}
	for id, st := range cn.streams {
		st.done = true
		delete(cn.streams, id)
		cn.s.buffered.Add(-int64(len(st.body)))
	}
	cn.buffered = 0
	cn.unended = 0
	cn.blocked = cn.blocked[:0]
	cn.stalled = time.Time{}
}

// goAway starts a graceful close in two steps, as RFC 9113 6.8 advises: a first GOAWAY
// names the highest stream ID possible, with a PING; the client opens no stream once it
// reads it, and those it opened meanwhile are served. Once the PING's acknowledgement
// comes (every frame the client sent before it was read), or after h2GoAwayWait, the
// final GOAWAY names the last stream the client opened (finalGoAwayLocked). A single
// GOAWAY naming the last stream read refused the calls already on their way
// (REFUSED_STREAM), which Envoy's rate limit filter does not retry: its failure mode
// decided them, at every restart of the daemon.
func (cn *h2conn) goAway() {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if cn.goneAway || cn.draining || cn.closed {
		return
	}
	cn.draining = true
	// A connection accepted before Shutdown whose client's preface has not come yet
	// gets the server's SETTINGS first. Before, the GOAWAY was the first frame, which
	// Envoy's codec and grpc-go's client take for a protocol error: the calls the
	// client had written on the connection failed, to Envoy's failure mode.
	err := cn.prefaceLocked()
	if err == nil {
		err = cn.wfr.WriteGoAway(1<<31-1, http2.ErrCodeNo, nil)
	}
	if err == nil {
		err = cn.wfr.WritePing(false, goAwayPing)
	}
	if err == nil {
		err = cn.bw.Flush()
	}
	if err != nil {
		cn.finalGoAwayLocked()
		return
	}
	cn.goAwayT = time.AfterFunc(h2GoAwayWait, func() {
		cn.mu.Lock()
		defer cn.mu.Unlock()
		cn.finalGoAwayLocked()
	})
}

// finalGoAwayLocked ends a graceful close: GOAWAY names the last stream the client
// opened, those streams are answered, and the connection closes once none is left.
func (cn *h2conn) finalGoAwayLocked() {
	if cn.goneAway || cn.closed {
		return
	}
	cn.goneAway = true
	if cn.goAwayT != nil {
		cn.goAwayT.Stop()
	}
	if cn.wfr.WriteGoAway(cn.lastID, http2.ErrCodeNo, nil) == nil {
		cn.bw.Flush()
	}
	if len(cn.streams) == 0 {
		cn.closeGracefullyLocked()
	}
}

// handle applies one frame. Called with mu held; it returns a StreamError for a stream's
// fault and any other error for the connection's.
func (cn *h2conn) handle(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.HeadersFrame:
		cn.hdr = hdrs{id: f.StreamID, end: f.StreamEnded()}
		return cn.headerFragment(f.HeaderBlockFragment(), f.HeadersEnded())
	case *http2.ContinuationFrame: // the Framer checks that it follows its HEADERS
		return cn.headerFragment(f.HeaderBlockFragment(), f.HeadersEnded())
	case *http2.DataFrame:
		return cn.onData(f)
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		if err := f.ForeachSetting(cn.onSetting); err != nil {
			return err
		}
		if err := cn.wfr.WriteSettingsAck(); err != nil {
			return err
		}
		return cn.pump()
	case *http2.PingFrame:
		if f.IsAck() {
			if cn.draining && f.Data == goAwayPing {
				cn.finalGoAwayLocked()
			}
			return nil
		}
		return cn.wfr.WritePing(true, f.Data)
	case *http2.WindowUpdateFrame:
		return cn.onWindowUpdate(f)
	case *http2.RSTStreamFrame:
		if f.StreamID > cn.lastID {
			return connErr(http2.ErrCodeProtocol, "RST_STREAM on an idle stream")
		}
		if st := cn.streams[f.StreamID]; st != nil {
			cn.closeStream(st)
		}
		return nil
	case *http2.GoAwayFrame:
		// The client opens no more streams: close once those it opened are answered.
		cn.goneAway = true
		if len(cn.streams) == 0 {
			cn.closeGracefullyLocked()
		}
		return nil
	case *http2.PushPromiseFrame:
		return connErr(http2.ErrCodeProtocol, "PUSH_PROMISE from a client")
	}
	return nil // PRIORITY, unknown frame types: ignored
}

// onSetting applies one of the client's settings.
func (cn *h2conn) onSetting(s http2.Setting) error {
	if err := s.Valid(); err != nil {
		return err
	}
	switch s.ID {
	case http2.SettingInitialWindowSize:
		delta := int64(s.Val) - cn.peerInit
		cn.peerInit = int64(s.Val)
		for _, st := range cn.streams {
			st.sendWin += delta
			if st.sendWin > 1<<31-1 {
				return connErr(http2.ErrCodeFlowControl, "a stream's send window past 2^31-1")
			}
		}
	case http2.SettingMaxFrameSize:
		cn.peerMax = int(s.Val)
	case http2.SettingHeaderTableSize:
		cn.henc.SetMaxDynamicTableSizeLimit(s.Val)
		if s.Val < cn.tableMax { // henc shrinks its table to s.Val, and owes the update
			cn.tableMax, cn.sizeUpdate = s.Val, true
		}
	}
	return nil
}

func (cn *h2conn) onWindowUpdate(f *http2.WindowUpdateFrame) error {
	inc := int64(f.Increment)
	if f.StreamID == 0 {
		cn.sendConn += inc
		if cn.sendConn > 1<<31-1 {
			return connErr(http2.ErrCodeFlowControl, "the connection's send window past 2^31-1")
		}
		return cn.pump()
	}
	if f.StreamID > cn.lastID {
		return connErr(http2.ErrCodeProtocol, "WINDOW_UPDATE on an idle stream")
	}
	st := cn.streams[f.StreamID]
	if st == nil {
		return nil // a closed stream
	}
	st.sendWin += inc
	if st.sendWin > 1<<31-1 {
		return http2.StreamError{StreamID: st.id, Code: http2.ErrCodeFlowControl}
	}
	return cn.pump()
}

// hdrs is the header block being read: a HEADERS frame's and its CONTINUATIONs',
// decoded as it arrives (emit) into what a call needs, with no per-field allocation but
// hpack's for literal values.
type hdrs struct {
	id        uint32
	end       bool   // END_STREAM
	size      uint32 // the decoded header list's size so far (RFC 9113, 6.5.2)
	block     int    // its encoded bytes so far
	truncated bool   // past h2MaxHeaderList
	invalid   string // why the block is malformed; "" if it is not
	regular   bool   // a regular field was seen: no pseudo-field may follow
	pseudo    uint8  // the pseudo-fields seen, one bit each (pseudoBits)
	post      bool
	path      string
	ctype     string
	timeout   string
	encoding  string
}

// pseudoBits are hdrs.pseudo's bits.
const (
	pseudoMethod uint8 = 1 << iota
	pseudoPath
	pseudoScheme
	pseudoAuthority
)

// emit takes one decoded header field of the block being read.
func (cn *h2conn) emit(hf hpack.HeaderField) {
	h := &cn.hdr
	if h.invalid != "" || h.truncated {
		return
	}
	h.size += hf.Size()
	if h.size > h2MaxHeaderList {
		h.truncated = true
		return
	}
	if len(hf.Name) > 0 && hf.Name[0] == ':' {
		if h.regular {
			h.invalid = "a pseudo-header field after a regular one"
			return
		}
		var bit uint8
		switch hf.Name {
		case ":method":
			bit, h.post = pseudoMethod, hf.Value == "POST"
		case ":path":
			bit, h.path = pseudoPath, hf.Value
		case ":scheme":
			bit = pseudoScheme
		case ":authority":
			bit = pseudoAuthority
		default:
			h.invalid = "pseudo-header field " + hf.Name + " in a request"
			return
		}
		if h.pseudo&bit != 0 {
			h.invalid = "pseudo-header field " + hf.Name + " twice"
		}
		h.pseudo |= bit
		return
	}
	h.regular = true
	switch hf.Name {
	case "content-type":
		h.ctype = hf.Value
	case "grpc-timeout":
		h.timeout = hf.Value
	case "grpc-encoding":
		h.encoding = hf.Value
	}
}

// headerFragment decodes a piece of a header block; the last one (ended) completes it.
func (cn *h2conn) headerFragment(frag []byte, ended bool) error {
	h := &cn.hdr
	h.block += len(frag)
	if h.block > 2*h2MaxHeaderList {
		return connErr(http2.ErrCodeProtocol, "a header block past twice the header list size")
	}
	if _, err := cn.hdec.Write(frag); err != nil {
		return connErr(http2.ErrCodeCompression, err.Error())
	}
	if !ended {
		return nil
	}
	if err := cn.hdec.Close(); err != nil {
		return connErr(http2.ErrCodeCompression, err.Error())
	}
	return cn.onHeaders()
}

// onHeaders opens a stream (a call) with the header block just read, or ends one with
// trailers.
func (cn *h2conn) onHeaders() error {
	h := &cn.hdr
	id := h.id
	if id%2 == 0 {
		return connErr(http2.ErrCodeProtocol, "an even stream id from a client")
	}
	if st := cn.streams[id]; st != nil {
		// Trailers: they must end the stream.
		if st.ended {
			return http2.StreamError{StreamID: id, Code: http2.ErrCodeStreamClosed}
		}
		if !h.end {
			return connErr(http2.ErrCodeProtocol, "trailers without END_STREAM")
		}
		if h.pseudo != 0 || h.invalid != "" {
			return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol}
		}
		st.ended = true
		cn.unended--
		return cn.requestEnded(st, st.body)
	}
	if id <= cn.lastID {
		if h.end {
			// Trailers of a call answered and reset before its request ended (too
			// large), sent before the client read the reset: ignored, as RFC 9113 5.1
			// says of frames on a stream the server reset (its header block decoded).
			return nil
		}
		return connErr(http2.ErrCodeStreamClosed, "HEADERS on a closed stream")
	}
	cn.lastID = id
	if cn.goneAway {
		return cn.wfr.WriteRSTStream(id, http2.ErrCodeRefusedStream)
	}
	if len(cn.streams) >= h2MaxStreams {
		return cn.wfr.WriteRSTStream(id, http2.ErrCodeRefusedStream)
	}
	if h.invalid != "" || (!h.truncated && h.pseudo&(pseudoMethod|pseudoPath|pseudoScheme) != pseudoMethod|pseudoPath|pseudoScheme) {
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol} // malformed
	}
	st := cn.newStream(id)
	st.ended = h.end
	cn.streams[id] = st
	if !st.ended {
		cn.unended++
	}
	if h.truncated {
		return cn.refuse(st, 431, codes.ResourceExhausted, "the header list is larger than "+strconv.Itoa(h2MaxHeaderList)+" bytes")
	}
	st.encoding = h.encoding
	path, ctype, timeout, post := h.path, h.ctype, h.timeout, h.post
	if !post {
		return cn.refuse(st, 405, codes.Internal, "invalid gRPC request method")
	}
	if !isGRPC(ctype) {
		return cn.refuse(st, 415, codes.InvalidArgument, fmt.Sprintf("invalid gRPC request content-type %q", ctype))
	}
	if timeout != "" {
		d, ok := parseTimeout(timeout)
		if !ok {
			return cn.refuse(st, 200, codes.Internal, fmt.Sprintf("malformed grpc-timeout %q", timeout))
		}
		// Saturating: the largest timeouts gRPC allows (99999999H) pass int64's range.
		st.deadline = cn.s.now()
		if st.deadline <= math.MaxInt64-int64(d) {
			st.deadline += int64(d)
		} else {
			st.deadline = math.MaxInt64
		}
	}
	switch path {
	case pathShouldRateLimit:
		st.method = methodShouldRateLimit
	case pathHealthCheck:
		st.method = methodHealthCheck
	case pathHealthWatch:
		return cn.refuse(st, 200, codes.Unimplemented, "Health/Watch is not served by the native transport (--envoy-rls-transport grpc-go serves it); use Health/Check")
	default:
		return cn.refuse(st, 200, codes.Unimplemented, fmt.Sprintf("unknown method %q", path))
	}
	if st.ended {
		return cn.requestEnded(st, nil)
	}
	return nil
}

// isGRPC reports whether a content-type is gRPC's with the proto codec.
func isGRPC(ct string) bool {
	rest, ok := strings.CutPrefix(ct, "application/grpc")
	if !ok {
		return false
	}
	if rest == "" || rest[0] == ';' {
		return true
	}
	sub, _, _ := strings.Cut(rest, ";")
	return sub == "+proto"
}

// parseTimeout reads a grpc-timeout value: at most 8 digits and a unit.
func parseTimeout(v string) (time.Duration, bool) {
	if len(v) < 2 || len(v) > 9 {
		return 0, false
	}
	n, err := strconv.ParseInt(v[:len(v)-1], 10, 64)
	if err != nil || n < 0 {
		return 0, false
	}
	var unit time.Duration
	switch v[len(v)-1] {
	case 'H':
		unit = time.Hour
	case 'M':
		unit = time.Minute
	case 'S':
		unit = time.Second
	case 'm':
		unit = time.Millisecond
	case 'u':
		unit = time.Microsecond
	case 'n':
		unit = time.Nanosecond
	default:
		return 0, false
	}
	if n > int64(1<<63-1)/int64(unit) {
		return 1<<63 - 1, true
	}
	return time.Duration(n) * unit, true
}

func (cn *h2conn) newStream(id uint32) *h2stream {
	var st *h2stream
	if n := len(cn.free); n > 0 {
		st = cn.free[n-1]
		cn.free = cn.free[:n-1]
		body := st.body[:0]
		*st = h2stream{body: body}
	} else {
		st = new(h2stream)
	}
	st.id, st.recvAvail, st.sendWin = id, h2Window, cn.peerInit
	return st
}

// onData takes a piece of a request's body.
func (cn *h2conn) onData(f *http2.DataFrame) error {
	n := int64(f.Length) // padding included: it counts against flow control
	cn.recvConn -= n
	if cn.recvConn < 0 {
		return connErr(http2.ErrCodeFlowControl, "DATA past the connection's window")
	}
	cn.recvUnacked += n
	if cn.recvUnacked >= h2Window/2 {
		if err := cn.wfr.WriteWindowUpdate(0, uint32(cn.recvUnacked)); err != nil {
			return err
		}
		cn.recvConn += cn.recvUnacked
		cn.recvUnacked = 0
	}
	id := f.StreamID
	if id > cn.lastID {
		return connErr(http2.ErrCodeProtocol, "DATA on an idle stream")
	}
	st := cn.streams[id]
	if st == nil {
		return nil // a stream answered or reset already: what was in flight is dropped
	}
	if st.ended {
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeStreamClosed}
	}
	st.recvAvail -= n
	if st.recvAvail < 0 {
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeFlowControl}
	}
	st.ended = f.StreamEnded()
	if st.ended {
		cn.unended--
	}
	data := f.Data()
	if st.refused {
		data = nil // dropped: the answer is an error already
	}
	if st.ended && len(st.body) == 0 {
		return cn.requestEnded(st, data) // the whole body in one frame: no copy
	}
	if cn.buffered+len(data) > h2MaxBuffered {
		return cn.abortRST(st, codes.ResourceExhausted, fmt.Sprintf("the connection's calls hold more than %d request bytes", h2MaxBuffered))
	}
	if cn.s.buffered.Load()+int64(len(data)) > h2MaxBufferedAll {
		return cn.abortRST(st, codes.ResourceExhausted, fmt.Sprintf("the server's calls hold more than %d request bytes", h2MaxBufferedAll))
	}
	cn.s.buffered.Add(int64(len(data)))
	if st.since.IsZero() {
		st.since = time.Now()
	}
	st.body = append(st.body, data...)
	cn.buffered += len(data)
	if len(st.body) >= 5 {
		if n := binary.BigEndian.Uint32(st.body[1:5]); n > h2MaxMessage {
			return cn.abortRST(st, codes.ResourceExhausted, fmt.Sprintf("grpc: received message larger than max (%d vs. %d)", n, h2MaxMessage))
		}
	}
	if st.ended {
		return cn.requestEnded(st, st.body)
	}
	st.recvUnacked += n
	if st.recvUnacked >= h2Window/2 {
		if err := cn.wfr.WriteWindowUpdate(id, uint32(st.recvUnacked)); err != nil {
			return err
		}
		st.recvAvail += st.recvUnacked
		st.recvUnacked = 0
	}
	return nil
}

// requestEnded answers a call whose request body is complete: body (nil when the stream
// ended with no data).
func (cn *h2conn) requestEnded(st *h2stream, body []byte) error {
	if st.refused {
		return cn.abort(st, st.refusedHTTP, st.refusedCode, st.refusedMsg)
	}
	if st.deadline != 0 && cn.s.now() >= st.deadline {
		return cn.abort(st, 200, codes.DeadlineExceeded, "the call's deadline passed before it was decided")
	}
	if len(body) < 5 {
		return cn.abort(st, 200, codes.Internal, "grpc: the request ended without a whole message")
	}
	n := binary.BigEndian.Uint32(body[1:5])
	if n > h2MaxMessage {
		return cn.abort(st, 200, codes.ResourceExhausted, fmt.Sprintf("grpc: received message larger than max (%d vs. %d)", n, h2MaxMessage))
	}
	switch body[0] {
	case 0:
	case 1:
		if st.encoding == "" || st.encoding == "identity" {
			return cn.abort(st, 200, codes.Internal, "grpc: compressed flag set with identity or empty encoding")
		}
		return cn.abort(st, 200, codes.Unimplemented, fmt.Sprintf("grpc: Decompressor is not installed for grpc-encoding %q", st.encoding))
	default:
		return cn.abort(st, 200, codes.Internal, fmt.Sprintf("grpc: invalid message flag %d", body[0]))
	}
	if int(n) != len(body)-5 {
		return cn.abort(st, 200, codes.Internal, "grpc: a unary call's request is not one whole message")
	}
	msg := body[5:]
	switch st.method {
	case methodShouldRateLimit:
		return cn.shouldRateLimit(st, msg)
	case methodHealthCheck:
		return cn.healthCheck(st, msg)
	}
	return errors.New("BUG: a request ended on a stream with no method")
}

// shouldRateLimit decides a call inline, or hands it to a goroutine when it waits on
// Redis.
func (cn *h2conn) shouldRateLimit(st *h2stream, msg []byte) error {
	s, sc := cn.s, cn.sc
	arrived := s.arrival()
	if err := parseRequest(msg, &sc.call); err != nil {
		err = cn.abort(st, 200, codes.Internal, "grpc: error unmarshalling request: "+err.Error())
		s.answered(arrived)
		return err
	}
	done, err := s.decideInline(sc)
	if err != nil {
		err = cn.abortErr(st, err)
		s.answered(arrived)
		return err
	}
	if !done {
		cn.decideLater(st, msg, arrived)
		return nil
	}
	cn.out = appendMessage(cn.out[:0], &sc.ans)
	err = cn.answer(st, cn.out)
	s.answered(arrived)
	return err
}

// appendMessage appends a's response as a gRPC message: the 5-byte prefix, then the
// protobuf bytes.
func appendMessage(b []byte, a *answer) []byte {
	start := len(b)
	b = append(b, 0, 0, 0, 0, 0)
	b = appendResponse(b, a)
	binary.BigEndian.PutUint32(b[start+1:], uint32(len(b)-start-5))
	return b
}

// decideLater decides the call in msg on a goroutine of its own, which answers st under
// mu unless the stream was reset or the connection closed meanwhile. A call the client
// reset, or whose deadline passed, before the goroutine begins is not decided: nothing
// is taken for it (once decided, a call is charged: a global rule's script is in Redis).
// A call answered is observed from arrived (Server.answered).
func (cn *h2conn) decideLater(st *h2stream, msg []byte, arrived int64) {
	s := cn.s
	sc := s.scratch.Get().(*scratch)
	sc.raw = append(sc.raw[:0], msg...)
	st.deciding = true
	cn.deciding.Add(1)
	go func() {
		defer cn.deciding.Done()
		cn.mu.Lock()
		gone := st.done
		cn.mu.Unlock()
		var out []byte
		var err error
		switch {
		case gone: // not answered either (below)
		case st.deadline != 0 && s.now() >= st.deadline:
			err = status.Error(codes.DeadlineExceeded, "the call's deadline passed before it was decided")
		default:
			err = parseRequest(sc.raw, &sc.call)
			if err == nil {
				err = s.decide(sc)
			}
		}
		if err == nil && !gone {
			out = appendMessage(make([]byte, 0, max(sc.outLen, 128)), &sc.ans)
			sc.outLen = len(out)
		}
		if cap(sc.raw) > maxKeptRequest {
			sc.raw = nil
		}
		s.scratch.Put(sc)
		cn.mu.Lock()
		defer cn.mu.Unlock()
		st.deciding = false
		if st.done {
			cn.free = append(cn.free, st)
			return
		}
		if err == nil {
			err = cn.answer(st, out)
		} else {
			err = cn.abortErr(st, err)
		}
		if err == nil && !cn.closed {
			err = cn.bw.Flush()
		}
		s.answered(arrived)
		if err != nil {
			cn.fail(err)
		}
	}()
}

// healthCheck answers grpc.health.v1.Health/Check from the server's health.
func (cn *h2conn) healthCheck(st *h2stream, msg []byte) error {
	var req healthpb.HealthCheckRequest
	if err := gproto.Unmarshal(msg, &req); err != nil {
		return cn.abort(st, 200, codes.Internal, "grpc: error unmarshalling request: "+err.Error())
	}
	resp, err := cn.s.health.Check(context.Background(), &req)
	if err != nil {
		return cn.abortErr(st, err)
	}
	b, err := gproto.MarshalOptions{}.MarshalAppend([]byte{0, 0, 0, 0, 0}, resp)
	if err != nil {
		return cn.abort(st, 200, codes.Internal, err.Error())
	}
	binary.BigEndian.PutUint32(b[1:], uint32(len(b)-5))
	return cn.answer(st, b)
}

// abortErr answers st with err's gRPC status.
func (cn *h2conn) abortErr(st *h2stream, err error) error {
	sts, _ := status.FromError(err)
	return cn.abort(st, 200, sts.Code(), sts.Message())
}

// refuse answers st with an error status once its request has ended (at once if it
// has); what the client sends until then is dropped. Answering while the client still
// sends is allowed, but clients take it badly (curl's nghttp2 reports an error, or waits
// forever, in place of the answer).
func (cn *h2conn) refuse(st *h2stream, httpStatus int, code codes.Code, msg string) error {
	if st.ended {
		return cn.abort(st, httpStatus, code, msg)
	}
	st.refused, st.refusedHTTP, st.refusedCode, st.refusedMsg = true, httpStatus, code, msg
	return nil
}

// abort answers st with an error status alone (a trailers-only response, with HTTP
// status httpStatus). Called before the request ended (abortRST), what the client still
// sends on the stream is dropped.
func (cn *h2conn) abort(st *h2stream, httpStatus int, code codes.Code, msg string) error {
	if st.method != methodHealthCheck && st.method != methodHealthWatch {
		cn.s.erred(code) // a rate limit call, or one refused before its method was known
	}
	cn.hbuf.Reset()
	cn.henc.WriteField(hpack.HeaderField{Name: ":status", Value: strconv.Itoa(httpStatus)})
	cn.henc.WriteField(hpack.HeaderField{Name: "content-type", Value: "application/grpc"})
	cn.henc.WriteField(hpack.HeaderField{Name: "grpc-status", Value: strconv.Itoa(int(code))})
	if msg != "" {
		cn.henc.WriteField(hpack.HeaderField{Name: "grpc-message", Value: encodeGRPCMessage(msg)})
	}
	cn.sizeUpdate = false // henc wrote it before its first field
	err := cn.wfr.WriteHeaders(http2.HeadersFrameParam{StreamID: st.id, BlockFragment: cn.hbuf.Bytes(), EndHeaders: true, EndStream: true})
	cn.closeStream(st)
	return err
}

// abortRST is abort for a request too large to read on: the stream is also reset
// (NO_ERROR), so that the client stops sending it.
func (cn *h2conn) abortRST(st *h2stream, code codes.Code, msg string) error {
	ended := st.ended
	if err := cn.abort(st, 200, code, msg); err != nil || ended {
		return err
	}
	return cn.wfr.WriteRSTStream(st.id, http2.ErrCodeNo)
}

// answer sends st's response headers, msg (a gRPC message) as far as the send windows
// allow, and the OK trailers once it is all sent; what the windows do not allow waits in
// st.out for WINDOW_UPDATEs.
func (cn *h2conn) answer(st *h2stream, msg []byte) error {
	if err := cn.wfr.WriteHeaders(http2.HeadersFrameParam{StreamID: st.id, BlockFragment: cn.okBlock(okHeaders), EndHeaders: true}); err != nil {
		return err
	}
	sent, err := cn.sendData(st, msg)
	if err != nil {
		return err
	}
	if sent < len(msg) {
		st.out = append(st.out[:0], msg[sent:]...)
		st.outOff = 0
		st.queued = true
		if len(cn.blocked) == 0 {
			// The client has WriteTimeout to open its window to it, as a client whose
			// socket does not take its answers has to take them. Before, the answer
			// waited for as long as the client stayed connected, and the connection,
			// holding a call, was never idle, so never closed to make room either:
			// 1,024 connections each with an answer held so (SETTINGS_INITIAL_WINDOW_SIZE
			// 0) kept every Envoy out.
			cn.stalled = time.Now()
			cn.setDeadline()
		}
		cn.blocked = append(cn.blocked, st)
		return nil
	}
	return cn.finish(st)
}

// The header blocks of every OK answer, HPACK-encoded once: ":status: 200" from the
// static table, the others as literals never indexed, so that they leave the dynamic
// table (which the error answers use, through henc) as it is.
var (
	okHeaders  = literalBlock([]byte{0x88}, "content-type", "application/grpc")
	okTrailers = literalBlock(nil, "grpc-status", "0")
)

// okBlock is block (okHeaders or okTrailers), after the dynamic table size update the
// connection owes its client, if it owes one. henc still writes its own before its next
// field (an error answer's): a second update, at the start of a later block and no larger
// than the client's setting, which HPACK allows.
func (cn *h2conn) okBlock(block []byte) []byte {
	if !cn.sizeUpdate {
		return block
	}
	cn.sizeUpdate = false
	cn.hbuf.Reset()
	b := appendTableSizeUpdate(cn.hbuf.AvailableBuffer(), cn.tableMax)
	return append(b, block...)
}

// appendTableSizeUpdate appends an HPACK dynamic table size update to n (RFC 7541 §6.3:
// 001 and n as an integer with a 5-bit prefix).
func appendTableSizeUpdate(b []byte, n uint32) []byte {
	const prefix = 1<<5 - 1
	if n < prefix {
		return append(b, 0x20|byte(n))
	}
	b = append(b, 0x20|prefix)
	n -= prefix
	for n >= 128 {
		b = append(b, byte(n&0x7f)|0x80)
		n >>= 7
	}
	return append(b, byte(n))
}

// literalBlock appends to b fields (name, value) as HPACK literals without indexing.
func literalBlock(b []byte, kv ...string) []byte {
	for i := 0; i < len(kv); i += 2 {
		b = append(b, 0x00)
		for _, s := range kv[i : i+2] {
			if len(s) > 126 {
				panic("BUG: literalBlock takes strings of at most 126 bytes")
			}
			b = append(b, byte(len(s)))
			b = append(b, s...)
		}
	}
	return b
}

// sendData writes DATA frames of b for st within the send windows and the client's
// frame size, and returns how much it wrote.
func (cn *h2conn) sendData(st *h2stream, b []byte) (int, error) {
	sent := 0
	for sent < len(b) {
		n := min(int64(len(b)-sent), cn.sendConn, st.sendWin, int64(cn.peerMax))
		if n <= 0 {
			break
		}
		if err := cn.wfr.WriteData(st.id, false, b[sent:sent+int(n)]); err != nil {
			return sent, err
		}
		sent += int(n)
		cn.sendConn -= n
		st.sendWin -= n
	}
	return sent, nil
}

// finish sends st's OK trailers and closes it.
func (cn *h2conn) finish(st *h2stream) error {
	err := cn.wfr.WriteHeaders(http2.HeadersFrameParam{StreamID: st.id, BlockFragment: cn.okBlock(okTrailers), EndHeaders: true, EndStream: true})
	cn.closeStream(st)
	return err
}

// pump sends what blocked streams can now send. The serve loop calls it, and sets the
// read deadline after (bodyDeadline): one that moved an answer on restarts stalled.
func (cn *h2conn) pump() error {
	if len(cn.blocked) == 0 {
		return nil
	}
	defer cn.moved()
	kept := cn.blocked[:0]
	for i, st := range cn.blocked {
		if st.done {
			continue
		}
		sent, err := cn.sendData(st, st.out[st.outOff:])
		if err != nil {
			cn.blocked = append(kept, cn.blocked[i:]...)
			return err
		}
		if sent > 0 {
			cn.stalled = time.Time{} // moved on (see moved)
		}
		st.outOff += sent
		if st.outOff < len(st.out) {
			kept = append(kept, st)
			continue
		}
		st.queued = false // off the list as it is rebuilt: finish's closeStream leaves it be
		if err := cn.finish(st); err != nil {
			cn.blocked = append(kept, cn.blocked[i+1:]...)
			return err
		}
	}
	cn.blocked = kept
	return nil
}

// moved updates stalled after pump, which cleared it if it sent any bytes of the answers
// waiting for window: none waits now, or those left wait from now on. A client taking its
// answers slowly but steadily is not cut off.
func (cn *h2conn) moved() {
	switch {
	case len(cn.blocked) == 0:
		cn.stalled = time.Time{}
	case cn.stalled.IsZero():
		cn.stalled = time.Now()
	}
}

// resetStream answers a stream error: RST_STREAM, and the stream is closed.
func (cn *h2conn) resetStream(id uint32, code http2.ErrCode) error {
	if id == 0 {
		return connErr(code, "a stream error on stream 0")
	}
	if id > cn.lastID && id%2 == 1 {
		cn.lastID = id // a stream the error opened (malformed HEADERS)
	}
	if st := cn.streams[id]; st != nil {
		cn.closeStream(st)
	}
	return cn.wfr.WriteRSTStream(id, code)
}

// closeStream forgets st; its struct is reused unless a goroutine still holds it. After
// GOAWAY, the last stream closed closes the connection.
func (cn *h2conn) closeStream(st *h2stream) {
	if st.done {
		return
	}
	st.done = true
	delete(cn.streams, st.id)
	if !st.ended {
		cn.unended--
	}
	if len(cn.streams) == 0 {
		cn.idleSince = time.Now()
	}
	if st.queued {
		// Reset while its answer waited for window: off the list before its struct is
		// reused, else the next pump took the new stream for this one and "finished" it
		// (bare OK trailers, before its request was read).
		st.queued = false
		for i, b := range cn.blocked {
			if b == st {
				cn.blocked = append(cn.blocked[:i], cn.blocked[i+1:]...)
				break
			}
		}
		if len(cn.blocked) == 0 {
			cn.stalled = time.Time{}
			cn.setDeadline()
		}
	}
	cn.buffered -= len(st.body)
	cn.s.buffered.Add(-int64(len(st.body)))
	st.body = st.body[:0]
	if cap(st.body) > maxKeptRequest {
		st.body = nil
	}
	st.out = st.out[:0]
	if !st.deciding {
		cn.free = append(cn.free, st)
	}
	if cn.goneAway && len(cn.streams) == 0 && !cn.closed {
		cn.closeGracefullyLocked() // after the last answer
	}
}

// encodeGRPCMessage percent-encodes a grpc-message value as gRPC's HTTP/2 mapping says
// (bytes outside printable ASCII, and '%'), cut to h2MaxGRPCMessage bytes.
func encodeGRPCMessage(msg string) string {
	if len(msg) > h2MaxGRPCMessage {
		msg = msg[:h2MaxGRPCMessage]
	}
	clean := true
	for i := 0; i < len(msg); i++ {
		if c := msg[i]; c < 0x20 || c > 0x7e || c == '%' {
			clean = false
			break
		}
	}
	if clean {
		return msg
	}
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(msg); i++ {
		c := msg[i]
		if c < 0x20 || c > 0x7e || c == '%' {
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&15])
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}
