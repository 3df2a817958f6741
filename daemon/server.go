// Package daemon is the rlsidecar server: the Unix socket, the per-connection loop that
// reads frames, decides and answers in order, and the lifecycle around them.
//
// One goroutine serves each connection. It decodes every complete frame already read,
// answers each into one output buffer, and writes that buffer with a single syscall when
// no further complete frame is waiting: pipelined requests cost one read and one write per
// batch, a lone request one of each. A request that waits on Redis (a check with a
// global-mode rule, or the release or renew of a global lease) is decided on a goroutine
// of its own, so the Redis round trips of one pipelined connection overlap; the answers
// after it wait in order behind it. The connection's goroutine does
// not wait for them: it hands the batch over (the write queue) and reads on, and whichever
// goroutine completes the oldest waiting check writes every answer that is then ready, in
// request order, with one writev. So a pipelined client's next requests are read and sent
// to Redis while the earlier ones are decided, and no goroutine is added per connection.
// Every other request (a local release among them) is decided inline, with no goroutine
// and no lock of the connection's while nothing waits on Redis. Requests decided off the
// fast path run concurrently: a client that needs a release done before its next check
// waits for the release's answer.
//
// When a connection closes, its goroutine waits for its requests in flight, then frees
// the leases it still holds: the global ones in one Redis pipeline bounded at 1 s
// (limiter.Limiter.ReleaseOwner), on that goroutine, so neither the accept loop nor any
// other connection waits for it; the connection counts against MaxConns until then.
package daemon

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/rlsidecar/rlsidecar/internal/plural"
	"github.com/rlsidecar/rlsidecar/internal/rawio"
	"github.com/rlsidecar/rlsidecar/internal/unixsock"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// Config is the server's configuration. Zero fields take the defaults named below.
type Config struct {
	Socket       string        // path of the Unix socket (required)
	SocketMode   os.FileMode   // permission bits of the socket file; default 0660
	SocketGroup  string        // group (name or number) given the socket file; empty: the daemon's own
	MaxFrame     int           // largest frame body accepted; default proto.DefaultMaxFrame
	MaxConns     int           // connections served at once; more are answered too_many_connections and closed; default 1024
	FrameTimeout time.Duration // time allowed to finish sending a frame once it has begun; default 5s
	WriteTimeout time.Duration // time allowed for a client to take its answers; past it the connection is closed; default 5s
	IdleTimeout  time.Duration // close a connection idle this long; 0 (default) keeps idle connections
	DrainTimeout time.Duration // on shutdown, time to answer what is in flight before connections are closed; default 5s
	// HeldBudget bounds the bytes of answers all connections together hold for clients
	// not reading them (HeldPerConn bounds one connection's): past it, a connection
	// holding more than minHeld stops reading until its client reads or the others'
	// clients do. Default 64 MiB.
	HeldBudget int
	// HeldPerConn bounds the bytes of answers (and of the requests they answer) one
	// connection holds for a client that is not reading them, as one that writes its
	// whole pipeline before it reads: past it the connection stops reading until its
	// client reads. Default 16 MiB (about 45,000 checks matching three rules); the
	// connections together stay under HeldBudget.
	HeldPerConn int
	// BusyPoll, when above zero, lets one connection at a time keep reading its socket for
	// up to this long after it finds it empty, instead of sleeping in the netpoller at
	// once: a gateway's next request then finds the daemon awake. It trades CPU (up to
	// one core while requests keep arriving within BusyPoll of each other) for the cost
	// of a wake-up, which on a VM whose idle vCPUs halt is an exit to the hypervisor.
	// Linux only; 0 (default): off.
	BusyPoll time.Duration
	Version  string       // reported by ping
	Logger   *slog.Logger // default: discard
	Metrics  *Metrics     // nil: no metrics
	Clock    Clock        // read once per batch of frames; default NewSystemClock()

	// Request bounds, passed to the decoder; zero takes the proto defaults.
	MaxAttrs   int
	MaxAttrLen int

	// Listener, when set, is an already-open listening socket (from systemd socket
	// activation): Listen takes it as it is, ignoring SocketMode and SocketGroup, and
	// Shutdown closes it without removing its file, which belongs to whoever opened it.
	Listener *net.UnixListener
}

func (c *Config) setDefaults() {
	if c.SocketMode == 0 {
		c.SocketMode = 0o660
	}
	if c.MaxFrame <= 0 {
		c.MaxFrame = proto.DefaultMaxFrame
	}
	if c.MaxConns <= 0 {
		c.MaxConns = 1024
	}
	if c.FrameTimeout <= 0 {
		c.FrameTimeout = 5 * time.Second
	}
	if c.WriteTimeout <= 0 {
		c.WriteTimeout = 5 * time.Second
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = 5 * time.Second
	}
	if c.HeldBudget <= 0 {
		c.HeldBudget = 64 << 20
	}
	if c.HeldPerConn <= 0 {
		c.HeldPerConn = 16 << 20
	}
	if c.Version == "" {
		c.Version = "dev"
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Clock == nil {
		c.Clock = NewSystemClock()
	}
}

// Server serves the protocol on a Unix socket. Create it with New, start it with Listen
// and Serve, stop it with Shutdown.
type Server struct {
	cfg Config
	lim *limiter.Limiter
	log *slog.Logger

	ln *net.UnixListener
	// sock is the socket file Listen created, by device and inode: Shutdown removes the
	// path only while it still names that file, not one another daemon has put there
	// since. Zero when the listener came from Config.Listener.
	sock     unixsock.FileID
	draining atomic.Bool
	// stopping is closed when Shutdown begins: it wakes the connections whose read side
	// is shut, waiting for their leases to end (awaitLeases), which no read deadline can.
	stopping chan struct{}
	mu       sync.Mutex
	conns    map[*net.UnixConn]struct{}
	wg       sync.WaitGroup
	// serving is Serve's accept loop: Shutdown waits for it to return before it waits
	// for the connections (wg), so the last one it accepted is counted first.
	serving sync.WaitGroup

	nconns atomic.Int64
	// lingering counts the connections refused (too_many_connections, shutting_down)
	// whose close waits for their client to take the error answer (lingerClose).
	lingering atomic.Int32
	connIDs   atomic.Uint64 // the last connection id given (conn.id)
	// owners holds the connections being served, by id (conn.id: the owner of the
	// leases taken on it), for ownerGone.
	owners sync.Map
	// held is the bytes of answers the connections hold for clients not reading them,
	// as each last counted its own (conn.report).
	held atomic.Int64
	// readBuf is the size of a connection's read buffer: frames that do not fit are read
	// into a buffer of their own (the fuzz test lowers it to reach that path).
	readBuf int
	// wallOffset is the wall clock's offset from the monotonic one last told the store.
	wallOffset atomic.Int64
	// heads holds each rule's pre-encoded name, limit and window for the answers.
	heads ruleHeads
	// spin is the busy-poll budget connections share (Config.BusyPoll); nil when off.
	spin *rawio.Spinner
	// orderSeed hashes the keys of a connection's checks that wait (conn.order).
	orderSeed maphash.Seed
}

// now reads the clock: it returns the monotonic time decisions are made on, and tells
// the store when the wall clock has moved from it by more than a millisecond (a step),
// so fixed windows stay aligned to wall time.
func (s *Server) now() int64 {
	mono, wall := s.cfg.Clock.Now()
	if d := wall - mono - s.wallOffset.Load(); d > int64(time.Millisecond) || d < -int64(time.Millisecond) {
		s.wallOffset.Store(wall - mono)
		s.lim.Store().SetWallOffset(wall - mono)
	}
	return mono
}

// New returns a server deciding with lim.
func New(cfg Config, lim *limiter.Limiter) (*Server, error) {
	if cfg.Socket == "" {
		return nil, errors.New("daemon: no socket path")
	}
	cfg.setDefaults()
	srv := &Server{cfg: cfg, lim: lim, log: cfg.Logger, conns: make(map[*net.UnixConn]struct{}), readBuf: readBufSize, orderSeed: maphash.MakeSeed(),
		stopping: make(chan struct{})}
	if cfg.BusyPoll > 0 {
		srv.spin = rawio.NewSpinner(cfg.BusyPoll)
	}
	lim.Leases().SetOwnerGone(srv.ownerGone)
	lim.Leases().SetGlobalOwnerGone(srv.globalOwnerGone)
	return srv, nil
}

// ownerGone reports whether connection owner, still served, has been closed by its
// client: a check that finds a concurrency slot full frees such a connection's leases at
// once (limiter.Leases.SetOwnerGone), rather than after its goroutine has seen the close.
// A client that closes a connection holding leases, then checks again on another, finds
// its slots free (PROTOCOL.md: a lease holds its slots "until released, expired, or its
// connection closed").
func (s *Server) ownerGone(owner uint64) bool {
	v, ok := s.owners.Load(owner)
	return ok && v.(*conn).peerClosed()
}

// globalOwnerGone is ownerGone for the global leases: false while the server drains,
// when a connection's close keeps its global leases (ReleaseOwnerAtShutdown), since the
// gateway's requests still hold them. Draining is read after the poll: a client that
// closed in answer to the drain has done so after it began.
func (s *Server) globalOwnerGone(owner uint64) bool {
	return s.ownerGone(owner) && !s.draining.Load()
}

// Connections returns the number of connections being served.
func (s *Server) Connections() int64 { return s.nconns.Load() }

// Draining reports whether Shutdown has begun: no connection is accepted any more.
func (s *Server) Draining() bool { return s.draining.Load() }

// Listen creates the socket. A socket file left by a dead daemon is replaced; one a live
// daemon answers on is refused, and so is a path that is not a socket or a file another
// user (not root) owns. With Config.Listener set, it takes that socket as it is.
func (s *Server) Listen() error {
	if s.cfg.Listener != nil {
		s.cfg.Listener.SetUnlinkOnClose(false)
		s.ln = s.cfg.Listener
		return nil
	}
	path := s.cfg.Socket
	if max := len(syscall.RawSockaddrUnix{}.Path) - 1; len(path) > max { // less its NUL
		return fmt.Errorf("listening on %s: the path is %d bytes, and a Unix socket's holds at most %d; choose a shorter --socket", path, len(path), max)
	}
	gid := -1
	if s.cfg.SocketGroup != "" {
		var err error
		if gid, err = unixsock.LookupGroup(s.cfg.SocketGroup); err != nil {
			return fmt.Errorf("listening on %s: %w", path, err)
		}
	}
	if dir := filepath.Dir(path); sharedDir(dir) {
		s.log.Warn("the socket is in a directory every local user can write: another user can take its path first, and then the daemon refuses to start, or that user answers the gateways' checks; set --socket or RLSIDECAR_SOCKET to a directory only the daemon's user and its gateways can write (e.g. /run/rlsidecar)",
			"socket", path, "dir", dir)
	}
	// Two daemons started at once on a stale socket would each find it refusing
	// connections, each remove it (the second removing the first's new socket) and each
	// bind: the lock makes the second look only after the first is listening, and so
	// find it live.
	unlock, err := unixsock.Lock(path)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", path, err)
	}
	defer unlock()
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return fmt.Errorf("listening on %s: the path exists and is not a socket; refusing to replace it", path)
		}
		if err := ownedByOther(fi); err != nil {
			return fmt.Errorf("listening on %s: the socket file there %w; refusing to use or remove it (remove it as that user or root if it is stale, and choose a --socket in a directory other users cannot write)", path, err)
		}
		c, err := net.DialTimeout("unix", path, time.Second)
		if err == nil {
			c.Close()
			return fmt.Errorf("listening on %s: another daemon is serving this socket", path)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return fmt.Errorf("listening on %s: probing the existing socket: %w", path, err)
		}
		if err := os.Remove(path); err != nil {
			return fmt.Errorf("listening on %s: removing a stale socket: %w", path, err)
		}
		s.log.Info("replaced a stale socket file", "socket", path)
	}
	// Create the socket owner-only, then open it up to the configured mode, so it is
	// never more permissive than configured, whatever the umask.
	old := syscall.Umask(0o177)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", path, err)
	}
	// Until the file is known, closing the listener removes it (as ListenUnix sets up).
	if gid >= 0 {
		if err := os.Chown(path, -1, gid); err != nil {
			ln.Close()
			return fmt.Errorf("giving %s to group %s: %w", path, s.cfg.SocketGroup, err)
		}
	}
	if err := os.Chmod(path, s.cfg.SocketMode); err != nil {
		ln.Close()
		return fmt.Errorf("setting mode %#o on %s: %w", s.cfg.SocketMode, path, err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		ln.Close()
		return fmt.Errorf("listening on %s: %w", path, err)
	}
	// From here Shutdown removes the file itself, and only while the path still names it.
	s.sock = unixsock.IDOf(fi)
	ln.SetUnlinkOnClose(false)
	s.ln = ln
	return nil
}

