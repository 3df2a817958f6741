//go:build !(linux || darwin || dragonfly || freebsd || netbsd || openbsd || solaris || illumos)

package sync

import (
	"crypto/tls"
	"net"
)

// checkable returns c: go-redis checks no idle connection on this system.
func checkable(c *tls.Conn) net.Conn { return c }
