package daemon

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// unixPair returns the two ends of a real Unix stream connection: the server's (as the
// daemon accepts it) and the client's.
func unixPair(t *testing.T) (server *net.UnixConn, client *net.UnixConn) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	client, err = net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	server, err = l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close(); client.Close() })
	return server, client
}

func TestRawIOIsUsedOnLinux(t *testing.T) {
	s, _ := unixPair(t)
	if _, ok := newConnIO(s).(*rawIO); !ok {
		t.Fatalf("newConnIO = %T, want *rawIO", newConnIO(s))
	}
}

func TestRawIORead(t *testing.T) {
	cases := []struct {
		name string
		// peer acts on the client end; then the server's reads are checked.
		peer    func(t *testing.T, s, c *net.UnixConn)
		want    string // what reads return before the error
		wantErr error
	}{
		{"data then EOF", func(t *testing.T, s, c *net.UnixConn) {
			c.Write([]byte("hello "))
			go func() { time.Sleep(20 * time.Millisecond); c.Write([]byte("world")); c.Close() }()
		}, "hello world", io.EOF},
		{"deadline", func(t *testing.T, s, c *net.UnixConn) {
			c.Write([]byte("x"))
			s.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
		}, "x", os.ErrDeadlineExceeded},
		{"past deadline wakes a waiting read (Shutdown)", func(t *testing.T, s, c *net.UnixConn) {
			go func() { time.Sleep(20 * time.Millisecond); s.SetReadDeadline(time.Unix(1, 0)) }()
		}, "", os.ErrDeadlineExceeded},
		{"closed by the daemon", func(t *testing.T, s, c *net.UnixConn) {
			go func() { time.Sleep(20 * time.Millisecond); s.Close() }()
		}, "", net.ErrClosed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, c := unixPair(t)
			rw := newConnIO(s)
			tc.peer(t, s, c)
			var got []byte
			buf := make([]byte, 4)
			var err error
			for {
				var n int
				n, err = rw.Read(buf)
				got = append(got, buf[:n]...)
				if err != nil {
					break
				}
				if n == 0 {
					t.Fatal("Read returned 0 bytes and no error")
				}
			}
			if string(got) != tc.want || !errors.Is(err, tc.wantErr) {
				t.Fatalf("read %q, %v; want %q, %v", got, err, tc.want, tc.wantErr)
			}
			if !isClosed(err) {
				t.Fatalf("isClosed(%v) = false: the connection loop would log it as a failure", err)
			}
		})
	}
}

func TestRawIOReadEmptyBuffer(t *testing.T) {
	s, _ := unixPair(t)
	if n, err := newConnIO(s).Read(nil); n != 0 || err != nil {
		t.Fatalf("Read(nil) = %d, %v; want 0, nil without waiting", n, err)
	}
}

// A write larger than the socket's buffer waits for the peer to read, then completes
// with every byte in order.
func TestRawIOWriteLargerThanTheSocketBuffer(t *testing.T) {
	s, c := unixPair(t)
	if err := s.SetWriteBuffer(4096); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 4<<20)
	for i := range want {
		want[i] = byte(i * 7)
	}
	got := make(chan []byte, 1)
	go func() {
		time.Sleep(20 * time.Millisecond) // the writer fills the buffer and waits first
		b, _ := io.ReadAll(c)
		got <- b
	}()
	n, err := newConnIO(s).Write(want)
	if n != len(want) || err != nil {
		t.Fatalf("Write = %d, %v; want %d, nil", n, err, len(want))
	}
	s.Close()
	if b := <-got; !bytes.Equal(b, want) {
		t.Fatalf("the peer read %d bytes, not the %d written in order", len(b), len(want))
	}
}

func TestRawIOWriteErrors(t *testing.T) {
	t.Run("peer gone", func(t *testing.T) {
		s, c := unixPair(t)
		c.Close()
		_, err := newConnIO(s).Write([]byte("answer"))
		if !errors.Is(err, syscall.EPIPE) && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("Write to a closed peer = %v, want EPIPE or ECONNRESET", err)
		}
		if !isClosed(err) {
			t.Fatalf("isClosed(%v) = false", err)
		}
	})
	t.Run("write deadline", func(t *testing.T) {
		s, _ := unixPair(t)
		if err := s.SetWriteBuffer(4096); err != nil {
			t.Fatal(err)
		}
		s.SetWriteDeadline(time.Now().Add(30 * time.Millisecond))
		n, err := newConnIO(s).Write(make([]byte, 4<<20)) // the peer never reads
		if !errors.Is(err, os.ErrDeadlineExceeded) || n >= 4<<20 {
			t.Fatalf("Write to a peer that does not read = %d, %v; want a short write and os.ErrDeadlineExceeded", n, err)
		}
	})
	t.Run("closed", func(t *testing.T) {
		s, _ := unixPair(t)
		rw := newConnIO(s)
		s.Close()
		if _, err := rw.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Write after Close = %v, want net.ErrClosed", err)
		}
	})
}