// removeSocket removes the socket file Listen created, if the path still names it: a
// daemon started on the same path after this one's file was removed (by hand, or by a
// cleaner of the temp directory) has its own file there, which stays.
func (s *Server) removeSocket() {
	if s.sock == (unixsock.FileID{}) {
		return // Config.Listener's file, or none created
	}
	path := s.cfg.Socket
	unlock, err := unixsock.Lock(path)
	if err != nil {
		// Removing unlocked risks only the race the lock closes (a successor replacing
		// the file between the look and the removal); leaving the file would refuse the
		// gateways a fresh start no more than a stale file does, but warn either way.
		s.log.Warn("removing the socket file without the start lock", "socket", path, "err", err)
		unlock = func() {}
	}
	defer unlock()
	fi, err := os.Lstat(path)
	if err != nil {
		return // already removed
	}
	if unixsock.IDOf(fi) != s.sock {
		s.log.Info("left the socket file in place: another daemon has put its own there since this one started", "socket", path)
		return
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		s.log.Warn("removing the socket file failed; the next daemon replaces it as stale", "socket", path, "err", err)
		return
	}
	s.sock = unixsock.FileID{} // removed: a second Shutdown has nothing to look at
}

// Serve accepts connections until Shutdown. It returns nil after Shutdown.
func (s *Server) Serve() error {
	if s.ln == nil {
		return errors.New("daemon: Serve before Listen")
	}
	s.mu.Lock()
	if s.draining.Load() {
		s.mu.Unlock()
		return nil
	}
	s.serving.Add(1) // under mu, before Shutdown sets draining: before its Wait
	s.mu.Unlock()
	defer s.serving.Done()
	var backoff time.Duration
	var lastRefusal time.Time
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if s.draining.Load() {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				// Out of descriptors: wait rather than spin.
				backoff = min(max(backoff*2, 5*time.Millisecond), time.Second)
				s.log.Warn("accept failed; retrying", "err", err, "backoff", backoff)
				time.Sleep(backoff)
				continue
			}
			return fmt.Errorf("accepting on %s: %w", s.cfg.Socket, err)
		}
		backoff = 0
		if s.nconns.Load() >= int64(s.cfg.MaxConns) {
			s.refuse(c, proto.CodeTooManyConnections, tooManyConnections(s.cfg.MaxConns))
			if m := s.cfg.Metrics; m != nil {
				m.connClosed(closeTooManyConnections)
			}
			if now := time.Now(); now.Sub(lastRefusal) > 10*time.Second { // one line per 10 s
				lastRefusal = now
				s.log.Warn("refusing connections: --max-conns reached (rlsidecar_connections_closed_total{reason=\"too_many_connections\"} counts them)", "max_conns", s.cfg.MaxConns)
			}
			continue
		}
		s.track(c)
		go s.serveConn(c)
	}
}

// tooManyConnections is the message of a too_many_connections refusal under --max-conns
// max ("at most 1 connection" under --max-conns 1, not "1 connections").
func tooManyConnections(max int) string {
	return fmt.Sprintf("the daemon serves at most %s; close idle ones or raise --max-conns", plural.Count(max, "connection"))
}

// acceptBacklog takes, without waiting, the connections waiting in the listen backlog of
// a socket the daemon made (at most MaxConns in all): closing the listener would reset
// them, and their clients may have written requests already. A socket systemd passed is
// left alone: systemd keeps it, and its backlog, for the next daemon.
func (s *Server) acceptBacklog() []*net.UnixConn {
	if s.ln == nil || s.cfg.Listener != nil {
		return nil
	}
	cs, errs := rawio.AcceptPending(s.ln, int(int64(s.cfg.MaxConns)-s.nconns.Load()))
	for _, err := range errs {
		s.log.Warn("drain: taking a connection from the backlog", "err", err)
	}
	conns := make([]*net.UnixConn, 0, len(cs))
	for _, c := range cs {
		if uc, ok := c.(*net.UnixConn); ok {
			conns = append(conns, uc)
		} else {
			c.Close()
		}
	}
	return conns
}

func (s *Server) refuse(c *net.UnixConn, code, msg string) {
	enc := proto.NewEncoder()
	enc.EncodeError(0, code, msg)
	_ = c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	_, _ = c.Write(enc.Bytes())
	s.lingerLater(c) // past maxLingering, a flood of refusals: closed at once
}

// A connection closed after an error answer (too_many_connections, frame_too_large,
// shutting_down) is first half-closed and drained, for up to lingerFor and lingerBytes:
// closed at once, with the client's request unread in it (a client writes before it
// reads), the client's write failed (EPIPE) or its read did (ECONNRESET) before it
// could read the answer, so the error code the protocol promises never reached it (0
// of 300 refused clients read too_many_connections, 0 of 100 read frame_too_large).
// At most maxLingering refused connections linger at once; past that they are closed
// at once, as before.
const (
	lingerFor    = time.Second
	lingerBytes  = 64 << 20
	maxLingering = 64
)

// lingerClose closes c once its client has read what was written to it: it shuts c's
// write side (the client reads the answer, then end of file) and reads and discards
// what the client sends until it closes, lingerFor passes or lingerBytes are read.
func lingerClose(c *net.UnixConn) {
	defer c.Close()
	if c.CloseWrite() != nil || c.SetReadDeadline(time.Now().Add(lingerFor)) != nil {
		return
	}
	buf := make([]byte, 16<<10)
	for n := 0; n < lingerBytes; {
		k, err := c.Read(buf)
		if err != nil {
			return
		}
		n += k
	}
}

// track counts c among the connections served. A connection taken while the server
// drains (from Serve's last accepts or the backlog) is served too, in drain mode: what it
// holds is answered (Read). Every call happens before Shutdown waits for wg: from Serve,
// which Shutdown waits for first, or from Shutdown itself.
func (s *Server) track(c *net.UnixConn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	s.nconns.Add(1)
}

func (s *Server) untrack(c *net.UnixConn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	s.nconns.Add(-1)
	s.wg.Done()
}

// Shutdown stops accepting, removes the socket file, lets every connection answer the
// frames it has received (read, or held by its socket: see conn.Read; a connection still
// in the backlog of a socket of the daemon's own is taken and answered too), and closes
// them. Connections still busy when ctx ends (or after DrainTimeout) are closed. It
// returns when every connection goroutine is done.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	if !s.draining.Swap(true) {
		close(s.stopping)
	}
	s.mu.Unlock()
	// Clients that connected and wrote just before the drain are answered, not reset.
	for _, c := range s.acceptBacklog() {
		s.track(c)
		go s.serveConn(c)
	}
	if s.ln != nil {
		s.removeSocket() // before the close, in the order the listener's own unlinking had
		s.ln.Close()
	}
	s.serving.Wait() // Serve has returned: no connection is tracked after this
	s.mu.Lock()
	conns := make([]*net.UnixConn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	// Wake readers blocked waiting for a next frame; they answer what they hold and exit.
	past := time.Unix(1, 0)
	for _, c := range conns {
		_ = c.SetReadDeadline(past)
	}
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	ctx, cancel := context.WithTimeout(ctx, s.cfg.DrainTimeout)
	defer cancel()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		for _, c := range conns {
			_ = c.Close()
		}
		<-done
		return fmt.Errorf("shutdown: connections still busy after %s were closed", s.cfg.DrainTimeout)
	}
}

