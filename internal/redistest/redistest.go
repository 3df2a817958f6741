// Package redistest starts real redis-server processes for tests: a standalone server
// (StartStandalone) or a three-master Redis Cluster (StartCluster), each on free loopback
// ports with its own temp directory and no persistence, stopped by t.Cleanup.
//
// No port is fixed, so tests using it may run in parallel, in parallel packages, and under
// -race. redis-server and redis-cli must be on PATH; ./scripts/test installs them. A missing
// binary fails the test rather than skipping it, so CI cannot pass without running them.
//
// Most callers want StartStandalone:
//
//	srv := redistest.StartStandalone(t)
//	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
//
// Failure tests use Stop, Restart, Freeze and Thaw on a Server. WithTLS makes a server
// or cluster speak TLS only, with certificates of a CA the test makes (NewCA).
package redistest

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

const (
	// readyTimeout bounds how long a started server may take to answer a PING.
	readyTimeout = 10 * time.Second
	// stopTimeout bounds how long a server may take to exit after SIGTERM before it is killed.
	stopTimeout = 5 * time.Second
	// startAttempts is how many free ports StartStandalone and StartCluster try per server
	// when redis-server cannot bind the one it was given (another process took it between
	// our probe and redis's bind).
	startAttempts = 5
	// maxClusterPort keeps a cluster node's bus port (port+10000) below 65536.
	maxClusterPort = 55535
)

// Option configures StartStandalone (or StartCluster).
type Option func(*config)

type config struct {
	password    string
	cluster     bool
	nodeTimeout time.Duration // cluster-node-timeout; 0: 2 s
	tls         *TLS          // WithTLS; nil: plain TCP
	files       *tlsFiles     // the server's certificate, issued for tls
}

// WithClusterNodeTimeout sets StartCluster's cluster-node-timeout: how long a master
// may be unreachable before the others mark it failed (and, with no replica to promote,
// answer CLUSTERDOWN for every key). The default, 2 s, is short for quick tests; a test
// that freezes a master for longer while the others keep serving needs more (Redis's
// own default is 15 s).
func WithClusterNodeTimeout(d time.Duration) Option {
	return func(c *config) { c.nodeTimeout = d }
}

// WithPassword makes the server require AUTH with p (requirepass).
func WithPassword(p string) Option {
	return func(c *config) { c.password = p }
}

// Server is one redis-server process. Addr and Password do not change over its life,
// including across Restart. Its methods are safe for concurrent use.
type Server struct {
	// Addr is "127.0.0.1:port".
	Addr string
	// Password is the requirepass value, "" for none.
	Password string
	// TLS is how this package reaches a server started WithTLS (trusting its CA,
	// presenting the server's own certificate); nil for a plain one.
	TLS *tls.Config

	dir  string // temp dir holding redis.conf, redis.log and (for cluster nodes) nodes.conf
	conf string // path of redis.conf
	log  string // path of redis.log

	mu   sync.Mutex
	proc *process // nil when stopped
}

// process is one run of redis-server; done is closed once it has exited and been reaped.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error // Wait's result, valid after done is closed
}

// StartStandalone starts a redis-server on a free loopback port with a temp dir and no
// persistence (save "", appendonly no), waits until it answers PING, and returns it.
// t.Cleanup stops it (SIGTERM, then SIGKILL after 5s) and removes the dir.
func StartStandalone(t testing.TB, opts ...Option) *Server {
	t.Helper()
	var c config
	for _, o := range opts {
		o(&c)
	}
	if c.tls != nil {
		c.files = serverTLS(t, c.tls)
	}
	return start(t, c)
}

