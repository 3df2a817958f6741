package daemon

import (
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
)

// DefaultSocketPath is where serve listens and check connects when no --socket is given:
// $RLSIDECAR_SOCKET if set; /run/rlsidecar/rlsidecar.sock for root when /run/rlsidecar
// exists (the systemd unit creates it); $XDG_RUNTIME_DIR/rlsidecar.sock; else
// rlsidecar-<uid>.sock in the temp directory. That last one is in a directory every
// local user can write, where another user can create the path first: the daemon warns
// when it serves there (sharedDir) and refuses a file another user owns (ownedByOther).
// `rlsidecar check` computes the same default, and proto/PROTOCOL.md states it, so it
// stays (the Go, Python, Node and Lua clients take the path as a required option).
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

// sharedDir reports whether every local user can create files in dir (/tmp, mode 1777):
// a socket path there can be taken by whoever creates it first.
func sharedDir(dir string) bool {
	fi, err := os.Stat(dir)
	return err == nil && fi.IsDir() && fi.Mode().Perm()&0o002 != 0
}

// ownedByOther returns an error naming the owner of the file fi describes when that is
// neither root nor this process's user: a file another user put at the daemon's path,
// in a directory both can write, is theirs to answer on, not the daemon's to use or
// remove. Root's files are not refused (a daemon run as root before, or a service
// manager's). The error reads after "the file": "belongs to user alice (uid 1001), not
// to this daemon's user (uid 1000)".
func ownedByOther(fi os.FileInfo) error {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	uid, me := int(st.Uid), os.Geteuid()
	if uid == 0 || uid == me {
		return nil
	}
	who := "uid " + strconv.Itoa(uid)
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil {
		who = fmt.Sprintf("user %s (uid %d)", u.Username, uid)
	}
	return fmt.Errorf("belongs to %s, not to this daemon's user (uid %d)", who, me)
}
