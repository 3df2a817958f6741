package rawio

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
	if _, ok := New(s, nil).(*rawIO); !ok {
		t.Fatalf("newConnIO = %T, want *rawIO", New(s, nil))
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
			rw := New(s, nil)
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
		})
	}
}

func TestRawIOReadEmptyBuffer(t *testing.T) {
	s, _ := unixPair(t)
	if n, err := New(s, nil).Read(nil); n != 0 || err != nil {
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
	n, err := New(s, nil).Write(want)
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
		_, err := New(s, nil).Write([]byte("answer"))
		if !errors.Is(err, syscall.EPIPE) && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("Write to a closed peer = %v, want EPIPE or ECONNRESET", err)
		}
	})
	t.Run("write deadline", func(t *testing.T) {
		s, _ := unixPair(t)
		if err := s.SetWriteBuffer(4096); err != nil {
			t.Fatal(err)
		}
		s.SetWriteDeadline(time.Now().Add(30 * time.Millisecond))
		n, err := New(s, nil).Write(make([]byte, 4<<20)) // the peer never reads
		if !errors.Is(err, os.ErrDeadlineExceeded) || n >= 4<<20 {
			t.Fatalf("Write to a peer that does not read = %d, %v; want a short write and os.ErrDeadlineExceeded", n, err)
		}
	})
	t.Run("closed", func(t *testing.T) {
		s, _ := unixPair(t)
		rw := New(s, nil)
		s.Close()
		if _, err := rw.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Write after Close = %v, want net.ErrClosed", err)
		}
	})
}

// readN reads from rw until want bytes have come, or fails the test.
func readN(t *testing.T, rw io.Reader, want int) string {
	t.Helper()
	buf := make([]byte, 64)
	var got []byte
	for len(got) < want {
		n, err := rw.Read(buf)
		if err != nil {
			t.Fatalf("Read after %q: %v", got, err)
		}
		got = append(got, buf[:n]...)
	}
	return string(got)
}

func TestBusyPoll(t *testing.T) {
	t.Run("a request arriving while it spins is read at once", func(t *testing.T) {
		sp := NewSpinner(2 * time.Second)
		s, c := unixPair(t)
		go func() { time.Sleep(20 * time.Millisecond); c.Write([]byte("next")) }()
		start := time.Now()
		if got := readN(t, New(s, sp), 4); got != "next" {
			t.Fatalf("read %q", got)
		}
		if el := time.Since(start); el > time.Second {
			t.Fatalf("read took %v: it waited out the budget instead of returning the data", el)
		}
		if sp.Spins() != 1 || sp.Busy() {
			t.Fatalf("spins = %d, busy = %v; want one poll, given back", sp.Spins(), sp.Busy())
		}
	})
	t.Run("past its budget it sleeps in the netpoller and gives the budget back", func(t *testing.T) {
		sp := NewSpinner(5 * time.Millisecond)
		s, c := unixPair(t)
		go func() { time.Sleep(100 * time.Millisecond); c.Write([]byte("late")) }()
		if got := readN(t, New(s, sp), 4); got != "late" {
			t.Fatalf("read %q", got)
		}
		if sp.Busy() {
			t.Fatal("the budget was not given back")
		}
	})
	t.Run("one connection at a time", func(t *testing.T) {
		sp := NewSpinner(500 * time.Millisecond)
		s1, c1 := unixPair(t)
		s2, c2 := unixPair(t)
		done := make(chan string)
		go func() { done <- readN(t, New(s1, sp), 2) }()
		deadline := time.Now().Add(2 * time.Second)
		for !sp.Busy() && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if !sp.Busy() {
			t.Fatal("the first connection never began to poll")
		}
		go func() { time.Sleep(20 * time.Millisecond); c2.Write([]byte("c2")) }()
		if got := readN(t, New(s2, sp), 2); got != "c2" {
			t.Fatalf("second connection read %q", got)
		}
		if n := sp.Spins(); n != 1 {
			t.Fatalf("spins = %d while one connection held the budget; want 1", n)
		}
		c1.Write([]byte("c1"))
		if got := <-done; got != "c1" {
			t.Fatalf("first connection read %q", got)
		}
	})
	t.Run("a deadline is still kept, at most one budget late", func(t *testing.T) {
		sp := NewSpinner(20 * time.Millisecond)
		s, _ := unixPair(t)
		s.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
		_, err := New(s, sp).Read(make([]byte, 4))
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("Read = %v, want os.ErrDeadlineExceeded", err)
		}
	})
}

// TestRawIODoesNotAllocate: a Read or a Write that need not wait allocates nothing (each
// allocated its callback and the state the callback shared with it, three objects and two, on every call).
func TestRawIODoesNotAllocate(t *testing.T) {
	s, c := unixPair(t)
	rw := New(s, nil)
	if _, err := c.Write(make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	one := make([]byte, 1)
	if allocs := testing.AllocsPerRun(200, func() {
		if n, err := rw.Read(one); n != 1 || err != nil {
			t.Fatalf("Read = %d, %v", n, err)
		}
	}); allocs != 0 {
		t.Errorf("%v allocs per Read", allocs)
	}
	answer := []byte("answer")
	if allocs := testing.AllocsPerRun(200, func() {
		if n, err := rw.Write(answer); n != len(answer) || err != nil {
			t.Fatalf("Write = %d, %v", n, err)
		}
	}); allocs != 0 {
		t.Errorf("%v allocs per Write", allocs)
	}
}

// TestRawIOReadWhileWriting: one goroutine may read while another writes (the state of
// each is its own): every byte each way arrives, in order. Run with -race.
func TestRawIOReadWhileWriting(t *testing.T) {
	s, c := unixPair(t)
	rw := New(s, nil)
	const n = 1 << 20
	out := make([]byte, n)
	for i := range out {
		out[i] = byte(i * 13)
	}
	echoed := make(chan []byte, 1)
	go func() { // the peer: sends out, and reads all it is sent
		go func() { c.Write(out) }()
		b, _ := io.ReadAll(c)
		echoed <- b
	}()
	wrote := make(chan error, 1)
	go func() {
		_, err := rw.Write(out)
		wrote <- err
	}()
	got := make([]byte, 0, n)
	buf := make([]byte, 4096)
	for len(got) < n {
		k, err := rw.Read(buf)
		if err != nil {
			t.Fatalf("Read after %d bytes: %v", len(got), err)
		}
		got = append(got, buf[:k]...)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	s.Close()
	if !bytes.Equal(got, out) {
		t.Fatal("the bytes read are not those the peer sent")
	}
	if b := <-echoed; !bytes.Equal(b, out) {
		t.Fatalf("the peer read %d bytes, not the %d written in order", len(b), n)
	}
}
