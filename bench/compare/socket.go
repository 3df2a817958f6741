package main

import (
	"bufio"
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
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// rulesYAML is the daemon's rule set for the comparison: one rule per request, keyed by
// user, with a limit high enough that the load is admitted.
const rulesYAML = `rules:
  - name: per-user
    key: user
    limit: { requests: 1000000000, per: 1h }
`

// process is a server the harness started; stop ends it.
type process struct {
	cmd *exec.Cmd
}

func (p *process) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

func (p *process) rssKB() (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			return strconv.Atoi(f[1])
		}
	}
	return 0, fmt.Errorf("no VmRSS for pid %d", p.cmd.Process.Pid)
}

// startLogged starts cmd and waits until a line of its stdout contains want.
func startLogged(cmd *exec.Cmd, want string) (*process, error) {
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", cmd.Path, err)
	}
	br := bufio.NewReader(stdout)
	line, _ := br.ReadString('\n')
	if !strings.Contains(line, want) {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("%s did not start: %q", filepath.Base(cmd.Path), line)
	}
	go func() { _, _ = io.Copy(io.Discard, br) }()
	return &process{cmd: cmd}, nil
}

// buildOurs builds the daemon and the floor server of the repository at root into dir,
// in the root module (whose go.mod, not this one's, pins the daemon's dependencies).
func buildOurs(root, dir string) error {
	for _, pkg := range []string{"./cmd/rlsidecar", "./bench/floorserver"} {
		cmd := exec.Command("go", "build", "-o", dir, pkg)
		cmd.Dir = root
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("building %s: %w\n%s", pkg, err, out)
		}
	}
	return nil
}

// startRlsidecar starts the daemon (local mode) on a socket in dir.
func startRlsidecar(dir string) (*process, string, error) {
	cfg := filepath.Join(dir, "rules.yaml")
	if err := os.WriteFile(cfg, []byte(rulesYAML), 0o600); err != nil {
		return nil, "", err
	}
	socket := filepath.Join(dir, "rlsidecar.sock")
	p, err := startLogged(exec.Command(filepath.Join(dir, "rlsidecar"), "serve", "--socket", socket, "--admin=",
		"--log-level", "warn", "--config", cfg), "listening")
	return p, socket, err
}

// startFloor starts the do-nothing server that speaks the same framing.
func startFloor(dir string) (*process, string, error) {
	socket := filepath.Join(dir, "floor.sock")
	p, err := startLogged(exec.Command(filepath.Join(dir, "floorserver"), "-socket", socket), "listening")
	return p, socket, err
}

// frames pre-encodes one check request per entry of ks: the load generator sends bytes,
// so its own encoding cost is not in the figures.
func frames(ks keys) [][]byte {
	out := make([][]byte, len(ks))
	enc := proto.NewEncoder()
	for i, k := range ks {
		enc.Reset()
		enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "method", Value: "GET"},
			{Name: "path", Value: "/v1/items"},
			{Name: "user", Value: "user-" + strconv.Itoa(k)},
		}})
		out[i] = append([]byte(nil), enc.Bytes()...)
	}
	return out
}

// sockChecker is one connection to a socket server, sending pre-encoded frames.
type sockChecker struct {
	c   net.Conn
	br  *bufio.Reader
	buf []byte
	fr  [][]byte
	out []byte
}

func dialSock(socket string, fr [][]byte) (*sockChecker, error) {
	c, err := net.Dial("unix", socket)
	if err != nil {
		return nil, err
	}
	s := &sockChecker{c: c, br: bufio.NewReaderSize(c, 64<<10), fr: fr}
	// The first answer is decoded in full: the load is real checks being admitted.
	if err := s.check(0); err != nil {
		c.Close()
		return nil, err
	}
	var resp proto.Response
	if err := proto.NewDecoder().DecodeResponse(s.buf, &resp); err != nil {
		c.Close()
		return nil, fmt.Errorf("first answer: %w", err)
	}
	if resp.IsError() || !resp.Allowed {
		c.Close()
		return nil, fmt.Errorf("first answer is not an admitted check: %+v", resp)
	}
	return s, nil
}

func (s *sockChecker) check(i int) error {
	if _, err := s.c.Write(s.fr[i]); err != nil {
		return err
	}
	var err error
	s.buf, err = proto.ReadFrame(s.br, s.buf, 1<<20)
	return err
}

func (s *sockChecker) close() { _ = s.c.Close() }

// sockSystem is a socket server as a system under test.
func sockSystem(name, socket string, fr [][]byte) *system {
	return &system{
		name: name,
		dial: func() (checker, error) { return dialSock(socket, fr) },
		pipelined: func(conns, depth int, d time.Duration) (int, []time.Duration, error) {
			return pipelinedLoad(socket, fr, conns, depth, d)
		},
	}
}

// pipelinedLoad keeps depth requests in flight on each of conns connections for d,
// writing as many new frames as answers arrived in one write, and samples each request's
// latency from its write to its answer.
func pipelinedLoad(socket string, fr [][]byte, conns, depth int, d time.Duration) (int, []time.Duration, error) {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		total int
		all   []time.Duration
		first error
	)
	deadline := time.Now().Add(d)
	for g := 0; g < conns; g++ {
		s, err := dialSock(socket, fr)
		if err != nil {
			return 0, nil, err
		}
		wg.Go(func() {
			defer s.close()
			sentAt := make([]time.Time, depth)
			lat := make([]time.Duration, 0, 1<<18)
			sent, recvd := 0, 0
			next := g * 7919
			var err error
			for {
				stopping := time.Now().After(deadline)
				s.out = s.out[:0]
				now := time.Now()
				for !stopping && sent-recvd < depth {
					s.out = append(s.out, fr[next%len(fr)]...)
					sentAt[sent%depth] = now
					next++
					sent++
				}
				if len(s.out) > 0 {
					if _, err = s.c.Write(s.out); err != nil {
						break
					}
				}
				if recvd == sent {
					break
				}
				// Read one answer, then every complete one already buffered.
				for {
					if s.buf, err = proto.ReadFrame(s.br, s.buf, 1<<20); err != nil {
						break
					}
					if recvd%16 == 0 {
						lat = append(lat, time.Since(sentAt[recvd%depth]))
					}
					recvd++
					if s.br.Buffered() < proto.HeaderSize {
						break
					}
					hdr, _ := s.br.Peek(proto.HeaderSize)
					if int(proto.FrameLength(hdr)) > s.br.Buffered()-proto.HeaderSize {
						break
					}
				}
				if err != nil {
					break
				}
			}
			mu.Lock()
			total += recvd
			all = append(all, lat...)
			if err != nil && first == nil {
				first = err
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	return total, all, first
}