// conn is the per-connection state: reused codec, request, decision and response.
type conn struct {
	s  *Server
	id uint64 // owns the leases taken on this connection (limiter.Decision.Owner)
	c  *net.UnixConn
	rw io.ReadWriter // c's reads and writes, without the scheduler's syscall state (rawio_linux.go)

	writeWaits func() // moveWriteDeadline, bound once
	br         *bufio.Reader
	dec        *proto.Decoder
	enc        *proto.Encoder

	// st is the frame being answered, decoded (and for a check, prepared), by handle.
	st staged
	// staged are walkAhead's frames decoded, and for checks prepared, before their turn:
	// frame k of a walk in staged[k%len(staged)], up to ahead frames past the one
	// answered. Made at its first walk: most connections never take it.
	staged *[ahead + 1]staged
	big    []byte // body of a frame larger than br's buffer
	// raw is c's descriptor, for the drain's reads (Read); nil in tests without a socket.
	raw syscall.RawConn
	// drainNoted: the drain has noted drainLeft, the bytes the socket held when it began
	// and not yet read. The connection's goroutine's (Read).
	drainNoted bool
	drainLeft  int
	// tally counts the allowed checks answered inline, added to the metrics at each flush.
	tally batchTally

	deadline  time.Time // the read deadline currently set (zero: none)
	idleSince time.Time // when waitIdle began to wait for a next frame (with an IdleTimeout)
	idleShut  bool      // the read side is shut: the connection ends once idle (shutIdle)
	wdeadline time.Time // the write deadline currently set (zero: none)
	waited    bool      // the frame being read was not all there: its time is when it completes
	// frameTimed: the frame being read has its deadline set.
	frameTimed bool
	// cut is why the daemon closed this connection (a closeReason), 0 while it has not;
	// set once, by the first cause (a failed write can come from a deciding goroutine).
	cut atomic.Uint32
	// answered counts the answers in the output buffer, which arrived at arrived (the
	// first batch's clock reading): the latency histogram is fed per flush.
	answered int
	arrived  int64

	// pending are this batch's checks waiting on Redis, in request order, not yet handed
	// to the write queue; answers read after the first of them go to the tail of the last
	// one, so answers leave in request order. Empty on the fast path (local and hybrid
	// checks are answered inline into enc).
	pending []*pending
	spare   []*pending // written ones, for reuse (the connection's goroutine's)

	// The write queue, shared with the deciding goroutines: under wmu.
	wmu     sync.Mutex
	wcond   sync.Cond   // signalled when the queue shrinks (L is &wmu)
	queue   []*pending  // handed over, not yet written, in request order
	free    []*pending  // written, for spare
	werr    error       // the first failed write: the connection is done
	writing bool        // a deciding goroutine is about to write what is ready
	bufs    net.Buffers // the write in progress
	bufsArr [][]byte    // bufs' backing array, reused
	// queued is len(queue), stored once the writes of the entries taken off it are done:
	// 0 means no other goroutine writes, so the fast path writes without wmu.
	queued   atomic.Int32
	wfailed  atomic.Bool // werr is set
	heldSeen int         // the held bytes this connection last added to Server.held (under wmu)
	// undecided counts the checks handed to deciding goroutines and not yet decided
	// (queued or not): at most about maxPending are in flight on Redis per connection.
	undecided atomic.Int32
	// inWrite is how many entries at the queue's head the write in progress holds (its
	// buffers alias their bytes): compact leaves them alone. Under wmu.
	inWrite  int
	deciding sync.WaitGroup // the deciding goroutines

	// order is the latest check waiting on Redis (goWait) that takes from a key, by the
	// key's hash (Server.orderSeed): a later check of the connection that shares a key
	// with it waits for it to be decided before it is decided itself, so that pipelined
	// checks of one key are decided in request order, whatever order their goroutines
	// run in (a lone goroutine spawned last runs first). Checks that share no key still
	// overlap their Redis round trips. shared is the releases and renews waiting since
	// the key's latest check, which free or hold slots of the key: they wait for that
	// check, the next check waits for them all, but they do not wait for one another (one
	// lease's release and renew are ordered by the lease's own token, in order). Under
	// omu; turns counts the distinct turns, read without omu: 0 (nothing waits) leaves the
	// fast path one load.
	omu    sync.Mutex
	order  map[uint64]*turn
	shared map[uint64][]*turn
	turns  atomic.Int32
	hashes []uint64  // the connection goroutine's scratch
	token  [1]uint64 // the connection goroutine's scratch: a lease token's hash
}

// turn is a waiting request's place in its connection's order: done is closed once it is
// decided.
type turn struct {
	done chan struct{}
	// queued is closed once the request's global script call is queued for Redis
	// (limiter.Decision.Queued), or else once it is decided: a later check that shares
	// only keys in Redis with it (limiter.KeyInRedis) waits for that alone, as Redis
	// decides the calls of a key in the order they are queued, and so shares its round
	// trip rather than taking one after it.
	queued chan struct{}
	qonce  sync.Once
	afterQ []*turn  // the waiting requests before it whose queued it waits for
	keys   []uint64 // the keys it takes from (a check's), or a lease's token
	shared []uint64 // the keys of the slots of a lease it releases or renews
	after  []*turn  // the waiting requests before it that it waits for
}

// pending is one request decided off the connection's goroutine because it waits on
// Redis (a check with a global-mode rule, the release or renew of a global lease), so that a pipelined connection's Redis round trips overlap. In
// the write queue, an entry may also be answers decided inline (fin from the start, enc
// holding them).
type pending struct {
	body []byte // a copy of the frame body: req's strings alias it
	req  proto.Request
	in   limiter.Input
	dcs  limiter.Decision
	enc  *proto.Encoder // the answer, written by the deciding goroutine before fin
	off  int            // the bytes of enc already written (writeBehind's first entry)
	tail *proto.Encoder // the answers of the frames after it, written by the connection
	fin  bool           // enc holds the answer (under wmu)
	// n answers (its own and its tail's), the frames of which arrived at arrived: the
	// latency histogram is fed when they are written.
	n       int
	arrived int64
}

// maxPending bounds the checks in flight on Redis per connection (handed over or not);
// past it the connection waits for one to be decided before reading further.
const maxPending = 64

// Config.HeldPerConn bounds the bytes of answers a connection holds for a client that is
// not reading them (it may be writing a long pipeline first, as the protocol allows):
// past it the connection stops reading until the client reads. (It was 2 MiB, a
// constant: a client that wrote 8,000 checks of three rules before reading was cut off
// by the write timeout, blocked writing while the daemon waited for it to read.)
// maxQueued bounds the write queue's entries; past it, runs of decided entries are
// merged (compact), so that a pipeline of checks that wait on Redis is held to the same
// bytes as one answered inline, not to a number of entries.
//
// Every connection holding that much would come to gigabytes at the default 1,024
// connections (a local process that writes and never reads, on each of them): together
// they are held to Config.HeldBudget. Past it, a connection holding more than minHeld
// stops reading too, and looks again every heldPoll (the others' clients may read, or be
// cut off by the write timeout), so the total stays under the budget plus minHeld and a
// batch per connection, and a client reading its answers is never held back.
const (
	minHeld   = 2 * flushAt // 64 KiB
	heldPoll  = 5 * time.Millisecond
	maxQueued = 4 * maxPending
)

// out is the encoder the next inline answer goes to: the output buffer, or after a
// pending check, that check's tail.
func (cn *conn) out() *proto.Encoder {
	if n := len(cn.pending); n > 0 {
		return cn.pending[n-1].tail
	}
	return cn.enc
}

// wait blocks until every deciding goroutine is done, and with them every write of the
// answers handed over.
func (cn *conn) wait() { cn.deciding.Wait() }

const readBufSize = 16 << 10

func (s *Server) serveConn(c *net.UnixConn) {
	defer s.untrack(c)
	var cut *atomic.Uint32
	farewelled := false // ended by farewell: closed as after an error answer
	defer func() {
		if cut != nil && closeReason(cut.Load()) == closeFrameTooLarge {
			lingerClose(c) // its answer written: the client must be able to read it
			return
		}
		if farewelled {
			s.lingerLater(c)
			return
		}
		_ = c.Close()
	}()
	cn := &conn{s: s, c: c, id: s.connIDs.Add(1), dec: proto.NewDecoder(), enc: proto.NewEncoder()}
	cut = &cn.cut
	cn.br = bufio.NewReaderSize(cn, s.readBuf) // through Read: rw's, or the drain's
	cn.wcond.L = &cn.wmu
	cn.st.d.Owner = cn.id
	if s.cfg.MaxAttrs > 0 {
		cn.dec.MaxAttrs = s.cfg.MaxAttrs
	}
	if s.cfg.MaxAttrLen > 0 {
		cn.dec.MaxAttrLen = s.cfg.MaxAttrLen
	}
	cn.rw = rawio.New(c, s.spin)
	cn.writeWaits = cn.moveWriteDeadline
	if rc, err := c.SyscallConn(); err == nil {
		cn.raw = rc
	}
	s.owners.Store(cn.id, cn) // once cn.raw is set: ownerGone reads it
	defer s.owners.Delete(cn.id)
	// Last, once no check is deciding: the connection's leases are freed when it closes,
	// so a gateway that dies frees its slots at once; but not its global leases when the
	// daemon is the one going away (draining): the gateway's requests still hold them.
	defer func() {
		if s.draining.Load() {
			s.lim.ReleaseOwnerAtShutdown(cn.id, s.now())
			return
		}
		s.lim.ReleaseOwner(cn.id, s.now())
	}()
	if m := s.cfg.Metrics; m != nil {
		defer func() { // after wait: a deciding goroutine's write may be the cause
			r := closeReason(cn.cut.Load())
			if r == 0 && cn.idleShut {
				// Ended after its read side was shut for idleness, by nothing else (a
				// frame too large after the shut is that): not marked at the shut, which
				// would have kept a later reason from its mark, and a frame too large from
				// its lingering close.
				r = closeIdleTimeout
			}
			if r != 0 {
				m.connClosed(r)
			}
		}()
	}
	defer func() { // what it held is freed with it
		cn.wmu.Lock()
		cn.report(0)
		cn.wmu.Unlock()
	}()
	defer cn.wait() // no deciding goroutine outlives its connection
	if m := s.cfg.Metrics; m != nil {
		defer m.flushTally(&cn.tally) // checks decided whose answers were not written
	}
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("BUG: panic serving a connection; closing it", "panic", p)
		}
	}()
	if s.draining.Load() {
		// Accepted while draining (Serve's last accepts, the backlog): what the client
		// wrote is answered; a client that has written nothing is told to go elsewhere.
		if _, err := cn.br.Peek(1); err != nil {
			s.refuse(c, proto.CodeShuttingDown, "the daemon is shutting down; connect again (to its successor)")
			return
		}
	}
	err := cn.loop()
	if err != nil && !isClosed(err) {
		s.log.Debug("connection closed", "err", err)
	}
	if s.draining.Load() && cn.drainNoted && errors.Is(err, net.ErrClosed) {
		farewelled = cn.farewell()
	}
}

// farewell ends a connection the drain has read to its end (every frame its client wrote
// before the drain: conn.Read): once every answer is written, an error frame with id 0
// and code shutting_down tells the client that whatever it sent without an answer before
// it was not read, so not decided, and can be sent again (to the daemon's successor).
// Without it a client could not tell those requests from ones a daemon that died had
// decided, and gave them its failure policy: about 20 checks of 32 in flight on every
// restart. It reports whether the frame was written (the connection is then closed as
// after an error answer: lingerLater).
func (cn *conn) farewell() bool {
	if cn.flush() != nil {
		return false
	}
	cn.wait() // every answer handed over written
	if cn.wfailed.Load() || cn.queued.Load() > 0 {
		return false
	}
	enc := proto.NewEncoder()
	enc.EncodeError(0, proto.CodeShuttingDown, "the daemon is shutting down: requests without an answer before this one were not read; send them again (to its successor)")
	if cn.c.SetWriteDeadline(time.Now().Add(100*time.Millisecond)) != nil {
		return false
	}
	_, err := cn.c.Write(enc.Bytes())
	return err == nil
}

