package daemon

import (
	"bytes"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// heapAfterGC is the bytes of live heap objects once collected.
func heapAfterGC() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// pipelineThenRead writes n checks on c before reading any answer, as the protocol
// allows, then reads their n answers, and leaves c open.
func pipelineThenRead(t *testing.T, c net.Conn, n int) {
	t.Helper()
	batch := bytes.Repeat(frameOf(proto.Request{ID: 7, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "ip", Value: "192.0.2.1"}}}), n)
	errc := make(chan error, 1)
	go func() {
		_ = c.SetWriteDeadline(time.Now().Add(30 * time.Second))
		_, err := c.Write(batch)
		errc <- err
	}()
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	var head [4]byte
	for i := range n {
		if _, err := io.ReadFull(c, head[:]); err != nil {
			t.Fatalf("answer %d: %v", i, err)
		}
		if _, err := io.CopyN(io.Discard, c, int64(head[0])<<24|int64(head[1])<<16|int64(head[2])<<8|int64(head[3])); err != nil {
			t.Fatalf("answer %d: %v", i, err)
		}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// A connection that once pipelined many checks before reading, and then stays open and
// idle (a gateway's pooled connection), keeps no more than a connection that never did:
// the buffers its answers were held in go back to the garbage collector. Before, each
// such connection kept them, about 4 MB (100 connections: 397 MB of RSS for good).
func TestIdleConnectionKeepsNoBurstBuffers(t *testing.T) {
	const conns, checks = 20, 12_000
	s := startServer(t, Config{})
	var cs []net.Conn
	base := heapAfterGC()
	for range conns {
		c, err := net.Dial("unix", s.cfg.Socket)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		// A small socket buffer, so that the daemon holds the answers the client has
		// not read yet, as it does for any client that writes enough before reading.
		_ = c.(*net.UnixConn).SetReadBuffer(4096)
		pipelineThenRead(t, c, checks)
		cs = append(cs, c)
	}
	// Each connection is idle, its answers all read; its queue is empty.
	for end := time.Now().Add(10 * time.Second); s.held.Load() != 0; {
		if time.Now().After(end) {
			t.Fatalf("%d bytes still held after every answer was read", s.held.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	kept := int64(heapAfterGC()) - int64(base)
	const bound = conns * 256 << 10 // the read buffer, an output buffer and a few small entries each, with room
	if kept > bound {
		t.Fatalf("%d idle connections that each once pipelined %d checks keep %d bytes of heap (%d each); want at most %d",
			conns, checks, kept, kept/conns, bound)
	}
	t.Logf("%d idle connections keep %d bytes of heap (%d each)", conns, kept, kept/int64(len(cs)))
}
