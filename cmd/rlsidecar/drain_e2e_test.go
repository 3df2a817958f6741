package main

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// drainRules make every answer long (four rules in rules[]), so that the answers to a
// pipelined batch fill the socket's buffer towards the client long before the requests
// are all read: at SIGTERM most of the batch is still in the socket, written by the
// client but not yet read by the daemon.
const drainRules = `rules:
  - { name: drain-user-a, key: user, limit: { requests: 100000, per: 1h } }
  - { name: drain-user-b, key: user, limit: { requests: 100000, per: 1m } }
  - { name: drain-user-c, key: user, limit: { requests: 100000, per: 1s } }
  - { name: drain-user-d, key: user, algorithm: sliding_window, limit: { requests: 100000, per: 1h } }
`

// SIGTERM answers every request a client wrote before it, including the frames still
// in the socket's buffer, not only those the daemon had already read: PROTOCOL.md's
// "in flight". Before, the drain answered what its 16 KiB read buffer held and closed
// the connection on the rest (here about 500 of 1,000 answered, then ECONNRESET), so a
// gateway pipelining at the moment of a restart got an error for requests it had sent.
func TestE2ESigtermAnswersWhatTheSocketHolds(t *testing.T) {
	dir := shortTempDir(t)
	d := startDaemon(t, "--config", writeFile(t, dir, "rules.yaml", drainRules))
	c := dialRaw(t, d.socket)
	// The whole batch fits the client's send buffer whatever the daemon does, so the
	// write below completes before the signal.
	if err := c.c.(*net.UnixConn).SetWriteBuffer(1 << 20); err != nil {
		t.Fatal(err)
	}
	// One round trip first: the daemon has accepted the connection (a connection still in
	// the listen backlog at SIGTERM is another case: TestE2ESigtermServesTheBacklog).
	c.send(&proto.Request{ID: 0, Op: proto.OpPing})
	if r := c.recv(); r.Err.Code != "" {
		t.Fatalf("ping: %+v", r.Err)
	}
	const n = 1000
	enc := proto.NewEncoder()
	for i := 1; i <= n; i++ {
		enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "drain"}}})
	}
	if len(enc.Bytes()) > 100<<10 {
		t.Fatalf("the batch is %d bytes: it must fit a socket buffer", len(enc.Bytes()))
	}
	c.write(enc.Bytes()) // every request is now in the daemon's hands: read or in its socket
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= n; i++ {
		frame, err := c.readFrame()
		if err != nil {
			t.Fatalf("answer %d of %d: %v (the drain dropped requests written before SIGTERM)\n%s", i, n, err, d.stderr.String())
		}
		var r proto.Response
		if err := c.dec.DecodeResponse(frame[proto.HeaderSize:], &r); err != nil {
			t.Fatal(err)
		}
		if r.ID != uint64(i) || r.Err.Code != "" || !r.Allowed || len(r.Rules) != 4 {
			t.Fatalf("answer %d: id %d, error %q, allowed %v, %d rules", i, r.ID, r.Err.Code, r.Allowed, len(r.Rules))
		}
	}
	// Then the connection ends cleanly: nothing more, no reset.
	if _, err := c.readFrame(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the last answer: %v, want EOF", err)
	}
	select {
	case err := <-d.done:
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, d.stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("daemon did not exit within 10s of SIGTERM")
	}
	if _, err := os.Stat(d.socket); !os.IsNotExist(err) {
		t.Fatalf("socket file left behind: %v", err)
	}
}
