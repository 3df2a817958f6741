package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sys/unix"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/internal/unixsock/unixsocktest"
	"github.com/rlsidecar/rlsidecar/proto"
)

func TestEnvName(t *testing.T) {
	for flagName, want := range map[string]string{
		"socket":              "RLSIDECAR_SOCKET",
		"redis-timeout":       "RLSIDECAR_REDIS_TIMEOUT",
		"redis-password-file": "RLSIDECAR_REDIS_PASSWORD_FILE",
		"max-attr-len":        "RLSIDECAR_MAX_ATTR_LEN",
	} {
		if got := envName(flagName); got != want {
			t.Errorf("envName(%q) = %q, want %q", flagName, got, want)
		}
	}
}

// Every flag reads RLSIDECAR_<FLAG>; the command line wins; a malformed value is an error
// naming the variable and changes nothing it has not already set.
func TestApplyEnv(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		want    string // "conns timeout admin watch" after parsing
		wantErr string
	}{
		{name: "defaults", want: "1024 50ms 127.0.0.1:9464 true"},
		{name: "from the environment",
			env:  map[string]string{"RLSIDECAR_MAX_CONNS": "7", "RLSIDECAR_REDIS_TIMEOUT": "20ms", "RLSIDECAR_WATCH": "false"},
			want: "7 20ms 127.0.0.1:9464 false"},
		{name: "the command line wins",
			args: []string{"--max-conns", "9", "--watch=true"},
			env:  map[string]string{"RLSIDECAR_MAX_CONNS": "7", "RLSIDECAR_WATCH": "false"},
			want: "9 50ms 127.0.0.1:9464 true"},
		{name: "an empty value is a value", env: map[string]string{"RLSIDECAR_ADMIN": ""},
			want: "1024 50ms  true"},
		{name: "malformed int", env: map[string]string{"RLSIDECAR_MAX_CONNS": "many"},
			wantErr: `$RLSIDECAR_MAX_CONNS="many": invalid value for --max-conns`},
		{name: "malformed duration", env: map[string]string{"RLSIDECAR_REDIS_TIMEOUT": "50"},
			wantErr: `$RLSIDECAR_REDIS_TIMEOUT="50": invalid value for --redis-timeout`},
		{name: "malformed bool", env: map[string]string{"RLSIDECAR_WATCH": "maybe"},
			wantErr: `$RLSIDECAR_WATCH="maybe": invalid value for --watch`},
		{name: "an empty number is malformed, not the default", env: map[string]string{"RLSIDECAR_MAX_CONNS": ""},
			wantErr: `$RLSIDECAR_MAX_CONNS="": invalid value for --max-conns`},
		{name: "malformed but overridden on the command line",
			args: []string{"--max-conns=3"}, env: map[string]string{"RLSIDECAR_MAX_CONNS": "many"},
			want: "3 50ms 127.0.0.1:9464 true"},
		{name: "unrelated variables are ignored", env: map[string]string{"RLSIDECAR_REDIS_PASSWORD": "x", "RLSIDECAR_NOPE": "1"},
			want: "1024 50ms 127.0.0.1:9464 true"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := newFlags("serve", io.Discard)
			conns := fs.Int("max-conns", 1024, "")
			timeout := fs.Duration("redis-timeout", 50*time.Millisecond, "")
			admin := fs.String("admin", "127.0.0.1:9464", "")
			watch := fs.Bool("watch", true, "")
			if err := fs.Parse(tt.args); err != nil {
				t.Fatal(err)
			}
			err := applyEnv(fs, func(k string) (string, bool) { v, ok := tt.env[k]; return v, ok })
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !errors.Is(err, errUsage) {
					t.Fatalf("err = %v, want a usage error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := fmt.Sprintf("%d %s %s %t", *conns, *timeout, *admin, *watch); got != tt.want {
				t.Fatalf("got %q, want %q", got, tt.want)
			}
		})
	}
}

func TestUnknownEnv(t *testing.T) {
	fs := newFlags("serve", io.Discard)
	fs.Int("max-conns", 0, "")
	fs.String("redis-password-file", "", "")
	env := []string{"RLSIDECAR_MAX_CONNS=1", "RLSIDECAR_MAX_CONN=2", "RLSIDECAR_REDIS_PASSWORD=secret",
		"RLSIDECAR_REDIS_PASSWORD_FILE=/x", "PATH=/bin", "RLSIDECAR_ZZZ=", "MY_RLSIDECAR_X=1"}
	got := unknownEnv(fs, env)
	if want := []string{"RLSIDECAR_MAX_CONN", "RLSIDECAR_ZZZ"}; !slices.Equal(got, want) {
		t.Fatalf("unknownEnv = %q, want %q", got, want)
	}
}

