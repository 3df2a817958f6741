package connlimit

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// At most max connections are held at once; one past it is closed as it is accepted,
// and a place freed by a close is taken by the next connection.
func TestListener(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := Listener(inner, 2)
	defer ln.Close()
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
