//go:build linux || darwin || dragonfly || freebsd || netbsd || openbsd || solaris || illumos

package sync

import (
	"crypto/tls"
	"errors"
	"net"
	"syscall"
)

// checkable returns c in a form go-redis's pool can check before reusing it. The pool
// peeks at the socket of an idle connection (MSG_PEEK, not waiting) and drops one the
// server has closed, but only when the connection is a socket itself (syscall.Conn),
// which a *tls.Conn is not: after a Redis restart every idle TLS connection answered its
// next call with EOF, 16 a pool, where plain ones were dialed anew
// (TestTLSRestartIdleConns).
//
// go-redis leaves TLS unchecked on purpose: on a RESP3 connection, bytes waiting on the
// socket make it read a reply type through TLS with no deadline, which blocks for good
// when the bytes are a TLS record with no data (a session ticket). So bytes waiting on
// an idle connection make the check fail here, before go-redis reads anything: the
// connection is closed and another dialed, as for one the server closed. (Bytes that
// arrive between the two peeks reach go-redis's read: on an idle connection to Redis,
// whose session tickets come before its first reply, a push is all they can be.) The
// connection's own reads and writes are crypto/tls's, untouched.
func checkable(c *tls.Conn) net.Conn {
	raw, ok := c.NetConn().(syscall.Conn)
	if !ok {
		return c // not a socket: left unchecked, as go-redis leaves it
	}
	return &tlsConn{Conn: c, raw: raw}
}

// tlsConn is a TLS connection whose socket go-redis's pool can check (checkable).
type tlsConn struct {
	*tls.Conn
	raw syscall.Conn
}

// SyscallConn gives the socket for go-redis's check: idle, open, and nothing waiting.
func (c *tlsConn) SyscallConn() (syscall.RawConn, error) {
	rc, err := c.raw.SyscallConn()
	if err != nil {
		return nil, err
	}
	return idleSocket{rc}, nil
}

// errWaiting fails go-redis's check of an idle TLS connection with bytes waiting on its
// socket (see checkable).
var errWaiting = errors.New("redis TLS: bytes waiting on an idle connection")

// idleSocket is a socket whose Read, go-redis's check, fails with errWaiting when bytes
// wait on it, else runs the check: it sees the socket closed (EOF) or open and quiet.
type idleSocket struct{ syscall.RawConn }

func (s idleSocket) Read(check func(fd uintptr) bool) error {
	waiting := false
	if err := s.RawConn.Read(func(fd uintptr) bool {
		var b [1]byte
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		waiting = n > 0 && err == nil
		return true
	}); err != nil {
		return err
	}
	if waiting {
		return errWaiting
	}
	return s.RawConn.Read(check)
}
