package rawio

import (
	"net"
	"os"
	"syscall"
)

// AcceptPending takes, without waiting, up to room connections waiting in the listen
// backlog of ln (nonblocking, as Go's listeners are: an empty backlog is EAGAIN), each
// as a net.Conn of its own in the netpoller. A drain calls it before it closes a socket
// it made, whose close would reset them while their clients may have written requests
// already. The errors are those of connections that could not be made net.Conns (each
// closed).
func AcceptPending(ln syscall.Conn, room int) (conns []net.Conn, errs []error) {
	rc, err := ln.SyscallConn()
	if err != nil || room <= 0 {
		return nil, nil
	}
	var fds []int
	_ = rc.Control(func(fd uintptr) {
		for len(fds) < room {
			nfd, _, err := syscall.Accept(int(fd))
			switch {
			case err == syscall.EINTR || err == syscall.ECONNABORTED:
				continue
			case err != nil:
				return
			}
			fds = append(fds, nfd)
		}
	})
	for _, fd := range fds {
		f := os.NewFile(uintptr(fd), "backlog")
		c, err := net.FileConn(f) // a duplicate, nonblocking, in the netpoller
		f.Close()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		conns = append(conns, c)
	}
	return conns, errs
}