func TestServeHelpNamesTheEnvironment(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"serve", "--help"}, io.Discard, &out); code != exitOK {
		t.Fatalf("exit %d", code)
	}
	for _, want := range []string{"RLSIDECAR_<FLAG>", "command line wins", "-socket-group", "RLSIDECAR_REDIS_PASSWORD"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("serve --help does not say %q:\n%s", want, out.String())
		}
	}
}

// The Redis password's sentence ends the help of serve only: validate, check, replay and
// import-envoy have no Redis flag, and their --help told of a --redis-password-file none
// of them takes.
func TestOnlyServeHelpNamesTheRedisPassword(t *testing.T) {
	for _, cmd := range []string{"validate", "check", "replay", "import-envoy"} {
		var out bytes.Buffer
		if code := run([]string{cmd, "--help"}, io.Discard, &out); code != exitOK {
			t.Fatalf("%s --help: exit %d", cmd, code)
		}
		if !strings.Contains(out.String(), "RLSIDECAR_<FLAG>") {
			t.Errorf("%s --help does not name the environment:\n%s", cmd, out.String())
		}
		if strings.Contains(out.String(), "redis-password-file") {
			t.Errorf("%s --help speaks of a Redis password it takes no flag for:\n%s", cmd, out.String())
		}
	}
}

// The real binary refuses a malformed environment value with exit 2 before creating
// anything, rather than starting with a default.
func TestE2EMalformedEnvironmentRefused(t *testing.T) {
	socket := filepath.Join(shortTempDir(t), "s.sock")
	cmd := exec.Command(binary, "serve", "--socket", socket, "--admin=")
	cmd.Env = append(os.Environ(), "RLSIDECAR_DRAIN_TIMEOUT=5")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitUsage {
		t.Fatalf("err = %v, want exit %d\n%s", err, exitUsage, out)
	}
	if !strings.Contains(string(out), "RLSIDECAR_DRAIN_TIMEOUT") {
		t.Fatalf("the error does not name the variable:\n%s", out)
	}
	if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a socket file was created: %v", err)
	}
}