// start starts one server for c, trying fresh ports when redis-server cannot bind.
func start(t testing.TB, c config) *Server {
	t.Helper()
	bin := lookPath(t, "redis-server")
	dir := t.TempDir() // registered before the Stop cleanup below, so removed after it
	s := &Server{
		Password: c.password,
		dir:      dir,
		conf:     filepath.Join(dir, "redis.conf"),
		log:      filepath.Join(dir, "redis.log"),
	}
	if c.files != nil {
		s.TLS = c.files.client
	}
	t.Cleanup(s.Stop)

	var lastErr error
	for attempt := 0; attempt < startAttempts; attempt++ {
		port, err := nextPort(c.cluster)
		if err != nil {
			t.Fatalf("redistest: finding a free port: %v", err)
		}
		s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		if err := os.WriteFile(s.conf, []byte(configFile(dir, port, c)), 0o600); err != nil {
			t.Fatalf("redistest: writing %s: %v", s.conf, err)
		}
		err = s.run(bin)
		if err == nil {
			return s
		}
		lastErr = err
		if !errors.Is(err, errBind) {
			break
		}
	}
	t.Fatalf("redistest: starting redis-server: %v\n%s", lastErr, s.logTail())
	return nil
}

var errBind = errors.New("redis-server could not bind its port")

