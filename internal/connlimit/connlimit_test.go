package connlimit

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// listen returns a loopback TCP listener and it capped at max, closed when t ends.
func listen(t *testing.T, max int) (inner, capped net.Listener) {
	t.Helper()
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	capped = Listener(inner, max)
	t.Cleanup(func() { capped.Close() })
	return inner, capped
}

// At most max connections are held at once; one past it is closed as it is accepted,
// and a place freed by a close is taken by the next connection.
func TestListener(t *testing.T) {
	inner, ln := listen(t, 2)
	accepted := make(chan net.Conn, 10)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// open reports whether the server holds c: a read waits rather than ending.
	open := func(c net.Conn) bool {
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		return errors.Is(err, os.ErrDeadlineExceeded)
	}
	a, b := dial(), dial()
	first, second := <-accepted, <-accepted
	if third := dial(); open(third) {
		t.Fatal("a third connection held with a cap of 2")
	} else if err := func() error { _, err := third.Read(make([]byte, 1)); return err }(); err != io.EOF {
		t.Fatalf("the third connection: %v, want closed (EOF)", err)
	}
	if !open(a) || !open(b) {
		t.Fatal("the first two connections were not held")
	}
	first.Close()
	first.Close() // a second close gives nothing back twice
	c := dial()
	got := <-accepted
	if !open(c) {
		t.Fatal("a connection after one closed was not held")
	}
	if d := dial(); open(d) {
		t.Fatal("a fourth connection held with two open")
	}
	second.Close()
	got.Close()
}

// A connection held reaches its socket's descriptor and can close its write side alone,
// as the socket itself can.
func TestConnReachesTheSocket(t *testing.T) {
	inner, ln := listen(t, 2)
	client, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sc, ok := c.(syscall.Conn)
	if !ok {
		t.Fatal("the connection does not offer SyscallConn")
	}
	if _, err := sc.SyscallConn(); err != nil {
		t.Fatalf("SyscallConn: %v", err)
	}
	cw, ok := c.(interface{ CloseWrite() error })
	if !ok {
		t.Fatal("the connection does not offer CloseWrite")
	}
	if err := cw.CloseWrite(); err != nil {
		t.Fatalf("CloseWrite: %v", err)
	}
	client.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := client.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("the client read %v after CloseWrite, want EOF", err)
	}
	if _, err := client.Write([]byte("x")); err != nil { // the read side is still open
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 1 || err != nil {
		t.Fatalf("the server read %d, %v after CloseWrite", n, err)
	}
}
