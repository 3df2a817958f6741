package daemon

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// batchFeed is a connection's transport in memory: each Read returns the next batch of
// whole frames (as a pipelining client's write arrives), cycling through batches, until
// left frames have been read; then io.EOF. Writes are counted, their frames too, and
// dropped.
type batchFeed struct {
	batches []feedBatch
	next    int // the index of the next batch to read
	left    int // frames still to read
	answers int // frames written
	writes  int // write calls
}

// feedBatch is frames back to back, and where each ends.
type feedBatch struct {
	data []byte
	ends []int
}

// newBatchFeed returns a feed of frames (each a header and a body) in batches of perRead.
func newBatchFeed(frames [][]byte, perRead int) *batchFeed {
	f := &batchFeed{}
	for i := 0; i < len(frames); i += perRead {
		var fb feedBatch
		for _, fr := range frames[i:min(i+perRead, len(frames))] {
			fb.data = append(fb.data, fr...)
			fb.ends = append(fb.ends, len(fb.data))
		}
		f.batches = append(f.batches, fb)
	}
	return f
}

func (f *batchFeed) Read(p []byte) (int, error) {
	if f.left == 0 {
		return 0, io.EOF
	}
	fb := &f.batches[f.next]
	k := min(f.left, len(fb.ends))
	if fb.ends[k-1] > len(p) {
		panic("batchFeed: a batch larger than the reader's buffer")
	}
	f.left -= k
	if f.next++; f.next == len(f.batches) {
		f.next = 0
	}
	return copy(p, fb.data[:fb.ends[k-1]]), nil
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
// op are what the loop adds to each request (framing, batching, the clock, the write),
// plus the transport's own copy and frame count (~20):
//
//	scripts/instructions ./daemon BenchmarkLoopBatch32 main
func BenchmarkLoopBatch32(b *testing.B) {
	body := checkFrame()
	frame := append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
	frames := make([][]byte, 32)
	for i := range frames {
		frames[i] = frame
	}
	benchLoop(b, frames)
}

// BenchmarkLoopBatch32Zipf is BenchmarkLoopBatch32 over real traffic's shape: the
// benchmark's two-rule checks from users drawn from a Zipf distribution over a million
// (s = 1.1: a few hot users, a long tail touched once), each with its own ip and one of 97
// paths, so that the store and the caches work as under a gateway's load.
func BenchmarkLoopBatch32Zipf(b *testing.B) {
	z := rand.NewZipf(rand.New(rand.NewPCG(1, 2)), 1.1, 1, 1_000_000-1)
	frames := make([][]byte, 1<<16)
	enc := proto.NewEncoder()
	for i := range frames {
		frames[i] = userFrame(enc, i, int(z.Uint64()))
	}
	benchLoop(b, frames)
}

// userFrame is the benchmarks' two-rule check of user u (its ip and one of 97 paths
// derived from u) as request id, a header and a body.
func userFrame(enc *proto.Encoder, id, u int) []byte {
	enc.Reset()
	enc.EncodeRequest(&proto.Request{ID: uint64(id), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
		{Name: "method", Value: "POST"},
		{Name: "path", Value: "/v1/events/" + strconv.Itoa(u%97) + "/holds"},
		{Name: "user", Value: "user-" + strconv.Itoa(u)},
		{Name: "ip", Value: "10." + strconv.Itoa(u>>16) + "." + strconv.Itoa(u>>8&255) + "." + strconv.Itoa(u&255)},
	}})
	return bytes.Clone(enc.Bytes())
}

// benchLoop runs the connection loop over frames, 32 per read: once through them all
// (creating their clients' keys), then b.N requests.
func benchLoop(b *testing.B, frames [][]byte) {
	feed := newBatchFeed(frames, 32)
	feed.left = len(frames)
	cn := feedConn(b, feed)
	if err := cn.loop(); !errors.Is(err, io.EOF) {
		b.Fatal(err)
	}
	warm := feed.answers
	feed.left = b.N
	b.ReportAllocs()
	b.ResetTimer()
	if err := cn.loop(); !errors.Is(err, io.EOF) {
		b.Fatal(err)
	}
	b.StopTimer()
	if feed.answers != warm+b.N {
		b.Fatalf("%d answers to %d requests", feed.answers-warm, b.N)
	}
	b.ReportMetric(float64(warm+b.N)/float64(feed.writes), "req/write")
}

// fixedClock is a Clock that does not move: answers then depend on the requests alone.
type fixedClock struct{}

func (fixedClock) Now() (mono, wall int64) { return 1e18, 1e18 }

// chunkFeed is a connection's transport in memory that hands out its stream in the
// given chunks, one per Read (cut to the reader's room), then io.EOF; it keeps what is
// written.
type chunkFeed struct {
	data   []byte
	chunks []int
	out    bytes.Buffer
}