// A daemon configured only by its environment (as /etc/default/rlsidecar does) reaches a
// password-protected Redis with $RLSIDECAR_REDIS_PASSWORD, and the password shows in
// neither its command line nor its logs.
func TestE2EConfiguredByEnvironment(t *testing.T) {
	const secret = "env-pw-5521"
	srv := redistest.StartStandalone(t, redistest.WithPassword(secret))
	t.Setenv("RLSIDECAR_REDIS", "redis://"+srv.Addr)
	t.Setenv("RLSIDECAR_REDIS_PASSWORD", secret)
	t.Setenv("RLSIDECAR_LOG_LEVEL", "debug")
	t.Setenv("RLSIDECAR_LOG_FORMAT", "json")
	t.Setenv("RLSIDECAR_SYNC_INTERVAL", "20ms")
	d := startDaemon(t)
	c := dialRaw(t, d.socket)
	if r := c.check(1, 1, "user=env-test"); !r.Allowed {
		t.Fatalf("%+v", r)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, Password: secret})
	defer rdb.Close()
	deadline := time.Now().Add(5 * time.Second)
	for rdb.DBSize(context.Background()).Val() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("nothing reached Redis: the daemon did not read its Redis settings from the environment\n%s", d.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !strings.HasPrefix(d.stderr.String(), `{"time":`) {
		t.Errorf("RLSIDECAR_LOG_FORMAT=json was not applied:\n%s", d.stderr.String())
	}
	if strings.Contains(strings.Join(d.cmd.Args, " "), secret) || strings.Contains(d.stderr.String(), secret) {
		t.Fatal("the password shows in the command line or the logs")
	}

	// A password in $RLSIDECAR_REDIS's URL stays out of the STATUS= line, which
	// `systemctl status` shows to every user.
	n := listenNotify(t)
	t.Setenv("NOTIFY_SOCKET", n.path)
	t.Setenv("RLSIDECAR_REDIS_PASSWORD", "")
	t.Setenv("RLSIDECAR_REDIS", "redis://:"+secret+"@"+srv.Addr)
	d2 := startDaemon(t)
	ready := n.waitFor(t, "READY", 10*time.Second)
	if st := ready.fields["STATUS"]; strings.Contains(st, secret) || !strings.Contains(st, srv.Addr) {
		t.Fatalf("STATUS=%q: want the Redis address without its password", st)
	}
	if r := dialRaw(t, d2.socket).check(1, 1, "user=env-test-2"); !r.Allowed {
		t.Fatalf("with the password in the URL: %+v", r)
	}
	for len(rdb.Keys(context.Background(), "*env-test-2*").Val()) == 0 {
		if time.Now().After(deadline.Add(5 * time.Second)) {
			t.Fatalf("nothing of user env-test-2 reached Redis: the URL's password was not used\n%s", d2.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if strings.Contains(d2.stderr.String(), secret) {
		t.Fatal("the password in the URL shows in the logs")
	}
}

// --socket-group gives the socket file, and the --envoy-rls unix: one, to a group,
// keeping the mode, without systemd; a group that does not exist is refused before any
// socket file is made.
func TestE2ESocketGroup(t *testing.T) {
	gid := unixsocktest.OtherGroup(t)
	envoySock := filepath.Join(shortTempDir(t), "envoy.sock")
	d := startDaemon(t, "--socket-group", strconv.Itoa(gid), "--socket-mode", "0660", "--envoy-rls", "unix:"+envoySock)
	for _, p := range []string{d.socket, envoySock} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if int(st.Gid) != gid || fi.Mode().Perm() != 0o660 {
			t.Errorf("%s: group %d mode %#o, want %d and 0660", p, st.Gid, fi.Mode().Perm(), gid)
		}
	}
	dialRaw(t, d.socket).check(1, 1, "user=g")

	socket := filepath.Join(shortTempDir(t), "s.sock")
	out, err := exec.Command(binary, "serve", "--socket", socket, "--admin=", "--socket-group", "no-such-group-rls").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "no-such-group-rls") {
		t.Fatalf("err = %v, want a refusal naming the group:\n%s", err, out)
	}
	if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a socket file was left behind: %v", err)
	}
}

// notifyMsg is one sd_notify datagram and the pid the kernel says sent it.
type notifyMsg struct {
	pid    int
	fields map[string]string
}

// notifyListener is a NOTIFY_SOCKET, as systemd holds one: a Unix datagram socket
// receiving the sender's credentials with each message.
type notifyListener struct {
	path string
	msgs chan notifyMsg
	seen []string
}

func listenNotify(t *testing.T) *notifyListener {
	t.Helper()
	path := filepath.Join(shortTempDir(t), "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	if err := raw.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_PASSCRED, 1)
	}); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	n := &notifyListener{path: path, msgs: make(chan notifyMsg, 1024)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(n.msgs)
		buf := make([]byte, 4096)
		oob := make([]byte, syscall.CmsgSpace(syscall.SizeofUcred))
		for {
			nb, noob, _, _, err := c.ReadMsgUnix(buf, oob)
			if err != nil {
				return
			}
			m := notifyMsg{pid: -1, fields: map[string]string{}}
			if cmsgs, err := syscall.ParseSocketControlMessage(oob[:noob]); err == nil && len(cmsgs) > 0 {
				if cred, err := syscall.ParseUnixCredentials(&cmsgs[0]); err == nil {
					m.pid = int(cred.Pid)
				}
			}
			for line := range strings.SplitSeq(string(buf[:nb]), "\n") {
				k, v, _ := strings.Cut(line, "=")
				m.fields[k] = v
			}
			n.msgs <- m
		}
	}()
	t.Cleanup(func() { c.Close(); <-done })
	return n
}

// waitFor returns the next message that carries key, failing the test after timeout.
func (n *notifyListener) waitFor(t *testing.T, key string, timeout time.Duration) notifyMsg {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case m, ok := <-n.msgs:
			if !ok {
				t.Fatalf("notify socket closed waiting for %s; seen %q", key, n.seen)
			}
			n.seen = append(n.seen, fmt.Sprint(m.fields))
			if _, ok := m.fields[key]; ok {
				return m
			}
		case <-deadline:
			t.Fatalf("no %s in %s; seen %q", key, timeout, n.seen)
		}
	}
}

