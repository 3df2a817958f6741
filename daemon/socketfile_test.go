package daemon

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// newServerAt returns a server on path, not yet listening, logging into log (nil: none).
func newServerAt(t *testing.T, path string, log *bytes.Buffer) *Server {
	t.Helper()
	set, err := rules.Parse("test.yaml", []byte(benchRules))
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Socket: path}
	if log != nil {
		cfg.Logger = slog.New(slog.NewTextHandler(log, nil))
	}
	s, err := New(cfg, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// staleSocket leaves a socket file at path that no one listens on, as a killed daemon does.
func staleSocket(t *testing.T, path string) {
	t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
}

// A daemon removes its socket file at shutdown only while the path still names it: when
// the file was removed and another daemon started on the same path meanwhile, the old
// daemon's exit leaves the new one reachable.
func TestShutdownLeavesAReplacedSocket(t *testing.T) {
	path := filepath.Join(shortDir(t), "s.sock")
	a := newServerAt(t, path, nil)
	if err := a.Listen(); err != nil {
		t.Fatal(err)
	}
	go a.Serve()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	b := newServerAt(t, path, nil)
	if err := b.Listen(); err != nil {
		t.Fatal(err)
	}
	go b.Serve()
	if err := a.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("the first daemon's exit removed the second's socket: %v", err)
	}
	c.Close()
	if err := b.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("the second daemon left its own socket file behind (lstat: %v)", err)
	}
}

// Daemons started at the same moment on a stale socket: one replaces it and serves, the
// others find it live and are refused. Without the start lock each could find the file
// refusing, remove it (one removing another's new socket) and bind, two daemons each
// believing it serves the path.
func TestListenRaceOnStaleSocket(t *testing.T) {
	for round := 0; round < 20; round++ {
		path := filepath.Join(shortDir(t), "s.sock")
		staleSocket(t, path)
		const n = 4
		servers := make([]*Server, n)
		for i := range servers {
			servers[i] = newServerAt(t, path, nil)
		}
		errs := make([]error, n)
		var start, wg sync.WaitGroup
		start.Add(1)
		for i, s := range servers {
			wg.Go(func() {
				start.Wait()
				errs[i] = s.Listen()
			})
		}
		start.Done()
		wg.Wait()
		ok := 0
		for i, err := range errs {
			switch {
			case err == nil:
				ok++
				defer servers[i].Shutdown(context.Background())
			case !strings.Contains(err.Error(), "another daemon is serving this socket"):
				t.Errorf("round %d: a daemon failed otherwise than being refused: %v", round, err)
			}
		}
		if ok != 1 {
			t.Fatalf("round %d: %d of %d daemons listen on one path (errors %v), want 1", round, ok, n, errs)
		}
	}
}

// A socket file at the path that another user (not root) owns, live or stale, may be a
// squatter's: the daemon neither removes nor uses it, and says whose it is.
func TestListenRefusesAnotherUsersSocket(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("giving a file to another user needs root")
	}
	const nobody = 65534
	dir := shortDir(t)
	path := filepath.Join(dir, "s.sock")
	staleSocket(t, path)
	if err := os.Chown(path, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	err := newServerAt(t, path, nil).Listen()
	if err == nil || !strings.Contains(err.Error(), "uid 65534") || !strings.Contains(err.Error(), "refusing") {
		t.Fatalf("Listen beside another user's stale socket: %v; want a refusal naming the owner", err)
	}
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("the other user's socket was removed: %v", err)
	}

	// Live: the squatter answers on it.
	live := filepath.Join(dir, "live.sock")
	ln, err := net.Listen("unix", live)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if err := os.Chown(live, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	if err := newServerAt(t, live, nil).Listen(); err == nil || !strings.Contains(err.Error(), "uid 65534") {
		t.Fatalf("Listen beside another user's live socket: %v; want a refusal naming the owner", err)
	}

	// A start lock another daemon left, of another user, does not keep this one from
	// starting (the lock narrows a race; it is no claim on the path), nor does a FIFO put
	// there, which is not waited on.
	lockd := filepath.Join(dir, "l.sock")
	if err := os.WriteFile(lockd+".lock", nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(lockd+".lock", nobody, nobody); err != nil {
		t.Fatal(err)
	}
	s := newServerAt(t, lockd, nil)
	if err := s.Listen(); err != nil {
		t.Fatalf("Listen beside another user's start lock: %v", err)
	}
	s.ln.Close()
	fifo := filepath.Join(dir, "f.sock")
	if err := syscall.Mkfifo(fifo+".lock", 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	s = newServerAt(t, fifo, nil)
	go func() { done <- s.Listen() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Listen beside a FIFO named as the start lock: %v", err)
		}
		s.ln.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("Listen waited on a FIFO named as the start lock")
	}
}

// A socket in a directory every user can write (the default's last resort, /tmp) is
// warned of, with what to do; one in a private directory is not.
func TestListenWarnsOfSharedDirectory(t *testing.T) {
	shared := shortDir(t)
	if err := os.Chmod(shared, 0o1777); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		dir  string
		warn bool
	}{{shared, true}, {shortDir(t), false}} {
		var log bytes.Buffer
		s := newServerAt(t, filepath.Join(tt.dir, "s.sock"), &log)
		if err := s.Listen(); err != nil {
			t.Fatal(err)
		}
		s.Shutdown(context.Background())
		got := strings.Contains(log.String(), "level=WARN") && strings.Contains(log.String(), "RLSIDECAR_SOCKET")
		if got != tt.warn {
			t.Errorf("socket in %s: warned %v, want %v:\n%s", tt.dir, got, tt.warn, log.String())
		}
	}
}

// shortDir returns a temp dir whose path fits a Unix socket address.
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "rlsd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