func (f *chunkFeed) Read(p []byte) (int, error) {
	if len(f.data) == 0 {
		return 0, io.EOF
	}
	n := len(f.data)
	if len(f.chunks) > 0 {
		n, f.chunks = min(n, f.chunks[0]), f.chunks[1:]
	}
	n = copy(p, f.data[:n])
	f.data = f.data[n:]
	return n, nil
}

func (f *chunkFeed) Write(p []byte) (int, error) { return f.out.Write(p) }

// TestLoopAnswersAsHandle: whatever the stream's cut into reads, the connection loop
// (walking the frames complete in its buffer, or taking them one at a time by the general
// path when they are cut, longer than the buffer or than the maximum) answers exactly
// the complete frames, in order, with the bytes handle gives each one on its own — and
// refuses an oversized header and stops there. The reference feeds handle frame by frame.
// The loop runs twice: over a store that fetches ahead from its first key (walkAhead:
// frames decoded and prepared before their turn) and over one that never does
// (walkEach). Under the race detector the store never fetches (localbucket's
// prefetching), and both runs are walkEach's: scripts/test runs this test without it too.
func TestLoopAnswersAsHandle(t *testing.T) {
	const readBuf, maxFrame = 256, 1024
	mkconn := func(t *rapid.T, rw io.ReadWriter, prefetchFrom int) *conn {
		set, err := rules.Parse("bench.yaml", []byte(benchRules))
		if err != nil {
			t.Fatal(err)
		}
		s, err := New(Config{Socket: "unused", Clock: fixedClock{}, MaxFrame: maxFrame}, limiter.New(set, localbucket.NewStore(localbucket.Options{PrefetchFrom: prefetchFrom})))
		if err != nil {
			t.Fatal(err)
		}
		s.readBuf = readBuf
		cn := &conn{s: s, dec: proto.NewDecoder(), enc: proto.NewEncoder(), rw: rw, br: bufio.NewReaderSize(rw, readBuf)}
		cn.wcond.L = &cn.wmu
		return cn
	}
	sock := socketConn(t) // for the loop's deadlines
	rapid.Check(t, func(t *rapid.T) {
		var stream []byte
		var bodies [][]byte
		for i := range rapid.IntRange(0, 40).Draw(t, "frames") {
			var body []byte
			switch rapid.IntRange(0, 7).Draw(t, "kind") {
			case 0, 1: // a check, of few users so that some are refused
				u := rapid.IntRange(0, 3).Draw(t, "user")
				body = frameOf(proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: uint64(rapid.IntRange(0, 3).Draw(t, "cost")), Attrs: []proto.Attr{
					{Name: "method", Value: "POST"}, {Name: "path", Value: "/login"},
					{Name: "user", Value: "u" + strconv.Itoa(u)}, {Name: "ip", Value: "10.0.0." + strconv.Itoa(u)}}})[proto.HeaderSize:]
			case 2:
				body = frameOf(proto.Request{ID: uint64(i), Op: proto.OpPing, Cost: 1})[proto.HeaderSize:]
			case 3: // longer than the read buffer
				body = frameOf(proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
					{Name: "user", Value: strings.Repeat("u", rapid.IntRange(200, 900).Draw(t, "len"))}, {Name: "ip", Value: "10.0.0.9"}}})[proto.HeaderSize:]
			case 4: // not a request
				body = rapid.SliceOfN(rapid.Byte(), 0, 40).Draw(t, "junk")
			case 5:
				body = frameOf(proto.Request{ID: uint64(i), Op: "nope", Cost: 1})[proto.HeaderSize:]
			case 6: // the release and renew of a lease no one holds
				op := rapid.SampledFrom([]string{proto.OpRelease, proto.OpRenew}).Draw(t, "op")
				body = frameOf(proto.Request{ID: uint64(i), Op: op, Cost: 1, Lease: "l" + strconv.Itoa(i), LeaseMs: 1000})[proto.HeaderSize:]
			case 7: // a check with an inline limit, now and then a malformed one
				body = frameOf(proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "u1"}},
					Limits: []proto.InlineLimit{{Key: "k", Name: "inline", Limit: uint64(rapid.IntRange(0, 3).Draw(t, "limit")), WindowMs: 60000}}})[proto.HeaderSize:]
			}
			bodies = append(bodies, body)
			stream = binary.BigEndian.AppendUint32(stream, uint32(len(body)))
			stream = append(stream, body...)
		}
		end := rapid.IntRange(0, 2).Draw(t, "end")
		// An oversized header: just over the maximum, or past what a 32-bit int holds.
		oversized := rapid.SampledFrom([]uint32{maxFrame + 1, 1<<31 + 5, 1<<32 - 1}).Draw(t, "oversized")
		switch end {
		case 1: // an oversized header, then bytes never read
			stream = append(binary.BigEndian.AppendUint32(stream, oversized), 1, 2, 3)
		case 2: // a frame cut short
			stream = append(binary.BigEndian.AppendUint32(stream, 50), 0x81)
		}
		// The reference: each complete frame answered by handle on its own.
		ref := mkconn(t, nil, -1)
		for _, body := range bodies {
			ref.handle(body, 1e18)
		}
		if end == 1 {
			ref.enc.EncodeError(0, proto.CodeFrameTooLarge,
				fmt.Sprintf("frame of %d bytes exceeds the maximum of %d; this connection is closed", oversized, maxFrame))
		}
		chunks := rapid.SliceOfN(rapid.IntRange(1, 300), 0, 60).Draw(t, "chunks")
		for _, prefetchFrom := range []int{-1, 1} {
			feed := &chunkFeed{data: stream, chunks: chunks}
			cn := mkconn(t, feed, prefetchFrom)
			cn.c = sock
			err := cn.loop()
			if want := error(io.EOF); end == 1 {
				if err != nil {
					t.Fatalf("loop after an oversized header: %v", err)
				}
			} else if !errors.Is(err, want) {
				t.Fatalf("loop: %v, want EOF", err)
			}
			if !bytes.Equal(feed.out.Bytes(), ref.enc.Bytes()) {
				t.Fatalf("the loop (fetching ahead: %v) answered\n%x\nhandle, frame by frame:\n%x", cn.s.lim.Prefetching(), feed.out.Bytes(), ref.enc.Bytes())
			}
		}
	})
}