// run starts redis-server on s's config and waits until it answers. If it exits first,
// run returns an error wrapping errBind when the log shows a bind failure.
func (s *Server) run(bin string) error {
	logf, err := os.OpenFile(s.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("opening log: %w", err)
	}
	defer logf.Close() // the child holds its own copy
	logStart, _ := logf.Seek(0, io.SeekEnd)

	cmd := exec.Command(bin, s.conf)
	cmd.Dir = s.dir
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("running %s: %w", bin, err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() { // owned by p: ends when the process exits; Stop waits for it
		p.err = cmd.Wait()
		close(p.done)
	}()
	s.mu.Lock()
	s.proc = p
	s.mu.Unlock()

	deadline := time.Now().Add(readyTimeout)
	for {
		err := ping(s.Addr, s.Password, s.TLS, cmd.Process.Pid)
		if err == nil {
			return nil
		}
		select {
		case <-p.done:
			s.mu.Lock()
			s.proc = nil
			s.mu.Unlock()
			out, _ := os.ReadFile(s.log)
			if int64(len(out)) > logStart {
				out = out[logStart:]
			}
			if isBindFailure(string(out)) {
				return fmt.Errorf("%w %s: %v", errBind, s.Addr, p.err)
			}
			return fmt.Errorf("redis-server on %s exited before answering PING: %v", s.Addr, p.err)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.Stop()
			return fmt.Errorf("redis-server on %s did not answer PING within %v: %v", s.Addr, readyTimeout, err)
		}
	}
}

func isBindFailure(log string) bool {
	return strings.Contains(log, "Address already in use") ||
		strings.Contains(log, "Could not create server TCP listening socket") ||
		strings.Contains(log, "Failed listening on port")
}

// Stop sends SIGTERM and waits for the server to exit, killing it after 5s. It is a
// no-op on a stopped server. A frozen server is thawed so that it can exit.
func (s *Server) Stop() {
	s.mu.Lock()
	p := s.proc
	s.proc = nil
	s.mu.Unlock()
	if p == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	_ = p.cmd.Process.Signal(syscall.SIGCONT) // a SIGSTOPped process handles SIGTERM only once continued
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// Restart starts the server again on the same port, config and dir (a cluster node keeps
// its nodes.conf, so it rejoins its cluster), stopping it first if it is running. It waits
// until the server answers PING, and fails t if it cannot start within 10s.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	bin := lookPath(t, "redis-server")
	deadline := time.Now().Add(readyTimeout)
	for {
		// The port was ours a moment ago, but another process may hold it briefly.
		err := s.run(bin)
		if err == nil {
			return
		}
		if !errors.Is(err, errBind) || time.Now().After(deadline) {
			t.Fatalf("redistest: restarting redis-server: %v\n%s", err, s.logTail())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Freeze stops the server with SIGSTOP: connections are still accepted by the kernel but
// nothing is answered, as with a hung server or a network partition. Thaw undoes it.
func (s *Server) Freeze() { s.signal(syscall.SIGSTOP) }

// Thaw continues a frozen server with SIGCONT.
func (s *Server) Thaw() { s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig os.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		panic("BUG: redistest: signal " + sig.String() + " to a stopped server " + s.Addr)
	}
	_ = s.proc.cmd.Process.Signal(sig)
}

// logTail returns the end of the server's log, for failure messages.
func (s *Server) logTail() string {
	out, err := os.ReadFile(s.log)
	if err != nil {
		return fmt.Sprintf("(no redis log: %v)", err)
	}
	const keep = 8 << 10
	if len(out) > keep {
		out = out[len(out)-keep:]
	}
	return fmt.Sprintf("--- redis log %s ---\n%s", s.log, out)
}

// configFile returns the redis.conf for a server on port in dir.
func configFile(dir string, port int, c config) string {
	var b strings.Builder
	line := func(args ...string) { b.WriteString(strings.Join(args, " ") + "\n") }
	line("bind", "127.0.0.1")
	if c.files != nil {
		line("port", "0") // TLS only, as a managed Redis
		line("tls-port", strconv.Itoa(port))
	} else {
		line("port", strconv.Itoa(port))
	}
	line("protected-mode", "no")
	line("daemonize", "no")
	line("dir", quote(dir))
	line("logfile", `""`) // stdout, which is redis.log
	line("save", `""`)
	line("appendonly", "no")
	if c.password != "" {
		line("requirepass", quote(c.password))
	}
	if c.files != nil {
		line("tls-cert-file", quote(c.files.cert))
		line("tls-key-file", quote(c.files.key))
		line("tls-ca-cert-file", quote(c.tls.CA.CertFile))
		if c.tls.AuthClients {
			line("tls-auth-clients", "yes")
		} else {
			line("tls-auth-clients", "no")
		}
		if c.cluster {
			line("tls-cluster", "yes") // the bus too; its port is tls-port+10000
		}
	}
	if c.cluster {
		line("cluster-enabled", "yes")
		line("cluster-config-file", quote(filepath.Join(dir, "nodes.conf")))
		ms := int64(2000)
		if c.nodeTimeout > 0 {
			ms = c.nodeTimeout.Milliseconds()
		}
		line("cluster-node-timeout", strconv.FormatInt(ms, 10))
	}
	return b.String()
}

// quote writes s as a redis config string that any bytes survive: every byte hex-escaped.
func quote(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		fmt.Fprintf(&b, `\x%02x`, s[i])
	}
	b.WriteByte('"')
	return b.String()
}

func lookPath(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("redistest: %s not found: run ./scripts/test, which installs it (Debian packages redis-server, redis-tools)", name)
	}
	return p
}

// nextPort is freePort; a test gives a port of its own choosing.
var nextPort = freePort

// freePort returns a loopback port that was free a moment ago. For a cluster node the
// bus port (port+10000) was free too. The caller retries if redis cannot bind it.
func freePort(cluster bool) (int, error) {
	for i := 0; i < 100; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		if !cluster {
			l.Close()
			return port, nil
		}
		if port >= maxClusterPort {
			l.Close()
			continue
		}
		bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000)))
		l.Close()
		if err != nil {
			continue
		}
		bus.Close()
		return port, nil
	}
	return 0, errors.New("no free port pair below 55535 after 100 tries")
}

// dial connects to addr, over TLS with tlsCfg unless it is nil.
func dial(addr string, tlsCfg *tls.Config, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	if tlsCfg == nil {
		return d.Dial("tcp", addr)
	}
	return tls.DialWithDialer(d, "tcp", addr, tlsCfg)
}

