package daemon

import "golang.org/x/sys/unix"

// heldBytes returns how many bytes the stream socket fd holds, received and not read.
func heldBytes(fd int) (int, error) { return unix.IoctlGetInt(fd, unix.SIOCINQ) }

// peerClosed reports whether the peer of the stream socket fd, whose read side this end
// has shut, has closed its end: poll says hang-up (both directions shut) only then.
func peerClosed(fd int) bool {
	p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(p, 0)
	return err == nil && n > 0 && p[0].Revents&unix.POLLHUP != 0
}
