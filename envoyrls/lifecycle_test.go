package envoyrls

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/rlsidecar/rlsidecar/internal/unixsock/unixsocktest"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// Listen, serve, answer, shut down, on each transport: the socket has the configured
// mode and is removed, health turns NOT_SERVING, Serve returns nil, and no goroutine is
// left behind.
func TestLifecycle(t *testing.T) {
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) { testLifecycle(t, tr) })
	}
}

func testLifecycle(t *testing.T, transport string) {
	defer goleak.VerifyNone(t)
	dir, err := os.MkdirTemp("", "rls")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "e.sock")
	s, err := New(Config{Addr: "unix:" + sock, SocketMode: 0o640, Transport: transport}, limiter.New(rules.Default(), localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o640 {
		t.Fatalf("socket: %v %v", fi, err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve() }()

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := rlsv3.NewRateLimitServiceClient(conn).ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d",
		Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "k", Value: "v"}}}}})
	if err != nil || resp.OverallCode != rlsv3.RateLimitResponse_OK || len(resp.Statuses) != 1 {
		t.Fatalf("call: %v %v", resp, err)
	}
	hc := healthpb.NewHealthClient(conn)
	if h, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: ServiceName}); err != nil || h.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: %v %v", h, err)
	}
	conn.Close()

	if err := s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
	// A second server may now take the path; a live one is refused.
	if err := s.Listen(); err != nil {
		t.Fatalf("relisten: %v", err)
	}
	other, _ := New(Config{Addr: "unix:" + sock, Transport: transport}, limiter.New(rules.Default(), localbucket.NewStore(localbucket.Options{})))
	if err := other.Listen(); err == nil {
		t.Error("a second server took a live socket")
	}
	s.ln.Close()
}

func TestNewRefuses(t *testing.T) {
	lim := limiter.New(rules.Default(), localbucket.NewStore(localbucket.Options{}))
	if _, err := New(Config{}, lim); err == nil {
		t.Error("no address: no error")
	}
	if _, err := New(Config{Addr: "unix:/tmp/x", Transport: "http3"}, lim); err == nil {
		t.Error("unknown transport: no error")
	}
}

// A server asked in process, or listening and never served, runs no goroutine (grpc-go's
// stream workers start with Serve), and Shutdown before Serve makes Serve return at once.
func TestNoGoroutinesUntilServed(t *testing.T) {
	defer goleak.VerifyNone(t)
	s := testServer(t)
	if _, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api",
		Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: "u"}}}}}); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "e.sock")
	l, err := New(Config{Addr: "unix:" + sock}, limiter.New(rules.Default(), localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Listen(); err != nil {
		t.Fatal(err)
	}
	if err := l.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := l.Serve(); err != nil {
		t.Fatalf("Serve after Shutdown: %v", err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
}

// A Unix socket is given to Config.SocketGroup with Config.SocketMode, as the msgpack
// socket is (it stayed the daemon's own group: a gateway user in the group could not
// connect); a group that does not exist is refused before any socket file is made.
func TestListenSocketGroup(t *testing.T) {
	gid := unixsocktest.OtherGroup(t)
	lim := limiter.New(rules.Default(), localbucket.NewStore(localbucket.Options{}))
	dir := t.TempDir()
	sock := filepath.Join(dir, "e.sock")
	s, err := New(Config{Addr: "unix:" + sock, SocketMode: 0o660, SocketGroup: strconv.Itoa(gid)}, lim)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	defer s.Shutdown(context.Background())
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); int(st.Gid) != gid || fi.Mode().Perm() != 0o660 {
		t.Fatalf("socket group %d mode %#o, want %d and 0660", st.Gid, fi.Mode().Perm(), gid)
	}

	bad := filepath.Join(dir, "bad.sock")
	s2, err := New(Config{Addr: "unix:" + bad, SocketGroup: "no-such-group-rls"}, lim)
	if err != nil {
		t.Fatal(err)
	}
	if err := s2.Listen(); err == nil || !strings.Contains(err.Error(), "no-such-group-rls") {
		t.Fatalf("err = %v, want a refusal naming the group", err)
	}
	if _, err := os.Lstat(bad); !os.IsNotExist(err) {
		t.Fatalf("a socket file was made for a group that does not exist: %v", err)
	}
}
