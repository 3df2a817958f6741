package proto

import (
	"encoding/binary"
	"slices"
	"unsafe"
)

// The fast path decodes the request shape every client sends — a fixmap holding id, op,
// cost and attrs (a fixmap of short strings), and limits only when nil — straight from the
// body, without the msgpack.Decoder's per-call overhead. It never produces an error: it
// either decodes the request completely, exactly as the msgpack path would, or it reports
// that it declined, and DecodeRequest runs the msgpack path (the codec of record) from the
// start. So every error message, and every shape it does not know, comes from one place.
//
// It declines on anything unusual: a key that is not a fixstr or is unknown, a key that
// appears twice (at the top level or in attrs), a non-canonical or negative integer, a
// bin where a str belongs, a string over its bound, inline limits, trailing bytes, a
// truncated body. FuzzDecodeFastDifferential checks that whenever it accepts, the msgpack
// path decodes the same request without error.

// Bits of the top-level fields the fast path has seen, to decline a repeated key.
const (
	seenID = 1 << iota
	seenOp
	seenCost
	seenAttrs
	seenLimits
)

// decodeFast decodes body into req (already reset) and reports whether it did. When it
// returns false req holds partial data and the caller must decode again.
func (d *Decoder) decodeFast(body []byte, req *Request) bool {
	if len(body) == 0 || body[0]&0xf0 != 0x80 { // fixmap
		return false
	}
	n := int(body[0] & 0x0f)
	p, i, seen := 1, 0, 0
	// Every client's request starts with id then op (as EncodeRequest writes it): read
	// the two without the key dispatch below, which takes over from the third key, or
	// from the first when the body starts otherwise.
	if n >= 2 && len(body) >= 8 && body[1] == 0xa2 && body[2] == 'i' && body[3] == 'd' {
		if id, q, ok := fastUint(body, 4); ok && q+3 < len(body) && body[q] == 0xa2 && body[q+1] == 'o' && body[q+2] == 'p' {
			if op, r, ok := fastStr(body, q+3, 64); ok {
				req.ID, req.Op = id, op
				p, i, seen = r, 2, seenID|seenOp
			}
		}
	}
	for ; i < n; i++ {
		key, q := fixStr(body, p, 31) // keys must be fixstr (and none is empty)
		if q == p {
			return false
		}
		var ok bool
		p = q
		switch key {
		case "id":
			if seen&seenID != 0 {
				return false
			}
			seen |= seenID
			req.ID, p, ok = fastUint(body, p)
		case "op":
			if seen&seenOp != 0 {
				return false
			}
			seen |= seenOp
			req.Op, p, ok = fastStr(body, p, 64)
		case "cost":
			if seen&seenCost != 0 {
				return false
			}
			seen |= seenCost
			req.Cost, p, ok = fastUint(body, p)
		case "attrs":
			if seen&seenAttrs != 0 {
				return false
			}
			seen |= seenAttrs
			p, ok = d.fastAttrs(body, p, req)
		case "limits":
			if seen&seenLimits != 0 || p >= len(body) || body[p] != 0xc0 { // only nil
				return false
			}
			seen |= seenLimits
			p++
		default:
			return false
		}
		if !ok {
			return false
		}
	}
	return p == len(body) && req.Op != ""
}

func (d *Decoder) fastAttrs(body []byte, p int, req *Request) (int, bool) {
	if p >= len(body) {
		return p, false
	}
	c := body[p]
	if c == 0xc0 { // nil: no attrs
		return p + 1, true
	}
	if c&0xf0 != 0x80 {
		return p, false
	}
	n := int(c & 0x0f)
	if n > d.MaxAttrs {
		return p, false
	}
	p++
	// The common case, a name and a value that are both non-empty fixstrs, in a tight
	// loop; at the first other string the loop hands over to fastAttrsFrom, which reads
	// every string shape, from that attribute on. A tail call: nothing is kept across it,
	// and the loop makes no other call (room for the n attributes is made before it, names
	// are compared byte by byte), so it keeps its state in registers.
	attrs := req.Attrs
	if cap(attrs)-len(attrs) < n {
		attrs = slices.Grow(attrs, n)
	}
	maxName, maxValue := d.MaxAttrNameLen, d.MaxAttrLen
	for i := 0; i < n; i++ {
		if p+1 >= len(body) {
			return p, false // truncated: no name and value fit
		}
		ln := int(body[p]) - 0xa0
		if ln <= 0 || ln >= 32 || ln > maxName || ln >= len(body)-p-1 {
			req.Attrs = attrs
			return d.fastAttrsFrom(body, p, req, i, n)
		}
		q := p + 1 + ln
		lv := int(body[q]) - 0xa0
		if lv <= 0 || lv >= 32 || lv > maxValue || lv >= len(body)-q {
			req.Attrs = attrs
			return d.fastAttrsFrom(body, p, req, i, n)
		}
		name := unsafe.String(&body[p+1], ln)
		value := unsafe.String(&body[q+1], lv)
		p = q + 1 + lv
		for j := range attrs {
			if a := attrs[j].Name; len(a) == ln && sameBytes(a, name) {
				return p, false
			}
		}
		attrs = attrs[:len(attrs)+1] // within the capacity made above
		attrs[len(attrs)-1] = Attr{Name: name, Value: value}
	}
	req.Attrs = attrs
	return p, true
}

