package proto

import (
	"encoding/binary"
	"math"
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

// appendMapLen is msgpack.Encoder.EncodeMapLen.
func appendMapLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xde), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdf), uint32(n))
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
	kShadowTrue    = "\xa6shadow\xc3"
	kShadowFalse   = "\xa6shadow\xc2"
	kReason        = "\xa6reason"
	kLease         = "\xa5lease"
	kWarningTrue   = "\xa7warning\xc3"
	kDelayMs       = "\xa8delay_ms"
	kBannedTrue    = "\xa6banned\xc3"
)

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
