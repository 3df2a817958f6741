// Package envoyrls serves Envoy's rate limit service API
// (envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit) and the gRPC health
// service on a second listener of the daemon, so that Envoy, Istio and other Envoy-based
// gateways ask rlsidecar with no client code. It asks the limiter as the msgpack socket
// server does; the two transports share no code and neither imports the other.
//
// The mapping. A call's descriptors are decided together, all-or-nothing, as the parts of
// one limiter check. Descriptor i is checked as a request with the attributes
//
//	domain       the call's domain
//	descriptor   the descriptor's keys in order, joined by ",": "message_type,to_number"
//	<key>        each entry's value, under the entry's key
//
// (the descriptor attribute lets a rule require a descriptor of exactly these keys, as
// Envoy's nested descriptors do; see rlsidecar import-envoy). Its cost is its own
// hits_addend when set (0 then asks without consuming), else the call's hits_addend, 0
// meaning 1. A descriptor's limit override is checked instead of the rules, as a fixed
// window keyed by the domain and the entries. A descriptor that matches nothing, and a
// domain no rule names, answer OK with no current_limit, as envoyproxy/ratelimit does.
//
// Most callers want [New], [Server.Listen], [Server.Serve] and [Server.Shutdown].
package envoyrls

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/bits"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"github.com/rlsidecar/rlsidecar/internal/connlimit"
	"github.com/rlsidecar/rlsidecar/internal/tcpaddr"
	"github.com/rlsidecar/rlsidecar/internal/unixsock"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// DescriptorAttribute is the attribute holding a descriptor's keys, in order, joined by
// ",".
const DescriptorAttribute = "descriptor"

// DomainAttribute is the attribute holding the call's domain.
const DomainAttribute = "domain"

// ServiceName is the gRPC service this package serves, also the name its health is
// reported under (besides "", the server as a whole).
const ServiceName = "envoy.service.ratelimit.v3.RateLimitService"

// Recorder counts decisions (the daemon's metrics). Record must be safe for concurrent
// use and must not keep d. A Recorder that also has the method of [LatencyRecorder]
// (daemon.Metrics) observes every ShouldRateLimit call answered, from its arrival to its
// answer, as the socket's checks are (rlsidecar_check_duration_seconds).
type Recorder interface {
	Record(d *limiter.Decision)
}

// LatencyRecorder observes n calls that arrived at arrived and were answered at now, both
// read from the server's clock (Config.Clock's mono, else the wall clock).
type LatencyRecorder interface {
	Answered(n int, arrived, now int64)
}

// ErrorRecorder counts the rate limit calls answered with an error status, by its gRPC
// code's name (codes.Code's String: "InvalidArgument", "DeadlineExceeded", ...). A
// Recorder that also has this method (daemon.Metrics: rlsidecar_envoy_error_answers_total)
// counts every such call the daemon answers: a malformed call (65 descriptors, an empty
// domain), one past its deadline, one too large. Envoy lets the request through on an
// error unless its filter sets failure_mode_deny, so each is a request no limit was
// applied to. On the grpc-go transport, the errors grpc-go answers itself before a call
// reaches the daemon (a message over 4 MiB, an unknown method) are not counted.
type ErrorRecorder interface {
	EnvoyErrorAnswered(code string)
}

// Config configures a Server. Addr is required; the zero value of the others is a
// sensible default.
type Config struct {
	// Addr is "unix:PATH" for a Unix socket (what Envoy's pipe address dials) or
	// "HOST:PORT" for TCP.
	Addr string
	// SocketMode is the permission of a Unix socket file; default 0660.
	SocketMode os.FileMode
	// SocketGroup is the group (name or number) given a Unix socket file, for the
	// gateways' users; empty: the daemon's own.
	SocketGroup string
	// Listener, when set, is an already-open listening socket (from systemd socket
	// activation, rlsidecar-envoy.socket): Listen takes it as it is, ignoring Addr,
	// SocketMode and SocketGroup (Addr then only names it), and Shutdown closes it
	// without removing its file, which belongs to whoever opened it.
	Listener net.Listener
	// MaxDescriptors and MaxEntries bound one call (default 64 each); a larger call is an
	// InvalidArgument error.
	MaxDescriptors int
	MaxEntries     int
	// Transport serves the calls: TransportNative (the default, "" too) or
	// TransportGRPCGo.
	Transport string
	// WriteTimeout is the time a client has to take the native transport's answers (its
	// socket's buffer full that long, or an answer waiting that long for the HTTP/2 window
	// it gives, none of it sent) before the connection is closed; default 5s, as the
	// socket server's --write-timeout. A client that stops reading otherwise holds the
	// connection, its streams and its goroutines for as long as it stays connected.
	WriteTimeout time.Duration
	// FrameTimeout is the time the native transport gives a call's request, once its
	// body has begun, to end (default 5s, as the socket server's --frame-timeout): past
	// it the connection is closed and what it held freed.
	FrameTimeout time.Duration
	// ChargeRefused: a refused call still consumes, on each of its descriptors, what
	// that descriptor's rules have left, up to its hits (--envoy-charge-refused). For
	// the costs Envoy sends once a response is done (apply_on_stream_done: a response's
	// tokens, its bytes), in a call whose answer it ignores: refused, such a cost
	// charged nothing, so a budget of them never ran out. envoyproxy/ratelimit counts
	// every hit, over the limit or not. The answer is the same either way.
	ChargeRefused bool
	// Recorder, when set, counts every decision.
	Recorder Recorder
	Logger   *slog.Logger
	// Clock is the daemon's clock (daemon.Clock's Now): mono, nanoseconds on a clock that
	// never steps, and wall, the Unix time. Calls are decided on mono, the clock the
	// socket server and the hybrid sync decide on with the same limiter, and the store's
	// wall offset (fixed windows) follows wall - mono, as the socket server keeps it. nil:
	// the wall clock for both (a server alone with its limiter).
	Clock func() (mono, wall int64)
}

