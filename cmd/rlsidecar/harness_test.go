package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// binary is the real rlsidecar, built once for the end-to-end tests.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "rlsidecar-e2e")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "rlsidecar")
	out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "building rlsidecar: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// daemonProc is a running daemon binary.
type daemonProc struct {
	t      *testing.T
	cmd    *exec.Cmd
	socket string
	stderr *syncBuffer
	done   chan error
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// shortTempDir returns a temp dir whose path fits a Unix socket address (108 bytes).
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "rls")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// startDaemon runs `rlsidecar serve` with args on a temp socket and waits until it says
// it is listening.
func startDaemon(t *testing.T, args ...string) *daemonProc {
	t.Helper()
	socket := filepath.Join(shortTempDir(t), "s.sock")
	return startDaemonAt(t, socket, args...)
}

func startDaemonAt(t *testing.T, socket string, args ...string) *daemonProc {
	t.Helper()
	// No admin endpoint unless a test asks: daemons run side by side.
	return startServe(t, socket, append([]string{"--admin="}, args...)...)
}

// startServe runs `rlsidecar serve --socket socket args...`, with no flag added.
func startServe(t *testing.T, socket string, args ...string) *daemonProc {
	t.Helper()
	return startServeVia(t, nil, socket, args...)
}

// startServeVia is startServe with the command run by the program via names, which gets
// the daemon's command line as its arguments (nil: none).
func startServeVia(t *testing.T, via []string, socket string, args ...string) *daemonProc {
	t.Helper()
	cmd := exec.Command(binary, append([]string{"serve", "--socket", socket}, args...)...)
	if len(via) > 0 {
		cmd = exec.Command(via[0], append(via[1:], cmd.Args...)...)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	d := &daemonProc{t: t, cmd: cmd, socket: socket, stderr: &syncBuffer{}}
	cmd.Stderr = d.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan string, 1)
	go func() {
		br := bufio.NewReader(stdout)
		line, _ := br.ReadString('\n')
		ready <- line
		io.Copy(io.Discard, br)
	}()
	d.done = waitInBackground(t, cmd)
	select {
	case line := <-ready:
		if !strings.Contains(line, "listening on") {
			t.Fatalf("daemon did not start: %q\n%s", line, d.stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("daemon did not start in 10s\n%s", d.stderr.String())
	}
	return d
}

// waitInBackground waits for cmd (started) on a goroutine of its own and returns the
// channel its Wait's error is sent on, and has t's cleanup kill the process if it has
// not exited by then, and wait for it. Whether it exited is told by a channel closed
// once Wait has returned: the cleanups read cmd.ProcessState instead, which Wait
// writes, and a daemon exiting as the test ended was a data race (-race failed
// TestE2EReadyzDuringDrain once in CI).
func waitInBackground(t *testing.T, cmd *exec.Cmd) chan error {
	done := make(chan error, 1)
	exited := make(chan struct{})
	go func() {
		err := cmd.Wait()
		close(exited)
		done <- err
	}()
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			cmd.Process.Kill()
			<-exited
		}
	})
	return done
}

// rawConn speaks frames directly.
type rawConn struct {
	t   *testing.T
	c   net.Conn
	br  *bufio.Reader
	dec *proto.Decoder
}

func dialRaw(t *testing.T, socket string) *rawConn {
	t.Helper()
	c, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	return &rawConn{t: t, c: c, br: bufio.NewReader(c), dec: proto.NewDecoder()}
}

func (r *rawConn) write(b []byte) {
	r.t.Helper()
	if _, err := r.c.Write(b); err != nil {
		r.t.Fatal(err)
	}
}

func (r *rawConn) send(req *proto.Request) {
	r.t.Helper()
	enc := proto.NewEncoder()
	enc.EncodeRequest(req)
	r.write(enc.Bytes())
}

// readFrame returns the next raw frame, header included.
func (r *rawConn) readFrame() ([]byte, error) {
	body, err := proto.ReadFrame(r.br, nil, 1<<20)
	if err != nil {
		return nil, err
	}
	frame := make([]byte, proto.HeaderSize+len(body))
	frame[3] = byte(len(body))
	frame[2] = byte(len(body) >> 8)
	frame[1] = byte(len(body) >> 16)
	frame[0] = byte(len(body) >> 24)
	copy(frame[proto.HeaderSize:], body)
	return frame, nil
}

func (r *rawConn) recv() *proto.Response {
	r.t.Helper()
	frame, err := r.readFrame()
	if err != nil {
		r.t.Fatalf("reading a response: %v", err)
	}
	var resp proto.Response
	if err := r.dec.DecodeResponse(frame[proto.HeaderSize:], &resp); err != nil {
		r.t.Fatal(err)
	}
	return &resp
}

func (r *rawConn) check(id uint64, cost uint64, attrs ...string) *proto.Response {
	r.t.Helper()
	req := proto.Request{ID: id, Op: proto.OpCheck, Cost: cost}
	for _, a := range attrs {
		k, v, _ := strings.Cut(a, "=")
		req.Attrs = append(req.Attrs, proto.Attr{Name: k, Value: v})
	}
	r.send(&req)
	resp := r.recv()
	if resp.ID != id {
		r.t.Fatalf("answer id %d, want %d", resp.ID, id)
	}
	return resp
}

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// clearOfWindowEnd returns once the fixed windows of length w (aligned to the Unix
// epoch, as the daemon aligns them) have at least need left before the next one begins,
// waiting for it to begin if not. A test that counts a fixed window's requests (or their
// sum in Redis) assumes that the window does not turn while it runs: one that takes
// seconds against hourly windows crosses an hour now and then. Every hour, day, and
// calendar day or month of a whole-hour time zone begins with a minute: need against
// time.Minute keeps all of them away.
func clearOfWindowEnd(t *testing.T, w, need time.Duration) {
	t.Helper()
	if need >= w/2 {
		t.Fatalf("clearOfWindowEnd: need %v of a %v window", need, w)
	}
	now := time.Now().UnixNano()
	end := (now/int64(w) + 1) * int64(w)
	if left := time.Duration(end - now); left < need {
		t.Logf("%v to the end of a %v window: waiting for the next one", left, w)
		time.Sleep(left + 10*time.Millisecond)
	}
}
