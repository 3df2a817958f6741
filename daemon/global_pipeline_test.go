package daemon

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

const globalPipelineRules = `
rules:
  - name: global
    match: { path: /g }
    key: user
    limit: { requests: 1000000, per: 1h }
    mode: global
  - name: local
    match: { path: /l }
    key: user
    limit: { requests: 1000000, per: 1h }
`

// startGlobalServer serves globalPipelineRules with a real redis-server behind the
// global rule (its script calls auto-pipelined, as the daemon runs it).
func startGlobalServer(t *testing.T) *Server {
	return startGlobalServerWith(t, globalPipelineRules, false)
}

// startGlobalServerWith serves yaml with a real redis-server behind its global rules (as
// startGlobalServer); sharedBans: the penalty rules' bans are shared in Redis too.
func startGlobalServerWith(t *testing.T, yaml string, sharedBans bool) *Server {
	t.Helper()
	return startGlobalServerConfig(t, yaml, sharedBans, Config{})
}

// startGlobalServerConfig is startGlobalServerWith with cfg (its Socket set here).
func startGlobalServerConfig(t *testing.T, yaml string, sharedBans bool, cfg Config) *Server {
	t.Helper()
	srv := redistest.StartStandalone(t)
	rdb, err := rlsync.Open(rlsync.Config{URL: "redis://" + srv.Addr, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	set, err := rules.Parse("test.yaml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{})).
		WithGlobal(rlsync.NewGlobal(rdb).WithAutoPipeline(), 5*time.Second)
	if sharedBans {
		bans, err := rlsync.NewBans(rdb, rlsync.DefaultPrefix)
		if err != nil {
			t.Fatal(err)
		}
		lim = lim.WithSharedBans(bans, 5*time.Second)
	}
	dir, err := os.MkdirTemp("", "rlsd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg.Socket = filepath.Join(dir, "s.sock")
	s, err := New(cfg, lim)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); s.Serve() }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Shutdown(ctx)
		<-done
	})
	return s
}

// A client keeping many checks in flight on one connection, global ones (decided on
// goroutines that write the answers themselves) among local ones and pings, while the
// connection reads on: every answer arrives once, in request order. With 200 in flight
// the connection also waits for room (maxPending). Run under -race it also checks the
// write queue shared by the connection and the deciding goroutines.
func TestGlobalPipelineAnswersInOrder(t *testing.T) {
	for _, inflight := range []int{1, 48, 200} {
		t.Run(fmt.Sprint("inflight=", inflight), func(t *testing.T) { testGlobalPipelineInOrder(t, inflight) })
	}
}

