package main

import (
	"fmt"
	"testing"

	"github.com/rlsidecar/rlsidecar/proto"
)

// A client may write its whole pipeline before it reads any answer (PROTOCOL.md:
// "A client may write many requests before reading"), as the simplest client does: one
// blocking write of every frame, then a read of every answer. 30,000 checks that match
// three rules are answered with about 8 MB, more than the socket holds, so the daemon
// must read the requests on while holding their answers. Before, it held at most 2 MiB
// of answers per connection (about 7,500 such checks), then stopped reading; the client,
// blocked writing, never read, and after the write timeout (5 s) the daemon cut it off:
// not one of its 30,000 requests was answered (a scratch client in Python: 7,000 checks
// answered, 8,000 broken pipe after 5 s).
func TestE2EPipelineWrittenWholeBeforeReading(t *testing.T) {
	d := startDaemon(t)
	c := dialRaw(t, d.socket)
	const n = 30_000
	enc := proto.NewEncoder()
	for i := range n {
		enc.EncodeRequest(&proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "ip", Value: fmt.Sprintf("10.1.%d.%d", i/250%250, i%250)},
			{Name: "user", Value: fmt.Sprintf("user-%d", i%5000)},
			{Name: "api_key", Value: fmt.Sprintf("key-%d", i%5000)}}})
	}
	c.write(enc.Bytes()) // all of it, before reading anything
	bytes := 0
	for i := range n {
		frame, err := c.readFrame()
		if err != nil {
			t.Fatalf("answer %d of %d (after %d bytes of answers): %v", i+1, n, bytes, err)
		}
		bytes += len(frame)
		var r proto.Response
		if err := c.dec.DecodeResponse(frame[proto.HeaderSize:], &r); err != nil {
			t.Fatal(err)
		}
		if r.ID != uint64(i+1) || r.Err.Code != "" || len(r.Rules) != 3 {
			t.Fatalf("answer %d: %+v", i+1, r)
		}
	}
	t.Logf("%d checks written before reading: %d bytes of answers, all read", n, bytes)
}