// TestLoopAllocs: the connection loop adds no allocation to a pipelined request
// (TestHandleAllocs covers the request's own work).
func TestLoopAllocs(t *testing.T) {
	body := checkFrame()
	frame := append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
	feed := newBatchFeed([][]byte{frame, frame, frame, frame}, 4)
	feed.left = 64
	cn := feedConn(t, feed)
	_ = cn.loop() // the client's keys exist from here
	allocs := testing.AllocsPerRun(20, func() {
		feed.left = 320
		if err := cn.loop(); !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocs per 320 pipelined requests", allocs)
	}
}

// BenchmarkLoopPrefetch: what fetching ahead (walkAhead, localbucket.Store.Prefetch)
// does for pipelined checks over a store too big for the CPU's caches: the benchmark's
// two-rule check from 524,288 users in a random order (1,048,576 keys, each check's two
// keys cold: about 120 MB of records and slots), 32 frames per read, through two
// connections of their own server, one fetching ahead and one not, alternating 32,768
// requests at a time over the same frames once both stores hold every key. It reports
// each one's time per request and their ratio (fetching ahead ÷ not).
//
//	go test -run '^$' -bench 'BenchmarkLoopPrefetch$' -benchtime 2000000x -count 3 ./daemon
func BenchmarkLoopPrefetch(b *testing.B) {
	const users = 1 << 19
	r := rand.New(rand.NewPCG(1, 2))
	frames := make([][]byte, users)
	enc := proto.NewEncoder()
	for i, u := range r.Perm(users) {
		frames[i] = userFrame(enc, i, u)
	}
	type side struct {
		feed *batchFeed
		cn   *conn
		took time.Duration
	}
	mk := func(prefetchFrom int) *side {
		set, err := rules.Parse("bench.yaml", []byte(benchRules))
		if err != nil {
			b.Fatal(err)
		}
		s, err := New(Config{Socket: "unused"}, limiter.New(set, localbucket.NewStore(localbucket.Options{PrefetchFrom: prefetchFrom})))
		if err != nil {
			b.Fatal(err)
		}
		feed := newBatchFeed(frames, 32)
		cn := &conn{s: s, dec: proto.NewDecoder(), enc: proto.NewEncoder(), c: socketConn(b), rw: feed, br: bufio.NewReaderSize(feed, s.readBuf)}
		cn.wcond.L = &cn.wmu
		return &side{feed: feed, cn: cn}
	}
	run := func(sd *side, n int) {
		sd.feed.left = n
		start := time.Now()
		if err := sd.cn.loop(); !errors.Is(err, io.EOF) {
			b.Fatal(err)
		}
		sd.took += time.Since(start)
	}
	on, off := mk(0), mk(-1) // the default, and never
	run(on, users)           // every key stored
	run(off, users)
	if !on.cn.s.lim.Prefetching() {
		b.Skip("the store does not fetch ahead here (the race detector, or a platform without prefetch)")
	}
	on.took, off.took = 0, 0
	b.ResetTimer()
	for done := 0; done < b.N; {
		n := min(32768, b.N-done)
		run(on, n)
		run(off, n)
		done += n
	}
	b.StopTimer()
	b.ReportMetric(float64(on.took.Nanoseconds())/float64(b.N), "prefetch-ns/req")
	b.ReportMetric(float64(off.took.Nanoseconds())/float64(b.N), "plain-ns/req")
	b.ReportMetric(float64(on.took)/float64(off.took), "ratio")
}
