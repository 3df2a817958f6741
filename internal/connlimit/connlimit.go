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

// Evicting is Listener, but a connection accepted past max first asks evict to close
// one of those held (an idle one, that the server would close anyway later): when it
// reports it did, the new connection takes its place. Without it, connections held
// idle by one process (keep-alive, a request every minute or so) kept every other
// client out for as long as that process liked.
func Evicting(ln net.Listener, max int, evict func() bool) net.Listener {
	return &listener{Listener: ln, max: int64(max), evict: evict}
}

type listener struct {
	net.Listener
	max   int64
	open  atomic.Int64
	evict func() bool // nil: none
}

func (l *listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.open.Add(1) > l.max && !l.makeRoom() {
			c.Close()
			continue
		}
		return &conn{Conn: c, l: l}, nil
	}
}

// makeRoom gives back the place Accept took past max, and has evict close a held
// connection (which gives back its own) to take another; it reports whether it did.
func (l *listener) makeRoom() bool {
	l.open.Add(-1)
	for l.evict != nil && l.evict() {
		if l.open.Add(1) <= l.max {
			return true
		}
		l.open.Add(-1)
	}
	return false
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
