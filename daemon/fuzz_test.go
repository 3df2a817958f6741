package daemon

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// Limits of the server under fuzzing: small, so that inputs reach them.
const (
	fuzzMaxFrame = 1024
	// fuzzReadBuf is the server's read buffer under fuzzing: frames of 257 to 1024 bytes
	// take the path of frames longer than the buffer.
	fuzzReadBuf      = 256
	fuzzFrameTimeout = 50 * time.Millisecond
	// fuzzCloseBound is how long the server may take to close a connection once its input
	// has ended (or stalled mid-frame); generous for the race detector on a busy machine.
	fuzzCloseBound = 3 * time.Second
)

// errorLog records what the server logs at level Error: a recovered panic is logged
// there ("BUG: panic serving a connection").
type errorLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *errorLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *errorLog) take() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.buf.String()
	l.buf.Reset()
	return s
}

// expectation is what the server must answer to a stream of bytes, worked out by the
// same decoder the server uses.
type expectation struct {
	answers []expectedAnswer
	partial bool // the stream ends inside a frame (header or body)
	closes  bool // an oversized header: the server answers it and closes
}

type expectedAnswer struct {
	id   uint64
	code string // error code; "" for a check or ping answer
	op   string // for a non-error: proto.OpCheck or proto.OpPing
}

// expect walks data as the server would: complete frames are answered one each, in
// order; an announced length above the maximum is answered frame_too_large and ends the
// connection; the bytes of an unfinished frame are never answered.
func expect(data []byte) expectation {
	var e expectation
	dec := proto.NewDecoder()
	var req proto.Request
	for len(data) > 0 {
		if len(data) < proto.HeaderSize {
			e.partial = true
			return e
		}
		n := proto.FrameLength(data)
		if n > fuzzMaxFrame {
			e.answers = append(e.answers, expectedAnswer{code: proto.CodeFrameTooLarge})
			e.closes = true
			return e
		}
		if uint32(len(data)-proto.HeaderSize) < n {
			e.partial = true
			return e
		}
		body := data[proto.HeaderSize : proto.HeaderSize+int(n)]
		data = data[proto.HeaderSize+int(n):]
		a := expectedAnswer{}
		if err := dec.DecodeRequest(body, &req); err != nil {
			var pe *proto.Error
			if errors.As(err, &pe) {
				a.code = pe.Code
			} else {
				a.code = proto.CodeInternal
			}
			a.id = req.ID
		} else {
			a.id = req.ID
			switch req.Op {
			case proto.OpCheck, proto.OpPing:
				a.op = req.Op
			default:
				a.code = proto.CodeUnknownOp
			}
		}
		e.answers = append(e.answers, a)
	}
	return e
}

func newFuzzServer(f *testing.F) (*Server, *errorLog) {
	dir, err := os.MkdirTemp("", "rlsf")
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { os.RemoveAll(dir) })
	set, err := rules.Parse("fuzz.yaml", []byte(benchRules))
	if err != nil {
		f.Fatal(err)
	}
	elog := &errorLog{}
	cfg := Config{
		Socket:       filepath.Join(dir, "s.sock"),
		MaxFrame:     fuzzMaxFrame,
		FrameTimeout: fuzzFrameTimeout,
		Logger:       slog.New(slog.NewTextHandler(elog, &slog.HandlerOptions{Level: slog.LevelError})),
	}
	// A small key cap: millions of inputs naming random keys must not grow the process.
	s, err := New(cfg, limiter.New(set, localbucket.NewStore(localbucket.Options{MaxKeys: 1 << 14})))
	if err != nil {
		f.Fatal(err)
	}
	s.readBuf = fuzzReadBuf
	if err := s.Listen(); err != nil {
		f.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve() }()
	f.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
		<-served
	})
	return s, elog
}

func frameOf(req proto.Request) []byte {
	enc := proto.NewEncoder()
	enc.EncodeRequest(&req)
	return append([]byte(nil), enc.Bytes()...)
}