// Server is the gRPC server. Build it with New; it is safe for concurrent use.
type Server struct {
	rlsv3.UnimplementedRateLimitServiceServer
	cfg     Config
	lim     *limiter.Limiter
	mu      sync.Mutex
	grpc    *grpc.Server // built by Serve: its stream workers run until it stops
	stopped bool         // Shutdown was called
	// buffered is the request bytes the native transport's connections hold together
	// (h2MaxBufferedAll).
	buffered atomic.Int64
	health   *health.Server
	// draining is closed when Shutdown begins: it ends the grpc-go transport's
	// Health/Watch calls (drainingHealth).
	draining  chan struct{}
	drainOnce sync.Once
	ln        net.Listener
	// sockPath and sock are the Unix socket file Listen created, by device and inode
	// (zero for Config.Listener and TCP): Shutdown removes the path only while it still
	// names that file.
	sockPath string
	sock     unixsock.FileID
	scratch  sync.Pool            // *scratch
	now      func() int64         // the clock, in Unix nanoseconds: clockNow, or the wall clock (tests set one)
	deciding atomic.Int64         // calls in decide (which may wait on Redis): for tests
	latency  LatencyRecorder      // Config.Recorder's Answered, when it has one
	errs     ErrorRecorder        // Config.Recorder's EnvoyErrorAnswered, when it has one
	conns    map[*h2conn]struct{} // the native transport's connections, under mu
	connWG   sync.WaitGroup       // their goroutines
	// accepting is the native transport's accept loop, while it runs (serveNative):
	// added to under mu while not stopped, so that Shutdown's Wait follows every Add.
	accepting sync.WaitGroup
	// own is the listening socket Listen made (a Unix socket or TCP; nil for
	// Config.Listener), whose backlog Shutdown serves (acceptBacklog).
	own      net.Listener
	charging sync.WaitGroup // charges of refused calls that wait on Redis (chargeRefused)
}

// New returns a server deciding with lim. Call Listen, then Serve.
func New(cfg Config, lim *limiter.Limiter) (*Server, error) {
	if cfg.Addr == "" {
		return nil, errors.New("envoyrls: an address is required (unix:PATH or HOST:PORT)")
	}
	if cfg.SocketMode == 0 {
		cfg.SocketMode = 0o660
	}
	if cfg.MaxDescriptors <= 0 {
		cfg.MaxDescriptors = 64
	}
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = 64
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = 5 * time.Second
	}
	if cfg.FrameTimeout <= 0 {
		cfg.FrameTimeout = 5 * time.Second
	}
	switch cfg.Transport {
	case "":
		cfg.Transport = DefaultTransport
	case TransportNative, TransportGRPCGo:
	default:
		return nil, fmt.Errorf("envoyrls: transport %q is neither %s nor %s", cfg.Transport, TransportNative, TransportGRPCGo)
	}
	s := &Server{cfg: cfg, lim: lim, health: health.NewServer(), draining: make(chan struct{}), now: func() int64 { return time.Now().UnixNano() }}
	if cfg.Clock != nil {
		s.now = s.clockNow
	}
	s.latency, _ = cfg.Recorder.(LatencyRecorder)
	s.errs, _ = cfg.Recorder.(ErrorRecorder)
	s.scratch.New = func() any { return new(scratch) }
	s.health.SetServingStatus(ServiceName, healthpb.HealthCheckResponse_SERVING)
	return s, nil
}

// newGRPC builds the gRPC server: the rate limit service and health.
func (s *Server) newGRPC() *grpc.Server {
	g := grpc.NewServer(append(TransportOptions(), grpc.ForceServerCodecV2(newCodec()))...)
	// The generated service description but for its handler: wireHandler decodes and
	// encodes the messages itself (wire.go).
	desc := rlsv3.RateLimitService_ServiceDesc
	desc.Methods = []grpc.MethodDesc{{MethodName: "ShouldRateLimit", Handler: wireHandler}}
	g.RegisterService(&desc, s)
	healthpb.RegisterHealthServer(g, drainingHealth{Server: s.health, draining: s.draining})
	return g
}

// TransportOptions are the grpc-go server options the Envoy listener is served with (the
// benchmark's do-nothing grpc-go server, bench/grpcfloor, uses them too, to measure the
// same transport). Each was measured in BenchmarkEnvoyRLS beside the defaults (README,
// "Envoy"); kept are those that lowered the daemon's CPU per call:
//   - fixed flow-control windows, so that no BDP-estimation ping goes between a call and
//     its answer;
//   - stream workers: a call runs on one of a few long-lived goroutines rather than a new
//     one, which would start on a small stack and grow it on every call (a worker that is
//     busy makes grpc-go fall back to a new goroutine, so no call waits for one).
//
// SharedWriteBuffer, larger read and write buffers and larger windows made no difference
// that the noise of a shared 2-core machine could show, and are left at grpc-go's
// defaults.
//
// One more is not about cost: keepalive pings are answered however often they come, with
// or without a call in flight, as the native transport answers them. grpc-go's default
// policy closes a connection (GOAWAY ENHANCE_YOUR_CALM, "too_many_pings") at the third
// ping that comes within 5 minutes of the one before, or within two hours when no call is
// in flight: Envoy's HTTP/2 connection_keepalive on the rate limit cluster (a ping every
// 30 s, say) had its idle connections torn down.
//
// Nor is the stream cap: h2MaxStreams calls of a connection at once, as the native
// transport advertises and enforces (REFUSED_STREAM past it). grpc-go's default is no
// limit: one connection could open stream after stream with HEADERS and no body, each a
// goroutine waiting for a request that never comes (a call without grpc-timeout has no
// deadline), until the daemon ran out of memory.
func TransportOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.StaticStreamWindowSize(1 << 20), grpc.StaticConnWindowSize(1 << 20),
		grpc.NumStreamWorkers(streamWorkers),
		// MinTime 0 means grpc-go's default, 5 minutes: the shortest time there is.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: time.Nanosecond, PermitWithoutStream: true}),
		grpc.MaxConcurrentStreams(h2MaxStreams),
	}
}

// streamWorkers is the number of long-lived goroutines calls run on: as many as the
// benchmark's concurrent streams.
const streamWorkers = 64