func testGlobalPipelineInOrder(t *testing.T, inflight int) {
	s := startGlobalServer(t)
	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const total = 3000
	kind := func(i int) string {
		switch {
		case i%7 == 3:
			return "ping"
		case i%3 == 0:
			return "local"
		}
		return "global"
	}
	frame := func(enc *proto.Encoder, i int) {
		switch kind(i) {
		case "ping":
			enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpPing})
		case "local":
			enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "path", Value: "/l"}, {Name: "user", Value: fmt.Sprint("u", i%50)}}})
		default:
			enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "path", Value: "/g"}, {Name: "user", Value: fmt.Sprint("u", i%50)}}})
		}
	}
	// The writer sends in bursts of varying size, so batches end at every position.
	errc := make(chan error, 1)
	credit := make(chan struct{}, inflight)
	for range inflight {
		credit <- struct{}{}
	}
	go func() {
		enc := proto.NewEncoder()
		for i := 0; i < total; {
			enc.Reset()
			<-credit
			frame(enc, i)
			i++
			for n := i % 5; n > 0 && i < total; n-- {
				select {
				case <-credit:
					frame(enc, i)
					i++
				default:
					n = 0
				}
			}
			if _, err := c.Write(enc.Bytes()); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	br := bufio.NewReader(c)
	dec := proto.NewDecoder()
	var resp proto.Response
	_ = c.SetReadDeadline(time.Now().Add(60 * time.Second))
	for i := 0; i < total; i++ {
		body, err := proto.ReadFrame(br, nil, 1<<20)
		if err != nil {
			t.Fatalf("answer %d: %v", i, err)
		}
		if err := dec.DecodeResponse(body, &resp); err != nil {
			t.Fatal(err)
		}
		if resp.ID != uint64(i) {
			t.Fatalf("answer %d has id %d: out of request order", i, resp.ID)
		}
		switch k := kind(i); k {
		case "ping":
			if resp.Protocol != proto.Version {
				t.Fatalf("answer %d: %+v, want a ping answer", i, resp)
			}
		default:
			if resp.IsError() || !resp.Allowed || resp.Degraded || resp.Rule != k {
				t.Fatalf("answer %d: %+v, want allowed by %s, not degraded", i, resp, k)
			}
		}
		credit <- struct{}{}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// A client that sends global checks and closes without reading its answers: the deciding
// goroutines' writes fail, and the connection is still cleaned up (its slot freed, no
// goroutine left).
func TestGlobalPipelineClientGone(t *testing.T) {
	s := startGlobalServer(t)
	for round := 0; round < 20; round++ {
		c, err := net.Dial("unix", s.cfg.Socket)
		if err != nil {
			t.Fatal(err)
		}
		enc := proto.NewEncoder()
		for i := 0; i < 40; i++ {
			enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "path", Value: "/g"}, {Name: "user", Value: "gone"}}})
		}
		if _, err := c.Write(enc.Bytes()); err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
	waitConns(t, s, 0, 10*time.Second)
}

// A client may write its whole pipeline before reading any answer, global checks
// included: 10,000 of them, among local checks, all answered in order. Each check that
// waits on Redis used to take an entry of the write queue, whose 64 entries stopped the
// connection's reads with far fewer answers held than the 2 MiB an inline pipeline is
// allowed (about 1,200 answers in, the write timeout cut the connection); decided
// entries are now merged, and the bytes bound the queue.
//
// The daemon's write timeout is a minute here, past the client's own 20 s deadlines: a
// daemon that stops reading still fails the test (the client's write times out), but
// one slowed by -race on a loaded machine, still reading, is not cut off by the default
// 5 s while its answers wait (it was, 2 of 4 runs at load 17-22: "writing 10000 checks
// (445878 bytes) before reading: ... broken pipe").
func TestGlobalLongPipelineWrittenBeforeReading(t *testing.T) {
	s := startGlobalServerConfig(t, globalPipelineRules, false, Config{WriteTimeout: time.Minute})
	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const n = 10_000
	enc := proto.NewEncoder()
	for i := range n {
		path := "/g"
		if i%4 == 3 {
			path = "/l"
		}
		enc.EncodeRequest(&proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1,
			Attrs: []proto.Attr{{Name: "path", Value: path}, {Name: "user", Value: fmt.Sprint("u", i%300)}}})
	}
	_ = c.SetWriteDeadline(time.Now().Add(20 * time.Second))
	if _, err := c.Write(enc.Bytes()); err != nil {
		t.Fatalf("writing %d checks (%d bytes) before reading: %v", n, len(enc.Bytes()), err)
	}
	br := bufio.NewReader(c)
	dec := proto.NewDecoder()
	var resp proto.Response
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	for i := range n {
		body, err := proto.ReadFrame(br, nil, 1<<20)
		if err != nil {
			t.Fatalf("answer %d: %v", i, err)
		}
		if err := dec.DecodeResponse(body, &resp); err != nil {
			t.Fatal(err)
		}
		if resp.ID != uint64(i+1) || resp.IsError() || !resp.Allowed || resp.Degraded {
			t.Fatalf("answer %d: %+v", i, resp)
		}
	}
}