func fuzzSeeds(f *testing.F) {
	check := frameOf(proto.Request{ID: 7, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
		{Name: "method", Value: "POST"}, {Name: "path", Value: "/v1/events/42/holds"},
		{Name: "user", Value: "user-12345"}, {Name: "ip", Value: "203.0.113.9"}}})
	ping := frameOf(proto.Request{ID: 1, Op: proto.OpPing, Cost: 1})
	inline := frameOf(proto.Request{ID: 9, Op: proto.OpCheck, Cost: 0, Limits: []proto.InlineLimit{
		{Key: "k", Limit: 3, WindowMs: 1000, Algorithm: "sliding_window", Name: "n"}, {Key: "bad"}}})
	notUTF8 := frameOf(proto.Request{ID: 10, Op: proto.OpCheck, Cost: 1, Limits: []proto.InlineLimit{
		{Key: "\x8c\x01", Limit: 5, WindowMs: 1000}, {Key: "k2", Name: "n\xff", Limit: 5, WindowMs: 1000}}})
	f.Add(ping)
	f.Add(check)
	f.Add(inline)
	f.Add(notUTF8)
	f.Add(bytes.Join([][]byte{ping, check, inline, ping}, nil))   // pipelined
	f.Add(append(append([]byte(nil), check...), check[:7]...))    // then half a frame
	f.Add(append(append([]byte(nil), ping...), 0, 0))             // then half a header
	f.Add(append(append([]byte(nil), ping...), 0, 1, 0, 1, 0x80)) // then an oversized header
	big := frameOf(proto.Request{ID: 8, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
		{Name: "user", Value: strings.Repeat("u", 600)}, {Name: "ip", Value: "203.0.113.9"}}})
	f.Add(append(append([]byte(nil), big...), ping...))             // longer than the read buffer
	f.Add(append(append([]byte(nil), ping...), big[:400]...))       // then half of a long frame
	f.Add(append(append([]byte(nil), big...), big[:len(big)-1]...)) // one long frame, then most of another
	f.Add([]byte{0, 0, 0, 0})                                       // L = 0
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	data, err := os.ReadFile("../proto/testdata/vectors.json")
	if err != nil {
		f.Fatal(err)
	}
	var vf struct {
		Requests  []struct{ Hex string } `json:"requests"`
		Malformed []struct{ Hex string } `json:"malformed"`
	}
	if err := json.Unmarshal(data, &vf); err != nil {
		f.Fatal(err)
	}
	for _, v := range append(vf.Requests, vf.Malformed...) {
		if b, err := hex.DecodeString(v.Hex); err == nil {
			f.Add(append(b, ping...))
		}
	}
}

// FuzzServeConn writes arbitrary bytes as a client's stream into the real connection
// loop (a Server on a temp socket, MaxFrame 1024, FrameTimeout 50 ms, a read buffer of
// 256 bytes so that longer frames take the large-frame path) and checks that:
// the server does not panic (a recovered panic is logged at level Error) or hang — once
// the input ends, or stalls inside a frame, the connection is closed within a bound;
// every frame it writes is a msgpack map DecodeResponse accepts; it answers exactly the
// complete frames sent (and an oversized header), in order, with their ids and the kind
// of answer the request decoder predicts — never more, and all of them unless the input
// ended inside a frame; afterwards a fresh connection still gets a ping answered and no
// connection is left open. Seeds: below and testdata/fuzz/FuzzServeConn.
//
// An input costs milliseconds (up to the 50 ms frame timeout), so run it with
// -fuzzminimizetime 20x: under the default 60 s of minimizing each new input, a run of
// 3m51s with one worker counted 91 execs, the rest spent minimizing three inputs; with
// 20x, 6 minutes counted 43,774.
func FuzzServeConn(f *testing.F) {
	fuzzSeeds(f)
	s, elog := newFuzzServer(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		want := expect(data)
		// The stream ends by a half-close, except that a stream stalled inside a frame is
		// left open on odd lengths, for the frame timeout to close it.
		halfClose := !want.partial || len(data)%2 == 0
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: s.cfg.Socket, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		wrote := make(chan struct{})
		go func() {
			defer close(wrote)
			// The server may close first (after an oversized header): errors are expected.
			if _, err := c.Write(data); err == nil && halfClose {
				_ = c.CloseWrite()
			}
		}()
		_ = c.SetReadDeadline(time.Now().Add(fuzzCloseBound + time.Second))
		br := bufio.NewReader(c)
		var got []proto.Response
		var body []byte
		dec := proto.NewDecoder()
		start := time.Now()
		for {
			body, err = proto.ReadFrame(br, body, 1<<20)
			if err != nil {
				break
			}
			var resp proto.Response
			if err := dec.DecodeResponse(body, &resp); err != nil {
				t.Fatalf("answer %d is not a valid response (%v): %x", len(got), err, body)
			}
			if s := invalidUTF8(&resp); s != "" {
				t.Fatalf("answer %d holds the string %q, not UTF-8, as a msgpack str: %x", len(got), s, body)
			}
			got = append(got, resp)
			if len(got) > len(want.answers) {
				t.Fatalf("%d answers to %d complete frames: %+v", len(got), len(want.answers), got)
			}
		}
		<-wrote
		// A server closing with input unread resets the connection: also a close.
		if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, syscall.ECONNRESET) {
			// A read deadline here means the server kept the connection open.
			t.Fatalf("after %d answers, the connection did not close within %s: %v", len(got), time.Since(start), err)
		}
		if el := time.Since(start); el > fuzzCloseBound {
			t.Fatalf("the connection took %s to close", el)
		}
		if len(got) < len(want.answers) && !want.partial {
			t.Fatalf("%d answers to %d complete frames (the input ends on a frame boundary)", len(got), len(want.answers))
		}
		for i, r := range got {
			w := want.answers[i]
			if err := matches(&r, w); err != nil {
				t.Fatalf("answer %d: %v: got %+v", i, err, r)
			}
		}
		if msg := elog.take(); msg != "" {
			t.Fatalf("the server logged an error: %s", msg)
		}
		pingAfter(t, s)
	})
}