// Listen binds the address. A Unix socket is created owner-only, given to SocketGroup,
// then opened to SocketMode; a stale socket file is replaced, a live one or any other
// file refused. A group that does not exist is refused before any file is created. With
// Config.Listener set, it takes that socket as it is.
func (s *Server) Listen() error {
	if s.cfg.Listener != nil {
		if ul, ok := s.cfg.Listener.(*net.UnixListener); ok {
			ul.SetUnlinkOnClose(false)
		}
		s.ln = s.capped(s.cfg.Listener)
		return nil
	}
	path, ok := strings.CutPrefix(s.cfg.Addr, "unix:")
	if !ok {
		ln, err := tcpaddr.Listen(s.cfg.Addr)
		if err != nil {
			return fmt.Errorf("envoy rls: listening on %s: %w", s.cfg.Addr, err)
		}
		s.own, s.ln = ln, s.capped(ln)
		return nil
	}
	if path == "" {
		return errors.New("envoy rls: unix: needs a path")
	}
	if max := len(syscall.RawSockaddrUnix{}.Path) - 1; len(path) > max { // less its NUL
		return fmt.Errorf("envoy rls: listening on %s: the path is %d bytes, and a Unix socket's holds at most %d; choose a shorter one", path, len(path), max)
	}
	gid := -1
	if s.cfg.SocketGroup != "" {
		var err error
		if gid, err = unixsock.LookupGroup(s.cfg.SocketGroup); err != nil {
			return fmt.Errorf("envoy rls: listening on %s: %w", path, err)
		}
	}
	// Two daemons started at once on a stale socket would each find it refusing
	// connections, each remove it and each bind: the lock makes the second look only
	// after the first is listening.
	unlock, err := unixsock.Lock(path)
	if err != nil {
		return fmt.Errorf("envoy rls: listening on %s: %w", path, err)
	}
	defer unlock()
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return fmt.Errorf("envoy rls: listening on %s: the path exists and is not a socket; refusing to replace it", path)
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid != 0 && int(st.Uid) != os.Geteuid() {
			// Another user's file, in a directory both can write: perhaps a squatter's,
			// which the gateways must not be sent to, nor the daemon remove.
			return fmt.Errorf("envoy rls: listening on %s: the socket file there belongs to uid %d, not to this daemon's user (uid %d); refusing to use or remove it (remove it as that user or root if it is stale, and choose a path in a directory other users cannot write)", path, st.Uid, os.Geteuid())
		}
		c, err := net.DialTimeout("unix", path, time.Second)
		if err == nil {
			c.Close()
			return fmt.Errorf("envoy rls: listening on %s: another server is serving this socket", path)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return fmt.Errorf("envoy rls: listening on %s: probing the existing socket: %w", path, err)
		}
		if err := os.Remove(path); err != nil {
			return fmt.Errorf("envoy rls: listening on %s: removing a stale socket: %w", path, err)
		}
	}
	old := syscall.Umask(0o177)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		return fmt.Errorf("envoy rls: listening on %s: %w", path, err)
	}
	if gid >= 0 {
		if err := os.Chown(path, -1, gid); err != nil {
			ln.Close()
			return fmt.Errorf("envoy rls: giving %s to group %s: %w", path, s.cfg.SocketGroup, err)
		}
	}
	if err := os.Chmod(path, s.cfg.SocketMode); err != nil {
		ln.Close()
		return fmt.Errorf("envoy rls: setting mode %#o on %s: %w", s.cfg.SocketMode, path, err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		ln.Close()
		return fmt.Errorf("envoy rls: listening on %s: %w", path, err)
	}
	// From here Shutdown removes the file itself, and only while the path still names
	// it: another daemon may have put its own there since (after this one's was removed).
	s.sockPath, s.sock = path, unixsock.IDOf(fi)
	ln.SetUnlinkOnClose(false)
	s.own, s.ln = ln, s.capped(ln)
	return nil
}

// removeSocket removes the socket file Listen created if the path still names it.
func (s *Server) removeSocket() {
	s.mu.Lock()
	path, id := s.sockPath, s.sock
	s.sock = unixsock.FileID{}
	s.mu.Unlock()
	if id == (unixsock.FileID{}) {
		return // Config.Listener's file, a TCP listener, or removed already
	}
	if unlock, err := unixsock.Lock(path); err == nil {
		defer unlock()
	} // else removed unlocked: the race the lock closes, at worst
	fi, err := os.Lstat(path)
	if err != nil {
		return
	}
	if unixsock.IDOf(fi) != id {
		s.cfg.Logger.Info("envoy rls: left the socket file in place: another daemon has put its own there since this one started", "socket", path)
		return
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		s.cfg.Logger.Warn("envoy rls: removing the socket file failed; the next daemon replaces it as stale", "socket", path, "err", err)
	}
}

// Addr returns the bound address (after Listen).
func (s *Server) Addr() net.Addr { return s.ln.Addr() }

// Serve answers calls until Shutdown; it returns nil after Shutdown (at once if Shutdown
// came first).
func (s *Server) Serve() error {
	if s.ln == nil {
		return errors.New("envoy rls: Serve before Listen")
	}
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return nil
	}
	if s.cfg.Transport == TransportNative {
		s.mu.Unlock()
		return s.serveNative()
	}
	if s.grpc == nil {
		s.grpc = s.newGRPC()
	}
	g := s.grpc
	s.mu.Unlock()
	if err := g.Serve(s.ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("envoy rls: %w", err)
	}
	return nil
}