// activator runs command under systemd-socket-activate on socket, in its own process
// group, killed at cleanup. env names the variables passed through (-E).
func activator(t *testing.T, socket string, env []string, command ...string) *exec.Cmd {
	t.Helper()
	args := []string{"-l", socket}
	for _, e := range env {
		args = append(args, "-E", e)
	}
	return startActivator(t, args, []string{socket}, command...).cmd
}

// activatorProc is a systemd-socket-activate process and what it printed; done is closed
// when it (or the command it execs) has exited.
type activatorProc struct {
	cmd  *exec.Cmd
	done chan struct{}
	out  *syncBuffer
}

// sigterm stops the activated daemon as systemd does, and checks it exits 0 within 10 s.
func (a *activatorProc) sigterm(t *testing.T) {
	t.Helper()
	if err := a.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.done:
	case <-time.After(10 * time.Second):
		t.Fatal("no exit within 10s of SIGTERM")
	}
	if code := a.cmd.ProcessState.ExitCode(); code != exitOK {
		t.Errorf("exit %d after SIGTERM:\n%s", code, a.out.String())
	}
}

// connectThenExit connects to sock, which makes systemd-socket-activate start the
// daemon, and waits up to 10 s for the daemon to exit: a start it must refuse.
func (a *activatorProc) connectThenExit(t *testing.T, sock string) {
	t.Helper()
	c, err := net.DialTimeout("unix", sock, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case <-a.done:
	case <-time.After(10 * time.Second):
		t.Fatalf("still running after 10s:\n%s", a.out.String())
	}
}

