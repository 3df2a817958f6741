package proto

import (
	"bytes"
	"encoding/binary"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"
)

// Encoder appends complete frames (length prefix and msgpack body) to an internal buffer,
// so a connection can encode several answers and write them with one syscall. It wraps one
// msgpack.Encoder for its whole life. Not safe for concurrent use.
//
// Field order is fixed (see PROTOCOL.md), so equal messages encode to equal bytes.
type Encoder struct {
	buf   sink
	enc   *msgpack.Encoder
	check int // where the check frame BeginCheck started begins
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

// AppendFrames appends b, whole frames encoded by an Encoder, to e's.
func (e *Encoder) AppendFrames(b []byte) { e.buf.b = append(e.buf.b, b...) }

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
	fID, fOp, fAttrs, fLimits, fCost            = field("id"), field("op"), field("attrs"), field("limits"), field("cost")
	fKey, fLimit, fWindowMs, fBurst, fAlgorithm = field("key"), field("limit"), field("window_ms"), field("burst"), field("algorithm")
	fMode, fName, fVersion, fProtocol, fError   = field("mode"), field("name"), field("version"), field("protocol"), field("error")
	fCode, fMessage                             = field("code"), field("message")
	fLease, fLeaseMs                            = field("lease"), field("lease_ms")
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
// reason when it is not empty, then lease when it is not empty, then warning, delay_ms and
// banned when set (each rule's entry likewise ends with its reason, then its policy fields).
//
// It is BeginCheck, AppendRule per rule and EndCheck; a server that has its rules' results
// elsewhere calls those directly instead of building a Response.
func (e *Encoder) EncodeCheck(r *Response) {
	h := CheckHead{ID: r.ID, Allowed: r.Allowed, Rule: r.Rule, Limit: r.Limit, Remaining: r.Remaining,
		ResetMs: r.ResetMs, RetryAfterMs: r.RetryAfterMs, Degraded: r.Degraded, Reason: r.Reason,
		Lease: r.Lease, Warning: r.Warning, DelayMs: r.DelayMs, Banned: r.Banned}
	e.BeginCheck(&h, len(r.Rules))
	for i := range r.Rules {
		e.AppendRule(&r.Rules[i])
	}
	e.EndCheck(&h)
}

// CheckHead is the top level of a check answer, its rules aside: what BeginCheck and
// EndCheck write. Rule, Limit, Remaining, ResetMs, RetryAfterMs and Reason are the
// deciding rule's (zero when no rule decides); the fields mean what Response's do.
type CheckHead struct {
	ID           uint64
	Allowed      bool
	Degraded     bool
	Warning      bool
	Banned       bool
	Rule         string
	Limit        uint64
	Remaining    uint64
	ResetMs      uint64
	RetryAfterMs uint64
	Reason       string
	Lease        string
	DelayMs      uint64
	// Head, when not nil, is the deciding rule's RuleHead: BeginCheck copies the rule's
	// name and limit from it, pre-encoded, instead of encoding Rule and Limit — when it
	// holds those (the same name and limit; else it is not used). Optional.
	Head *RuleHead
}

// beginRoom is the most BeginCheck writes but the rule's name, limit and the remaining
// key (topRoom with its name): the length (4), the map's length (a fixmap: at most 14
// fields), id, allowed, the rule key, remaining, reset_ms, retry_after_ms, degraded and
// rules, and the array's length.
const (
	beginRoom = 4 + 1 + len(kID) + maxUint + len(kAllowedTrue) + len(kRule) + maxUint +
		len(kResetMs) + maxUint + len(kRetryAfterMs) + maxUint + len(kDegradedTrue) + len(kRules) + 5
	topRoom = maxStrHead + len(kLimit) + maxUint + len(kRemaining)
)

// BeginCheck starts a check response frame: it appends the fields of h up to the rules
// array, announcing n rules. The caller then appends exactly n with AppendRule or
// AppendRuleHead and ends the frame with EndCheck(h), h unchanged; nothing else may be
// encoded in between.
//
// This is the hot path's encoder: it writes msgpack directly (appendfast.go) into the
// output buffer, with no intermediate Response; TestEncodeCheckMatchesMsgpack checks the
// bytes are the ones msgpack/v5 writes.
func (e *Encoder) BeginCheck(h *CheckHead, n int) {
	m := 9
	if h.Reason != "" || h.Lease != "" || h.Warning || h.DelayMs != 0 || h.Banned {
		m += policyFields(h.Warning, h.DelayMs, h.Banned)
		if h.Reason != "" {
			m++
		}
		if h.Lease != "" {
			m++
		}
	}
	top := h.Head
	need := beginRoom + topRoom + len(h.Rule)
	if top != nil && top.limit == h.Limit && sameString(top.name, h.Rule) {
		need = beginRoom + top.top.room
	} else {
		top = nil
	}
	b := e.room(need)
	p, i := base(b), len(b)
	e.check = i
	// The length (patched by EndCheck), the map's, then the id key.
	*(*[8]byte)(unsafe.Add(p, i)) = [8]byte{0, 0, 0, 0, 0x80 | byte(m), kID[0], kID[1], kID[2]}
	i = putUint(p, i+8, h.ID)
	if h.Allowed {
		*(*[len(kAllowedTrue + kRule)]byte)(unsafe.Add(p, i)) = [len(kAllowedTrue + kRule)]byte([]byte(kAllowedTrue + kRule))
	} else {
		*(*[len(kAllowedFalse + kRule)]byte)(unsafe.Add(p, i)) = [len(kAllowedFalse + kRule)]byte([]byte(kAllowedFalse + kRule))
	}
	i += len(kAllowedTrue + kRule)
	if top != nil {
		i = top.top.put(p, i)
	} else {
		i = putStr(p, i, h.Rule)
		*(*[len(kLimit)]byte)(unsafe.Add(p, i)) = [len(kLimit)]byte([]byte(kLimit))
		i = putUint(p, i+len(kLimit), h.Limit)
		*(*[len(kRemaining)]byte)(unsafe.Add(p, i)) = [len(kRemaining)]byte([]byte(kRemaining))
		i += len(kRemaining)
	}
	i = putUint(p, i, h.Remaining)
	i = putResetRetry(p, i, h.ResetMs, h.RetryAfterMs)
	if h.Degraded {
		*(*[len(kDegradedTrue + kRules)]byte)(unsafe.Add(p, i)) = [len(kDegradedTrue + kRules)]byte([]byte(kDegradedTrue + kRules))
	} else {
		*(*[len(kDegradedFalse + kRules)]byte)(unsafe.Add(p, i)) = [len(kDegradedFalse + kRules)]byte([]byte(kDegradedFalse + kRules))
	}
	i += len(kDegradedTrue + kRules)
	if n < 16 {
		*(*byte)(unsafe.Add(p, i)) = 0x90 | byte(n)
		e.buf.b = e.buf.b[:i+1] // the length only: b is e.buf.b
		return
	}
	e.buf.b = appendArrayLen(b[:i], n)
}

// BeginCheckV1 is BeginCheck for an answer of the v1 fields only — no reason, lease or
// policy fields — whose deciding rule's name and limit head holds (the RuleHead of the
// deciding rule's entry): the hot path's common answer, from its values, without a
// CheckHead. The caller appends n rules and ends the frame with EndCheckV1.
func (e *Encoder) BeginCheckV1(id uint64, allowed, degraded bool, head *RuleHead, remaining, resetMs, retryAfterMs uint64, n int) {
	b := e.buf.b
	if cap(b)-len(b) < beginRoom+head.top.room {
		e.beginCheckV1Grow(id, allowed, degraded, head, remaining, resetMs, retryAfterMs, n) // as AppendRuleHeadV1's
		return
	}
	p, i := base(b), len(b)
	e.check = i
	// The length (patched by EndCheckV1), a map of the 9 v1 fields, the id key.
	*(*[8]byte)(unsafe.Add(p, i)) = [8]byte{0, 0, 0, 0, 0x89, kID[0], kID[1], kID[2]}
	// putUint written out, putUintWide inline: no call on the way (no registers to save).
	if i += 8; id <= 0x7f {
		*(*byte)(unsafe.Add(p, i)) = byte(id)
		i++
	} else {
		i = putUintWide(p, i, id)
	}
	*(*[len(kAllowedFalse + kRule)]byte)(unsafe.Add(p, i)) = [len(kAllowedFalse + kRule)]byte([]byte(kAllowedFalse + kRule))
	*(*byte)(unsafe.Add(p, i+len(kAllowed))) = 0xc2 | b2u(allowed)
	i = head.top.put(p, i+len(kAllowedFalse+kRule))
	if remaining <= 0x7f {
		*(*byte)(unsafe.Add(p, i)) = byte(remaining)
		i++
	} else {
		i = putUintWide(p, i, remaining)
	}
	*(*[len(kResetMs)]byte)(unsafe.Add(p, i)) = [len(kResetMs)]byte([]byte(kResetMs))
	if i += len(kResetMs); resetMs <= 0x7f {
		*(*byte)(unsafe.Add(p, i)) = byte(resetMs)
		i++
	} else {
		i = putUintWide(p, i, resetMs)
	}
	*(*[len(kRetryAfterMs)]byte)(unsafe.Add(p, i)) = [len(kRetryAfterMs)]byte([]byte(kRetryAfterMs))
	if i += len(kRetryAfterMs); retryAfterMs <= 0x7f {
		*(*byte)(unsafe.Add(p, i)) = byte(retryAfterMs)
		i++
	} else {
		i = putUintWide(p, i, retryAfterMs)
	}
	*(*[len(kDegradedFalse + kRules)]byte)(unsafe.Add(p, i)) = [len(kDegradedFalse + kRules)]byte([]byte(kDegradedFalse + kRules))
	*(*byte)(unsafe.Add(p, i+len(kDegradedFalse)-1)) = 0xc2 | b2u(degraded)
	i += len(kDegradedFalse + kRules)
	if n < 16 {
		*(*byte)(unsafe.Add(p, i)) = 0x90 | byte(n)
		e.buf.b = e.buf.b[:i+1] // the length only: b is e.buf.b
		return
	}
	e.buf.b = appendArrayLen(b[:i], n)
}

// beginCheckV1Grow is BeginCheckV1 when the buffer needs to grow first.
//
//go:noinline
func (e *Encoder) beginCheckV1Grow(id uint64, allowed, degraded bool, head *RuleHead, remaining, resetMs, retryAfterMs uint64, n int) {
	e.grow(beginRoom + head.top.room)
	e.BeginCheckV1(id, allowed, degraded, head, remaining, resetMs, retryAfterMs, n)
}

// EndCheckV1 completes the frame BeginCheckV1 started.
func (e *Encoder) EndCheckV1() {
	b := e.buf.b
	binary.BigEndian.PutUint32(b[e.check:], uint32(len(b)-e.check-HeaderSize))
}

// sameString is a == b, at once when they are the same string (a rule's name, both).
func sameString(a, b string) bool {
	return len(a) == len(b) && (unsafe.StringData(a) == unsafe.StringData(b) || a == b)
}

// putResetRetry writes the reset_ms and retry_after_ms fields (2 keys and maxUint each).
func putResetRetry(p unsafe.Pointer, i int, resetMs, retryAfterMs uint64) int {
	*(*[len(kResetMs)]byte)(unsafe.Add(p, i)) = [len(kResetMs)]byte([]byte(kResetMs))
	i = putUint(p, i+len(kResetMs), resetMs)
	*(*[len(kRetryAfterMs)]byte)(unsafe.Add(p, i)) = [len(kRetryAfterMs)]byte([]byte(kRetryAfterMs))
	return putUint(p, i+len(kRetryAfterMs), retryAfterMs)
}

// AppendRule appends one entry of the rules array of the check BeginCheck started.
func (e *Encoder) AppendRule(rr *RuleResult) {
	b := append(e.buf.b, ruleMapLen(rr))
	b = appendStrField(b, kName, rr.Name)
	b = appendUintField(b, kLimit, rr.Limit)
	b = appendUintField(b, kWindowMs, rr.WindowMs)
	e.buf.b = appendRuleTail(append(b, kRemaining...), rr)
}

// RuleHead is the part of a rule's entry in check answers that stays the same from one
// answer to the next — its name, limit and window_ms — encoded once; and the same rule's
// name and limit as the deciding rule at the top level (CheckHead.Head). A server keeps
// one per rule and passes it to AppendRuleHead instead of encoding them in every answer.
// It is immutable, so safe for concurrent use. Make it with NewRuleHead.
type RuleHead struct {
	name     string
	limit    uint64
	windowMs uint64
	entry    block // name, limit and window_ms, then the remaining key
	top      block // the name's string, the limit key and value, then the remaining key
}

// NewRuleHead encodes the constant part of a rule's entry. The head keeps name for Is, so
// it must be a string that never changes: a rule's name, not a string decoded from a
// request (those alias the read buffer).
func NewRuleHead(name string, limit, windowMs uint64) *RuleHead {
	b := appendStrField(nil, kName, name)
	b = appendUintField(b, kLimit, limit)
	b = appendUintField(b, kWindowMs, windowMs)
	top := appendStr(nil, name)
	top = append(appendUintField(top, kLimit, limit), kRemaining...)
	return &RuleHead{name: name, limit: limit, windowMs: windowMs,
		entry: newBlock(append(b, kRemaining...)), top: newBlock(top)}
}

// Is reports whether h encodes this name, limit and window.
func (h *RuleHead) Is(name string, limit, windowMs uint64) bool {
	return h.limit == limit && h.windowMs == windowMs && h.name == name
}

// AppendRuleHead is AppendRule for a rule whose name, limit and window_ms h holds:
// rr's Name, Limit and WindowMs are not read, h's are written. The bytes are those of
// AppendRule.
func (e *Encoder) AppendRuleHead(h *RuleHead, rr *RuleResult) {
	start := len(e.buf.b)
	e.AppendRuleHeadV1(h, rr.Remaining, rr.ResetMs, rr.RetryAfterMs, rr.Allowed, rr.Shadow)
	if rr.Reason != "" || rr.Warning || rr.DelayMs != 0 || rr.Banned || rr.Unasked || rr.Concurrency || rr.Degraded {
		e.buf.b[start] = ruleMapLen(rr)
		b := e.buf.b
		if rr.Reason != "" {
			b = appendStrField(b, kReason, rr.Reason)
		}
		b = appendPolicies(b, rr.Warning, rr.DelayMs, rr.Banned)
		if rr.Unasked {
			b = append(b, kUnaskedTrue...)
		}
		if rr.Concurrency {
			b = append(b, kConcurrencyTrue...)
		}
		if rr.Degraded {
			b = append(b, kDegradedTrue...)
		}
		e.buf.b = b
	}
}

// ruleRoom is the most AppendRuleHeadV1 writes but its head: the map's length,
// remaining, reset_ms, retry_after_ms, allowed and shadow.
const ruleRoom = 1 + maxUint + len(kResetMs) + maxUint + len(kRetryAfterMs) + maxUint +
	len(kAllowed) + 1 + len(kShadow) + 1

// AppendRuleHeadV1 is AppendRuleHead for an entry of the v1 fields only — no reason, no
// policy fields (warning, delay_ms, banned) — from its values: the hot path's common
// entry, without a RuleResult.
func (e *Encoder) AppendRuleHeadV1(h *RuleHead, remaining, resetMs, retryAfterMs uint64, allowed, shadow bool) {
	b := e.buf.b
	if cap(b)-len(b) < ruleRoom+h.entry.room {
		// A call after which nothing is live, so that the fast path keeps its arguments
		// in registers.
		e.appendRuleHeadV1Grow(h, remaining, resetMs, retryAfterMs, allowed, shadow)
		return
	}
	p, i := base(b), len(b)
	*(*byte)(unsafe.Add(p, i)) = 0x88 // a map of the 8 v1 fields
	i = h.entry.put(p, i+1)
	// putUint written out, putUintWide inline: no call on the way (no registers to save).
	if remaining <= 0x7f {
		*(*byte)(unsafe.Add(p, i)) = byte(remaining)
		i++
	} else {
		i = putUintWide(p, i, remaining)
	}
	*(*[len(kResetMs)]byte)(unsafe.Add(p, i)) = [len(kResetMs)]byte([]byte(kResetMs))
	if i += len(kResetMs); resetMs <= 0x7f {
		*(*byte)(unsafe.Add(p, i)) = byte(resetMs)
		i++
	} else {
		i = putUintWide(p, i, resetMs)
	}
	*(*[len(kRetryAfterMs)]byte)(unsafe.Add(p, i)) = [len(kRetryAfterMs)]byte([]byte(kRetryAfterMs))
	if i += len(kRetryAfterMs); retryAfterMs <= 0x7f {
		*(*byte)(unsafe.Add(p, i)) = byte(retryAfterMs)
		i++
	} else {
		i = putUintWide(p, i, retryAfterMs)
	}
	*(*[len(kAllowed)]byte)(unsafe.Add(p, i)) = [len(kAllowed)]byte([]byte(kAllowed))
	*(*byte)(unsafe.Add(p, i+len(kAllowed))) = 0xc2 | b2u(allowed)
	i += len(kAllowed) + 1
	*(*[len(kShadow)]byte)(unsafe.Add(p, i)) = [len(kShadow)]byte([]byte(kShadow))
	*(*byte)(unsafe.Add(p, i+len(kShadow))) = 0xc2 | b2u(shadow)
	e.buf.b = e.buf.b[:i+len(kShadow)+1] // the length only: b is e.buf.b
}

// appendRuleHeadV1Grow is AppendRuleHeadV1 when the buffer needs to grow first.
//
//go:noinline
func (e *Encoder) appendRuleHeadV1Grow(h *RuleHead, remaining, resetMs, retryAfterMs uint64, allowed, shadow bool) {
	e.grow(ruleRoom + h.entry.room)
	e.AppendRuleHeadV1(h, remaining, resetMs, retryAfterMs, allowed, shadow)
}

// ruleMapLen is the map header of rr's entry: 8 fields and those set of the others (at
// most 15: a fixmap).
func ruleMapLen(rr *RuleResult) byte {
	m := 8 + policyFields(rr.Warning, rr.DelayMs, rr.Banned)
	if rr.Reason != "" {
		m++
	}
	if rr.Unasked {
		m++
	}
	if rr.Concurrency {
		m++
	}
	if rr.Degraded {
		m++
	}
	return 0x80 | byte(m)
}

// appendRuleTail appends the value of remaining (its key already written) and the fields
// of rr's entry after it.
func appendRuleTail(b []byte, rr *RuleResult) []byte {
	b = appendUintValue(b, rr.Remaining)
	b = appendUintField(b, kResetMs, rr.ResetMs)
	b = appendUintField(b, kRetryAfterMs, rr.RetryAfterMs)
	// Two constants of at most 16 bytes each, which the compiler copies inline (one of
	// 17 bytes would be a call).
	b = appendBoolField(b, kAllowedTrue, kAllowedFalse, rr.Allowed)
	b = appendBoolField(b, kShadowTrue, kShadowFalse, rr.Shadow)
	if rr.Reason != "" {
		b = appendStrField(b, kReason, rr.Reason)
	}
	if rr.Warning || rr.DelayMs != 0 || rr.Banned {
		b = appendPolicies(b, rr.Warning, rr.DelayMs, rr.Banned)
	}
	if rr.Unasked {
		b = append(b, kUnaskedTrue...)
	}
	if rr.Concurrency {
		b = append(b, kConcurrencyTrue...)
	}
	if rr.Degraded {
		b = append(b, kDegradedTrue...)
	}
	return b
}

// EndCheck appends the fields of h after the rules array and completes the frame.
func (e *Encoder) EndCheck(h *CheckHead) {
	b := e.buf.b
	if h.Reason != "" || h.Lease != "" || h.Warning || h.DelayMs != 0 || h.Banned {
		if h.Reason != "" {
			b = appendStrField(b, kReason, h.Reason)
		}
		if h.Lease != "" {
			b = appendStrField(b, kLease, h.Lease)
		}
		if h.Warning || h.DelayMs != 0 || h.Banned {
			b = appendPolicies(b, h.Warning, h.DelayMs, h.Banned)
		}
		e.buf.b = b
	}
	binary.BigEndian.PutUint32(b[e.check:], uint32(len(b)-e.check-HeaderSize))
}

// EncodeRelease appends a release response frame: id, released. Written directly, as
// the check answer is (TestEncodeReleaseRenewMatchMsgpack).
func (e *Encoder) EncodeRelease(id uint64, released bool) {
	b := append(e.buf.b, 0, 0, 0, 0, 0x82)
	start := len(b) - 5
	b = appendUintField(b, kID, id)
	b = appendBoolField(b, kReleasedTrue, kReleasedFalse, released)
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-HeaderSize))
	e.buf.b = b
}

// EncodeRenew appends a renew response frame: id, renewed, expires_ms. Written
// directly, as EncodeRelease.
func (e *Encoder) EncodeRenew(id uint64, renewed bool, expiresMs uint64) {
	b := append(e.buf.b, 0, 0, 0, 0, 0x83)
	start := len(b) - 5
	b = appendUintField(b, kID, id)
	b = appendBoolField(b, kRenewedTrue, kRenewedFalse, renewed)
	b = appendUintField(b, kExpiresMs, expiresMs)
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-HeaderSize))
	e.buf.b = b
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
// limits (when any), cost (when it is not 1), lease and lease_ms (when set). Each inline limit carries key, limit,
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
	if r.Lease != "" {
		n++
	}
	if r.LeaseMs != 0 {
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
	if r.Lease != "" {
		e.str(fLease, r.Lease)
	}
	if r.LeaseMs != 0 {
		e.uint(fLeaseMs, r.LeaseMs)
	}
	e.end(start)
}
