package main

import (
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// A --daemon-id with a space or a control character is refused: Redis's records of a
// key's last user and of the reservation of its credit are space-separated, and such a
// name parsed as no daemon at all there.
func TestCheckDaemonID(t *testing.T) {
	for _, id := range []string{"gw-1", "host.example-1234-ab12", "gw/2", "ünïcode", "a:b"} {
		if err := checkDaemonID(id); err != nil {
			t.Errorf("%q: %v", id, err)
		}
	}
	for _, id := range []string{"gw 1", " gw", "gw\t1", "gw\n", "gw\x00", "gw\u00a0x", "gw\u2003"} {
		if err := checkDaemonID(id); err == nil || !errors.Is(err, errUsage) {
			t.Errorf("%q: err = %v, want a usage error", id, err)
		}
	}
}

func TestE2EDaemonIDWithASpaceRefused(t *testing.T) {
	sock := filepath.Join(shortTempDir(t), "s.sock")
	out, err := runCLI(t, "serve", "--admin=", "--socket", sock, "--daemon-id", "gw 1")
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(out, `--daemon-id "gw 1"`) {
		t.Fatalf("serve --daemon-id 'gw 1': %v\n%s\nwant exit 2 naming the id", err, out)
	}
}