// lingerLater closes c as refuse does after its error answer: on a goroutine of its own
// (lingerClose), or at once past maxLingering.
func (s *Server) lingerLater(c *net.UnixConn) {
	if s.lingering.Add(1) > maxLingering {
		s.lingering.Add(-1)
		_ = c.Close()
		return
	}
	go func() {
		defer s.lingering.Add(-1)
		lingerClose(c)
	}()
}

func isClosed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// setDeadline sets the read deadline the connection's goroutine waits under (a call
// that changes nothing makes none).
//
// A write that failed (writeReady) ends the reads with a past read deadline; a deadline
// set here after that one replaced it, and the read then waited for a client that was
// gone or could not read: a client that had shut its read side and kept its end open
// held the connection, at --idle-timeout 0 for good (TestE2EHalfShutClientsAllEnd: 129
// to 237 of 480 such connections, whose last frame came in pieces, still open). So once
// a write has failed, the past deadline is set again after the new one. The failed
// write sets its flag before its deadline, and this reads the flag after its own: one
// of the two deadlines set last is past. A deadline changes once per IdleTimeout/2 and
// per frame waited for, not per request: the reads themselves check nothing more.
func (cn *conn) setDeadline(t time.Time) error {
	if t.Equal(cn.deadline) {
		return nil
	}
	cn.deadline = t
	if err := cn.c.SetReadDeadline(t); err != nil {
		return err
	}
	if cn.wfailed.Load() {
		return cn.c.SetReadDeadline(time.Unix(1, 0))
	}
	return nil
}

// waitIdle flushes the answers so far and waits for the first byte of a next frame.
//
// After the answers to a pipelined batch (yield: more than one frame), it first lets the
// goroutines ready on this P run: other connections whose frames the netpoller has seen.
// This connection's client is reading the answers just written and has not sent its next
// batch yet, so a read now would most often find the socket empty and park the goroutine,
// to be woken again: a system call and a trip through the netpoller for nothing. With
// nothing else ready, Gosched returns at once. A batch of one (a gateway's one check at a
// time) goes straight to its read: its round trip is the latency the gateway waits for.
func (cn *conn) waitIdle(yield bool) error {
	if err := cn.flush(); err != nil {
		return err
	}
	if yield {
		goyield()
	}
	s := cn.s
	if s.cfg.IdleTimeout > 0 {
		now := time.Now()
		cn.idleSince = now
		// Move the deadline only when it is more than half used: one syscall-free check
		// per request, one timer update per IdleTimeout/2. It can then fire before the
		// connection has been idle for IdleTimeout (after half of it, at worst): see below.
		// One further ahead than IdleTimeout is no idle wait's: the deadline set for the
		// rest of a frame (FrameTimeout). Before, it was kept, and a connection whose last
		// request arrived in pieces was cut after the frame timeout instead.
		if left := cn.deadline.Sub(now); cn.deadline.IsZero() || left < s.cfg.IdleTimeout/2 || left > s.cfg.IdleTimeout {
			if err := cn.setDeadline(now.Add(s.cfg.IdleTimeout)); err != nil {
				return err
			}
		}
	} else if err := cn.setDeadline(time.Time{}); err != nil {
		return err
	}
	// Draining, Read returns what the socket holds and waits for nothing. Shutdown sets
	// the draining flag before it sets a past deadline, so a Peek that was waiting ends
	// with that deadline, and peek reads again through the drain.
	_, err := cn.peek(1)
	// A deadline that fires before the connection has been idle for IdleTimeout (one set
	// by an earlier request, not moved since) waits for the rest of it: a connection is
	// cut only once idle for IdleTimeout. Before, one idle for just over half of it was.
	// Idle, but holding leases: a gateway keeps the connection that took a lease open for
	// as long as its request runs (a download, a stream), and closing it would free the
	// slots of requests still running. Such a connection outlives the idle timeout; it is
	// cut once its leases are released or have run out.
	//
	// A write that failed (writeReady) wakes this wait with a past read deadline too: the
	// connection is done, and ends now. Before, the wake-up was taken for an idle
	// deadline come early, and the wait went on for the rest of IdleTimeout, or for as
	// long as the connection held leases (TestWriteTimeoutCutsAnIdleWaitingConnection).
	for err != nil && s.cfg.IdleTimeout > 0 && errors.Is(err, os.ErrDeadlineExceeded) && !s.draining.Load() && !cn.wfailed.Load() {
		next := cn.idleSince.Add(s.cfg.IdleTimeout)
		if now := time.Now(); !now.Before(next) {
			if !s.lim.HoldsLeases(cn.id, s.now()) {
				break
			}
			next = now.Add(s.cfg.IdleTimeout)
		}
		if err = cn.setDeadline(next); err != nil {
			return err
		}
		if s.draining.Load() {
			// Shutdown may have woken this reader before the deadline above replaced its
			// wake-up: wake it as Shutdown does.
			if err = cn.setDeadline(time.Unix(1, 0)); err != nil {
				return err
			}
		}
		_, err = cn.peek(1)
	}
	if err != nil && cn.wfailed.Load() {
		return err // not idle: its write failed (its cause is counted: cutBy)
	}
	if err != nil {
		if cn.shutIdle(err) {
			return nil
		}
		if cn.idleShut {
			// A check that waits on Redis (a global lease) is decided by a goroutine of
			// its own, likely not done yet: the lease it takes is seen only after it.
			cn.wait()
			cn.awaitLeases()
		}
		cn.cutBy(closeIdleTimeout, err)
	}
	return err
}

// awaitLeases keeps a connection whose read side shutIdle shut open while it holds
// leases: a check written as the idle timeout fired, answered after the shut, may have
// taken one, and the connection's close frees its slots (ReleaseOwner) while the
// gateway's request still runs. Nothing can be read from it any more, so it looks again
// every awaitLeasesEvery (IdleTimeout if shorter) until they are released (through
// another connection) or have run out, its client has closed its end (a gateway that
// died: its slots are freed, as at once on a connection not shut), or the daemon drains.
// Before, it closed once its answers were written, and another request took the slot the
// client had just been granted (TestIdleShutKeepsALeaseTakenAsItFired).
func (cn *conn) awaitLeases() {
	s := cn.s
	every := min(s.cfg.IdleTimeout, awaitLeasesEvery)
	t := time.NewTimer(every)
	defer t.Stop()
	for !s.draining.Load() && !cn.peerClosed() && s.lim.HoldsLeases(cn.id, s.now()) {
		t.Reset(every)
		select {
		case <-t.C:
		case <-s.stopping:
		}
	}
}

// awaitLeasesEvery bounds how long awaitLeases takes to see that the client has closed
// its end of a connection it keeps open.
const awaitLeasesEvery = time.Second

// peerClosed reports whether the client has closed its end of the connection, whose
// read side is shut (awaitLeases).
func (cn *conn) peerClosed() bool {
	closed := false
	if cn.raw != nil {
		_ = cn.raw.Control(func(fd uintptr) { closed = peerClosed(int(fd)) })
	}
	return closed
}

// beforeIdleShut, when set (tests), runs as an idle connection's read side is about to be
// shut.
var beforeIdleShut atomic.Pointer[func()]

// shutIdle ends a connection found idle for IdleTimeout (err, its read's deadline) by
// shutting its read side first; it reports whether the client had written a frame before
// that, which is then served, the connection ending once idle again. A request the
// client writes as the timeout fires was otherwise closed unread: a Unix socket closed
// with bytes unread resets the connection, and a client that had pipelined several
// requests could not tell which were read (the Node client's audit: 4 checks in 1,200
// answered by the policy at --idle-timeout 50ms). Shut, the socket holds what the client
// wrote before, and its writes after fail at once (EPIPE), which every rlsidecar client
// reads as not sent, and sends again on a new connection.
func (cn *conn) shutIdle(err error) bool {
	s := cn.s
	if cn.idleShut || cn.raw == nil || s.cfg.IdleTimeout <= 0 || !errors.Is(err, os.ErrDeadlineExceeded) || s.draining.Load() || cn.wfailed.Load() {
		return false
	}
	cn.idleShut = true
	if f := beforeIdleShut.Load(); f != nil {
		(*f)()
	}
	var serr error
	if cerr := cn.raw.Control(func(fd uintptr) { serr = syscall.Shutdown(int(fd), syscall.SHUT_RD) }); cerr != nil || serr != nil {
		return false
	}
	if cn.setDeadline(time.Time{}) != nil {
		return false
	}
	_, perr := cn.peek(1) // what the socket holds, or its end: a shut socket waits for nothing
	return perr == nil
}

// peek is br.Peek, but a read that Shutdown's wake-up ended (a past read deadline) is
// tried once more, through Read's drain: the frames the socket holds when the daemon
// drains were written before it, and are answered.
func (cn *conn) peek(n int) ([]byte, error) {
	b, err := cn.br.Peek(n)
	if err != nil && cn.s.draining.Load() && errors.Is(err, os.ErrDeadlineExceeded) {
		b, err = cn.br.Peek(n) // bufio gives an error once: this Peek reads again
	}
	return b, err
}

// Read is what br reads through. While the server serves, it is rw's Read, which waits
// for the first byte. Once the server drains, it waits for nothing: the first drain Read
// notes how many bytes the socket holds (what the client wrote before the drain), and
// the drain reads those and no more, without regard to deadlines, then returns
// net.ErrClosed. So every frame a client wrote before the drain is answered, a frame it
// has begun and not finished is not waited for, and a client that keeps writing does not
// hold the connection, nor the daemon's exit, until DrainTimeout.
func (cn *conn) Read(p []byte) (int, error) {
	if !cn.s.draining.Load() {
		return cn.rw.Read(p)
	}
	if cn.raw == nil || cn.wfailed.Load() || len(p) == 0 {
		return 0, net.ErrClosed
	}
	var n int
	var rerr error
	// Control runs on the descriptor without waiting in the netpoller, and without the
	// read deadline Shutdown set to wake the connection. The socket is nonblocking: an
	// empty one is EAGAIN.
	err := cn.raw.Control(func(fd uintptr) {
		if !cn.drainNoted {
			cn.drainNoted = true
			held, err := heldBytes(int(fd))
			if err != nil {
				held = 0 // unknown: answer what was read already
			}
			cn.drainLeft = held
		}
		if cn.drainLeft <= 0 {
			rerr = syscall.EAGAIN
			return
		}
		q := p[:min(len(p), cn.drainLeft)]
		for {
			n, rerr = syscall.Read(int(fd), q)
			if rerr != syscall.EINTR {
				return
			}
		}
	})
	switch {
	case err != nil: // closed by Shutdown after DrainTimeout
		return 0, err
	case rerr == syscall.EAGAIN:
		return 0, net.ErrClosed // nothing more held: the drain is done
	case rerr != nil:
		return 0, rerr
	case n <= 0:
		return 0, io.EOF
	}
	cn.drainLeft -= n
	return n, nil
}

