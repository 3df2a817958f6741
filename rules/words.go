package rules

import "slices"

// Short strings (attribute names, values, key literals) are compared, tested and copied
// here a machine word at a time, with no call to the runtime's memequal or memmove: for
// the few bytes a request's attributes hold, the call costs more than the work. Byte
// order does not matter: every test is per byte, and a copy stores a word as it was
// loaded. load64 and load32 (words_*.go) read inside the string only: callers check its
// length first.

const (
	lsb = 0x0101010101010101 // 0x01 in every byte
	msb = 0x8080808080808080 // 0x80 in every byte
)

// shortWord packs s, at most 8 bytes long, into a word such that two strings of the same
// length up to 8 are equal exactly when their words are: 4 to 8 bytes as the two
// (overlapping) 4-byte words at its ends, 1 to 3 as its first, middle and last bytes.
func shortWord(s string) uint64 {
	n := len(s)
	if n >= 4 {
		return uint64(load32(s, 0)) | uint64(load32(s, n-4))<<32
	}
	if n > 0 {
		return uint64(s[0]) | uint64(s[n>>1])<<8 | uint64(s[n-1])<<16
	}
	return 0
}

// lookupShort is Lookup for a name n bytes long, n <= 8, whose shortWord is w: lengths
// are compared first, and a name of the same length by its word (shortWord written out:
// a call per attribute would cost what it saves).
func lookupShort(attrs []Attr, n int, w uint64) (string, bool) {
	for i := range attrs {
		a := &attrs[i]
		if len(a.Name) != n {
			continue
		}
		s := a.Name
		var x uint64
		if n >= 4 {
			x = uint64(load32(s, 0)) | uint64(load32(s, n-4))<<32
		} else if n > 0 {
			x = uint64(s[0]) | uint64(s[n>>1])<<8 | uint64(s[n-1])<<16
		}
		if x == w {
			return a.Value, true
		}
	}
	return "", false
}

// plainWord has the top bit of each byte of x set where that byte is one of - . / 0-9 :
// A-Z a-z, the kept bytes (see keep) bar + @ _ ~, provided no byte of x has its top bit
// set: a value whose words are all plain needs no escaping, and one that is not is
// tested byte by byte. It is two range tests, [-, :] on x and [a, z] on x with A-Z moved
// onto a-z, each the difference of two "byte >= c" tests: x + (0x80-c)*lsb has the top
// bit of each byte set where that byte is >= c (1 <= c <= 0x80), since no byte of x has
// its top bit set and so no sum carries into the next byte.
func plainWord(x uint64) uint64 {
	y := x | 0x20*lsb // A-Z onto a-z; no other byte lands on a-z
	return ((x+(0x80-'-')*lsb)&^(x+(0x80-':'-1)*lsb) | (y+(0x80-'a')*lsb)&^(y+(0x80-'z'-1)*lsb)) & msb
}

// appendPart appends lit, then v escaped by AppendEscaped, then '}' (which closes a key,
// or which the caller drops to go on).
func appendPart(dst []byte, lit, v string) []byte {
	if out, ok := appendPlain(dst, lit, v); ok {
		return out
	}
	if cap(dst)-len(dst) < len(lit)+len(v)+1 && len(v) <= MaxKeyValue { // a longer v is written as its digest
		dst = slices.Grow(dst, len(lit)+len(v)+1)
		if out, ok := appendPlain(dst, lit, v); ok {
			return out
		}
	}
	dst = append(dst, lit...)
	return append(AppendEscaped(dst, v), '}')
}

// appendPlain is appendPart's common case, done with words and no call to grow or to
// escape: a value of at most 16 bytes needing no escaping (tested by plainWord), when dst
// has room; the literal (not empty) is copied by words up to 16 bytes. ok is false, and
// dst untouched, otherwise.
func appendPlain(dst []byte, lit, v string) (_ []byte, ok bool) {
	n, m, k := len(lit), len(v), len(dst)
	if n == 0 || m > 16 || cap(dst)-k < n+m+1 {
		return dst, false
	}
	var v0, v1 uint64
	switch {
	case m >= 8:
		v0, v1 = load64(v, 0), load64(v, m-8)
	case m >= 4:
		v0 = uint64(load32(v, 0)) | uint64(load32(v, m-4))<<32
		v1 = v0
	case m > 0:
		// Bytes 0, m/2 and m-1 (all of them), in the low three lanes; the other lanes
		// copy lane 0 so that they pass or fail with it.
		v0 = uint64(v[0]) * lsb
		v0 = v0&^0xFFFF00 | uint64(v[m>>1])<<8 | uint64(v[m-1])<<16
		v1 = v0
	}
	if m > 0 && ((v0|v1)&msb != 0 || plainWord(v0)&plainWord(v1) != msb) { // a byte to escape, or + @ _ ~
		return dst, false
	}
	// dst[k:k+n+m+1] is in its capacity: stores at offsets checked above.
	dst = dst[:k+n+m+1]
	switch {
	case n > 16:
		copy(dst[k:], lit)
	case n >= 8:
		store64(dst, k, load64(lit, 0))
		store64(dst, k+n-8, load64(lit, n-8))
	case n >= 4:
		store32(dst, k, load32(lit, 0))
		store32(dst, k+n-4, load32(lit, n-4))
	default:
		dst[k], dst[k+n>>1], dst[k+n-1] = lit[0], lit[n>>1], lit[n-1]
	}
	k += n
	switch {
	case m >= 8:
		store64(dst, k, v0)
		store64(dst, k+m-8, v1)
	case m >= 4:
		store32(dst, k, uint32(v0))
		store32(dst, k+m-4, uint32(v0>>32))
	case m > 0:
		dst[k], dst[k+m>>1], dst[k+m-1] = v[0], v[m>>1], v[m-1]
	}
	dst[k+m] = '}'
	return dst, true
}

// words16 returns two words identifying s, at most 16 bytes long, among the strings of
// its length: its first and last 8 bytes, or its shortWord and 0.
func words16(s string) (uint64, uint64) {
	if n := len(s); n >= 8 {
		return load64(s, 0), load64(s, n-8)
	}
	return shortWord(s), 0
}

// word16 is a string of at most 16 bytes compiled for comparing by words (words16); a
// longer string is compared as a string. The zero value is "".
type word16 struct {
	s      string
	w0, w1 uint64
}

func newWord16(s string) word16 {
	w := word16{s: s}
	if len(s) <= 16 {
		w.w0, w.w1 = words16(s)
	}
	return w
}

// eq reports whether s == w.s (words16 written out: one call, not two).
func (w *word16) eq(s string) bool {
	n := len(s)
	if n != len(w.s) {
		return false
	}
	if n < 8 {
		return shortWord(s) == w.w0
	}
	if n <= 16 {
		return load64(s, 0) == w.w0 && load64(s, n-8) == w.w1
	}
	return s == w.s
}