// invalidUTF8 returns a string of r's that is not valid UTF-8 (a msgpack str is UTF-8, and
// strict decoders refuse the whole answer otherwise), or "".
func invalidUTF8(r *proto.Response) string {
	strs := []string{r.Rule, r.Reason, r.Lease, r.Version, r.Err.Code, r.Err.Message}
	for _, rr := range r.Rules {
		strs = append(strs, rr.Name, rr.Reason)
	}
	for _, s := range strs {
		if !utf8.ValidString(s) {
			return s
		}
	}
	return ""
}

func matches(r *proto.Response, w expectedAnswer) error {
	if r.ID != w.id {
		return fmt.Errorf("id %d, want %d", r.ID, w.id)
	}
	switch {
	case w.code == proto.CodeFrameTooLarge || w.code == proto.CodeBadRequest || w.code == proto.CodeUnknownOp:
		if r.Err.Code != w.code || r.Err.Message == "" {
			return fmt.Errorf("want error %s with a message", w.code)
		}
	case w.code != "":
		return fmt.Errorf("the decoder gave code %q, which the server never sends for a frame", w.code)
	case w.op == proto.OpPing:
		if r.IsError() || r.Protocol != proto.Version || r.Version == "" {
			return errors.New("want a ping answer")
		}
	case w.op == proto.OpCheck:
		// A check decoded by the server is decided, or its inline limits are invalid.
		if r.IsError() && r.Err.Code != proto.CodeInvalidLimit {
			return fmt.Errorf("want a check answer or invalid_limit")
		}
		if !r.IsError() && !r.Allowed && r.Rule == "" {
			return errors.New("rejected without a deciding rule")
		}
	}
	return nil
}

// pingAfter checks that a fresh connection is served and, once it is closed, that the
// server holds no connection.
func pingAfter(t *testing.T, s *Server) {
	t.Helper()
	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(fuzzCloseBound))
	if _, err := c.Write(frameOf(proto.Request{ID: 99, Op: proto.OpPing, Cost: 1})); err != nil {
		t.Fatal(err)
	}
	body, err := proto.ReadFrame(bufio.NewReader(c), nil, 1<<20)
	if err != nil {
		t.Fatalf("ping after the input: %v", err)
	}
	var resp proto.Response
	if err := proto.NewDecoder().DecodeResponse(body, &resp); err != nil || resp.ID != 99 || resp.Protocol != proto.Version {
		t.Fatalf("ping after the input: %+v %v", resp, err)
	}
	c.Close()
	deadline := time.Now().Add(fuzzCloseBound)
	for s.Connections() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections still served after every client closed", s.Connections())
		}
		time.Sleep(100 * time.Microsecond)
	}
}