// cutBy records r as why the daemon closes the connection when err is a deadline that
// passed (not the client's close, nor a shutdown's deadline); the first cause wins. The
// past deadline a failed write sets to end the reads (writeReady) is none of the
// reader's: a write timeout is recorded by the write itself, and a write that failed
// because the client is gone (EPIPE, ECONNRESET) is the client's close. Before, a read
// waiting for a next frame, or for the rest of one, took that deadline for its own, and
// a client that shut its read side while answers waited for room was counted as an
// idle_timeout (at --idle-timeout 0, where none is cut for idleness) or a frame_timeout.
func (cn *conn) cutBy(r closeReason, err error) {
	if errors.Is(err, os.ErrDeadlineExceeded) && !cn.s.draining.Load() && !cn.wfailed.Load() {
		cn.cut.CompareAndSwap(0, uint32(r))
	}
}

// setWriteDeadline keeps a write deadline ahead: a client that does not read its answers
// is cut off after WriteTimeout, freeing its goroutine and connection slot. The deadline
// moves only once more than half used: one timer update per WriteTimeout/2, not per write.
func (cn *conn) setWriteDeadline() error {
	wt := cn.s.cfg.WriteTimeout
	if now := time.Now(); cn.wdeadline.Sub(now) < wt/2 {
		cn.wdeadline = now.Add(wt)
		return cn.c.SetWriteDeadline(cn.wdeadline)
	}
	return nil
}

// need makes sure n bytes are buffered, under the frame deadline if it has to wait.
func (cn *conn) need(n int) ([]byte, error) {
	if cn.br.Buffered() < n {
		if err := cn.awaitFrame(); err != nil {
			return nil, err
		}
	}
	b, err := cn.peek(n)
	if err != nil {
		cn.cutBy(closeFrameTimeout, err)
	}
	return b, err
}

// awaitFrame prepares to wait for the rest of a frame: it answers the frames already
// read, so a client sending a next frame slowly still gets the earlier answers, and sets
// the frame deadline. Each frame gets FrameTimeout from when the daemon first waits for
// it: a client that pipelines without pause always has a frame in progress, and is fine
// as long as each one completes in time.
func (cn *conn) awaitFrame() error {
	if err := cn.flush(); err != nil {
		return err
	}
	cn.waited = true
	if !cn.frameTimed {
		cn.frameTimed = true
		if err := cn.setDeadline(time.Now().Add(cn.s.cfg.FrameTimeout)); err != nil {
			return err
		}
	}
	// Draining, the rest of the frame is read if the socket holds it, and not waited
	// for if it does not (Read): a half-sent frame is not in flight.
	return nil
}

func (cn *conn) flush() error {
	if m := cn.s.cfg.Metrics; m != nil {
		m.flushTally(&cn.tally) // counted before the answers are out
	}
	if len(cn.pending) > 0 || cn.queued.Load() > 0 || cn.wfailed.Load() {
		return cn.handOver()
	}
	if cn.enc.Len() == 0 {
		return nil
	}
	if m := cn.s.cfg.Metrics; m != nil {
		m.Answered(cn.answered, cn.arrived, cn.s.now())
		cn.answered = 0
	}
	if err := cn.setWriteDeadline(); err != nil {
		return err
	}
	b := cn.enc.Bytes()
	var n int
	var err error
	if t, ok := cn.rw.(tryWriter); ok {
		if n, err = t.TryWrite(b); err == nil && n < len(b) {
			// The socket is full: the client is not reading yet (it may be writing a long
			// pipeline first). The rest is written behind, while this goroutine reads on.
			cn.writeBehind(n)
			return nil
		}
	} else {
		_, err = cn.rw.Write(b)
	}
	cn.enc.Reset()
	if err != nil {
		cn.cutBy(closeWriteTimeout, err)
	}
	return err
}

// vecWriter is the write-behind's writer when it can write a run of answers with one
// writev and call back before each wait for room (rawio.WriteBuffers).
type vecWriter interface {
	WriteBuffers(bufs *net.Buffers, waiting func()) (int64, error)
}

// moveWriteDeadline (writeWaits, bound once) moves the write deadline a whole WriteTimeout past now, as the writer is
// about to wait for room: for the first time in a write, or after the client took some of
// its answers. A client is cut off when it takes nothing for WriteTimeout, however many
// answers it has still to take.
func (cn *conn) moveWriteDeadline() {
	cn.wdeadline = time.Now().Add(cn.s.cfg.WriteTimeout)
	_ = cn.c.SetWriteDeadline(cn.wdeadline)
}

// tryWriter is the hot path's writer when it can write without waiting
// (rawio.TryWrite): what the socket takes now.
type tryWriter interface {
	TryWrite(p []byte) (int, error)
}

// writeBehind queues the output buffer's answers from byte off on (those before it are
// written) and has a goroutine of its own write them when the socket has room: a client
// that writes a long pipeline before it reads its answers (the protocol allows any
// number) is not left waiting on a daemon that stopped reading because its answers did
// not fit the socket, until the write timeout cut the connection. Up to maxPending
// batches wait so (handOver), each up to flushAt bytes: then this goroutine waits too.
func (cn *conn) writeBehind(off int) {
	p := cn.takeOut()
	p.enc, cn.enc = cn.enc, p.enc
	p.off, p.n, p.fin = off, 0, true // the metrics counted these answers (flush)
	cn.wmu.Lock()
	cn.queue = append(cn.queue, p)
	cn.queued.Store(int32(len(cn.queue)))
	cn.report(cn.held())
	cn.startWriter()
	cn.wmu.Unlock()
}

// startWriter has a goroutine write the queue's decided head (writeReady), unless one
// writes already. Under wmu. The connection's goroutine calls it instead of writing
// itself, so that it never waits for a client that is not reading.
func (cn *conn) startWriter() {
	if cn.writing || len(cn.queue) == 0 || !cn.queue[0].fin {
		return
	}
	cn.writing = true
	cn.deciding.Add(1)
	go func() {
		defer cn.deciding.Done()
		cn.wmu.Lock()
		cn.writing = false
		cn.writeReady()
		cn.wmu.Unlock()
	}()
}

// handOver queues the answers of this batch behind those already queued (the inline
// ones as an entry of their own when something is queued before them), writes what is
// ready, and returns without waiting for the rest: the goroutine that decides the oldest
// waiting check writes it and what follows it. While maxPending checks are queued it
// waits for the oldest. It returns the error of a failed write, queued or not.
func (cn *conn) handOver() error {
	var lead *pending // the inline answers before the batch's first waiting check
	if cn.enc.Len() > 0 {
		lead = cn.takeOut()
		lead.enc, cn.enc = cn.enc, lead.enc
		lead.n, lead.arrived, lead.fin = cn.answered, cn.arrived, true
		cn.answered = 0
	}
	cn.wmu.Lock()
	defer cn.wmu.Unlock()
	if lead != nil {
		cn.queue = append(cn.queue, lead)
	}
	cn.queue = append(cn.queue, cn.pending...)
	clear(cn.pending)
	cn.pending = cn.pending[:0]
	cn.queued.Store(int32(len(cn.queue)))
	cn.startWriter()
	for cn.werr == nil {
		if cn.undecided.Load() < maxPending {
			if len(cn.queue) >= maxQueued {
				cn.compact()
			}
			h := cn.held()
			cn.report(h)
			if len(cn.queue) < maxQueued && h < cn.s.cfg.HeldPerConn {
				if h < minHeld || cn.s.held.Load() <= int64(cn.s.cfg.HeldBudget) {
					break
				}
				// Over the daemon's budget: the others' bytes going down wakes nobody
				// here, so look again in a while.
				cn.wmu.Unlock()
				time.Sleep(heldPoll)
				cn.wmu.Lock()
				continue
			}
		}
		cn.wcond.Wait()
	}
	return cn.werr
}

// report tells the server the bytes this connection holds now (held). Under wmu.
func (cn *conn) report(h int) {
	if d := h - cn.heldSeen; d != 0 {
		cn.s.held.Add(int64(d))
		cn.heldSeen = h
	}
}

// held returns the bytes of the answers queued and not yet written (of a check still
// deciding, its tail only: its goroutine writes its answer without wmu), and of the
// copies of the requests they answer, which an entry keeps until it is written. Under
// wmu. Before, the copies were not counted: a client that never read, pipelining checks
// of a global rule with a 60,000-byte attribute, had the daemon hold about 20 MB for it
// (a few hundred entries waiting to be written, each with its copy), 637 MB for 40 such
// connections, where their answers alone came to a few hundred KB.
func (cn *conn) held() int {
	n := 0
	for _, p := range cn.queue {
		if p.fin {
			n += p.enc.Len() - p.off
		}
		n += p.tail.Len() + cap(p.body)
	}
	return n
}

// compact merges each run of decided entries of the queue into its first (their bytes
// appended to its tail, in order), past the entries the write in progress holds: a
// queue then has at most about twice as many entries as checks deciding. Under wmu.
func (cn *conn) compact() {
	start := 0
	if cn.writing {
		start = cn.inWrite
	}
	w := start
	for r := start; r < len(cn.queue); r++ {
		p := cn.queue[r]
		if prev := w - 1; prev >= start && p.fin && cn.queue[prev].fin {
			into := cn.queue[prev]
			into.tail.AppendFrames(p.enc.Bytes()[p.off:])
			into.tail.AppendFrames(p.tail.Bytes())
			into.n += p.n
			cn.recycle(p)
			continue
		}
		cn.queue[w] = p
		w++
	}
	clear(cn.queue[w:])
	cn.queue = cn.queue[:w]
	cn.queued.Store(int32(w))
}

