package envoyrls

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

func newUnixServer(t *testing.T, path, transport string) *Server {
	t.Helper()
	s, err := New(Config{Addr: "unix:" + path, Transport: transport}, limiter.New(rules.Default(), localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// The Envoy socket file is removed at shutdown only while the path still names the file
// this server created: when it was removed and another daemon started on the same path
// meanwhile, the old one's exit leaves the new one reachable.
func TestShutdownLeavesAReplacedSocket(t *testing.T) {
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) {
			dir, err := os.MkdirTemp("", "rls")
			if err != nil {
				t.Fatal(err)
			}
			defer os.RemoveAll(dir)
			path := filepath.Join(dir, "e.sock")
			a := newUnixServer(t, path, tr)
			if err := a.Listen(); err != nil {
				t.Fatal(err)
			}
			aDone := make(chan error, 1)
			go func() { aDone <- a.Serve() }()
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			b := newUnixServer(t, path, tr)
			if err := b.Listen(); err != nil {
				t.Fatal(err)
			}
			bDone := make(chan error, 1)
			go func() { bDone <- b.Serve() }()
			if err := a.Shutdown(context.Background()); err != nil {
				t.Fatal(err)
			}
			<-aDone
			c, err := net.Dial("unix", path)
			if err != nil {
				t.Fatalf("the first server's exit removed the second's socket: %v", err)
			}
			c.Close()
			if err := b.Shutdown(context.Background()); err != nil {
				t.Fatal(err)
			}
			<-bDone
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Fatalf("the second server left its own socket file behind (lstat: %v)", err)
			}
		})
	}
}

// A socket file at the path that another user (not root) owns may be a squatter's: it is
// neither removed nor used, and the error says whose it is.
func TestListenRefusesAnotherUsersSocket(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("giving a file to another user needs root")
	}
	dir, err := os.MkdirTemp("", "rls")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "e.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	if err := os.Chown(path, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	err = newUnixServer(t, path, TransportNative).Listen()
	if err == nil || !strings.Contains(err.Error(), "uid 65534") {
		t.Fatalf("Listen beside another user's stale socket: %v; want a refusal naming the owner", err)
	}
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("the other user's socket was removed: %v", err)
	}
}
