package main

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A secret file every local user can read is warned of, the salt file as the password
// file; so is one the socket's group can read (the gateways': root:rlsidecar 0640 in the
// package's layout), but not one of another group, nor one of the daemon's user alone.
// Before, only a world-readable password file was.
func TestWarnReadableSecrets(t *testing.T) {
	dir := t.TempDir()
	gid := os.Getgid()
	if gid == 0 {
		gid = 65534 // as root: give the socket and the files nogroup
	}
	file := func(name string, mode os.FileMode, g int) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte("0123456789abcdef0123"), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, -1, g); err != nil {
			t.Skipf("cannot give %s group %d: %v", p, g, err)
		}
		return p
	}
	socket := file("s.sock", 0o660, gid)
	other := gid + 1
	for _, tt := range []struct {
		name, flag string
		mode       os.FileMode
		gid        int
		want       string
	}{
		{"salt world-readable", "top-labels-salt-file", 0o644, gid, "the --top-labels-salt-file can be read by every local user"},
		{"password world-readable", "redis-password-file", 0o604, other, "the Redis password file can be read by every local user"},
		{"password group-readable by the gateways", "redis-password-file", 0o640, gid, "the Redis password file can be read by the socket's group"},
		{"salt group-readable by the gateways", "top-labels-salt-file", 0o440, gid, "the --top-labels-salt-file can be read by the socket's group"},
		{"password of another group", "redis-password-file", 0o640, other, ""},
		{"password the user's alone", "redis-password-file", 0o400, gid, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			log := slog.New(slog.NewTextHandler(&buf, nil))
			p := file(strings.ReplaceAll(tt.name, " ", "-"), tt.mode, tt.gid)
			warnReadableSecrets(log, socket, [2]string{tt.flag, p}, [2]string{"top-labels-salt-file", ""})
			if tt.want == "" {
				if buf.Len() != 0 {
					t.Errorf("a warning: %s", buf.String())
				}
				return
			}
			if !strings.Contains(buf.String(), tt.want) || strings.Count(buf.String(), "\n") != 1 {
				t.Errorf("want one line with %q, got:\n%s", tt.want, buf.String())
			}
		})
	}
}

// The real daemon warns of a --top-labels-salt-file every local user can read, as of
// such a --redis-password-file: with the salt, the hashed client labels of the metrics
// can be matched to every IPv4 address in minutes.
func TestE2EWorldReadableSaltFileWarned(t *testing.T) {
	dir := shortTempDir(t)
	salt := filepath.Join(dir, "salt")
	if err := os.WriteFile(salt, []byte("0123456789abcdef0123456789abcdef"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(salt, 0o644); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, "--top-labels-salt-file", salt)
	// The log is read from its pipe on a goroutine of its own: give it time.
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(d.stderr.String(), "the --top-labels-salt-file can be read by every local user"); {
		if time.Now().After(deadline) {
			t.Fatalf("no warning of a world-readable salt file:\n%s", d.stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A salt file too short is refused with its length, in the singular when it is one byte
// ("holds 1 bytes" before).
func TestShortSaltFileRefused(t *testing.T) {
	dir := shortTempDir(t)
	salt := filepath.Join(dir, "salt")
	if err := os.WriteFile(salt, []byte("x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var out, errs bytes.Buffer
	err := serve([]string{"--socket", filepath.Join(dir, "s.sock"), "--admin", "", "--top-labels-salt-file", salt}, &out, &errs)
	if err == nil || !errors.Is(err, errUsage) || !strings.Contains(err.Error(), salt+" holds 1 byte; use at least 16") {
		t.Fatalf("serve with a 1-byte salt file: %v, want a usage error saying it holds 1 byte\n%s", err, errs.String())
	}
}
