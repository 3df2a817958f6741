package daemon

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
)

// batchFeed is a connection's transport in memory: each Read returns one batch of whole
// frames (as a pipelining client's write arrives), until frames frames have been read;
// then io.EOF. Writes are counted, their frames too, and dropped.
type batchFeed struct {
	batch   []byte // perBatch frames, back to back
	frame   int    // the size of one frame
	left    int    // frames still to read
	answers int    // frames written
	writes  int    // write calls
}

func (f *batchFeed) Read(p []byte) (int, error) {
	if f.left == 0 {
		return 0, io.EOF
	}
	n := min(len(f.batch)/f.frame, f.left, len(p)/f.frame)
	f.left -= n
	return copy(p, f.batch[:n*f.frame]), nil
}

func (f *batchFeed) Write(p []byte) (int, error) {
	f.writes++
	for q := p; len(q) > 0; f.answers++ { // the loop writes whole frames
		q = q[4+binary.BigEndian.Uint32(q):]
	}
	return len(p), nil
}

// socketConn returns one end of a real Unix socket pair, for the loop's deadline calls
// (the loop reads and writes through cn.rw, not through it).
func socketConn(tb testing.TB) *net.UnixConn {
	tb.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		tb.Fatal(err)
	}
	var cs [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			tb.Fatal(err)
		}
		cs[i] = c.(*net.UnixConn)
	}
	tb.Cleanup(func() { cs[0].Close(); cs[1].Close() })
	return cs[0]
}

// feedConn returns a connection of a test server whose transport is feed.
func feedConn(tb testing.TB, feed *batchFeed) *conn {
	cn := newTestConn(tb)
	cn.c = socketConn(tb)
	cn.rw = feed
	cn.br = bufio.NewReaderSize(feed, cn.s.readBuf)
	cn.wcond.L = &cn.wmu
	return cn
}

// BenchmarkLoopBatch32 is the connection loop's cost per request under pipelined load:
// the request of BenchmarkHandle, arriving 32 frames per read, answered 32 per write, over
// an in-memory transport (no system call). Minus BenchmarkHandle's, its instructions per
// op are what the loop adds to each request (framing, batching, the clock, the write):
//
//	scripts/instructions ./daemon BenchmarkLoopBatch32 main
func BenchmarkLoopBatch32(b *testing.B) {
	body := checkFrame()
	frame := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	frame = append(frame, body...)
	feed := &batchFeed{batch: bytes.Repeat(frame, 32), frame: len(frame), left: 64}
	cn := feedConn(b, feed)
	if err := cn.loop(); !errors.Is(err, io.EOF) { // the client's keys exist from here
		b.Fatal(err)
	}
	feed.left = b.N
	b.ReportAllocs()
	b.ResetTimer()
	if err := cn.loop(); !errors.Is(err, io.EOF) {
		b.Fatal(err)
	}
	b.StopTimer()
	if feed.answers != 64+b.N {
		b.Fatalf("%d answers to %d requests", feed.answers, 64+b.N)
	}
	b.ReportMetric(float64(64+b.N)/float64(feed.writes), "req/write")
}