// writeReady writes the answers at the head of the queue that are decided, one writev
// per run of them, and takes them off it, until the head is still deciding. Under wmu,
// which it releases while it writes, with writing set: nobody else writes meanwhile, and
// a deciding goroutine that finishes then leaves its answer to this loop. A deciding
// goroutine calls it, or startWriter's: it waits for the socket's room.
func (cn *conn) writeReady() {
	for {
		k := 0
		cn.bufs = cn.bufsArr[:0]
		for k < len(cn.queue) && cn.queue[k].fin {
			p := cn.queue[k]
			cn.bufs = append(cn.bufs, p.enc.Bytes()[p.off:], p.tail.Bytes())
			k++
		}
		if k == 0 {
			return
		}
		cn.bufsArr = cn.bufs[:0]
		if m := cn.s.cfg.Metrics; m != nil {
			now := cn.s.now()
			for _, p := range cn.queue[:k] {
				m.Answered(p.n, p.arrived, now)
			}
		}
		if cn.werr == nil {
			cn.writing, cn.inWrite = true, k
			cn.wmu.Unlock()
			// A deadline not past (a past one fails the write before it starts); then,
			// where the writer can, one counted from each wait for room: a client that
			// takes its answers slowly but steadily is not cut off (writeWaits).
			err := cn.setWriteDeadline()
			if v, ok := cn.rw.(vecWriter); ok && err == nil {
				_, err = v.WriteBuffers(&cn.bufs, cn.writeWaits)
			} else if err == nil {
				_, err = cn.bufs.WriteTo(cn.c)
			}
			cn.wmu.Lock()
			cn.writing, cn.inWrite = false, 0
			if err != nil {
				cn.cutBy(closeWriteTimeout, err) // before the read deadline below ends the reads
				cn.werr = err
				cn.wfailed.Store(true)
				// Wake the connection's goroutine if it waits for room, and stop its reads:
				// the connection is done.
				_ = cn.c.SetReadDeadline(time.Unix(1, 0))
			}
		}
		// The buffers written go with their entries: the backing array, kept for the
		// next write, must not hold them (a merged run of answers can be megabytes).
		clear(cn.bufsArr[:2*k])
		for _, p := range cn.queue[:k] {
			cn.recycle(p)
		}
		n := copy(cn.queue, cn.queue[k:])
		clear(cn.queue[n:])
		cn.queue = cn.queue[:n]
		cn.queued.Store(int32(n))
		if cn.heldSeen > 0 {
			cn.report(cn.held())
		}
		cn.wcond.Broadcast()
	}
}

// maxKeptBody and maxKeptEnc bound the buffers of a written pending entry kept for
// reuse (recycle): a check's request copy, and each of its answer encoders. A check of a
// global rule fits them many times over; a batch written behind (writeBehind, about
// flushAt), the answers compaction merged into one entry, or the copy of a long request
// do not, and their entry is left to the garbage collector. Before, every entry was
// kept with its buffers for the connection's life: 100 connections, each of which had
// once pipelined 12,000 checks before reading their answers (as the protocol allows),
// then stayed open and idle (a gateway's pool), held 397 MB for good.
//
// An entry whose answer encoder alone is larger, up to maxKeptOut, holds an output buffer
// that writeBehind or handOver swapped out: it goes to outKept, where the next of them on
// any connection takes it (takeOut) and the garbage collector drops it once unused for two
// cycles. Without it, a client pipelining past the socket's room had the daemon grow a
// new output buffer for each batch written behind (1.8 MB allocated for 4,000 checks
// then their answers, against 8 KB before the bound: TestPipelineBurstReusesBuffers).
const (
	maxKeptBody = 1 << 10
	maxKeptEnc  = 2 << 10
	maxKeptOut  = 4 * flushAt
)

// outKept holds written entries kept for their grown answer encoders (recycle).
var outKept sync.Pool

// recycle empties p, written, and keeps it for reuse (take, or takeOut for an output
// buffer), unless its buffers are larger than a next use needs or maxPending entries are
// kept already. Under wmu.
func (cn *conn) recycle(p *pending) {
	p.enc.Reset()
	p.tail.Reset()
	p.fin, p.off = false, 0
	if cap(p.body) > maxKeptBody || cap(p.tail.Bytes()) > maxKeptEnc {
		return
	}
	if c := cap(p.enc.Bytes()); c > maxKeptEnc {
		if c <= maxKeptOut {
			outKept.Put(p)
		}
		return
	}
	if len(cn.free) >= maxPending {
		return
	}
	cn.free = append(cn.free, p)
}

// takeOut returns a pending entry to take the output buffer's answers, its own answer
// encoder to become the output buffer: one kept for its grown encoder when there is one.
func (cn *conn) takeOut() *pending {
	if p, ok := outKept.Get().(*pending); ok {
		return p
	}
	return cn.take()
}

// take returns a pending entry to fill: a written one when there is one.
func (cn *conn) take() *pending {
	if len(cn.spare) == 0 {
		cn.wmu.Lock()
		cn.spare, cn.free = cn.free, cn.spare
		cn.wmu.Unlock()
	}
	if n := len(cn.spare); n > 0 {
		p := cn.spare[n-1]
		cn.spare[n-1] = nil
		cn.spare = cn.spare[:n-1]
		return p
	}
	return &pending{enc: proto.NewEncoder(), tail: proto.NewEncoder()}
}

const flushAt = 32 << 10

// clockEvery is how many frames of one batch share a reading of the clock.
const clockEvery = 64

// loop serves the connection until it ends. The frames already complete in the read
// buffer are walked with plain slice indexing and discarded together (walk); a frame that
// is not all there yet, or is longer than the buffer or the maximum, takes the general
// path (frame), one at a time.
func (cn *conn) loop() error {
	var now int64 // the monotonic clock (see Clock), read when a batch of frames arrives
	batched := 0  // frames since the clock was read
	for {
		if cn.br.Buffered() == 0 {
			if err := cn.waitIdle(batched > 1); err != nil {
				return err
			}
			batched = 0
		}
		done, err := cn.walk(&now, &batched)
		if err != nil || done {
			return err
		}
	}
}

// walk answers the frames complete in the read buffer, then, when none is, one frame by
// the general path (frame). Frames that arrived together share one reading of the clock;
// a long pipelined batch reads it again every clockEvery frames. done: the connection
// ends without an error.
func (cn *conn) walk(now *int64, batched *int) (done bool, err error) {
	// Buffered bytes only: Peek does not read.
	buf, _ := cn.br.Peek(cn.br.Buffered())
	var off int
	if cn.s.lim.Prefetching() {
		off, err = cn.walkAhead(buf, now, batched)
	} else {
		off, err = cn.walkEach(buf, now, batched)
	}
	if err != nil {
		return false, err
	}
	if off > 0 {
		// The frames walked stayed in the buffer until now: a flush does not read.
		_, err := cn.br.Discard(off) // buffered: cannot fail
		return false, err
	}
	return cn.frame(now, batched)
}

// frameEnd returns the end in buf of the frame at off, or -1 when it is not all there or
// is longer than the maximum (the general path's: frame).
func (cn *conn) frameEnd(buf []byte, off int) int {
	if len(buf)-off < proto.HeaderSize {
		return -1
	}
	l := proto.FrameLength(buf[off:])
	if uint64(l) > uint64(cn.s.cfg.MaxFrame) { // compared unconverted: int is 32 bits on some platforms
		return -1
	}
	if end := off + proto.HeaderSize + int(l); end <= len(buf) {
		return end
	}
	return -1
}

// walkEach is walk's loop over the frames of buf, each answered in turn; it returns the
// end of the last one answered.
func (cn *conn) walkEach(buf []byte, now *int64, batched *int) (int, error) {
	off := 0
	for {
		end := cn.frameEnd(buf, off)
		if end < 0 {
			return off, nil
		}
		if *batched%clockEvery == 0 {
			*now = cn.s.now()
		}
		*batched++
		cn.count(*now)
		cn.handle(buf[off+proto.HeaderSize:end], *now)
		off = end
		if cn.out().Len() >= flushAt || len(cn.pending) >= maxPending {
			if err := cn.flush(); err != nil {
				return off, err
			}
		}
	}
}

// walkAhead is walkEach for a local store too big for the CPU's caches: it decodes and
// prepares (stage) the frames up to ahead past the one it answers, so that their keys'
// slots, then records, are fetched while the checks before them are decided
// (limiter.Prefetch): under a million keys most of a check's time was those misses, one
// after the other.
func (cn *conn) walkAhead(buf []byte, now *int64, batched *int) (int, error) {
	if cn.staged == nil {
		cn.staged = new([ahead + 1]staged)
		for i := range cn.staged {
			cn.staged[i].d.Owner = cn.id
		}
	}
	stages := cn.staged
	off, next := 0, 0 // the frame to answer, the frame to stage
	k, n := 0, 0      // frames answered and staged: k <= n <= k+ahead+1
	for {
		for n <= k+ahead {
			end := cn.frameEnd(buf, next)
			if end < 0 {
				break
			}
			cn.stage(&stages[n%len(stages)], buf[next+proto.HeaderSize:end])
			next = end
			n++
		}
		if k == n {
			return off, nil
		}
		if k+1 < n {
			// The next check's records, found from the slots fetched when it was staged.
			cn.s.lim.PrefetchRecords(&stages[(k+1)%len(stages)].d)
		}
		if *batched%clockEvery == 0 {
			*now = cn.s.now()
		}
		*batched++
		cn.count(*now)
		end := cn.frameEnd(buf, off)
		body := buf[off+proto.HeaderSize : end]
		if st := &stages[k%len(stages)]; st.prepared {
			cn.check(st, body, *now, st.waits, st.perr)
		} else {
			cn.decoded(&st.req, st.err, body, *now)
		}
		off = end
		k++
		if cn.out().Len() >= flushAt || len(cn.pending) >= maxPending {
			if err := cn.flush(); err != nil {
				return off, err
			}
			// A flush may wait (for the client to take its answers, or for checks
			// waiting on Redis): the frames staged before it are staged again, so that
			// a rules reload meanwhile decides them as it does the frames after them.
			// Before, they were decided under the rules it replaced.
			next, n = off, k
		}
	}
}

// count counts the frame about to be answered: into the output buffer, or after a
// waiting check, into that check's tail (goWait moves it when it waits itself).
func (cn *conn) count(now int64) {
	if n := len(cn.pending); n > 0 {
		cn.pending[n-1].n++
		return
	}
	if cn.answered == 0 {
		cn.arrived = now
	}
	cn.answered++
}

// readBig reads an n-byte frame body into cn.big, which grows as the bytes arrive (from
// 64 KiB, doubling) rather than at the header: a header announcing --max-frame bytes,
// then nothing, costs what was sent, not a --max-frame buffer per connection.
func (cn *conn) readBig(n int) ([]byte, error) {
	b := cn.big[:0]
	for len(b) < n {
		if len(b) == cap(b) {
			nb := make([]byte, len(b), min(n, max(2*cap(b), 64<<10)))
			copy(nb, b)
			b = nb
		}
		m, err := cn.br.Read(b[len(b):min(cap(b), n)])
		b = b[:len(b)+m]
		if err != nil && len(b) < n {
			cn.big = b[:0]
			return nil, err
		}
	}
	cn.big = b[:0]
	return b, nil
}

