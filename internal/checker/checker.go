// Package checker is a minimal client of the rlsidecar protocol for tests and
// benchmarks: one connection, one check at a time, every answer decoded and its id
// checked, the round trip measured. (The product's client is clients/go.)
package checker

import (
	"bufio"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// Conn sends checks one at a time on one connection. Not safe for concurrent use.
type Conn struct {
	c   net.Conn
	br  *bufio.Reader
	enc *proto.Encoder
	dec *proto.Decoder
	buf []byte
	id  uint64
}

// Dial connects to a daemon's socket.
func Dial(socket string) (*Conn, error) {
	c, err := net.Dial("unix", socket)
	if err != nil {
		return nil, err
	}
	return &Conn{c: c, br: bufio.NewReader(c), enc: proto.NewEncoder(), dec: proto.NewDecoder()}, nil
}

// Close closes the connection.
func (f *Conn) Close() error { return f.c.Close() }

// Check sends one check of cost 1 with attrs ("name=value" each) and waits at most 5 s
// for its answer. It returns the answer and the round trip; an error response is an error.
func (f *Conn) Check(attrs ...string) (proto.Response, time.Duration, error) {
	req := proto.Request{Op: proto.OpCheck, Cost: 1}
	for _, a := range attrs {
		k, v, _ := strings.Cut(a, "=")
		req.Attrs = append(req.Attrs, proto.Attr{Name: k, Value: v})
	}
	return f.do(&req)
}

// Release releases lease, as Check sends a check.
func (f *Conn) Release(lease string) (proto.Response, time.Duration, error) {
	return f.do(&proto.Request{Op: proto.OpRelease, Lease: lease})
}

// do sends req with the next id and waits at most 5 s for its answer.
func (f *Conn) do(req *proto.Request) (proto.Response, time.Duration, error) {
	f.id++
	req.ID = f.id
	f.enc.Reset()
	f.enc.EncodeRequest(req)
	_ = f.c.SetDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	var resp proto.Response
	if _, err := f.c.Write(f.enc.Bytes()); err != nil {
		return resp, 0, err
	}
	body, err := proto.ReadFrame(f.br, f.buf, 1<<20)
	el := time.Since(start)
	if err != nil {
		return resp, el, err
	}
	f.buf = body[:0]
	if err := f.dec.DecodeResponse(body, &resp); err != nil {
		return resp, el, err
	}
	if resp.ID != f.id {
		return resp, el, fmt.Errorf("answer id %d, want %d", resp.ID, f.id)
	}
	if resp.IsError() {
		return resp, el, fmt.Errorf("error response %s: %s", resp.Err.Code, resp.Err.Message)
	}
	return resp, el, nil
}

// WaitNormal checks attrs until an answer is allowed and not degraded, and returns how
// long that took; an error when it does not come within timeout.
func (f *Conn) WaitNormal(timeout time.Duration, attrs ...string) (time.Duration, error) {
	start := time.Now()
	for {
		r, _, err := f.Check(attrs...)
		if err != nil {
			return time.Since(start), err
		}
		if r.Allowed && !r.Degraded {
			return time.Since(start), nil
		}
		if time.Since(start) > timeout {
			return time.Since(start), fmt.Errorf("%v: no normal (allowed, not degraded) answer within %s: %+v", attrs, timeout, r)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
