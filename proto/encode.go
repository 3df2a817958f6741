package proto

import (
	"bytes"
	"encoding/binary"

	"github.com/vmihailenco/msgpack/v5"
)

// Encoder appends complete frames (length prefix and msgpack body) to an internal buffer,
// so a connection can encode several answers and write them with one syscall. It wraps one
// msgpack.Encoder for its whole life. Not safe for concurrent use.
//
// Field order is fixed (see PROTOCOL.md), so equal messages encode to equal bytes.
type Encoder struct {
	buf bytes.Buffer
	enc *msgpack.Encoder
}

// NewEncoder returns an empty Encoder.
func NewEncoder() *Encoder {
	e := &Encoder{}
	e.enc = msgpack.NewEncoder(&e.buf)
	return e
}

// Bytes returns the frames encoded since the last Reset. The slice aliases the buffer.
func (e *Encoder) Bytes() []byte { return e.buf.Bytes() }

// Len returns the number of bytes encoded since the last Reset.
func (e *Encoder) Len() int { return e.buf.Len() }

// Reset empties the buffer, keeping its capacity.
func (e *Encoder) Reset() { e.buf.Reset() }

// begin writes a length placeholder and returns where the frame starts.
func (e *Encoder) begin() int {
	start := e.buf.Len()
	e.buf.Write([]byte{0, 0, 0, 0})
	return start
}

// end patches the frame's length prefix.
func (e *Encoder) end(start int) {
	b := e.buf.Bytes()
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-HeaderSize))
}

// The msgpack.Encoder writes to a bytes.Buffer, which never fails, so the errors of the
// calls below are always nil and are not checked.

func (e *Encoder) str(k, v string) {
	_ = e.enc.EncodeString(k)
	_ = e.enc.EncodeString(v)
}

func (e *Encoder) uint(k string, v uint64) {
	_ = e.enc.EncodeString(k)
	_ = e.enc.EncodeUint(v)
}

func (e *Encoder) bool(k string, v bool) {
	_ = e.enc.EncodeString(k)
	_ = e.enc.EncodeBool(v)
}

// EncodeCheck appends a check response frame:
// id, allowed, rule, limit, remaining, reset_ms, retry_after_ms, degraded, rules, then
// reason when it is not empty.
func (e *Encoder) EncodeCheck(r *Response) {
	start := e.begin()
	n := 9
	if r.Reason != "" {
		n++
	}
	_ = e.enc.EncodeMapLen(n)
	e.uint("id", r.ID)
	e.bool("allowed", r.Allowed)
	e.str("rule", r.Rule)
	e.uint("limit", r.Limit)
	e.uint("remaining", r.Remaining)
	e.uint("reset_ms", r.ResetMs)
	e.uint("retry_after_ms", r.RetryAfterMs)
	e.bool("degraded", r.Degraded)
	_ = e.enc.EncodeString("rules")
	_ = e.enc.EncodeArrayLen(len(r.Rules))
	for i := range r.Rules {
		rr := &r.Rules[i]
		m := 8
		if rr.Reason != "" {
			m++
		}
		_ = e.enc.EncodeMapLen(m)
		e.str("name", rr.Name)
		e.uint("limit", rr.Limit)
		e.uint("window_ms", rr.WindowMs)
		e.uint("remaining", rr.Remaining)
		e.uint("reset_ms", rr.ResetMs)
		e.uint("retry_after_ms", rr.RetryAfterMs)
		e.bool("allowed", rr.Allowed)
		e.bool("shadow", rr.Shadow)
		if rr.Reason != "" {
			e.str("reason", rr.Reason)
		}
	}
	if r.Reason != "" {
		e.str("reason", r.Reason)
	}
	e.end(start)
}

// EncodePing appends a ping response frame: id, version, protocol.
func (e *Encoder) EncodePing(id uint64, version string) {
	start := e.begin()
	_ = e.enc.EncodeMapLen(3)
	e.uint("id", id)
	e.str("version", version)
	e.uint("protocol", Version)
	e.end(start)
}

// EncodeError appends an error response frame: id, error{code, message}.
func (e *Encoder) EncodeError(id uint64, code, message string) {
	start := e.begin()
	_ = e.enc.EncodeMapLen(2)
	e.uint("id", id)
	_ = e.enc.EncodeString("error")
	_ = e.enc.EncodeMapLen(2)
	e.str("code", code)
	e.str("message", message)
	e.end(start)
}

// EncodeRequest appends a request frame: id, op, attrs (when any, in the given order),
// limits (when any), cost (when it is not 1). Each inline limit carries key, limit,
// window_ms, then burst, algorithm, mode and name when set.
func (e *Encoder) EncodeRequest(r *Request) {
	start := e.begin()
	n := 2
	if len(r.Attrs) > 0 {
		n++
	}
	if len(r.Limits) > 0 {
		n++
	}
	if r.Cost != 1 {
		n++
	}
	_ = e.enc.EncodeMapLen(n)
	e.uint("id", r.ID)
	e.str("op", r.Op)
	if len(r.Attrs) > 0 {
		_ = e.enc.EncodeString("attrs")
		_ = e.enc.EncodeMapLen(len(r.Attrs))
		for _, a := range r.Attrs {
			e.str(a.Name, a.Value)
		}
	}
	if len(r.Limits) > 0 {
		_ = e.enc.EncodeString("limits")
		_ = e.enc.EncodeArrayLen(len(r.Limits))
		for i := range r.Limits {
			l := &r.Limits[i]
			m := 3
			for _, set := range [...]bool{l.Burst != 0, l.Algorithm != "", l.Mode != "", l.Name != ""} {
				if set {
					m++
				}
			}
			_ = e.enc.EncodeMapLen(m)
			e.str("key", l.Key)
			e.uint("limit", l.Limit)
			e.uint("window_ms", l.WindowMs)
			if l.Burst != 0 {
				e.uint("burst", l.Burst)
			}
			if l.Algorithm != "" {
				e.str("algorithm", l.Algorithm)
			}
			if l.Mode != "" {
				e.str("mode", l.Mode)
			}
			if l.Name != "" {
				e.str("name", l.Name)
			}
		}
	}
	if r.Cost != 1 {
		e.uint("cost", r.Cost)
	}
	e.end(start)
}