// ping sends AUTH (if password is set), PING and INFO server on a new connection, and
// wants PONG from the redis-server whose process id is pid. Another server may answer at
// addr: one that took the port between freePort's probe and this one's bind (which then
// fails), another test's, perhaps in another test binary, which may stop it at any time.
// Its PONG was taken for this server's: on a loaded machine a test then ran against
// another test's Redis, and saw it vanish mid-test ("connection refused").
func ping(addr, password string, tlsCfg *tls.Config, pid int) error {
	conn, err := dial(addr, tlsCfg, 200*time.Millisecond)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(time.Second))
	r := bufio.NewReader(conn)
	if password != "" {
		if _, err := do(conn, r, "AUTH", password); err != nil {
			return err
		}
	}
	reply, err := do(conn, r, "PING")
	if err != nil {
		return err
	}
	if reply != "PONG" {
		return fmt.Errorf("PING: got %q", reply)
	}
	info, err := do(conn, r, "INFO", "server")
	if err != nil {
		return err
	}
	if !strings.Contains(info, "\r\nprocess_id:"+strconv.Itoa(pid)+"\r\n") {
		return fmt.Errorf("%s is answered by another redis-server than process %d", addr, pid)
	}
	return nil
}

// Command runs one command on a new connection to s (authenticated with Password, over
// TLS for a server started WithTLS) and returns its reply: a simple string, an integer
// or a bulk string (an error reply is an error).
func (s *Server) Command(args ...string) (string, error) {
	conn, err := dial(s.Addr, s.TLS, time.Second)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
	r := bufio.NewReader(conn)
	if s.Password != "" {
		if _, err := do(conn, r, "AUTH", s.Password); err != nil {
			return "", err
		}
	}
	return do(conn, r, args...)
}

// do writes args as a RESP array and reads one simple-string, error, integer or bulk
// reply, enough for the few commands this package sends.
func do(conn net.Conn, r *bufio.Reader, args ...string) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := conn.Write([]byte(b.String())); err != nil {
		return "", err
	}
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimSuffix(line, "\r\n")
	if line == "" {
		return "", errors.New("empty reply")
	}
	switch line[0] {
	case '+', ':':
		return line[1:], nil
	case '-':
		return "", fmt.Errorf("%s: %s", args[0], line[1:])
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < 0 {
			return "", fmt.Errorf("%s: bad bulk reply %q", args[0], line)
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	}
	return "", fmt.Errorf("%s: unexpected reply %q", args[0], line)
}

// Strings runs one command on a new connection to s, as Command does, whose reply is an
// array of bulk strings (KEYS, CLUSTER GETKEYSINSLOT), and returns them.
func (s *Server) Strings(args ...string) ([]string, error) {
	conn, err := dial(s.Addr, s.TLS, time.Second)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
	r := bufio.NewReader(conn)
	if s.Password != "" {
		if _, err := do(conn, r, "AUTH", s.Password); err != nil {
			return nil, err
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := conn.Write([]byte(b.String())); err != nil {
		return nil, err
	}
	line, err := r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	line = strings.TrimSuffix(line, "\r\n")
	if strings.HasPrefix(line, "-") {
		return nil, fmt.Errorf("%s: %s", args[0], line[1:])
	}
	if !strings.HasPrefix(line, "*") {
		return nil, fmt.Errorf("%s: not an array: %q", args[0], line)
	}
	n, err := strconv.Atoi(line[1:])
	if err != nil {
		return nil, fmt.Errorf("%s: bad array reply %q", args[0], line)
	}
	out := make([]string, 0, max(n, 0))
	for range n {
		line, err := r.ReadString('\n')
		if err != nil {
			return nil, err
		}
		line = strings.TrimSuffix(line, "\r\n")
		k, err := strconv.Atoi(strings.TrimPrefix(line, "$"))
		if !strings.HasPrefix(line, "$") || err != nil || k < 0 {
			return nil, fmt.Errorf("%s: bad element %q", args[0], line)
		}
		buf := make([]byte, k+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return nil, err
		}
		out = append(out, string(buf[:k]))
	}
	return out, nil
}

// running reports whether s has a redis-server running (not Stopped).
func (s *Server) running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc != nil
}
