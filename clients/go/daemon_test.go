package rlclient

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The real rlsidecar daemon for the tests that need its own behaviour (--idle-timeout):
// $RLSIDECAR_BIN, or built once from this repository's cmd/rlsidecar with the go on PATH
// (scripts/test-modules sets RLSIDECAR_BIN: the old Go releases it tests the client with
// cannot build the daemon).
var daemonBin struct {
	once sync.Once
	path string
	err  error
	out  []byte
}

// removeDaemonBinary removes the daemon daemonBinary built, if it did (TestMain).
func removeDaemonBinary() {
	if daemonBin.path != "" {
		os.RemoveAll(filepath.Dir(daemonBin.path))
	}
}

func daemonBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("RLSIDECAR_BIN"); p != "" {
		return p
	}
	daemonBin.once.Do(func() {
		dir, err := os.MkdirTemp("", "rlc-bin")
		if err != nil {
			daemonBin.err = err
			return
		}
		daemonBin.path = filepath.Join(dir, "rlsidecar")
		cmd := exec.Command("go", "build", "-o", daemonBin.path, "./cmd/rlsidecar")
		cmd.Dir = filepath.Join("..", "..")
		daemonBin.out, daemonBin.err = cmd.CombinedOutput()
	})
	if daemonBin.err != nil {
		t.Fatalf("building the daemon (or set RLSIDECAR_BIN): %v\n%s", daemonBin.err, daemonBin.out)
	}
	return daemonBin.path
}

// startDaemon runs the real daemon with the rules and args on a socket of its own, waits
// until it says it is listening, and has t's cleanup stop it. It returns the socket.
func startDaemon(t *testing.T, rules string, args ...string) string {
	t.Helper()
	bin := daemonBinary(t)
	sock := socketPath(t)
	cfg := filepath.Join(filepath.Dir(sock), "rules.yaml")
	if err := os.WriteFile(cfg, []byte(rules), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, append([]string{"serve", "--socket", sock, "--admin=", "--config", cfg}, args...)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan string, 1)
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		br := bufio.NewReader(stdout)
		line, _ := br.ReadString('\n')
		ready <- line
		io.Copy(io.Discard, br)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-copied
		cmd.Wait()
	})
	select {
	case line := <-ready:
		if !strings.Contains(line, "listening on") {
			t.Fatalf("the daemon did not start: %q", line)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the daemon did not start in 10 s")
	}
	return sock
}

const perUserRules = `
rules:
  - name: per-user
    key: user
    limit: { requests: 5, per: 60s }
`

// The daemon at --idle-timeout has closed both connections of the pool, and the client
// has not seen it yet (the hook holds each reader at the end of its stream until a check's
// write on its connection has failed). A check's write fails on the first (EPIPE: nothing
// delivered), and its resend's on the second. Its frame never reached the daemon, either
// time: it is sent again on a new connection, answered and counted once. Before, a check
// was sent again once, and the second failed write gave it the Policy ("writing a
// request: ... broken pipe").
func TestCheckResentAcrossThePoolsIdleClosedConnections(t *testing.T) {
	sock := startDaemon(t, perUserRules, "--idle-timeout", "200ms")
	c := newClient(t, Options{Socket: sock, Conns: 2, Timeout: 10 * time.Second, Policy: FailClosed,
		Logger: slog.New(slog.DiscardHandler)})
	check := func(want uint64) {
		t.Helper()
		d, err := c.Check(context.Background(), map[string]string{"user": "dee"}, nil)
		if err != nil || d.Unreachable || d.Remaining != want {
			t.Fatalf("check: %+v %v (want remaining %d: each check counted once)", d, err, want)
		}
	}
	check(4)
	check(3)
	for i := range c.slots {
		s := &c.slots[i]
		s.mu.Lock()
		cn := s.cn
		s.mu.Unlock()
		if cn == nil {
			t.Fatalf("slot %d: no connection", i)
		}
	}
	var held atomic.Int32
	done := make(chan struct{})
	rf := func(cn *conn) {
		if held.Add(1) > 2 {
			return
		}
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			select {
			case <-done:
				return
			default:
			}
			cn.mu.Lock()
			failed := cn.werr != nil
			cn.mu.Unlock()
			if failed {
				return
			}
		}
	}
	readFailedHook.Store(&rf)
	t.Cleanup(func() { close(done); readFailedHook.Store(nil) }) // before c closes
	eventually(t, "the daemon closing both idle connections", func() bool { return held.Load() >= 2 })
	check(2)
	check(1)
}
