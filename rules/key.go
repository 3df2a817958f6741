package rules

import (
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"unsafe"
)

// keep marks the bytes AppendEscaped writes as they are.
var keep = func() (t [256]bool) {
	for c := 'A'; c <= 'Z'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c] = true
	}
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for _, c := range "-._~:@/+" {
		t[c] = true
	}
	return t
}()

// keep8 is keep as 1s and 0s, to test several bytes with one branch.
var keep8 = func() (t [256]uint8) {
	for c, k := range keep {
		if k {
			t[c] = 1
		}
	}
	return t
}()

const upperHex = "0123456789ABCDEF"

// MaxKeyValue is the longest escaping [AppendEscaped] writes out. A value whose escaping
// is longer, which a request can carry up to its frame's size (a gateway's path, a
// header), is written as '=' and the lowercase hex of its SHA-256: keys stay bounded in
// memory and in Redis, and a long value is still limited, by a key of its own. The bound
// is on the escaped bytes, not the value's: each byte escaped takes three, and a value of
// 4,094 bytes of "é" made a key part of 12,282 bytes (a client with a key that size per
// inline limit held 12 KB of the daemon's memory per key).
const MaxKeyValue = 4096

// AppendEscaped appends s to dst, keeping the bytes A-Z a-z 0-9 - . _ ~ : @ / + and
// writing every other byte as %XX (uppercase hex), so "a|b{c}" becomes "a%7Cb%7Bc%7D".
// A value whose escaping would be longer than MaxKeyValue is written as '=' and its
// SHA-256 in hex instead. The
// encoding is injective (an escaped value never holds '=', so no value's escaping is
// another's digest; two digests meet only where SHA-256 collides) and its output never
// contains '{', '}', '|' or '%' other than as the start of an escape, nor '=' other than
// as a digest's mark, which is what keeps client keys unambiguous and hash tags intact.
// It does not allocate when dst has room.
func AppendEscaped(dst []byte, s string) []byte {
	if len(s) > MaxKeyValue {
		return appendDigest(dst, s)
	}
	// The common case is a value with nothing to escape, copied in one append; test its
	// bytes four at a time, one branch each.
	i := 0
	for ; i+4 <= len(s); i += 4 {
		b := s[i : i+4]
		if keep8[b[0]]&keep8[b[1]]&keep8[b[2]]&keep8[b[3]] == 0 {
			break
		}
	}
	for ; i < len(s); i++ {
		if keep8[s[i]] == 0 {
			return appendEscapedFrom(dst, s, i)
		}
	}
	return append(dst, s...)
}

// appendEscapedFrom is AppendEscaped when s[i] is the first byte to escape. It counts
// the bytes to escape first, grows dst once to the exact length (so it allocates only
// when dst has no room for the result), and writes every byte in place.
func appendEscapedFrom(dst []byte, s string, i int) []byte {
	esc := 0
	for j := i; j < len(s); j++ {
		esc += int(keep8[s[j]] ^ 1)
	}
	if len(s)+2*esc > MaxKeyValue {
		return appendDigest(dst, s)
	}
	k := len(dst)
	dst = slices.Grow(dst, len(s)+2*esc)[:k+len(s)+2*esc]
	k += copy(dst[k:], s[:i])
	out := dst[k:]
	o := 0
	for ; i < len(s); i++ {
		c := s[i]
		if keep[c] {
			out[o] = c
			o++
			continue
		}
		out[o], out[o+1], out[o+2] = '%', upperHex[c>>4], upperHex[c&0xF]
		o += 3
	}
	return dst
}

// appendDigest appends '=' and the lowercase hex of s's SHA-256 to dst.
func appendDigest(dst []byte, s string) []byte {
	sum := sha256.Sum256(unsafe.Slice(unsafe.StringData(s), len(s))) // read only: no copy of up to a frame
	dst = append(dst, '=')
	return hex.AppendEncode(dst, sum[:])
}