// frame reads and answers one frame by the general path: waiting for its bytes under
// the frame deadline, or reading a frame longer than the read buffer into a buffer of
// its own, or refusing one longer than the maximum (done: the connection is closed).
func (cn *conn) frame(now *int64, batched *int) (done bool, err error) {
	maxFrame := cn.s.cfg.MaxFrame
	if *batched%clockEvery == 0 {
		*now = cn.s.now()
	}
	*batched++
	cn.frameTimed = false
	hdr, err := cn.need(proto.HeaderSize)
	if err != nil {
		return false, err
	}
	l := proto.FrameLength(hdr)
	if uint64(l) > uint64(maxFrame) {
		cn.s.encodeError(cn.out(), 0, proto.CodeFrameTooLarge,
			fmt.Sprintf("frame of %d bytes exceeds the maximum of %d; this connection is closed", l, maxFrame))
		_ = cn.flush()
		cn.cut.CompareAndSwap(0, uint32(closeFrameTooLarge))
		return true, nil
	}
	n := int(l)
	var body []byte
	if proto.HeaderSize+n <= cn.s.readBuf {
		b, err := cn.need(proto.HeaderSize + n)
		if err != nil {
			return false, err
		}
		body = b[proto.HeaderSize:]
	} else {
		if _, err := cn.br.Discard(proto.HeaderSize); err != nil {
			return false, err
		}
		// The frame is longer than the buffer: reading it may wait, under the same
		// frame deadline as a frame that fits.
		if cn.br.Buffered() < n {
			if err := cn.awaitFrame(); err != nil {
				return false, err
			}
		}
		b, err := cn.readBig(n)
		if err != nil {
			cn.cutBy(closeFrameTimeout, err)
			return false, err
		}
		body = b
		n = -proto.HeaderSize // already consumed
	}
	if cn.waited {
		*now, cn.waited = cn.s.now(), false
	}
	cn.count(*now)
	cn.handle(body, *now)
	if _, err := cn.br.Discard(proto.HeaderSize + n); err != nil {
		return false, err
	}
	if cn.out().Len() >= flushAt || len(cn.pending) >= maxPending {
		if err := cn.flush(); err != nil {
			return false, err
		}
	}
	return false, nil
}

// ahead is how many frames past the one it answers walkAhead decodes and prepares: the
// slots of a check's keys are fetched two checks before its turn, and their records one
// check before, when the slots have arrived.
const ahead = 2

// staged is a frame decoded before its turn, and when it is a check, prepared.
type staged struct {
	req proto.Request
	err error // the decoding's
	in  limiter.Input
	d   limiter.Decision
	// prepared: a check, whose Prepare gave waits and perr.
	prepared bool
	waits    bool
	perr     error
}

// stage decodes body into st and, when it is a check, prepares it (limiter.Prepare:
// nothing is taken) and starts fetching its keys' slots. Nothing is answered or changed
// before the frame's turn.
func (cn *conn) stage(st *staged, body []byte) {
	st.err = cn.dec.DecodeRequest(body, &st.req)
	st.prepared = st.err == nil && st.req.Op == proto.OpCheck
	if st.prepared {
		input(&st.in, &st.req)
		st.waits, st.perr = cn.s.lim.Prepare(&st.in, &st.d)
		if st.perr == nil && !st.waits {
			cn.s.lim.Prefetch(&st.d)
		}
	}
}

// handle answers one frame body into the output buffer. now is the request's time, read
// once at the edge.
func (cn *conn) handle(body []byte, now int64) {
	st := &cn.st
	err := cn.dec.DecodeRequest(body, &st.req)
	if err == nil && st.req.Op == proto.OpCheck {
		input(&st.in, &st.req)
		waits, err := cn.s.lim.Prepare(&st.in, &st.d)
		cn.check(st, body, now, waits, err)
		return
	}
	cn.decoded(&st.req, err, body, now)
}

// decoded answers the request req decoded from body, other than a check, or the error
// err its decoding gave.
func (cn *conn) decoded(req *proto.Request, err error, body []byte, now int64) {
	if err != nil {
		var pe *proto.Error
		if errors.As(err, &pe) {
			cn.s.encodeError(cn.out(), req.ID, pe.Code, pe.Message)
		} else {
			cn.s.encodeError(cn.out(), req.ID, proto.CodeInternal, err.Error())
		}
		return
	}
	switch req.Op {
	case proto.OpPing:
		cn.out().EncodePing(req.ID, cn.s.cfg.Version)
	case proto.OpRelease:
		if cn.s.lim.LeaseWaits(req.Lease) || cn.turns.Load() > 0 && cn.leaseBehind(req.Lease) {
			// A global lease: Redis decides, off the fast path; or a local one whose slot
			// a waiting check before it takes from: released after it is decided.
			cn.goWait(body, now, cn.tokenKey(req.Lease), cn.leaseKeys(req.Lease))
			return
		}
		cn.out().EncodeRelease(req.ID, cn.s.lim.ReleaseLease(req.Lease, now))
	case proto.OpRenew:
		cn.renew(req, body, now)
	default:
		// proto.Quote: an op may be as long as its frame; the answer quotes its start.
		cn.s.encodeError(cn.out(), req.ID, proto.CodeUnknownOp, fmt.Sprintf("unknown op %s; this server knows %q, %q, %q and %q",
			proto.Quote(req.Op), proto.OpCheck, proto.OpPing, proto.OpRelease, proto.OpRenew))
	}
}

// renew answers the renew request req (decoded from body): inline for a local lease,
// off the fast path (goWait) for one with a global part.
func (cn *conn) renew(req *proto.Request, body []byte, now int64) {
	if req.LeaseMs > uint64(rules.MaxLease/time.Millisecond) {
		cn.s.encodeError(cn.out(), req.ID, proto.CodeBadRequest, fmt.Sprintf("lease_ms %d is longer than the longest lease, %d (1h)", req.LeaseMs, rules.MaxLease/time.Millisecond))
		return
	}
	if cn.s.lim.LeaseWaits(req.Lease) || cn.turns.Load() > 0 && cn.leaseBehind(req.Lease) {
		cn.goWait(body, now, cn.tokenKey(req.Lease), cn.leaseKeys(req.Lease))
		return
	}
	cn.s.renew(cn.out(), req, now)
}

// renew decides the renew request req (its lease_ms already checked) and answers it.
func (s *Server) renew(enc *proto.Encoder, req *proto.Request, now int64) {
	renewed, in := s.lim.RenewLease(req.Lease, time.Duration(req.LeaseMs)*time.Millisecond, now)
	enc.EncodeRenew(req.ID, renewed, ceilMs(in))
}

// input fills in from req.
func input(in *limiter.Input, req *proto.Request) {
	in.Cost = req.Cost
	in.Attrs = rulesAttrs(req.Attrs) // req's own array: in lives no longer than req
	in.Limits = in.Limits[:0]
	for i := range req.Limits {
		l := &req.Limits[i]
		in.Limits = append(in.Limits, limiter.Inline{Key: l.Key, Name: l.Name, Algorithm: l.Algorithm, Mode: l.Mode, Limit: l.Limit, WindowMs: l.WindowMs, Burst: l.Burst})
	}
}

// check answers the check in st (decoded from body), whose Prepare gave waits and err.
// A check that waits on Redis (a global rule, or a hybrid key the daemon cannot decide
// from its local view) is decided by a goroutine of its own, so that the Redis round
// trips of a pipelined connection overlap and its other requests are not stalled; every
// other check is decided and answered inline.
func (cn *conn) check(st *staged, body []byte, now int64, waits bool, err error) {
	d := &st.d
	if err == nil && (waits || cn.turns.Load() > 0 && cn.behind(cn.keysOf(d), true)) {
		// Waits on Redis, or shares a key with a check of this connection that does: it
		// is decided after that one, off the fast path.
		cn.goWait(body, now, cn.keysOf(d), nil)
		return
	}
	if err == nil && !cn.s.lim.DecideInline(now, d) {
		// A hybrid key needs Redis (an exact sync): decide off the fast path too.
		cn.goWait(body, now, cn.keysOf(d), nil)
		return
	}
	cn.s.answer(cn.out(), &st.req, d, err, &cn.tally)
}

// keysOf returns the hashes of the keys d's prepared check takes from, in cn.hashes.
func (cn *conn) keysOf(d *limiter.Decision) []uint64 {
	cn.hashes = d.AppendKeyHashes(cn.hashes[:0], cn.s.orderSeed)
	return cn.hashes
}

// leaseKeys returns the hashes of the keys whose slots the lease of token holds (local
// and global), in cn.hashes: its release or renew is ordered with the checks of those
// keys.
func (cn *conn) leaseKeys(token string) []uint64 {
	cn.hashes = cn.s.lim.AppendLeaseKeyHashes(cn.hashes[:0], token, cn.s.orderSeed)
	return cn.hashes
}

// tokenKey returns the hash of a lease's token, in cn.token: a release or renew of the
// lease waits for the waiting ones before it (enter's keys).
func (cn *conn) tokenKey(token string) []uint64 {
	cn.token[0] = maphash.String(cn.s.orderSeed, token) &^ 1 // not a key in Redis
	return cn.token[:]
}

// leaseBehind reports whether a release or renew of the lease of token must wait for a
// request of this connection still waiting: a check that takes from its slots' keys, or
// another release or renew of it.
func (cn *conn) leaseBehind(token string) bool {
	return cn.behind(cn.tokenKey(token), true) || cn.behind(cn.leaseKeys(token), false)
}

// behind reports whether a request with keys must wait for a request of this connection
// still waiting to be decided: one with a key of keys, or with shared (a check), one
// that releases or renews a lease of a key of keys too.
func (cn *conn) behind(keys []uint64, shared bool) bool {
	cn.omu.Lock()
	defer cn.omu.Unlock()
	for _, k := range keys {
		if cn.order[k] != nil || shared && len(cn.shared[k]) > 0 {
			return true
		}
	}
	return false
}

