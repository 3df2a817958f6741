// Package rawio reads and writes a server's connections with raw system calls on Linux
// (see rawIO), so that a request arriving after an idle gap does not wake the Go
// runtime's sysmon thread on its path, and optionally busy-polls (Spinner). Both
// transports use it: the msgpack socket (daemon) and the Envoy API's native HTTP/2
// server (envoyrls).
package rawio

import (
	"io"
	"syscall"
)

// Conn is what New needs of a connection: *net.UnixConn and *net.TCPConn are Conns.
type Conn interface {
	io.ReadWriter
	SyscallConn() (syscall.RawConn, error)
}