// Shutdown reports NOT_SERVING, stops accepting, and waits for the calls in flight until
// ctx ends, then closes every connection. Health/Watch calls end at once, after their
// NOT_SERVING (they would otherwise last until ctx ends). The socket file is removed,
// unless it came from Config.Listener.
func (s *Server) Shutdown(ctx context.Context) error {
	s.health.Shutdown()
	s.drainOnce.Do(func() { close(s.draining) })
	s.removeSocket() // before the listener closes, as its own unlinking did
	s.mu.Lock()
	s.stopped = true
	g := s.grpc
	s.mu.Unlock()
	if s.cfg.Transport == TransportNative {
		// Clients that connected and wrote just before the drain are answered, not
		// reset by the listener's close.
		s.acceptBacklog()
		if s.ln != nil {
			_ = s.ln.Close()
		}
		err := s.shutdownNative(ctx)
		if e := s.waitCharges(ctx); err == nil {
			err = e
		}
		return err
	}
	done := make(chan struct{})
	go func() {
		if g != nil {
			g.GracefulStop()
		}
		if s.ln != nil {
			_ = s.ln.Close() // not yet served (a failed start): gRPC does not own it
		}
		close(done)
	}()
	select {
	case <-done:
		return s.waitCharges(ctx)
	case <-ctx.Done():
		if g != nil {
			g.Stop()
		}
		<-done
		return fmt.Errorf("envoy rls: calls still in flight at the deadline were cut: %w", ctx.Err())
	}
}

// waitCharges waits, within ctx, for the charges of refused calls that went on
// goroutines of their own (chargeRefused).
func (s *Server) waitCharges(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		s.charging.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("envoy rls: charges of refused calls still waiting on Redis at the deadline: %w", ctx.Err())
	}
}

// clockNow reads cfg.Clock: it returns mono, and tells the store when the wall clock has
// moved from it by more than a millisecond (a step), so fixed windows stay aligned to wall
// time for calls that arrive here alone (daemon.Server.now does the same).
func (s *Server) clockNow() int64 {
	mono, wall := s.cfg.Clock()
	st := s.lim.Store()
	if d := wall - mono - st.WallOffset(); d > int64(time.Millisecond) || d < -int64(time.Millisecond) {
		st.SetWallOffset(wall - mono)
	}
	return mono
}

// scratch is one call's reusable space: its bytes and decoded request, the limiter's
// input and decision, the answer; kept in a pool so that a call allocates only its
// response's bytes.
type scratch struct {
	raw    []byte
	call   call
	ans    answer
	num    []byte
	outLen int
	in     limiter.Input
	parts  []limiter.Part
	attrs  []rules.Attr
	limits []limiter.Inline
	keys   []byte
	pol    []byte
	cur    []byte
	warn   []byte
	best   []int32
	d      limiter.Decision
}

// maxKeptRequest is the largest request buffer a pooled scratch keeps.
const maxKeptRequest = 64 << 10

// ShouldRateLimit decides one call. Malformed calls (empty domain, no descriptors, an
// empty key, an override with no unit or a unit_multiplier of 0, too many descriptors
// or entries) are InvalidArgument errors and change nothing. The gRPC server answers
// calls with the same decision path without the generated types (wireHandler); this
// method is for calls in process.
func (s *Server) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	sc := s.scratch.Get().(*scratch)
	defer s.scratch.Put(sc)
	if err := fromProto(req, &sc.call); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := s.decide(sc); err != nil {
		return nil, err
	}
	return toProto(&sc.ans), nil
}

// arrival reads the clock for a call that has arrived, when its answer will be observed
// (answered); else it returns 0, and no clock is read.
func (s *Server) arrival() int64 {
	if s.latency == nil {
		return 0
	}
	return s.now()
}

// erred counts a rate limit call answered with an error status of code (ErrorRecorder).
func (s *Server) erred(code codes.Code) {
	if s.errs != nil {
		s.errs.EnvoyErrorAnswered(code.String())
	}
}

// answered observes a call that arrived at arrived (arrival) and has been answered.
func (s *Server) answered(arrived int64) {
	if s.latency != nil {
		s.latency.Answered(1, arrived, s.now())
	}
}

// wireHandler is ShouldRateLimit's gRPC handler: dec (the codec) parses the request's
// bytes into a pooled scratch, and the response goes back as its bytes.
func wireHandler(srv any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (_ any, err error) {
	s := srv.(*Server)
	arrived := s.arrival()
	sc := s.scratch.Get().(*scratch)
	defer func() {
		if cap(sc.raw) > maxKeptRequest {
			sc.raw = nil
		}
		s.scratch.Put(sc)
		s.answered(arrived)
		if err != nil {
			s.erred(status.Code(err))
		}
	}()
	if err := dec(sc); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		// Cancelled or past its deadline before a stream worker took it up: decided, it
		// would be charged for an answer nobody reads.
		return nil, status.FromContextError(err).Err()
	}
	if err := s.decide(sc); err != nil {
		return nil, err
	}
	out := appendResponse(make([]byte, 0, max(sc.outLen, 128)), &sc.ans)
	sc.outLen = len(out)
	return (*encoded)(&out), nil
}

// decideInline answers sc.call into sc.ans unless the decision would wait on Redis (a
// global rule, or a hybrid key that needs an exact sync); then it reports done false,
// having taken nothing, and the caller decides where waiting is fine (decide).
func (s *Server) decideInline(sc *scratch) (done bool, err error) {
	now := s.now()
	if err := s.input(&sc.call, sc); err != nil {
		return true, status.Error(codes.InvalidArgument, err.Error())
	}
	d := &sc.d
	waits, err := s.prepare(&sc.in, d, false)
	if err != nil {
		return true, status.Error(codes.InvalidArgument, err.Error())
	}
	if waits || !s.lim.DecideInline(now, d) {
		return false, nil
	}
	s.finish(now, sc)
	s.chargeRefused(now, sc, false)
	return true, nil
}

// prepare is the limiter's Prepare for a call: its concurrency rules then ask whether a
// slot is free and take none (Decision.AskLeases), Envoy's protocol having no release.
// Before, a call took a slot and gave it back as it was answered (for a global rule, a
// second Redis call), and other checks counted it meanwhile. A call's refusal by a
// concurrency rule counts toward the rule's penalty. A charge (charge true: a check
// chargeRefused makes of its own for a call already refused) leaves them out
// (Decision.SkipLeases): it charges the rate rules, and a full concurrency rule of the
// descriptor, which refused the call, would refuse it too and charge nothing.
func (s *Server) prepare(in *limiter.Input, d *limiter.Decision, charge bool) (waits bool, err error) {
	waits, err = s.lim.Prepare(in, d)
	if err == nil {
		if charge {
			d.SkipLeases()
		} else {
			d.AskLeases()
		}
	}
	return waits, err
}