// enter gives a request that waits its turn: a check taking from keys, after the waiting
// requests before it that share a key with it; a release or renew of a lease (keys its
// token, shared its slots' keys), after the waiting checks of those keys and the waiting
// releases and renews of the same lease, not after those of other leases of its keys
// (they do not change what it does). No keys take no turn.
func (cn *conn) enter(keys, shared []uint64) *turn {
	if len(keys) == 0 && len(shared) == 0 {
		return nil
	}
	t := &turn{done: make(chan struct{}), queued: make(chan struct{}), keys: append([]uint64(nil), keys...)}
	if len(shared) > 0 {
		t.shared = append([]uint64(nil), shared...)
	}
	// wait makes t wait for prev: for prev's queued alone (queuedOnly) if no other key
	// makes it wait for prev's done.
	wait := func(prev *turn, queuedOnly bool) {
		if prev == nil || prev == t || slices.Contains(t.after, prev) {
			return
		}
		if queuedOnly {
			if !slices.Contains(t.afterQ, prev) {
				t.afterQ = append(t.afterQ, prev)
			}
			return
		}
		t.afterQ = slices.DeleteFunc(t.afterQ, func(q *turn) bool { return q == prev })
		t.after = append(t.after, prev)
	}
	check := len(shared) == 0 // a check, not a lease's release or renew
	cn.omu.Lock()
	if cn.order == nil {
		cn.order = make(map[uint64]*turn)
		cn.shared = make(map[uint64][]*turn)
	}
	for _, k := range t.keys {
		wait(cn.order[k], check && limiter.KeyInRedis(k))
		for _, s := range cn.shared[k] {
			wait(s, false)
		}
		delete(cn.shared, k) // t waits for them: so does whoever waits for t
		cn.order[k] = t
	}
	for _, k := range t.shared {
		wait(cn.order[k], false)
		if !slices.Contains(cn.shared[k], t) {
			cn.shared[k] = append(cn.shared[k], t)
		}
	}
	cn.omu.Unlock()
	cn.turns.Add(1)
	return t
}

// leave ends t's turn once its check is decided: the checks after it may go.
func (cn *conn) leave(t *turn) {
	cn.omu.Lock()
	for _, k := range t.keys {
		if cn.order[k] == t {
			delete(cn.order, k)
		}
	}
	for _, k := range t.shared {
		if ts := cn.shared[k]; len(ts) > 0 {
			if ts = slices.DeleteFunc(ts, func(s *turn) bool { return s == t }); len(ts) == 0 {
				delete(cn.shared, k)
			} else {
				cn.shared[k] = ts
			}
		}
	}
	cn.omu.Unlock()
	cn.turns.Add(-1)
	t.markQueued()
	close(t.done)
}

// markQueued closes t.queued, once.
func (t *turn) markQueued() { t.qonce.Do(func() { close(t.queued) }) }

// goWait decides the request in body (a check, or the release or renew of a global
// lease) on a goroutine of its own, answering into a pending slot that the next flush
// writes in order.
func (cn *conn) goWait(body []byte, now int64, keys, shared []uint64) {
	p := cn.take()
	// This frame was counted as answered inline (into the tail before it, or into enc):
	// it moves to its own entry.
	if n := len(cn.pending); n > 0 {
		cn.pending[n-1].n--
	} else {
		cn.answered--
	}
	p.n, p.arrived = 1, now
	// The body is in the read buffer, which the next read overwrites: decide on a copy.
	p.body = append(p.body[:0], body...)
	if err := cn.dec.DecodeRequest(p.body, &p.req); err != nil {
		panic("BUG: a frame decoded twice gave an error the second time: " + err.Error())
	}
	input(&p.in, &p.req)
	p.dcs.Owner = cn.id
	cn.pending = append(cn.pending, p)
	lim := cn.s.lim
	cn.undecided.Add(1)
	cn.deciding.Add(1)
	t := cn.enter(keys, shared)
	go func() {
		defer cn.deciding.Done()
		if t != nil {
			for _, before := range t.after {
				<-before.done
			}
			for _, before := range t.afterQ {
				<-before.queued
			}
		}
		switch p.req.Op {
		case proto.OpRelease:
			p.enc.EncodeRelease(p.req.ID, lim.ReleaseLease(p.req.Lease, now))
		case proto.OpRenew:
			cn.s.renew(p.enc, &p.req, now)
		default:
			_, err := lim.Prepare(&p.in, &p.dcs)
			if err == nil {
				if t != nil {
					p.dcs.Queued = t.markQueued
				}
				lim.Decide(now, &p.dcs)
				p.dcs.Queued = nil
			}
			cn.s.answer(p.enc, &p.req, &p.dcs, err, nil)
		}
		if t != nil {
			// The turn ends once the checks before it whose queued alone it waited for
			// (keys in Redis) are decided too: a release or renew waits for the latest
			// check of its slots' keys only, and must find every earlier one decided. t
			// may be decided without Redis (refused by a local rule) while an earlier
			// check of the key is still on its way there; a release pipelined after
			// both then reached Redis first, and the earlier check took the slot it
			// freed (the wire audit's TestE2EWireFuzz: a concurrency rule's check
			// allowed where, in request order, its slots were full). The answers are
			// written in request order anyway: this delays none.
			for _, before := range t.afterQ {
				<-before.done
			}
			cn.leave(t)
		}
		cn.wmu.Lock()
		p.fin = true // p may be written (and reused) from here: not touched again below
		cn.undecided.Add(-1)
		cn.wcond.Broadcast() // the connection may wait for a check to be decided
		if cn.writing || len(cn.queue) == 0 || !cn.queue[0].fin {
			// Someone is about to write, or the oldest answer is not ready.
			cn.wmu.Unlock()
			return
		}
		// Checks sent to Redis together come back together: let the others decided by
		// the same reply finish first, so that one writev carries them all rather than
		// one write each.
		cn.writing = true
		cn.wmu.Unlock()
		runtime.Gosched()
		cn.wmu.Lock()
		cn.writing = false
		cn.writeReady()
		cn.wmu.Unlock()
	}()
}

// answer encodes the answer to the check req, decided into d (or refused with err),
// straight from d into enc: no Response is built.
func (s *Server) answer(enc *proto.Encoder, req *proto.Request, d *limiter.Decision, err error, t *batchTally) {
	if err != nil {
		var il *limiter.InvalidLimitError
		if errors.As(err, &il) {
			s.encodeError(enc, req.ID, proto.CodeInvalidLimit, il.Error())
		} else {
			s.encodeError(enc, req.ID, proto.CodeInternal, err.Error())
		}
		return
	}
	if m := s.cfg.Metrics; m != nil {
		m.record(d, t)
	}
	var lease string
	if d.TookLease() {
		// The lease's token, written into tb (no allocation for a local lease) and read
		// through lease until the answer is encoded.
		var tb [limiter.LeaseTokenMaxLen]byte
		tok := s.lim.AppendLeaseToken(tb[:0], d)
		lease = unsafe.String(unsafe.SliceData(tok), len(tok))
	}
	if d.Deciding >= 0 && lease == "" && !d.Warning && d.Delay <= 0 && !d.Banned {
		r := &d.Results[d.Deciding]
		if head := s.heads.table().first(r); head != nil && !r.Impossible {
			// The common answer, its v1 fields only: written from d's fields, the deciding
			// rule's name and limit pre-encoded.
			enc.BeginCheckV1(req.ID, d.Allowed, d.Degraded, head, r.Remaining, ceilMs(r.Reset), ceilMs(r.RetryAfter), len(d.Results))
			s.answerRules(enc, d)
			enc.EndCheckV1()
			return
		}
	}
	s.answerCheckHead(enc, req, d, lease)
}

// answerCheckHead is answer past its common case: the top level through a CheckHead,
// with a reason, a lease or policy fields to write, or no deciding rule's head.
func (s *Server) answerCheckHead(enc *proto.Encoder, req *proto.Request, d *limiter.Decision, lease string) {
	h := proto.CheckHead{ID: req.ID, Allowed: d.Allowed, Degraded: d.Degraded, Warning: d.Warning,
		DelayMs: ceilMs(d.Delay), Banned: d.Banned, Lease: lease}
	if d.Deciding >= 0 {
		r := &d.Results[d.Deciding]
		h.Rule, h.Limit, h.Remaining = r.Name, r.Limit, r.Remaining
		h.ResetMs, h.RetryAfterMs = ceilMs(r.Reset), ceilMs(r.RetryAfter)
		if r.Impossible {
			h.Reason = proto.ReasonCostExceedsCapacity
		}
		h.Head = s.heads.get(r) // the rule's name and limit pre-encoded
	}
	enc.BeginCheck(&h, len(d.Results))
	s.answerRules(enc, d)
	enc.EndCheck(&h)
}

// answerRules encodes the rules array of the answer to d: each entry's name, limit and
// window_ms pre-encoded (s.heads), the common entries (their v1 fields only) written from
// the results' fields. A concurrency rule's entry is not one of those: it says
// concurrency: true (answerRule).
func (s *Server) answerRules(enc *proto.Encoder, d *limiter.Decision) {
	heads := s.heads.table()
	for i := range d.Results {
		r := &d.Results[i]
		head := heads.first(r)
		// head is not nil only for a rule's result (first): r.Rule is not nil then.
		if head != nil && !r.Impossible && !r.Warning && r.Delay <= 0 && !r.Banned && !r.Unasked && !r.Rule.Concurrency && !r.Degraded {
			enc.AppendRuleHeadV1(head, r.Remaining, ceilMs(r.Reset), ceilMs(r.RetryAfter), r.Allowed, r.Shadow)
			continue
		}
		s.answerRule(enc, r, head)
	}
}

// answerRule encodes r's entry in a check answer when answer's common case does not
// apply: a reason or policy fields to write, or a head not found at once (head nil: it
// is looked up, or the entry encoded in full).
func (s *Server) answerRule(enc *proto.Encoder, r *limiter.Result, head *proto.RuleHead) {
	rr := proto.RuleResult{Remaining: r.Remaining, ResetMs: ceilMs(r.Reset), RetryAfterMs: ceilMs(r.RetryAfter),
		Allowed: r.Allowed, Shadow: r.Shadow, Warning: r.Warning, Banned: r.Banned, DelayMs: ceilMs(r.Delay),
		Unasked: r.Unasked, Concurrency: r.Rule != nil && r.Rule.Concurrency, Degraded: r.Degraded}
	if r.Impossible {
		rr.Reason = proto.ReasonCostExceedsCapacity
	}
	if head == nil {
		head = s.heads.find(r)
	}
	if head != nil {
		enc.AppendRuleHead(head, &rr)
		return
	}
	rr.Name, rr.Limit, rr.WindowMs = r.Name, r.Limit, uint64(r.Window/time.Millisecond)
	enc.AppendRule(&rr)
}

// encodeError encodes an error answer and counts it by code
// (rlsidecar_error_answers_total): a client sending malformed frames was seen nowhere, in
// no metric nor log.
func (s *Server) encodeError(enc *proto.Encoder, id uint64, code, msg string) {
	enc.EncodeError(id, code, msg)
	if m := s.cfg.Metrics; m != nil {
		m.errorAnswered(code)
	}
}

// ceilMs rounds a duration up to whole milliseconds, so a client that waits retry_after_ms
// is never early (limiter.CeilMs, which the deciding rule's choice compares by).
func ceilMs(d time.Duration) uint64 { return limiter.CeilMs(d) }
