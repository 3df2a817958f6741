//go:build !linux

package daemon

import "errors"

// heldBytes returns how many bytes the stream socket fd holds, received and not read.
// Not on this platform: a drain answers what it has read already, nothing from the
// socket's buffer.
func heldBytes(fd int) (int, error) { return 0, errors.ErrUnsupported }

// peerClosed reports whether the peer of the stream socket fd has closed its end: not
// known on this platform (false).
func peerClosed(fd int) bool { return false }
