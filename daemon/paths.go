package daemon

import (
	"os"
	"path/filepath"
	"strconv"
)

// DefaultSocketPath is where serve listens and check connects when no --socket is given:
// $RLSIDECAR_SOCKET if set; /run/rlsidecar/rlsidecar.sock for root when /run/rlsidecar
// exists (the systemd unit creates it); $XDG_RUNTIME_DIR/rlsidecar.sock; else
// rlsidecar-<uid>.sock in the temp directory.
func DefaultSocketPath() string {
	if p := os.Getenv("RLSIDECAR_SOCKET"); p != "" {
		return p
	}
	if os.Geteuid() == 0 {
		if fi, err := os.Stat("/run/rlsidecar"); err == nil && fi.IsDir() {
			return "/run/rlsidecar/rlsidecar.sock"
		}
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "rlsidecar.sock")
	}
	return filepath.Join(os.TempDir(), "rlsidecar-"+strconv.Itoa(os.Getuid())+".sock")
}