// check is the limiter's Check for a call, or a charge (prepare, then Decide).
func (s *Server) check(now int64, in *limiter.Input, d *limiter.Decision, charge bool) error {
	if _, err := s.prepare(in, d, charge); err != nil {
		return err
	}
	s.lim.Decide(now, d)
	return nil
}

// decide answers sc.call into sc.ans.
func (s *Server) decide(sc *scratch) error {
	s.deciding.Add(1)
	defer s.deciding.Add(-1)
	now := s.now()
	if err := s.input(&sc.call, sc); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	d := &sc.d
	if err := s.check(now, &sc.in, d, false); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	s.finish(now, sc)
	s.chargeRefused(now, sc, true)
	return nil
}

// chargeRefused charges a refused call (Config.ChargeRefused; sc.d decided and answered)
// on each of its descriptors: what the descriptor's rules have left, up to its hits, in
// one check of those descriptors alone. A descriptor whose rules were not asked (another
// refused first) is charged its hits if they fit, what is left if not. A banned call,
// shadow and concurrency rules, and descriptors with nothing left, are not charged. If
// another call takes units meanwhile, the check is refused and made again on what is
// left then, at most three times. mayWait false (a transport's connection loop): a charge
// that would wait on Redis goes on a goroutine of its own, with copies of the call's
// strings, and the answer does not wait for it.
func (s *Server) chargeRefused(now int64, sc *scratch, mayWait bool) {
	d := &sc.d
	if !s.cfg.ChargeRefused || d.Allowed || d.Banned {
		return
	}
	parts := chargeParts(d, sc.parts, nil)
	if len(parts) == 0 {
		return
	}
	if !mayWait {
		var c limiter.Decision
		in := limiter.Input{Parts: parts}
		if waits, err := s.prepare(&in, &c, true); err == nil && !waits && s.lim.DecideInline(now, &c) {
			s.charged(now, &c)
			if c.Allowed {
				return
			}
		}
		for i := range parts {
			parts[i] = ownPart(parts[i])
		}
		s.charging.Add(1)
		go func() {
			defer s.charging.Done()
			s.charge(parts)
		}()
		return
	}
	s.charge(parts)
}

// charge checks parts until they pass or three tries are refused, each try on what the
// one before found left.
func (s *Server) charge(parts []limiter.Part) {
	var d limiter.Decision
	for range 3 {
		now := s.now()
		if err := s.check(now, &limiter.Input{Parts: parts}, &d, true); err != nil {
			return
		}
		s.charged(now, &d)
		if d.Allowed || d.Banned {
			return
		}
		if parts = chargeParts(&d, parts, parts[:0:0]); len(parts) == 0 {
			return
		}
	}
}

// charged gives back a lease a charge took (a concurrency rule matching a charged
// descriptor asks a slot; Envoy's protocol holds none).
func (s *Server) charged(now int64, d *limiter.Decision) {
	if tok := s.lim.LeaseToken(d); tok != "" {
		s.lim.ReleaseLease(tok, now)
	}
}

// chargeParts returns, appended to dst, the parts of refused decision d to charge, each
// with its cost cut to what its rules have left (see chargeRefused).
func chargeParts(d *limiter.Decision, parts []limiter.Part, dst []limiter.Part) []limiter.Part {
	for p := range parts {
		cost, matched := parts[p].Cost, false
		for i := range d.Results {
			r := &d.Results[i]
			if r.Part != p || r.Shadow || r.Rule != nil && r.Rule.Concurrency {
				continue
			}
			matched = true
			if !r.Unasked { // an unasked rule's Remaining was not read
				cost = min(cost, r.Remaining)
			}
		}
		if matched && cost > 0 {
			q := parts[p]
			q.Cost = cost
			dst = append(dst, q)
		}
	}
	return dst
}

// ownPart returns p with copies of the strings it refers to (a call's strings are its
// request's bytes, which the next call reuses).
func ownPart(p limiter.Part) limiter.Part {
	attrs := make([]rules.Attr, len(p.Attrs))
	for i, a := range p.Attrs {
		attrs[i] = rules.Attr{Name: strings.Clone(a.Name), Value: strings.Clone(a.Value)}
	}
	p.Attrs = attrs
	if p.Limits != nil {
		lims := make([]limiter.Inline, len(p.Limits))
		for i, l := range p.Limits {
			l.Key, l.Name, l.Algorithm, l.Mode = strings.Clone(l.Key), strings.Clone(l.Name), strings.Clone(l.Algorithm), strings.Clone(l.Mode)
			lims[i] = l
		}
		p.Limits = lims
	}
	return p
}

// finish completes a decision in sc: a lease it took is given back, the decision is
// recorded, and sc.ans filled.
func (s *Server) finish(now int64, sc *scratch) {
	d := &sc.d
	if tok := s.lim.LeaseToken(d); tok != "" {
		// Envoy's protocol has no release: a concurrency rule here only asks whether a
		// slot is free (prepare), and holds none past the call; were one taken, it is
		// given back.
		s.lim.ReleaseLease(tok, now)
	}
	if s.cfg.Recorder != nil {
		s.cfg.Recorder.Record(d)
	}
	s.response(len(sc.call.descs), sc)
}

