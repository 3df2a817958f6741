package proto

import (
	"encoding/binary"
	"math"
	"slices"
	"unsafe"
)

// Direct msgpack appenders for the hot path's answer. Each writes the same bytes as the
// msgpack.Encoder method named beside it (the smallest encoding of the value).

// appendUint is msgpack.Encoder.EncodeUint.
func appendUint(b []byte, v uint64) []byte {
	switch {
	case v <= math.MaxInt8:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

// appendStr is msgpack.Encoder.EncodeString.
func appendStr(b []byte, v string) []byte {
	n := len(v)
	switch {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n < 256:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = binary.BigEndian.AppendUint16(append(b, 0xda), uint16(n))
	default:
		b = binary.BigEndian.AppendUint32(append(b, 0xdb), uint32(n))
	}
	return append(b, v...)
}

// appendArrayLen is msgpack.Encoder.EncodeArrayLen.
func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

// The check answer's keys as msgpack fixstrs. String constants, not the fieldName slices:
// appending a constant the compiler knows the size of is a few moves, not a memmove call.
// TestEncodeCheckMatchesMsgpack checks them against msgpack's encoding.
const (
	kID            = "\xa2id"
	kAllowed       = "\xa7allowed"
	kAllowedTrue   = "\xa7allowed\xc3"
	kAllowedFalse  = "\xa7allowed\xc2"
	kRule          = "\xa4rule"
	kLimit         = "\xa5limit"
	kRemaining     = "\xa9remaining"
	kResetMs       = "\xa8reset_ms"
	kRetryAfterMs  = "\xaeretry_after_ms"
	kDegradedTrue  = "\xa8degraded\xc3"
	kDegradedFalse = "\xa8degraded\xc2"
	kRules         = "\xa5rules"
	kName          = "\xa4name"
	kWindowMs      = "\xa9window_ms"
	kShadow        = "\xa6shadow"
	kShadowTrue    = "\xa6shadow\xc3"
	kShadowFalse   = "\xa6shadow\xc2"
	kReason        = "\xa6reason"
	kLease         = "\xa5lease"
	kWarningTrue   = "\xa7warning\xc3"
	kDelayMs       = "\xa8delay_ms"
	kBannedTrue    = "\xa6banned\xc3"
	kUnaskedTrue   = "\xa7unasked\xc3"
)

// The release and renew answers' keys (EncodeRelease, EncodeRenew).
const (
	kReleasedTrue  = "\xa8released\xc3"
	kReleasedFalse = "\xa8released\xc2"
	kRenewedTrue   = "\xa7renewed\xc3"
	kRenewedFalse  = "\xa7renewed\xc2"
	kExpiresMs     = "\xaaexpires_ms"
)

// kConcurrencyTrue is a concurrency rule's entry's field (an addition to v1).
const kConcurrencyTrue = "\xabconcurrency\xc3"

// appendUintField appends the key k and v.
func appendUintField(b []byte, k string, v uint64) []byte {
	return appendUintValue(append(b, k...), v)
}

// appendUintValue is appendUint with a positive fixint (most values) inline.
func appendUintValue(b []byte, v uint64) []byte {
	if v <= 0x7f {
		return append(b, byte(v))
	}
	return appendUint(b, v)
}

func appendStrField(b []byte, k string, v string) []byte {
	return appendStr(append(b, k...), v)
}

// appendBoolField appends kTrue or kFalse: a key with its value, one constant each.
func appendBoolField(b []byte, kTrue, kFalse string, v bool) []byte {
	if v {
		return append(b, kTrue...)
	}
	return append(b, kFalse...)
}

// appendPolicies appends the policy fields that are set: warning, delay_ms, banned
// (policyFields counts them for the map's length).
func appendPolicies(b []byte, warning bool, delayMs uint64, banned bool) []byte {
	if warning {
		b = append(b, kWarningTrue...)
	}
	if delayMs != 0 {
		b = appendUintField(b, kDelayMs, delayMs)
	}
	if banned {
		b = append(b, kBannedTrue...)
	}
	return b
}

// Writers into reserved room, for the hot path's answer (BeginCheck, AppendRuleHead,
// EndCheck). Encoder.room makes sure the buffer's capacity holds what they write past its
// length; they then store at p+i (p the buffer's array, i an index below its capacity)
// with no capacity or bounds check of their own, and return the index after what they
// wrote. Each caller's room is the most its writes can take, counted beside them.

// room returns e's buffer with capacity for at least n bytes past its length.
func (e *Encoder) room(n int) []byte {
	if b := e.buf.b; cap(b)-len(b) >= n {
		return b
	}
	return e.grow(n)
}

// grow is room's slow path, out of line so that its callers' fast paths stay small.
//
//go:noinline
func (e *Encoder) grow(n int) []byte {
	e.buf.b = slices.Grow(e.buf.b, n)
	return e.buf.b
}

// base is the address of b's array: p for the writers.
func base(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

// maxUint is the most putUint writes.
const maxUint = 9

// putUint writes v as msgpack.Encoder.EncodeUint does (its smallest encoding). A
// positive fixint (most values) is one store; a wider value is putUintWide.
func putUint(p unsafe.Pointer, i int, v uint64) int {
	if v <= 0x7f {
		*(*byte)(unsafe.Add(p, i)) = byte(v)
		return i + 1
	}
	return putUintWideCall(p, i, v)
}

// putUintWideCall is putUintWide, not inlined, so that putUint is.
//
//go:noinline
func putUintWideCall(p unsafe.Pointer, i int, v uint64) int { return putUintWide(p, i, v) }

// putUintWide is putUint for v > 0x7f: a tag and 1, 2, 4 or 8 big-endian bytes.
// Small enough to inline, though not within putUint: a function writing several values
// (AppendRuleHeadV1) calls it inline, so that its fast path has no call.
func putUintWide(p unsafe.Pointer, i int, v uint64) int {
	q := unsafe.Add(p, i)
	switch {
	case v <= math.MaxUint8:
		*(*[2]byte)(q) = [2]byte{0xcc, byte(v)}
		return i + 2
	case v <= math.MaxUint16:
		*(*byte)(q) = 0xcd
		binary.BigEndian.PutUint16((*[2]byte)(unsafe.Add(q, 1))[:], uint16(v))
		return i + 3
	case v <= math.MaxUint32:
		*(*byte)(q) = 0xce
		binary.BigEndian.PutUint32((*[4]byte)(unsafe.Add(q, 1))[:], uint32(v))
		return i + 5
	}
	*(*byte)(q) = 0xcf
	binary.BigEndian.PutUint64((*[8]byte)(unsafe.Add(q, 1))[:], v)
	return i + 9
}

// b2u is 1 for true, 0 for false, without a branch: a bool's byte is 0 or 1.
func b2u(v bool) byte { return *(*byte)(unsafe.Pointer(&v)) }

// putBytes writes s (len(s) bytes of room).
func putBytes(p unsafe.Pointer, i int, s []byte) int {
	return i + copy(unsafe.Slice((*byte)(unsafe.Add(p, i)), len(s)), s)
}

// maxStrHead is the most a msgpack string's header takes (str32).
const maxStrHead = 5

// putStr writes s as msgpack.Encoder.EncodeString does: maxStrHead+len(s) bytes of room.
func putStr(p unsafe.Pointer, i int, s string) int {
	n := len(s)
	q := unsafe.Add(p, i)
	switch {
	case n < 32:
		*(*byte)(q) = 0xa0 | byte(n)
		i++
	case n < 256:
		*(*[2]byte)(q) = [2]byte{0xd9, byte(n)}
		i += 2
	case n <= math.MaxUint16:
		*(*byte)(q) = 0xda
		binary.BigEndian.PutUint16((*[2]byte)(unsafe.Add(q, 1))[:], uint16(n))
		i += 3
	default:
		*(*byte)(q) = 0xdb
		binary.BigEndian.PutUint32((*[4]byte)(unsafe.Add(q, 1))[:], uint32(n))
		i += 5
	}
	return i + copy(unsafe.Slice((*byte)(unsafe.Add(p, i)), n), s)
}

// blockSize is the size of a block's single store.
const blockSize = 64

// block is constant bytes an answer copies: with one 64-byte store when they fit in it
// (the bytes past them are room that later writes overwrite or the frame's length leaves
// out), else with a copy.
type block struct {
	a    [blockSize]byte
	b    []byte // the bytes; a holds them too when they fit
	room int    // the room put needs: max(blockSize, len(b))
}

func newBlock(b []byte) block {
	k := block{b: b, room: max(blockSize, len(b))}
	copy(k.a[:], b)
	return k
}

// put writes k's bytes (k.room bytes of room).
func (k *block) put(p unsafe.Pointer, i int) int {
	if len(k.b) <= blockSize {
		*(*[blockSize]byte)(unsafe.Add(p, i)) = k.a
		return i + len(k.b)
	}
	return putBytes(p, i, k.b)
}