// sameBytes reports whether a and b, of equal lengths, are equal: a loop the compiler
// inlines, where a == b is a call (names are short, and most differ at the first byte).
func sameBytes(a, b string) bool {
	for k := 0; k < len(a) && k < len(b); k++ {
		if a[k] != b[k] {
			return false
		}
	}
	return true
}

// fastAttrsFrom reads attributes i to n-1 of an attrs map (those before i are in
// req.Attrs), the next one at body[p:], taking every string shape fastStrLong reads.
func (d *Decoder) fastAttrsFrom(body []byte, p int, req *Request, i, n int) (int, bool) {
	attrs := req.Attrs
	for ; i < n; i++ {
		name, q, ok := fastStr(body, p, d.MaxAttrNameLen)
		if !ok {
			return p, false
		}
		p = q
		value, q, ok := fastStr(body, p, d.MaxAttrLen)
		if !ok {
			return p, false
		}
		p = q
		for j := range attrs {
			if a := attrs[j].Name; len(a) == len(name) && (len(a) == 0 || a[0] == name[0]) && a == name {
				return p, false
			}
		}
		attrs = append(attrs, Attr{Name: name, Value: value})
	}
	req.Attrs = attrs
	return p, true
}

// fastStr reads a fixstr, str8 or str16 of at most maxLen bytes at body[p:] and returns
// it aliasing body, and the position after it. A non-empty fixstr (nearly every string a
// client sends) is read inline; the rest by fastStrLong.
func fastStr(body []byte, p, maxLen int) (string, int, bool) {
	if s, q := fixStr(body, p, maxLen); q > p {
		return s, q, true
	}
	return fastStrLong(body, p, maxLen)
}

// fixStr reads a non-empty fixstr of at most maxLen bytes at body[p:], returning it and
// the position after it; it returns p itself for anything else (fastStr reads it).
// Small enough to be inlined where attributes are read.
func fixStr(body []byte, p, maxLen int) (string, int) {
	if uint(p) < uint(len(body)) {
		if n := int(body[p]) - 0xa0; n > 0 && n < 32 && n <= maxLen && n < len(body)-p {
			return unsafe.String(&body[p+1], n), p + 1 + n
		}
	}
	return "", p
}

func fastStrLong(body []byte, p, maxLen int) (string, int, bool) {
	if p >= len(body) {
		return "", p, false
	}
	c := body[p]
	var n int
	switch {
	case c >= 0xa0 && c <= 0xbf:
		n = int(c & 0x1f)
		p++
	case c == 0xd9:
		if p+2 > len(body) {
			return "", p, false
		}
		n = int(body[p+1])
		p += 2
	case c == 0xda:
		if p+3 > len(body) {
			return "", p, false
		}
		n = int(binary.BigEndian.Uint16(body[p+1:]))
		p += 3
	default:
		return "", p, false
	}
	if n > maxLen || n > len(body)-p {
		return "", p, false
	}
	if n == 0 {
		return "", p, true
	}
	return unsafe.String(&body[p], n), p + n, true
}

// fastUint reads a positive fixint or a uint8/16/32/64 at body[p:].
func fastUint(body []byte, p int) (uint64, int, bool) {
	if p >= len(body) {
		return 0, p, false
	}
	c := body[p]
	switch {
	case c <= 0x7f:
		return uint64(c), p + 1, true
	case c == 0xcc:
		if p+2 > len(body) {
			return 0, p, false
		}
		return uint64(body[p+1]), p + 2, true
	case c == 0xcd:
		if p+3 > len(body) {
			return 0, p, false
		}
		return uint64(binary.BigEndian.Uint16(body[p+1:])), p + 3, true
	case c == 0xce:
		if p+5 > len(body) {
			return 0, p, false
		}
		return uint64(binary.BigEndian.Uint32(body[p+1:])), p + 5, true
	case c == 0xcf:
		if p+9 > len(body) {
			return 0, p, false
		}
		return binary.BigEndian.Uint64(body[p+1:]), p + 9, true
	}
	return 0, p, false
}