// input fills sc.in from c.
func (s *Server) input(c *call, sc *scratch) error {
	if c.domain == "" {
		return errors.New("domain must not be empty")
	}
	n := len(c.descs)
	if n == 0 {
		return errors.New("descriptors must not be empty")
	}
	if n > s.cfg.MaxDescriptors {
		return fmt.Errorf("%d descriptors; at most %d in one call", n, s.cfg.MaxDescriptors)
	}
	cost := uint64(max(c.hits, 1))
	sc.parts = sc.parts[:0]
	sc.attrs = sc.attrs[:0]
	sc.limits = sc.limits[:0]
	sc.keys = sc.keys[:0]
	for i := range c.descs {
		desc := &c.descs[i]
		entries := c.entries[desc.lo:desc.hi]
		if len(entries) > s.cfg.MaxEntries {
			return fmt.Errorf("descriptors[%d]: %d entries; at most %d", i, len(entries), s.cfg.MaxEntries)
		}
		if desc.negative {
			return fmt.Errorf("descriptors[%d]: is_negative_hits (giving budget back) is not supported", i)
		}
		keys := ""
		if len(entries) == 1 {
			keys = entries[0].key // the common case, without building a string
		} else if len(entries) > 1 {
			var b strings.Builder
			for j, e := range entries {
				if j > 0 {
					b.WriteByte(',')
				}
				b.WriteString(e.key)
			}
			keys = b.String()
		}
		start := len(sc.attrs)
		sc.attrs = append(sc.attrs, rules.Attr{Name: DomainAttribute, Value: c.domain}, rules.Attr{Name: DescriptorAttribute, Value: keys})
		for j, e := range entries {
			if e.key == "" {
				return fmt.Errorf("descriptors[%d].entries[%d]: key must not be empty", i, j)
			}
			sc.attrs = append(sc.attrs, rules.Attr{Name: e.key, Value: e.value})
		}
		p := limiter.Part{Cost: cost}
		if desc.hasHits {
			p.Cost = desc.hits
		}
		if desc.hasLimit {
			il, err := s.override(c.domain, desc, entries, sc)
			if err != nil {
				return fmt.Errorf("descriptors[%d].limit: %w", i, err)
			}
			sc.limits = append(sc.limits, il)
			p.NoRules = true
		}
		p.Attrs = sc.attrs[start:len(sc.attrs):len(sc.attrs)]
		sc.parts = append(sc.parts, p)
	}
	// Slice the attributes and overrides only now that their buffers no longer grow.
	at, li := 0, 0
	for i := range sc.parts {
		p := &sc.parts[i]
		k := len(p.Attrs)
		p.Attrs = sc.attrs[at : at+k : at+k]
		at += k
		if p.NoRules {
			p.Limits = sc.limits[li : li+1 : li+1]
			li++
		} else {
			p.Limits = nil
		}
	}
	sc.in = limiter.Input{Parts: sc.parts}
	return nil
}

// appendKeyPart appends s, a part of an override's key, to dst: as it is, but for NUL,
// which separates the parts, written 0x01 0x02, and 0x01, written 0x01 0x01. So the
// parts of two keys are the same exactly when the keys are, whatever bytes the domain,
// keys and values hold (a value "a\x00b\x00c" of one entry read as the two entries a=b,
// c: two descriptors shared a counter). A part without those bytes is written as it is:
// the keys of the counters kept so far are unchanged.
func appendKeyPart(dst []byte, s string) []byte {
	for {
		i := strings.IndexAny(s, "\x00\x01")
		if i < 0 {
			return append(dst, s...)
		}
		dst = append(dst, s[:i]...)
		if s[i] == 0 {
			dst = append(dst, 1, 2)
		} else {
			dst = append(dst, 1, 1)
		}
		s = s[i+1:]
	}
}

// override is a descriptor's limit override as an inline limit: a fixed window (Envoy's),
// keyed by the domain and the entries. requests_per_unit 0 refuses every call (Envoy's
// block list), as envoyproxy/ratelimit does (any hit is over 0): a deny limit
// (limiter.Inline.Deny), refused as a rule's limit: deny is, no retry ever passing, the
// call's other descriptors consuming nothing, nothing kept; reported as 0 per the unit,
// reset at the end of the unit's window.
func (s *Server) override(domain string, desc *desc, entries []entry, sc *scratch) (limiter.Inline, error) {
	unit, ok := unitDuration[typev3.RateLimitUnit(desc.unit)]
	if !ok {
		return limiter.Inline{}, fmt.Errorf("unit %v is not one of SECOND, MINUTE, HOUR, DAY, MONTH, YEAR", typev3.RateLimitUnit(desc.unit))
	}
	mult := uint64(1)
	if desc.hasMult {
		mult = uint64(desc.mult)
	}
	if mult == 0 {
		return limiter.Inline{}, errors.New("unit_multiplier must be at least 1")
	}
	// The limiter's longest window is 366 days; a longer override is refused here, in
	// the descriptor's terms, and before the product could wrap past 2^64.
	if maxMult := uint64(maxOverride / unit); mult > maxMult {
		return limiter.Inline{}, fmt.Errorf("%d × %v is longer than 366 days, the longest window an override can have", mult, typev3.RateLimitUnit(desc.unit))
	}
	windowMs := uint64(unit/time.Millisecond) * mult
	start := len(sc.keys)
	sc.keys = append(sc.keys, "envoy:"...)
	sc.keys = appendKeyPart(sc.keys, domain)
	for _, e := range entries {
		sc.keys = append(sc.keys, 0)
		sc.keys = appendKeyPart(sc.keys, e.key)
		sc.keys = append(sc.keys, 0)
		sc.keys = appendKeyPart(sc.keys, e.value)
	}
	key := string(sc.keys[start:])
	// Its name, in the RateLimit headers and a refusal's body, is the domain and the
	// descriptor's keys: the key would show the entries' values (who is limited, which
	// path) and NUL bytes to the end client. current_limit.name stays "", as
	// envoyproxy/ratelimit leaves it for an override.
	n := len(domain) + len(".override")
	for _, e := range entries {
		n += 1 + len(e.key)
	}
	var name strings.Builder
	name.Grow(n)
	name.WriteString(domain)
	for _, e := range entries {
		name.WriteByte('.')
		name.WriteString(e.key)
	}
	name.WriteString(".override")
	if desc.rpu == 0 {
		return limiter.Inline{Key: key, Name: name.String(), WindowMs: windowMs, Deny: true}, nil
	}
	return limiter.Inline{Key: key, Name: name.String(), Limit: uint64(desc.rpu), WindowMs: windowMs, Algorithm: "fixed_window"}, nil
}

// maxOverride is the longest window an override can have: the limiter's longest.
const maxOverride = 366 * 24 * time.Hour

