package daemon

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// reloadingFeed is a connection's transport in memory: one read hands out the whole
// stream, then io.EOF; the first write (a flush in the middle of the walk) counts the
// answers it carries and runs reload before it returns, as a rules reload does while a
// flush waits for a client to read.
type reloadingFeed struct {
	data   []byte
	out    bytes.Buffer
	first  int // answers in the first write; -1 before it
	reload func()
}

func (f *reloadingFeed) Read(p []byte) (int, error) {
	if len(f.data) == 0 {
		return 0, io.EOF
	}
	n := copy(p, f.data)
	f.data = f.data[n:]
	return n, nil
}

func (f *reloadingFeed) Write(p []byte) (int, error) {
	if f.first < 0 {
		f.first = 0
		for b := p; len(b) >= proto.HeaderSize; b = b[proto.HeaderSize+int(proto.FrameLength(b)):] {
			f.first++
		}
		f.reload()
	}
	return f.out.Write(p)
}

// TestPrefetchWalkStagesAgainAfterAFlush: a rules reload while a pipelined walk fetching
// ahead waits in a flush (here, as the flush writes; on a socket, a client slow to read
// its answers holds it up to --write-timeout) decides every frame answered after the
// flush, as walkEach does. Before, the two frames walkAhead had staged (decoded and
// prepared) before the flush were decided under the rules replaced, after the reload.
// Not under the race detector, where the store never fetches ahead.
func TestPrefetchWalkStagesAgainAfterAFlush(t *testing.T) {
	const before = `
rules:
  - name: users
    key: user
    limit: { requests: 1000000000, per: 1h }
`
	const after = `
rules:
  - name: users
    key: user
    limit: deny
`
	parse := func(src string) *rules.Set {
		set, err := rules.Parse("rules.yaml", []byte(src))
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	lim := limiter.New(parse(before), localbucket.NewStore(localbucket.Options{PrefetchFrom: 1}))
	s, err := New(Config{Socket: "unused", Clock: fixedClock{}}, lim)
	if err != nil {
		t.Fatal(err)
	}
	s.readBuf = 256 << 10  // the whole stream in one walk
	var d limiter.Decision // a first key: the store holds its PrefetchFrom
	if err := lim.Check(1e18, &limiter.Input{Cost: 1, Attrs: []rules.Attr{{Name: "user", Value: "warm"}}}, &d); err != nil {
		t.Fatal(err)
	}
	if !lim.Prefetching() {
		t.Skip("the store does not fetch ahead here (the race detector, or a platform without prefetch)")
	}
	enc := proto.NewEncoder()
	const frames = 2000 // answers of several flushAt
	for i := range frames {
		enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "u"}}})
	}
	feed := &reloadingFeed{data: bytes.Clone(enc.Bytes()), first: -1, reload: func() { lim.SetRules(parse(after)) }}
	cn := &conn{s: s, dec: proto.NewDecoder(), enc: proto.NewEncoder(), c: socketConn(t), rw: feed, br: bufio.NewReaderSize(feed, s.readBuf)}
	cn.wcond.L = &cn.wmu
	if err := cn.loop(); !errors.Is(err, io.EOF) {
		t.Fatalf("loop: %v, want EOF", err)
	}
	if feed.first <= 0 || feed.first >= frames-2 {
		t.Fatalf("the first flush carried %d answers of %d: not in the middle of the walk", feed.first, frames)
	}
	br := bufio.NewReader(&feed.out)
	dec := proto.NewDecoder()
	var resp proto.Response
	for i := range frames {
		body, err := proto.ReadFrame(br, nil, 1<<20)
		if err != nil {
			t.Fatalf("answer %d: %v", i, err)
		}
		if err := dec.DecodeResponse(body, &resp); err != nil || resp.IsError() {
			t.Fatalf("answer %d: %+v, %v", i, resp, err)
		}
		if want := i < feed.first; resp.Allowed != want {
			t.Fatalf("answer %d (the first flush carried %d, then the rules were reloaded): allowed %v, want %v", i, feed.first, resp.Allowed, want)
		}
	}
}
