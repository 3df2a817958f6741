package main

import (
	"bytes"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A TCP listener bound beyond loopback is warned of, the Envoy API as the admin endpoint
// (neither has authentication); loopback, unix: sockets and listeners turned off are not.
// The admin warning says what is really exposed: lifting a ban is refused but from
// loopback, so it must not say anyone can.
func TestWarnExposed(t *testing.T) {
	for _, tt := range []struct {
		admin, envoy string
		want         []string // substrings of the warnings, in order; none: no warning
	}{
		{"127.0.0.1:9464", "127.0.0.1:8081", nil},
		{"localhost:9464", "unix:/run/rlsidecar/envoy.sock", nil},
		{"", "", nil},
		{"0.0.0.0:9464", "", []string{"the admin endpoint listens beyond this host"}},
		{"", "0.0.0.0:8081", []string{"the Envoy rate limit service listens beyond this host"}},
		{"", ":8081", []string{"spend any client's budget"}},
		{":9464", "[::]:8081", []string{"admin endpoint", "Envoy rate limit service"}},
		{"garbage", "garbage", nil}, // not an address: its listener refuses it, with no warning first
	} {
		var buf bytes.Buffer
		warnExposed(slog.New(slog.NewTextHandler(&buf, nil)), tt.admin, tt.envoy)
		out := buf.String()
		if n := strings.Count(out, "level=WARN"); n != len(tt.want) || strings.Count(out, "\n") != n {
			t.Errorf("admin %q envoy %q: %d warnings, want %d:\n%s", tt.admin, tt.envoy, n, len(tt.want), out)
			continue
		}
		rest := out
		for _, w := range tt.want {
			i := strings.Index(rest, w)
			if i < 0 {
				t.Errorf("admin %q envoy %q: no %q in:\n%s", tt.admin, tt.envoy, w, out)
				break
			}
			rest = rest[i:]
		}
		if strings.Contains(out, "can lift bans") {
			t.Errorf("the admin warning says anyone can lift bans; DELETE /bans is refused but from loopback:\n%s", out)
		}
	}
}

// --socket-mode with no write bit (0, 0000, 0444) is refused when the flags are read,
// naming the flag: it once became 0660 silently (0), or made a socket no gateway can
// connect to. Left out, the flag is 0660.
func TestSocketModeRefusesNoWriteBit(t *testing.T) {
	for _, v := range []string{"0", "0000", "0444", "0500"} {
		var m octalMode
		if err := m.Set(v); err == nil || !strings.Contains(err.Error(), "lets no one connect") {
			t.Errorf("--socket-mode %s: %v, want a refusal", v, err)
		}
	}
	for v, want := range map[string]os.FileMode{"0660": 0o660, "0600": 0o600, "0666": 0o666, "0220": 0o220} {
		var m octalMode
		if err := m.Set(v); err != nil || os.FileMode(m) != want {
			t.Errorf("--socket-mode %s: %v %#o", v, err, os.FileMode(m))
		}
	}
	sock := filepath.Join(shortTempDir(t), "s.sock")
	out, err := runCLI(t, "serve", "--socket", sock, "--admin=", "--socket-mode", "0")
	if err == nil || !strings.Contains(out, "socket-mode") || strings.Contains(out, "listening on") {
		t.Fatalf("serve --socket-mode 0: %v\n%s", err, out)
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Fatalf("serve --socket-mode 0 left a socket (lstat: %v)", err)
	}
}

// The world-writable warning is about the mode a socket really has: --socket-mode for a
// socket the daemon creates, the file's own mode for one systemd passed (which the flag
// does not change).
func TestWarnOpenSockets(t *testing.T) {
	dir := shortTempDir(t)
	sock := func(name string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		ln, err := net.Listen("unix", p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	closed, open := sock("closed.sock", 0o660), sock("open.sock", 0o666)
	for _, tt := range []struct {
		name           string
		mode           os.FileMode
		socket         string
		activated      bool
		envoy          string
		envoyActivated bool
		warnings       int
	}{
		{"flag 0666", 0o666, "/run/x.sock", false, "", false, 1},
		{"flag 0666, both sockets", 0o666, "/run/x.sock", false, "unix:/run/e.sock", false, 2},
		{"flag 0666, TCP Envoy", 0o666, "/run/x.sock", false, "127.0.0.1:8081", false, 1},
		{"flag 0660", 0o660, "/run/x.sock", false, "unix:/run/e.sock", false, 0},
		{"activated 0660, flag 0666", 0o666, closed, true, "unix:" + closed, true, 0},
		{"activated 0666, flag 0660", 0o660, open, true, "", false, 1},
		{"activated 0660, own Envoy socket by flag 0666", 0o666, closed, true, "unix:/run/e.sock", false, 1},
		{"activated, file not found", 0o660, filepath.Join(dir, "gone.sock"), true, "", false, 0},
	} {
		var buf bytes.Buffer
		warnOpenSockets(slog.New(slog.NewTextHandler(&buf, nil)), tt.mode, tt.socket, tt.activated, tt.envoy, tt.envoyActivated)
		if n := strings.Count(buf.String(), "level=WARN"); n != tt.warnings {
			t.Errorf("%s: %d warnings, want %d:\n%s", tt.name, n, tt.warnings, buf.String())
		}
	}
}
