package daemon

import "golang.org/x/sys/unix"

// heldBytes returns how many bytes the stream socket fd holds, received and not read.
func heldBytes(fd int) (int, error) { return unix.IoctlGetInt(fd, unix.SIOCINQ) }
