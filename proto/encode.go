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
	buf sink
	enc *msgpack.Encoder
}

// sink is the Encoder's output: an append-only byte slice that never fails. It is what
// the msgpack.Encoder writes to, and constant field names are appended to it directly.
type sink struct{ b []byte }

func (s *sink) Write(p []byte) (int, error)       { s.b = append(s.b, p...); return len(p), nil }
func (s *sink) WriteByte(c byte) error            { s.b = append(s.b, c); return nil }
func (s *sink) WriteString(v string) (int, error) { s.b = append(s.b, v...); return len(v), nil }

// NewEncoder returns an empty Encoder.
func NewEncoder() *Encoder {
	e := &Encoder{}
	e.enc = msgpack.NewEncoder(&e.buf)
	return e
}

// Bytes returns the frames encoded since the last Reset. The slice aliases the buffer.
func (e *Encoder) Bytes() []byte { return e.buf.b }

// Len returns the number of bytes encoded since the last Reset.
func (e *Encoder) Len() int { return len(e.buf.b) }

// Reset empties the buffer, keeping its capacity.
func (e *Encoder) Reset() { e.buf.b = e.buf.b[:0] }

// begin writes a length placeholder and returns where the frame starts.
func (e *Encoder) begin() int {
	start := len(e.buf.b)
	e.buf.b = append(e.buf.b, 0, 0, 0, 0)
	return start
}

// end patches the frame's length prefix.
func (e *Encoder) end(start int) {
	b := e.buf.b
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-HeaderSize))
}

// The msgpack.Encoder writes to a sink, which never fails, so the errors of the calls
// below are always nil and are not checked.

// Field names are constant: each is encoded once, at init, by msgpack, and copied into
// frames as bytes. Values go through the msgpack.Encoder.
type fieldName []byte

func field(name string) fieldName {
	var b bytes.Buffer
	_ = msgpack.NewEncoder(&b).EncodeString(name)
	return b.Bytes()
}

var (
	fID, fOp, fAttrs, fLimits, fCost              = field("id"), field("op"), field("attrs"), field("limits"), field("cost")
	fKey, fLimit, fWindowMs, fBurst, fAlgorithm   = field("key"), field("limit"), field("window_ms"), field("burst"), field("algorithm")
	fMode, fName, fAllowed, fRule, fRemaining     = field("mode"), field("name"), field("allowed"), field("rule"), field("remaining")
	fResetMs, fRetryAfterMs, fDegraded, fRules    = field("reset_ms"), field("retry_after_ms"), field("degraded"), field("rules")
	fShadow, fReason, fVersion, fProtocol, fError = field("shadow"), field("reason"), field("version"), field("protocol"), field("error")
	fCode, fMessage                               = field("code"), field("message")
	fWarning, fDelayMs, fBanned                   = field("warning"), field("delay_ms"), field("banned")
)

func (e *Encoder) str(k fieldName, v string) {
	e.buf.b = append(e.buf.b, k...)
	_ = e.enc.EncodeString(v)
}

func (e *Encoder) uint(k fieldName, v uint64) {
	e.buf.b = append(e.buf.b, k...)
	_ = e.enc.EncodeUint(v)
}

func (e *Encoder) bool(k fieldName, v bool) {
	e.buf.b = append(e.buf.b, k...)
	_ = e.enc.EncodeBool(v)
}

func (e *Encoder) key(k fieldName) { e.buf.b = append(e.buf.b, k...) }

