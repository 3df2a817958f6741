package daemon

import (
	"bufio"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// A listener handed over already open (systemd socket activation) is served as it is, and
// Shutdown closes the server's copy without removing the socket file, which belongs to
// whoever opened it: connections made after the shutdown wait in its backlog for the
// next daemon instead of being refused.
func TestListenerHandedOver(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	owner, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { owner.Close() })
	f, err := owner.File() // a second descriptor of the same socket, as systemd passes one
	if err != nil {
		t.Fatal(err)
	}
	fl, err := net.FileListener(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	set, err := rules.Parse("test.yaml", []byte(benchRules))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Socket: path, Listener: fl.(*net.UnixListener), SocketGroup: "no-such-group"},
		limiter.New(set, localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err != nil {
		t.Fatalf("Listen with a handed-over listener: %v (it must not create, chown or probe the path)", err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve() }()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if r := roundTrip(t, c, bufio.NewReader(c), &proto.Request{ID: 1, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "ip", Value: "a"}}}); !r.Allowed {
		t.Fatalf("%+v", r)
	}
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("Shutdown removed the handed-over socket file: %v", err)
	}
	later, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("a connection after the shutdown was refused: %v", err)
	}
	later.Close()
}

// A socket path longer than a Unix socket address holds is refused with an error that
// says so and names the flag, not the kernel's "bind: invalid argument".
func TestListenPathTooLong(t *testing.T) {
	set, err := rules.Parse("test.yaml", []byte(benchRules))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), strings.Repeat("x", 120)+".sock")
	s, err := New(Config{Socket: path}, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		t.Fatal(err)
	}
	err = s.Listen()
	if err == nil || !strings.Contains(err.Error(), "holds at most 107") || !strings.Contains(err.Error(), "--socket") {
		t.Fatalf("Listen on a %d-byte path: %v", len(path), err)
	}
}
