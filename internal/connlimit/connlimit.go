// Package connlimit bounds the connections a listener holds open at once.
package connlimit

import (
	"net"
	"sync"
	"sync/atomic"
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