// EncodeCheck appends a check response frame:
// id, allowed, rule, limit, remaining, reset_ms, retry_after_ms, degraded, rules, then
// reason when it is not empty, then warning, delay_ms and banned when set.
func (e *Encoder) EncodeCheck(r *Response) {
	start := e.begin()
	n := 9 + policyFields(r.Warning, r.DelayMs, r.Banned)
	if r.Reason != "" {
		n++
	}
	_ = e.enc.EncodeMapLen(n)
	e.uint(fID, r.ID)
	e.bool(fAllowed, r.Allowed)
	e.str(fRule, r.Rule)
	e.uint(fLimit, r.Limit)
	e.uint(fRemaining, r.Remaining)
	e.uint(fResetMs, r.ResetMs)
	e.uint(fRetryAfterMs, r.RetryAfterMs)
	e.bool(fDegraded, r.Degraded)
	e.key(fRules)
	_ = e.enc.EncodeArrayLen(len(r.Rules))
	for i := range r.Rules {
		rr := &r.Rules[i]
		m := 8 + policyFields(rr.Warning, rr.DelayMs, rr.Banned)
		if rr.Reason != "" {
			m++
		}
		_ = e.enc.EncodeMapLen(m)
		e.str(fName, rr.Name)
		e.uint(fLimit, rr.Limit)
		e.uint(fWindowMs, rr.WindowMs)
		e.uint(fRemaining, rr.Remaining)
		e.uint(fResetMs, rr.ResetMs)
		e.uint(fRetryAfterMs, rr.RetryAfterMs)
		e.bool(fAllowed, rr.Allowed)
		e.bool(fShadow, rr.Shadow)
		if rr.Reason != "" {
			e.str(fReason, rr.Reason)
		}
		e.policies(rr.Warning, rr.DelayMs, rr.Banned)
	}
	if r.Reason != "" {
		e.str(fReason, r.Reason)
	}
	e.policies(r.Warning, r.DelayMs, r.Banned)
	e.end(start)
}

// policyFields counts the policy fields (additions to v1) that are set.
func policyFields(warning bool, delayMs uint64, banned bool) int {
	n := 0
	if warning {
		n++
	}
	if delayMs != 0 {
		n++
	}
	if banned {
		n++
	}
	return n
}

// policies writes the policy fields that are set: warning, delay_ms, banned.
func (e *Encoder) policies(warning bool, delayMs uint64, banned bool) {
	if warning {
		e.bool(fWarning, true)
	}
	if delayMs != 0 {
		e.uint(fDelayMs, delayMs)
	}
	if banned {
		e.bool(fBanned, true)
	}
}

// EncodePing appends a ping response frame: id, version, protocol.
func (e *Encoder) EncodePing(id uint64, version string) {
	start := e.begin()
	_ = e.enc.EncodeMapLen(3)
	e.uint(fID, id)
	e.str(fVersion, version)
	e.uint(fProtocol, Version)
	e.end(start)
}

// EncodeError appends an error response frame: id, error{code, message}.
func (e *Encoder) EncodeError(id uint64, code, message string) {
	start := e.begin()
	_ = e.enc.EncodeMapLen(2)
	e.uint(fID, id)
	e.key(fError)
	_ = e.enc.EncodeMapLen(2)
	e.str(fCode, code)
	e.str(fMessage, message)
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
	e.uint(fID, r.ID)
	e.str(fOp, r.Op)
	if len(r.Attrs) > 0 {
		e.key(fAttrs)
		_ = e.enc.EncodeMapLen(len(r.Attrs))
		for _, a := range r.Attrs {
			_ = e.enc.EncodeString(a.Name)
			_ = e.enc.EncodeString(a.Value)
		}
	}
	if len(r.Limits) > 0 {
		e.key(fLimits)
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
			e.str(fKey, l.Key)
			e.uint(fLimit, l.Limit)
			e.uint(fWindowMs, l.WindowMs)
			if l.Burst != 0 {
				e.uint(fBurst, l.Burst)
			}
			if l.Algorithm != "" {
				e.str(fAlgorithm, l.Algorithm)
			}
			if l.Mode != "" {
				e.str(fMode, l.Mode)
			}
			if l.Name != "" {
				e.str(fName, l.Name)
			}
		}
	}
	if r.Cost != 1 {
		e.uint(fCost, r.Cost)
	}
	e.end(start)
}