// startActivator runs systemd-socket-activate with saArgs then command, in its own
// process group, killed at cleanup, and waits until it has bound every path in sockets.
func startActivator(t *testing.T, saArgs, sockets []string, command ...string) *activatorProc {
	t.Helper()
	sa, err := exec.LookPath("systemd-socket-activate")
	if err != nil {
		t.Skip("systemd-socket-activate (Debian package systemd) is not installed")
	}
	cmd := exec.Command(sa, append(append([]string{}, saArgs...), command...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	a := &activatorProc{cmd: cmd, done: make(chan struct{}), out: &syncBuffer{}}
	cmd.Stdout, cmd.Stderr = a.out, a.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { cmd.Wait(); close(a.done) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-a.done
		if t.Failed() {
			t.Logf("activator output:\n%s", a.out.String())
		}
	})
	// systemd-socket-activate binds and listens before it waits for a first connection.
	// The file appears at bind, before listen: a connection between the two is refused (a
	// fresh-clone CI run's first Envoy call was), so wait for the listening socket, as
	// /proc/net/unix shows it, without connecting (that would start the daemon).
	deadline := time.Now().Add(10 * time.Second)
	for _, socket := range sockets {
		for {
			if fi, err := os.Lstat(socket); err == nil && fi.Mode()&os.ModeSocket != 0 && unixListening(socket) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("systemd-socket-activate did not bind %s:\n%s", socket, a.out.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return a
}

// Socket activation for real: systemd-socket-activate binds the socket and starts the
// daemon on the first connection with LISTEN_FDS; the daemon tells NOTIFY_SOCKET READY=1
// (after answering nothing yet: the first connection waits in the backlog), pings the
// watchdog, brackets a SIGHUP reload with RELOADING=1 (with MONOTONIC_USEC) and READY=1,
// says STOPPING=1 on SIGTERM, and leaves the socket file, which is not its own, in place.
func TestE2ESocketActivationAndNotify(t *testing.T) {
	dir := shortTempDir(t)
	socket := filepath.Join(dir, "s.sock")
	rulesFile := writeFile(t, dir, "rules.yaml", "rules:\n  - name: per-user\n    key: user\n    limit: { requests: 5, per: 1m }\n")
	n := listenNotify(t)
	t.Setenv("NOTIFY_SOCKET", n.path)
	t.Setenv("WATCHDOG_USEC", "200000")
	act := activator(t, socket, []string{"NOTIFY_SOCKET", "WATCHDOG_USEC"}, binary, "serve", "--admin=", "--config", rulesFile, "--watch=false")

	// Nothing runs until a gateway connects.
	select {
	case m := <-n.msgs:
		t.Fatalf("a notification before any connection: %v", m.fields)
	case <-time.After(200 * time.Millisecond):
	}
	c := dialRaw(t, socket)
	c.send(&proto.Request{ID: 1, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "a"}}})
	ready := n.waitFor(t, "READY", 10*time.Second)
	if ready.pid != act.Process.Pid {
		t.Errorf("READY=1 from pid %d, want the activated process %d (systemd-socket-activate execs it)", ready.pid, act.Process.Pid)
	}
	if !strings.Contains(ready.fields["STATUS"], "serving 1 rule (") || !strings.Contains(ready.fields["STATUS"], socket) {
		t.Errorf("STATUS=%q", ready.fields["STATUS"])
	}
	if r := c.recv(); r.ID != 1 || !r.Allowed || r.Limit != 5 {
		t.Fatalf("the first connection's check: %+v", r)
	}
	n.waitFor(t, "WATCHDOG", 2*time.Second)

	before := monotonicUsec()
	writeFile(t, dir, "rules.yaml", "rules:\n  - name: per-user\n    key: user\n    limit: { requests: 7, per: 1m }\n")
	if err := act.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	rel := n.waitFor(t, "RELOADING", 5*time.Second)
	usec, err := strconv.ParseInt(rel.fields["MONOTONIC_USEC"], 10, 64)
	if err != nil || usec < before || usec > monotonicUsec() {
		t.Errorf("MONOTONIC_USEC=%q, want CLOCK_MONOTONIC between %d and now", rel.fields["MONOTONIC_USEC"], before)
	}
	n.waitFor(t, "READY", 5*time.Second)
	if r := c.check(2, 1, "user=b"); r.Limit != 7 {
		t.Fatalf("after the reload: %+v", r)
	}

	if err := act.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if m := n.waitFor(t, "STOPPING", 5*time.Second); m.pid != act.Process.Pid {
		t.Errorf("STOPPING=1 from pid %d", m.pid)
	}
	if _, err := os.Lstat(socket); err != nil {
		t.Fatalf("the daemon removed the activated socket file: %v", err)
	}
}

// Only a listening Unix stream socket is taken from LISTEN_FDS: Go's net.FileListener
// alone also takes a datagram socket (whose Accept fails once the daemon has said it
// serves) and a seqpacket one (served, with message boundaries the protocol does not
// expect).
func TestUnixStreamListenerRefusesOtherSockets(t *testing.T) {
	dir := shortTempDir(t)
	n := 0
	unixSocket := func(typ int, listen bool) int {
		fd, err := unix.Socket(unix.AF_UNIX, typ|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		n++
		if err := unix.Bind(fd, &unix.SockaddrUnix{Name: filepath.Join(dir, strconv.Itoa(n))}); err != nil {
			t.Fatal(err)
		}
		if listen {
			if err := unix.Listen(fd, 8); err != nil {
				t.Fatal(err)
			}
		}
		return fd
	}
	tcp := func() int {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
			t.Fatal(err)
		}
		if err := unix.Listen(fd, 8); err != nil {
			t.Fatal(err)
		}
		return fd
	}
	pipe := func() int {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		unix.Close(p[1])
		return p[0]
	}
	for _, tt := range []struct {
		name    string
		fd      func() int
		wantErr string // "" accepts
	}{
		{"unix stream, listening", func() int { return unixSocket(unix.SOCK_STREAM, true) }, ""},
		{"unix datagram", func() int { return unixSocket(unix.SOCK_DGRAM, false) }, "is a Unix datagram socket, not a Unix stream socket"},
		{"unix seqpacket, listening", func() int { return unixSocket(unix.SOCK_SEQPACKET, true) }, "is a Unix seqpacket socket, not a Unix stream socket"},
		{"unix stream, not listening", func() int { return unixSocket(unix.SOCK_STREAM, false) }, "does not listen"},
		{"tcp, listening", tcp, "is a TCP socket, not a Unix stream socket"},
		{"a pipe", pipe, "is not a socket"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := os.NewFile(uintptr(tt.fd()), "LISTEN_FD_3")
			defer f.Close()
			ln, err := unixStreamListener(f)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				ln.Close()
				return
			}
			if err == nil {
				ln.Close()
				t.Fatalf("accepted; want an error containing %q", tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.wantErr) || !strings.Contains(err.Error(), "LISTEN_FD_3") {
				t.Fatalf("err = %v, want it to name the descriptor and say %q", err, tt.wantErr)
			}
		})
	}
}

// The real daemon, handed a datagram or a seqpacket socket by systemd-socket-activate,
// refuses it at start, exit 1, with the error a TCP socket gets: it neither says it
// listens nor tells NOTIFY_SOCKET READY=1 (it used to announce itself, then exit at
// accept with "operation not supported", or serve the seqpacket socket).
func TestE2ESocketActivationRefusesNonStreamSockets(t *testing.T) {
	for _, tt := range []struct {
		name, flag string
		sotype     int
	}{
		{"datagram", "--datagram", unix.SOCK_DGRAM},
		{"seqpacket", "--seqpacket", unix.SOCK_SEQPACKET},
	} {
		t.Run(tt.name, func(t *testing.T) {
			socket := filepath.Join(shortTempDir(t), "s.sock")
			n := listenNotify(t)
			t.Setenv("NOTIFY_SOCKET", n.path)
			a := startActivator(t, []string{tt.flag, "-l", socket, "-E", "NOTIFY_SOCKET"}, []string{socket},
				binary, "serve", "--admin=", "--watch=false")
			// A first message or connection starts the daemon.
			fd, err := unix.Socket(unix.AF_UNIX, tt.sotype|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			if tt.sotype == unix.SOCK_DGRAM {
				err = unix.Sendto(fd, []byte("x"), 0, &unix.SockaddrUnix{Name: socket})
			} else {
				err = unix.Connect(fd, &unix.SockaddrUnix{Name: socket})
			}
			if err != nil {
				t.Fatal(err)
			}
			select {
			case <-a.done:
			case <-time.After(10 * time.Second):
				t.Fatalf("the daemon still runs on a %s socket after 10s:\n%s", tt.name, a.out.String())
			}
			if code := a.cmd.ProcessState.ExitCode(); code != exitFailure {
				t.Errorf("exit %d, want %d", code, exitFailure)
			}
			out := a.out.String()
			if want := "is a Unix " + tt.name + " socket, not a Unix stream socket"; !strings.Contains(out, want) {
				t.Errorf("the output does not say %q:\n%s", want, out)
			}
			if strings.Contains(out, "listening") || strings.Contains(out, "serving") {
				t.Errorf("the daemon announced itself before refusing the socket:\n%s", out)
			}
			select {
			case m := <-n.msgs:
				t.Errorf("a notification from a daemon that refused its socket: %v", m.fields)
			default:
			}
		})
	}
}

// A restart under load, as systemd does it: the socket (held here by the process
// systemd-socket-activate starts, a shell loop playing systemd's Restart=) outlives each
// daemon, so a gateway reconnecting during the restart is queued, never refused. Each
// client's only visible effect is a closed connection, after which it resends its one
// unanswered check on a new connection.
func TestE2ESocketActivationRestartUnderLoad(t *testing.T) {
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("needs bash")
	}
	const restarts = 3
	dir := shortTempDir(t)
	socket := filepath.Join(dir, "s.sock")
	rulesFile := writeFile(t, dir, "rules.yaml", "rules:\n  - name: per-user\n    key: user\n    limit: { requests: 1000000, per: 1s }\n")
	n := listenNotify(t)
	t.Setenv("NOTIFY_SOCKET", n.path)
	// systemd sets LISTEN_PID to the pid of the service process it forks; so does this loop.
	loop := `for i in $(seq 0 "$1"); do (export LISTEN_PID=$BASHPID; exec "$0" serve --admin= --config "$2" --watch=false --drain-timeout 2s); done`
	activator(t, socket, []string{"NOTIFY_SOCKET"}, "bash", "-c", loop, binary, strconv.Itoa(restarts), rulesFile)

	var (
		answered, retries, refused atomic.Int64
		stop                       atomic.Bool
		wg                         sync.WaitGroup
		errMu                      sync.Mutex
		clientErr                  error
	)
	fail := func(err error) {
		errMu.Lock()
		if clientErr == nil {
			clientErr = err
		}
		errMu.Unlock()
		stop.Store(true)
	}
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var (
				c   net.Conn
				br  *bufio.Reader
				enc = proto.NewEncoder()
				dec = proto.NewDecoder()
				buf []byte
			)
			defer func() {
				if c != nil {
					c.Close()
				}
			}()
			for id := uint64(1); !stop.Load(); id++ {
				req := proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: fmt.Sprintf("u%d-%d", w, id%100)}}}
				for attempt := 0; ; attempt++ {
					if attempt > 3 {
						fail(fmt.Errorf("client %d: request %d unanswered after %d connections", w, id, attempt))
						return
					}
					if c == nil {
						var err error
						if c, err = net.Dial("unix", socket); err != nil {
							refused.Add(1)
							fail(fmt.Errorf("client %d: dial: %w", w, err))
							return
						}
						br = bufio.NewReader(c)
					}
					_ = c.SetDeadline(time.Now().Add(10 * time.Second))
					enc.Reset()
					enc.EncodeRequest(&req)
					var resp proto.Response
					_, err := c.Write(enc.Bytes())
					if err == nil {
						buf, err = proto.ReadFrame(br, buf[:0], 1<<20)
					}
					if err == nil {
						err = dec.DecodeResponse(buf, &resp)
					}
					if err == nil && resp.Err.Code == proto.CodeShuttingDown {
						err = io.EOF // accepted while draining: reconnect
					}
					if err != nil {
						if errors.Is(err, os.ErrDeadlineExceeded) {
							fail(fmt.Errorf("client %d: no answer in 10s: %w", w, err))
							return
						}
						c.Close()
						c = nil
						retries.Add(1)
						continue
					}
					if resp.ID != id || !resp.Allowed {
						fail(fmt.Errorf("client %d: answer %+v to request %d", w, resp, id))
						return
					}
					answered.Add(1)
					break
				}
			}
		}()
	}
	t.Cleanup(func() { stop.Store(true); wg.Wait() })

	pids := map[int]bool{}
	for i := 0; i <= restarts; i++ {
		m := n.waitFor(t, "READY", 10*time.Second)
		if pids[m.pid] {
			t.Fatalf("READY=1 twice from pid %d", m.pid)
		}
		pids[m.pid] = true
		// Let the clients run against this daemon.
		from := answered.Load()
		deadline := time.Now().Add(10 * time.Second)
		for answered.Load() < from+200 && !stop.Load() {
			if time.Now().After(deadline) {
				t.Fatalf("daemon %d (pid %d) answered %d checks in 10s", i, m.pid, answered.Load()-from)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if stop.Load() || i == restarts {
			break // the last daemon serves until the cleanup
		}
		if err := syscall.Kill(m.pid, syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		n.waitFor(t, "STOPPING", 5*time.Second)
	}
	stop.Store(true)
	wg.Wait()
	if clientErr != nil {
		t.Fatal(clientErr)
	}
	if refused.Load() != 0 {
		t.Fatalf("%d connections refused", refused.Load())
	}
	if retries.Load() == 0 {
		t.Fatalf("no client saw a restart (%d answered): the test did not restart under load", answered.Load())
	}
	t.Logf("%d daemons, %d checks answered, %d resent after a restart closed their connection, 0 refused", len(pids), answered.Load(), retries.Load())
}

// The packaged settings file names only real flags (commented or not), and the packaged
// rules validate (the built-in example: 4 rules).
func TestPackagedConfiguration(t *testing.T) {
	var help bytes.Buffer
	run([]string{"serve", "--help"}, io.Discard, &help)
	flags := map[string]bool{"RLSIDECAR_REDIS_PASSWORD": true}
	for line := range strings.SplitSeq(help.String(), "\n") {
		if f, ok := strings.CutPrefix(line, "  -"); ok {
			flags[envName(strings.Fields(f)[0])] = true
		}
	}
	if !flags["RLSIDECAR_REDIS_TIMEOUT"] {
		t.Fatalf("no flags read from serve --help:\n%s", help.String())
	}
	data, err := os.ReadFile("../../deploy/debian/default")
	if err != nil {
		t.Fatal(err)
	}
	for i, line := range strings.Split(string(data), "\n") {
		name, _, ok := strings.Cut(strings.TrimPrefix(line, "#"), "=")
		if !ok || !strings.HasPrefix(name, envPrefix) {
			continue
		}
		if !flags[name] {
			t.Errorf("deploy/debian/default:%d: %s sets no flag of serve", i+1, name)
		}
	}
	var out bytes.Buffer
	if code := run([]string{"validate", "--config", "../../deploy/debian/rules.yaml"}, &out, io.Discard); code != exitOK {
		t.Fatalf("the packaged rules do not validate")
	}
	if !strings.Contains(out.String(), "4 rules") {
		t.Errorf("the packaged rules: %s", out.String())
	}
}

// unixListening reports whether a Unix socket bound at path is listening, by
// /proc/net/unix (its flags __SO_ACCEPTCON, 00010000), or is a datagram socket; true
// where that file cannot be read, so that the check only ever adds a wait.
func unixListening(path string) bool {
	b, err := os.ReadFile("/proc/net/unix")
	if err != nil {
		return true
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		// Num RefCount Protocol Flags Type St Inode Path
		if len(f) >= 8 && f[7] == path && (f[3] == "00010000" || f[4] == "0002") {
			return true // listening, or a datagram socket (which never listens)
		}
	}
	return false
}

// Under socket activation the socket unit sets the socket's path, mode and group: a
// --socket-group or --socket-mode given anyway (RLSIDECAR_SOCKET_GROUP in
// /etc/default/rlsidecar), or a --socket naming another path, is said to be ignored, as
// --envoy-rls is; a --socket naming the passed socket is not. Before, each was ignored
// without a word: the gateways of the group set there could not connect, and nothing
// said why.
func TestE2ESocketActivationWarnsOfIgnoredSocketFlags(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		env  string
		want []string
	}{
		{"environment", []string{"--socket-mode", "0600"}, "nogroup", []string{"ignoring --socket-group=nogroup --socket-mode=0600: systemd passed the socket"}},
		{"other path", []string{"--socket", "/nonexistent/other.sock"}, "", []string{"ignoring --socket=/nonexistent/other.sock: systemd passed the socket"}},
		{"same path", []string{"--socket", "SOCKET"}, "", nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := shortTempDir(t)
			socket := filepath.Join(dir, "s.sock")
			var env []string
			if tt.env != "" {
				t.Setenv("RLSIDECAR_SOCKET_GROUP", tt.env)
				env = append(env, "RLSIDECAR_SOCKET_GROUP")
			}
			args := []string{binary, "serve", "--admin=", "--watch=false"}
			for _, a := range tt.args {
				args = append(args, strings.ReplaceAll(a, "SOCKET", socket))
			}
			saArgs := []string{"-l", socket, "--fdname=rlsidecar"}
			for _, e := range env {
				saArgs = append(saArgs, "-E", e)
			}
			a := startActivator(t, saArgs, []string{socket}, args...)
			c := dialRaw(t, socket)
			if r := c.check(1, 1, "ip=192.0.2.1"); !r.Allowed {
				t.Fatalf("check: %+v", r)
			}
			a.sigterm(t)
			out := a.out.String()
			for _, w := range tt.want {
				if !strings.Contains(out, w) {
					t.Errorf("no %q in the log:\n%s", w, out)
				}
			}
			if tt.want == nil && strings.Contains(out, "ignoring") {
				t.Errorf("a warning for a --socket naming the passed socket:\n%s", out)
			}
		})
	}
}

// Once STOPPING=1 is sent, a reload (the file watcher runs until the drain ends) says
// neither RELOADING=1 nor READY=1: a draining daemon is not shown as serving again.
func TestNotifierQuietAfterStopping(t *testing.T) {
	n := listenNotify(t)
	t.Setenv("NOTIFY_SOCKET", n.path)
	nt := newNotifier(slog.New(slog.DiscardHandler))
	nt.ready("serving")
	n.waitFor(t, "READY", 10*time.Second)
	nt.stopping("draining")
	n.waitFor(t, "STOPPING", 10*time.Second)
	nt.reloading("reloading the rules (file changed)")
	nt.ready("serving again")
	nt.stopping("the last word") // datagrams arrive in order: whatever came between is seen first
	m := n.waitFor(t, "STOPPING", 10*time.Second)
	if m.fields["STATUS"] != "the last word" {
		t.Fatalf("STOPPING with STATUS=%q, want the last word; seen %q", m.fields["STATUS"], n.seen)
	}
	for _, s := range n.seen[2:] {
		if strings.Contains(s, "READY") || strings.Contains(s, "RELOADING") {
			t.Fatalf("after STOPPING=1: %s; seen %q", s, n.seen)
		}
	}
}