var unitDuration = map[typev3.RateLimitUnit]time.Duration{
	typev3.RateLimitUnit_SECOND: time.Second,
	typev3.RateLimitUnit_MINUTE: time.Minute,
	typev3.RateLimitUnit_HOUR:   time.Hour,
	typev3.RateLimitUnit_DAY:    24 * time.Hour,
	typev3.RateLimitUnit_MONTH:  30 * 24 * time.Hour,
	typev3.RateLimitUnit_YEAR:   365 * 24 * time.Hour,
}

// leastRoom returns the index in d.Results of the result written first in the RateLimit
// headers, as the clients list it (clients/go leastRoom): refused, the deciding one;
// allowed, of the non-shadow, asked results with as little remaining as the deciding
// one, the one with the longest reset (in whole milliseconds, as the socket answers it),
// the most restrictive; among those, the deciding one, else the first. The deciding
// result, when allowed, is the first with the least remaining: with per-second and
// per-day both at 1 left, per-second, and a client reading only the first item would
// miss the daily limit.
func leastRoom(d *limiter.Decision) int {
	best := d.Deciding
	if best < 0 || !d.Allowed {
		return best
	}
	for i := range d.Results {
		r, b := &d.Results[i], &d.Results[best]
		if !r.Shadow && !r.Unasked && r.Remaining == b.Remaining && limiter.CeilMs(r.Reset) > limiter.CeilMs(b.Reset) {
			best = i
		}
	}
	return best
}

// headerItem reports whether result i of d is written in the RateLimit headers after the
// first one (d.Results[first], leastRoom): not shadow, and the item of its name (the
// headers are keyed by policy name, so a rule that several descriptors hit is written
// once): no result of that name is the first one or the deciding one, and none is
// better: asked where i is not (an unasked result's figures were not read), or asked
// alike with less remaining (or as much, earlier).
func headerItem(d *limiter.Decision, first, i int) bool {
	r := &d.Results[i]
	if r.Shadow || i == first {
		return false
	}
	for j := range d.Results {
		o := &d.Results[j]
		if j == i || o.Name != r.Name || o.Shadow {
			continue
		}
		if j == first || j == d.Deciding {
			return false
		}
		if o.Unasked != r.Unasked {
			if r.Unasked {
				return false
			}
			continue
		}
		if o.Remaining < r.Remaining || (o.Remaining == r.Remaining && j < i) {
			return false
		}
	}
	return true
}

// warnedBefore reports whether a result before i of d warns under i's name.
func warnedBefore(d *limiter.Decision, i int) bool {
	for j := range i {
		if o := &d.Results[j]; o.Warning && !o.Shadow && o.Name == d.Results[i].Name {
			return true
		}
	}
	return false
}

// response fills sc.ans, the answer to a call of n descriptors, from sc.d.
func (s *Server) response(n int, sc *scratch) {
	d := &sc.d
	a := &sc.ans
	a.over = !d.Allowed
	a.statuses = a.statuses[:0]
	a.headers = a.headers[:0]
	a.body = nil
	for range n {
		a.statuses = append(a.statuses, dstatus{})
	}
	for _, p := range d.Unlimited {
		a.statuses[p].remaining = math.MaxUint32
	}
	// Each descriptor reports its own deciding result, chosen as the limiter chooses the
	// request's: a rejecting one (the longest retry-after) before the least remaining,
	// non-shadow before shadow, asked before not asked (better).
	best := sc.best[:0] // index+1 in d.Results; 0 for none
	for range n {
		best = append(best, 0)
	}
	sc.best = best
	for i := range d.Results {
		r := &d.Results[i]
		if b := best[r.Part]; b == 0 || better(r, &d.Results[b-1]) {
			best[r.Part] = int32(i + 1)
		}
	}
	for p, b := range best {
		if b == 0 {
			continue
		}
		r := &d.Results[b-1]
		st := &a.statuses[p]
		if r.Unasked {
			// Its figures were not read (limiter.Result.Unasked): no current_limit, as a
			// descriptor no rule limits. With one, its 0 remaining and 0 to the reset
			// read as "none left, resetting now": Envoy's x-ratelimit headers (the
			// status of least remaining, the first of equals) then named this rule, and
			// X-RateLimit-Reset: 0, on a refusal another rule decided.
			st.remaining = 0
			continue
		}
		st.over = !r.Allowed && !r.Shadow
		st.hasLimit = true
		st.rpu, st.unit = envoyUnit(r.Limit, r.Window)
		if r.Rule != nil {
			st.name = r.Rule.Name
			switch {
			case calendarMonth(r.Rule): // 28 to 31 days: Envoy's MONTH, not its nominal length per year
				st.rpu, st.unit = uint32(min(r.Limit, math.MaxUint32)), rlsv3.RateLimitResponse_RateLimit_MONTH
			case r.Rule.Concurrency:
				// Requests in flight, not per a unit of time: max, and the unit UNKNOWN
				// (Envoy's x-ratelimit headers then give it no window), not max per its
				// lease's length.
				st.rpu, st.unit = uint32(min(r.Limit, math.MaxUint32)), rlsv3.RateLimitResponse_RateLimit_UNKNOWN
			}
		}
		st.remaining = uint32(min(r.Remaining, math.MaxUint32))
		// Whole seconds, rounded up, as envoyproxy/ratelimit answers: Envoy's own
		// X-RateLimit-Reset takes the seconds of it, rounded down, which made it up to a
		// second early, and 0 on a refusal in a window's last second.
		st.reset = time.Duration(proto.CeilSeconds(r.Reset)) * time.Second
	}

	// The HTTP mapping, as the clients write it: the deciding rule first (allowed, the
	// one of its remaining with the longest reset: leastRoom), then the others in order.
	sc.pol, sc.cur = sc.pol[:0], sc.cur[:0]
	if first := leastRoom(d); first >= 0 {
		sc.pol, sc.cur = proto.AppendRateLimitItem(sc.pol, sc.cur, rateLimitItem(&d.Results[first]))
		for i := range d.Results {
			// A rule that several descriptors hit (each its own key) is one policy: one
			// item, the first one's, the deciding one's, or the least remaining.
			if !headerItem(d, first, i) {
				continue
			}
			r := &d.Results[i]
			if r.Unasked {
				// Its figures were not read (limiter.Result.Unasked): its quota stays in
				// RateLimit-Policy, the same from one response to the next, but it has
				// no RateLimit item.
				sc.pol = proto.AppendRateLimitPolicyItem(sc.pol, rateLimitItem(r))
				continue
			}
			sc.pol, sc.cur = proto.AppendRateLimitItem(sc.pol, sc.cur, rateLimitItem(r))
		}
		a.headers = append(a.headers, hdr{"RateLimit-Policy", sc.pol}, hdr{"RateLimit", sc.cur})
	}
	if d.Allowed {
		sc.warn = sc.warn[:0]
		for i := range d.Results {
			if r := &d.Results[i]; r.Warning && !r.Shadow && !warnedBefore(d, i) {
				sc.warn = proto.AppendWarningItem(sc.warn, r.Name)
			}
		}
		if len(sc.warn) > 0 {
			a.headers = append(a.headers, hdr{"RateLimit-Warning", sc.warn})
		}
	}
	if !d.Allowed {
		dr := d.DecidingResult()
		rule, impossible, retry := "", false, time.Duration(0)
		if dr != nil {
			rule, impossible, retry = dr.Name, dr.Impossible, dr.RetryAfter
		}
		if !impossible {
			sc.num = strconv.AppendInt(sc.num[:0], proto.RetryAfterSeconds(retry), 10)
			a.headers = append(a.headers, hdr{"Retry-After", sc.num})
		}
		a.headers = append(a.headers, hdr{"Content-Type", problemJSON})
		a.body = proto.TooManyRequestsBody(rule, impossible, retry)
	}
}

