// Package connlimit bounds the connections a listener holds open at once.
package connlimit

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
)

// Listener returns ln accepting at most max connections open at once: past it, a
// connection is closed as soon as it is accepted, and Accept goes on to the next. Each
// connection held is one of the process's descriptors, which its other listeners need
// too: a listener any local user can reach, unbounded, let one process holding idle
// connections up to the descriptor limit make every accept fail (EMFILE).
func Listener(ln net.Listener, max int) net.Listener {
	return &listener{Listener: ln, max: int64(max)}
}

type listener struct {
	net.Listener
	max  int64
	open atomic.Int64
}

func (l *listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.open.Add(1) > l.max {
			l.open.Add(-1)
			c.Close()
			continue
		}
		return &conn{Conn: c, l: l}, nil
	}
}

// conn gives its place back to its listener when closed (once).
type conn struct {
	net.Conn
	l    *listener
	once sync.Once
}

func (c *conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.open.Add(-1) })
	return err
}

// SyscallConn and CloseWrite reach the socket under the wrapper, as they would without
// it: the Envoy transport reads and writes its connections with raw system calls
// (internal/rawio) and shuts a connection's write side first when it closes it
// gracefully. Hidden by the wrapper, the first fell back to net.Conn's reads and the
// second to an immediate close.
func (c *conn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.New("connlimit: the connection has no descriptor")
}

func (c *conn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.New("connlimit: the connection cannot close only its write side")
}
