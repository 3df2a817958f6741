package main

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/rlsidecar/rlsidecar/envoyrls"
)

// The Envoy API under socket activation: systemd-socket-activate passes the msgpack
// socket and the Envoy one, named as the units name them (FileDescriptorName=rlsidecar,
// =envoy); the daemon serves Envoy's API on the one named envoy, in place of the
// --envoy-rls it was given (with a warning), says so in STATUS=, and leaves both socket
// files, which are not its own, in place when it stops.
func TestE2ESocketActivationEnvoy(t *testing.T) {
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) { testE2ESocketActivationEnvoy(t, tr) })
	}
}

func testE2ESocketActivationEnvoy(t *testing.T, transport string) {
	dir := shortTempDir(t)
	sock, envoySock, elsewhere := filepath.Join(dir, "s.sock"), filepath.Join(dir, "envoy.sock"), filepath.Join(dir, "elsewhere.sock")
	rulesFile := writeFile(t, dir, "rules.yaml", envoyRules)
	n := listenNotify(t)
	t.Setenv("NOTIFY_SOCKET", n.path)
	a := startActivator(t, []string{"-l", sock, "-l", envoySock, "--fdname=rlsidecar:" + envoyFDName, "-E", "NOTIFY_SOCKET"},
		[]string{sock, envoySock}, binary, "serve", "--admin=", "--config", rulesFile, "--watch=false",
		"--envoy-rls", "unix:"+elsewhere, "--envoy-rls-transport", transport)

	// Envoy's first call starts the daemon.
	conn, err := grpc.NewClient("unix://"+envoySock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	f := &rlsFixture{rls: rlsv3.NewRateLimitServiceClient(conn), hc: healthpb.NewHealthClient(conn)}
	checkStatuses(t, f.call(t, "edge", 0, desc("remote_address=1.2.3.4")), ok,
		wantStatus{code: ok, name: "per-ip", limit: true, rpu: 6, unit: rlsv3.RateLimitResponse_RateLimit_MINUTE, remaining: 2})
	ready := n.waitFor(t, "READY", 10*time.Second)
	if st := ready.fields["STATUS"]; !strings.Contains(st, "on "+sock) || !strings.Contains(st, "Envoy API on unix:"+envoySock) {
		t.Errorf("STATUS=%q: want both sockets", st)
	}
	if r := dialRaw(t, sock).check(1, 1, "user=a"); !r.Allowed {
		t.Fatalf("the msgpack socket: %+v", r)
	}
	if !strings.Contains(a.out.String(), "ignoring --envoy-rls") {
		t.Errorf("no warning that --envoy-rls gave way to the passed socket:\n%s", a.out.String())
	}
	if _, err := os.Lstat(elsewhere); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the daemon bound --envoy-rls as well: %v", err)
	}

	if err := a.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.done:
	case <-time.After(10 * time.Second):
		t.Fatal("no exit within 10s of SIGTERM")
	}
	if code := a.cmd.ProcessState.ExitCode(); code != exitOK {
		t.Errorf("exit %d after SIGTERM", code)
	}
	for _, p := range []string{sock, envoySock} {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("the daemon removed %s, which systemd owns: %v", p, err)
		}
	}
}

// Passed sockets the daemon cannot tell apart are refused at start, before READY=1: two
// that are not named envoy, or two that are.
func TestE2ESocketActivationNames(t *testing.T) {
	for _, tt := range []struct{ names, want string }{
		{"rlsidecar:other", "2 sockets passed (LISTEN_FDS) besides any named \"envoy\""},
		{"envoy:envoy", "two sockets named \"envoy\" passed"},
	} {
		t.Run(tt.names, func(t *testing.T) {
			dir := shortTempDir(t)
			s1, s2 := filepath.Join(dir, "1.sock"), filepath.Join(dir, "2.sock")
			n := listenNotify(t)
			t.Setenv("NOTIFY_SOCKET", n.path)
			a := startActivator(t, []string{"-l", s1, "-l", s2, "--fdname=" + tt.names, "-E", "NOTIFY_SOCKET"}, []string{s1, s2},
				binary, "serve", "--admin=", "--watch=false")
			c, err := net.DialTimeout("unix", s1, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			select {
			case <-a.done:
			case <-time.After(10 * time.Second):
				t.Fatalf("still running after 10s:\n%s", a.out.String())
			}
			if code := a.cmd.ProcessState.ExitCode(); code != exitFailure || !strings.Contains(a.out.String(), tt.want) {
				t.Fatalf("exit %d, want %d and %q:\n%s", code, exitFailure, tt.want, a.out.String())
			}
			select {
			case m := <-n.msgs:
				t.Errorf("a notification from a daemon that refused its sockets: %v", m.fields)
			default:
			}
		})
	}
}