var problemJSON = []byte("application/problem+json")

// better reports whether result a describes its descriptor better than b. A result whose
// rule was not asked (limiter.Result.Unasked) says nothing, and comes last.
func better(a, b *limiter.Result) bool {
	if a.Unasked != b.Unasked {
		return !a.Unasked
	}
	if a.Shadow != b.Shadow {
		return !a.Shadow
	}
	ar, br := !a.Allowed, !b.Allowed
	if ar != br {
		return ar
	}
	if ar {
		if b.Impossible {
			return false
		}
		return a.Impossible || a.RetryAfter > b.RetryAfter
	}
	return a.Remaining < b.Remaining
}

// calendarMonth reports whether r's window is a calendar month (per: month), whose length
// varies; a calendar day or week has its unit's length.
func calendarMonth(r *rules.Rule) bool {
	lim, _ := r.LimitFor("", false)
	if lim == nil {
		return false
	}
	unit, _ := lim.Calendar()
	return unit == localbucket.Month
}

// units are Envoy's, shortest first, with the lengths envoyproxy/ratelimit gives them.
var units = [...]struct {
	unit rlsv3.RateLimitResponse_RateLimit_Unit
	d    time.Duration
}{
	{rlsv3.RateLimitResponse_RateLimit_SECOND, time.Second},
	{rlsv3.RateLimitResponse_RateLimit_MINUTE, time.Minute},
	{rlsv3.RateLimitResponse_RateLimit_HOUR, time.Hour},
	{rlsv3.RateLimitResponse_RateLimit_DAY, 24 * time.Hour},
	{rlsv3.RateLimitResponse_RateLimit_WEEK, 7 * 24 * time.Hour},
	{rlsv3.RateLimitResponse_RateLimit_MONTH, 30 * 24 * time.Hour},
	{rlsv3.RateLimitResponse_RateLimit_YEAR, 365 * 24 * time.Hour},
}

// envoyUnit expresses limit per window in an Envoy unit. A window that is a unit is
// reported as is (10 per minute). Otherwise the rate is kept: the first unit at least as
// long as the window in which it is a whole number of requests (10 per 30s → 20 per
// minute; 100 per 90s → 4000 per hour); when there is none, the first unit at least as
// long as the window, the count rounded down, at least 1 (7 per 13s → 32 per minute).
// A window past a year is reported per year, rounded down likewise.
func envoyUnit(limit uint64, window time.Duration) (uint32, rlsv3.RateLimitResponse_RateLimit_Unit) {
	if window <= 0 {
		return uint32(min(limit, math.MaxUint32)), rlsv3.RateLimitResponse_RateLimit_SECOND
	}
	first := -1
	for i, u := range units {
		if u.d < window {
			continue
		}
		if first < 0 {
			first = i
		}
		hi, lo := bits.Mul64(limit, uint64(u.d))
		if hi >= uint64(window) {
			break // past uint64: longer units only grow
		}
		q, rem := bits.Div64(hi, lo, uint64(window))
		if q > math.MaxUint32 {
			break
		}
		if rem == 0 {
			return uint32(q), u.unit
		}
	}
	if first < 0 {
		first = len(units) - 1
	}
	u := units[first]
	hi, lo := bits.Mul64(limit, uint64(u.d))
	if hi >= uint64(window) {
		return math.MaxUint32, u.unit
	}
	q, _ := bits.Div64(hi, lo, uint64(window))
	return uint32(min(max(q, 1), math.MaxUint32)), u.unit
}

// rateLimitItem is r's figures for the RateLimit fields.
func rateLimitItem(r *limiter.Result) *proto.RateLimitItem {
	return &proto.RateLimitItem{Name: r.Name, Limit: r.Limit, Window: r.Window, Remaining: r.Remaining,
		Allowed: r.Allowed, Reset: r.Reset, RetryAfter: r.RetryAfter, Concurrency: r.Rule != nil && r.Rule.Concurrency}
}

// maxConns bounds the listener's connections at once; past it a new connection closes
// the native transport's connection idle longest (closeIdlest), or is closed as soon as
// it is accepted when none is idle. Each holds one of the daemon's descriptors, which
// its msgpack socket needs too, and a HOST:PORT listener answers any local user:
// unbounded, a process holding idle connections up to the descriptor limit made every
// accept fail (EMFILE), the msgpack socket's as well. Envoy opens a few per worker
// thread.
const maxConns = 1024

// capped returns ln accepting at most maxConns connections open at once.
func (s *Server) capped(ln net.Listener) net.Listener {
	return connlimit.Evicting(ln, maxConns, s.closeIdlest)
}
