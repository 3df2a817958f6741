package proto

import (
	"encoding/binary"
	"slices"
	"unsafe"
)

// The fast paths decode the request shape every client sends — a fixmap holding id, op,
// cost and attrs (a fixmap of short strings), and limits only when nil; for a release or
// a renew, id, op, lease and lease_ms (decodeFast) — straight from the body, without the
// msgpack.Decoder's per-call overhead. They never produce an error themselves: each
// either decodes the request completely, exactly as the msgpack path would, or declines,
// and the msgpack path (the codec of record) decodes it from the start. So every error
// message, and every shape they do not know, comes from one place.
//
// There are two, each declining to the next: DecodeRequest's straight path reads the order
// clients write (id, op, attrs, cost) in one line; decodeFast reads the same keys in any
// order. Both read attributes with fixAttrs, a loop without calls; where it stops,
// decodeFast hands over to fastAttrsFrom and the straight path passes the body on.
//
// They decline on anything unusual: a key that is not a fixstr or is unknown, a key that
// appears twice (at the top level or in attrs), a non-canonical or negative integer, a
// bin where a str belongs, a string over its bound, inline limits, trailing bytes, a
// truncated body. FuzzDecodeFastDifferential checks that whenever either accepts, the
// msgpack path decodes the same request without error.

// Bits of the top-level fields the fast path has seen, to decline a repeated key.
const (
	seenID = 1 << iota
	seenOp
	seenCost
	seenAttrs
	seenLimits
	seenLease
	seenLeaseMs
)

// The fast path's keys after their fixstr header, as the little-endian integers of their
// bytes ("attrs" and "limits" split in two), so that a key is compared in one or two
// integer comparisons instead of a string switch.
const (
	keyID     = 'i' | 'd'<<8
	keyOp     = 'o' | 'p'<<8
	keyCost   = 'c' | 'o'<<8 | 's'<<16 | 't'<<24
	keyAttr   = 'a' | 't'<<8 | 't'<<16 | 'r'<<24 // "attr", then 's'
	keyLimi   = 'l' | 'i'<<8 | 'm'<<16 | 'i'<<24 // "limi", then "ts"
	keyLimits = 't' | 's'<<8
	keyLeas   = 'l' | 'e'<<8 | 'a'<<16 | 's'<<24 // "leas", then 'e'
	// "lease_ms" whole.
	keyLeaseMs = 'l' | 'e'<<8 | 'a'<<16 | 's'<<24 | 'e'<<32 | '_'<<40 | 'm'<<48 | 's'<<56
)

// The fast path reads the body through a frame: the body's bytes with reads that skip
// Go's bounds checks. Every read is preceded, in the same function, by an explicit check
// that it is inside the body (those checks are what the fast path's declining is made of
// anyway), so a bounds check would test a second time what was just tested; the strings it
// returns are of length at least 1 and inside the body, so they never point past it.
// Built with the tag rlsidecar_checkframe (scripts/test-proto-checked runs the proto tests
// and the differential fuzz seeds so), every read is checked and one outside the body
// panics: the differential tests then catch a read that a result does not show.
type frame struct {
	base unsafe.Pointer // the body's first byte
	n    int            // the body's length
}

// check panics, in a build with the tag rlsidecar_checkframe, if the size bytes at i are
// not all inside the body; in the default build it is nothing.
func (f frame) check(i, size int) {
	if checkFrame && (i < 0 || i > f.n-size) {
		panic("BUG: the fast request decoder reads outside the body")
	}
}

// at is the byte at i, which the caller has checked is below f.n.
func (f frame) at(i int) byte {
	f.check(i, 1)
	return *(*byte)(unsafe.Add(f.base, i))
}

// le16, le32 and le64 are the little-endian integers at i, whose 2, 4 or 8 bytes the
// caller has checked are below f.n: one load where the machine allows it.
func (f frame) le16(i int) uint16 {
	f.check(i, 2)
	return binary.LittleEndian.Uint16((*[2]byte)(unsafe.Add(f.base, i))[:])
}
func (f frame) le32(i int) uint32 {
	f.check(i, 4)
	return binary.LittleEndian.Uint32((*[4]byte)(unsafe.Add(f.base, i))[:])
}
func (f frame) le64(i int) uint64 {
	f.check(i, 8)
	return binary.LittleEndian.Uint64((*[8]byte)(unsafe.Add(f.base, i))[:])
}

// str is the string of the n bytes at i, 1 <= n and i+n <= f.n checked by the caller.
// It is unsafe.String without the check of n (that it is not negative, and does not wrap
// around the address space), which the caller's checks make: a string's header built
// in place.
func (f frame) str(i, n int) string {
	f.check(i, max(n, 1))
	return *(*string)(unsafe.Pointer(&stringHeader{unsafe.Add(f.base, i), n}))
}

// stringHeader is the layout of a string: its data and its length.
type stringHeader struct {
	data unsafe.Pointer
	n    int
}

// DecodeRequest decodes one request frame body into req, which it resets first.
// On failure it returns an *Error with code bad_request; req.ID holds the request's id if
// it was read before the failure. The strings in req alias body: they are valid while
// body is not modified, and decoding copies nothing.
//
// It reads the request every client sends for a check or a ping in one straight path, in
// the order EncodeRequest and the Lua client write it: a fixmap of an id (an unsigned
// integer), an op (a fixstr of 1 to 31 bytes), then attrs (a fixmap that fixAttrs reads
// whole) and then cost (an unsigned integer), each of the last two optional but attrs
// first. Any other body it passes on to decodeOther (decode.go) from the start, whatever
// it has written into req: decodeFast for the same keys in another order or form, then
// msgpack/v5, the codec of record, for anything else and every error.
func (d *Decoder) DecodeRequest(body []byte, req *Request) error {
	if len(body) < 10 {
		return d.decodeOther(body, req)
	}
	f := frame{unsafe.Pointer(&body[0]), len(body)}
	x := f.le64(0) // a fixmap header, "\xa2id", the id and, when it is a fixint, "\xa2op"
	n := int(x&0xff) - 0x80
	if uint(n-2) > 2 { // a fixmap of 2 to 4 keys
		return d.decodeOther(body, req)
	}
	const idOp = (0xa2|keyID<<8)<<8 | (0xa2|keyOp<<8)<<40
	var id uint64
	var p int
	ok := true
	if x&0xffff_ff80_ffff_ff00 == idOp { // a positive fixint id: one comparison for both keys
		id, p = x>>32&0x7f, 8
	} else { // an id of another width
		if x&0xffff_ff00 != (0xa2|keyID<<8)<<8 {
			return d.decodeOther(body, req)
		}
		if byte(x>>32) == 0xcd { // a uint16, as a connection's ids soon are
			id, p = uint64(byte(x>>40))<<8|uint64(byte(x>>48)), 7
		} else if id, p, ok = fastUint(f, 4); !ok {
			return d.decodeOther(body, req)
		}
		if f.n-p < 5 || f.le32(p)&0xff_ffff != 0xa2|keyOp<<8 { // "\xa2op", a header and a byte
			return d.decodeOther(body, req)
		}
		p += 3
	}
	ln := int(f.at(p)) - 0xa0 // the op's fixstr header
	if uint(ln-1) >= 31 || ln >= f.n-p {
		return d.decodeOther(body, req)
	}
	op := f.str(p+1, ln)
	p += 1 + ln
	// req is written as it is read (decodeOther resets it), so that
	// little is kept across the call to fixAttrs.
	req.ID, req.Op, req.Cost = id, op, 1
	attrs := req.Attrs[:0]
	if n < 3 {
		req.Attrs = attrs
	} else { // attrs: "\xa5attrs" and a fixmap header
		const key = 0xa5 | keyAttr<<8 | 's'<<40 | 0x80<<48
		if f.n-p < 8 {
			return d.decodeOther(body, req)
		}
		y := f.le64(p)
		m := int(y>>48) & 0x0f
		if y&0x00f0_ffff_ffff_ffff != key || m > d.MaxAttrs || d.MaxAttrNameLen < 31 || d.MaxAttrLen < 255 {
			return d.decodeOther(body, req)
		}
		if cap(attrs) < m {
			attrs = slices.Grow(attrs, m)
		}
		attrs = attrs[:m]
		req.Attrs = attrs
		var i int
		if p, i = fixAttrs(f, p+7, attrs); i < m {
			return d.decodeOther(body, req)
		}
		if n == 4 { // cost: "\xa4cost" and an unsigned integer
			if f.n-p < 6 || f.at(p) != 0xa4 || f.le32(p+1) != keyCost {
				return d.decodeOther(body, req)
			}
			if req.Cost, p, ok = fastUint(f, p+5); !ok {
				return d.decodeOther(body, req)
			}
		}
	}
	req.Limits, req.Lease, req.LeaseMs = req.Limits[:0], "", 0
	if p != f.n {
		return d.decodeOther(body, req)
	}
	return nil
}

// decodeFast decodes body into req (already reset) and reports whether it did. When it
// returns false req holds partial data and the caller must decode again.
//
// Each key is dispatched on its fixstr header (its length) and then compared as an
// integer; a key is at least 2 bytes and its value at least 1, so one length check per key
// covers the header, the shortest keys and the first byte of their value.
func (d *Decoder) decodeFast(body []byte, req *Request) bool {
	if len(body) == 0 || body[0]&0xf0 != 0x80 { // fixmap
		return false
	}
	f := frame{unsafe.Pointer(&body[0]), len(body)}
	n := int(body[0] & 0x0f)
	p, seen := 1, 0
	// Every client starts a request with an id (a positive fixint when small) and an op (a
	// short fixstr), as EncodeRequest does: those two are read here with one comparison
	// for both keys, and the loop reads the rest, or all of a request that starts
	// otherwise.
	const idOp = (0xa2 | keyID<<8) | (0xa2|keyOp<<8)<<32 // bytes 1 to 8 but the id and the op's header
	if n >= 2 && f.n >= 10 {
		if x := f.le64(1); x&0x00ff_ffff_80ff_ffff == idOp {
			if ln := int(x>>56) - 0xa0; uint(ln-1) < 31 && ln < f.n-8 {
				req.ID, req.Op = x>>24&0x7f, f.str(9, ln)
				p, seen, n = 9+ln, seenID|seenOp, n-2
			}
		}
	}
	for ; n > 0; n-- {
		if f.n-p < 4 { // the shortest key ("id", "op") and a one-byte value
			return false
		}
		var ok bool
		switch f.at(p) {
		case 0xa2: // "id" or "op"
			switch f.le16(p + 1) {
			case keyID:
				if seen&seenID != 0 {
					return false
				}
				seen |= seenID
				if c := f.at(p + 3); c <= 0x7f { // a positive fixint: nearly every id
					req.ID, p, ok = uint64(c), p+4, true
				} else {
					req.ID, p, ok = fastUint(f, p+3)
				}
			case keyOp:
				if seen&seenOp != 0 {
					return false
				}
				seen |= seenOp
				p += 3
				// A fixstr of 1 to 31 bytes ("check"), else any string shape.
				if ln := int(f.at(p)) - 0xa0; uint(ln-1) < 31 && ln < f.n-p {
					req.Op, p, ok = f.str(p+1, ln), p+1+ln, true
				} else {
					req.Op, p, ok = fastStr(f, p, 64)
				}
			default:
				return false
			}
		case 0xa4: // "cost"
			if f.n-p < 6 || f.le32(p+1) != keyCost || seen&seenCost != 0 {
				return false
			}
			seen |= seenCost
			if c := f.at(p + 5); c <= 0x7f {
				req.Cost, p, ok = uint64(c), p+6, true
			} else {
				req.Cost, p, ok = fastUint(f, p+5)
			}
		case 0xa5: // "attrs" or "lease"
			if f.n-p < 7 {
				return false
			}
			if f.le32(p+1) == keyLeas && f.at(p+5) == 'e' { // a release's or a renew's
				if seen&seenLease != 0 {
					return false
				}
				seen |= seenLease
				req.Lease, p, ok = fastStr(f, p+6, f.n) // any length, as decodeFields
				break
			}
			if f.le32(p+1) != keyAttr || f.at(p+5) != 's' || seen&seenAttrs != 0 {
				return false
			}
			seen |= seenAttrs
			p += 6
			c := f.at(p)
			if c&0xf0 != 0x80 || int(c&0x0f) > d.MaxAttrs || d.MaxAttrNameLen < 31 || d.MaxAttrLen < 255 {
				p, ok = d.fastAttrs(f, p, req) // nil, or what fixAttrs does not read
				break
			}
			n := int(c & 0x0f)
			attrs := req.Attrs[:0]
			if cap(attrs) < n {
				attrs = slices.Grow(attrs, n)
			}
			var i int
			p, i = fixAttrs(f, p+1, attrs[:n])
			req.Attrs = attrs[:i]
			ok = true
			if i < n {
				p, ok = d.fastAttrsFrom(f, p, req, i, n)
			}
		case 0xa8: // "lease_ms", a renew's
			if f.n-p < 10 || f.le64(p+1) != keyLeaseMs || seen&seenLeaseMs != 0 {
				return false
			}
			seen |= seenLeaseMs
			req.LeaseMs, p, ok = fastUint(f, p+9)
		case 0xa6: // "limits", only nil
			if f.n-p < 8 || f.le32(p+1) != keyLimi || f.le16(p+5) != keyLimits || f.at(p+7) != 0xc0 || seen&seenLimits != 0 {
				return false
			}
			seen |= seenLimits
			p, ok = p+8, true
		default:
			return false
		}
		if !ok {
			return false
		}
	}
	return p == f.n && req.Op != ""
}

// fastAttrs reads the attrs value at f's p (the caller has checked p < f.n) into
// req.Attrs, which is empty, when decodeFast does not: a nil, or a map under bounds that
// fixAttrs does not check.
func (d *Decoder) fastAttrs(f frame, p int, req *Request) (int, bool) {
	c := f.at(p)
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
	req.Attrs = slices.Grow(req.Attrs[:0], n)
	return d.fastAttrsFrom(f, p+1, req, 0, n)
}

// fixAttrs reads the attributes at f's p into attrs, as many as it holds, as long as each
// has a fixstr name of 1 to 31 bytes and a value that is a fixstr of 1 to 31 bytes or a
// str8 of 1 to 255 bytes (a long path or key), and its name is not one of the names before
// it. It returns the position after the attributes it read and their number: a loop with
// a length check per string, no call and no write but attrs. The caller checks the bounds
// on names and values (MaxAttrNameLen, MaxAttrLen) allow those lengths.
//
// A repeated name is found with a 64-bit set of hashed names: at a name whose bit is
// already set (a repeat, or two names sharing a bit) it stops. Where it stops, decodeFast
// reads on with fastAttrsFrom, which compares names, and DecodeRequest passes the body on.
func fixAttrs(f frame, p int, attrs []Attr) (int, int) {
	var names uint64 // bit nameBit of each name read
	for i := range attrs {
		if p >= f.n-3 { // a name, a value header and a value of a byte each
			return p, i
		}
		ln := int(f.at(p)) - 0xa0 // a fixstr name's length, if 1 to 31
		v := p + 1 + ln           // then the value's header
		if uint(v) >= uint(f.n-1) {
			return p, i
		}
		lv := int(f.at(v)) - 0xa0
		if (uint(ln-1) | uint(lv-1)) >= 31 { // not both fixstrs of 1 to 31 bytes
			if uint(ln-1) >= 31 || f.at(v) != 0xd9 { // a str8 value of 1 to 255 bytes reads on
				return p, i
			}
			v++
			lv = int(f.at(v))
			if lv == 0 {
				return p, i
			}
		}
		end := v + 1 + lv // the value is at v+1
		if end > f.n {
			return p, i
		}
		h := (uint(f.at(p+1)) + 3*uint(f.at(p+ln))) & 63 // nameBit, written out
		if names>>h&1 != 0 {
			return p, i
		}
		names |= 1 << h
		a := &attrs[i]
		a.Name, a.Value = f.str(p+1, ln), f.str(v+1, lv)
		p = end
	}
	return p, len(attrs)
}

// nameBit is the bit of a name in fixAttrs' set of names, from its first and last bytes:
// TestNameBits checks that the usual names take different bits.
func nameBit(first, last byte) uint {
	return (uint(first) + 3*uint(last)) & 63
}

// repeated reports whether name is among attrs' names.
func repeated(attrs []Attr, name string) bool {
	for j := range attrs {
		if attrs[j].Name == name {
			return true
		}
	}
	return false
}

// fastAttrsFrom reads attributes i to n-1 of an attrs map (those before i are in
// req.Attrs), the next one at f's p, taking every string shape fastStr reads.
func (d *Decoder) fastAttrsFrom(f frame, p int, req *Request, i, n int) (int, bool) {
	attrs := req.Attrs
	for ; i < n; i++ {
		name, q, ok := fastStr(f, p, d.MaxAttrNameLen)
		if !ok {
			return p, false
		}
		p = q
		value, q, ok := fastStr(f, p, d.MaxAttrLen)
		if !ok {
			return p, false
		}
		p = q
		if repeated(attrs, name) {
			return p, false
		}
		attrs = append(attrs, Attr{Name: name, Value: value})
	}
	req.Attrs = attrs
	return p, true
}

// fastStr reads a fixstr, str8 or str16 of at most maxLen bytes at f's p and returns it
// (aliasing the body) and the position after it.
func fastStr(f frame, p, maxLen int) (string, int, bool) {
	if p >= f.n {
		return "", p, false
	}
	c := f.at(p)
	var n int
	switch {
	case c >= 0xa0 && c <= 0xbf:
		n = int(c & 0x1f)
		p++
	case c == 0xd9:
		if f.n-p < 2 {
			return "", p, false
		}
		n = int(f.at(p + 1))
		p += 2
	case c == 0xda:
		if f.n-p < 3 {
			return "", p, false
		}
		n = int(f.at(p+1))<<8 | int(f.at(p+2))
		p += 3
	default:
		return "", p, false
	}
	if n > maxLen || n > f.n-p {
		return "", p, false
	}
	if n == 0 {
		return "", p, true
	}
	return f.str(p, n), p + n, true
}

// fastUint reads a positive fixint or a uint8/16/32/64 at f's p.
func fastUint(f frame, p int) (uint64, int, bool) {
	if p >= f.n {
		return 0, p, false
	}
	var v uint64
	var size int
	switch c := f.at(p); {
	case c <= 0x7f:
		return uint64(c), p + 1, true
	case c == 0xcc:
		size = 1
	case c == 0xcd:
		size = 2
	case c == 0xce:
		size = 4
	case c == 0xcf:
		size = 8
	default:
		return 0, p, false
	}
	if f.n-p <= size {
		return 0, p, false
	}
	for k := 1; k <= size; k++ {
		v = v<<8 | uint64(f.at(p+k))
	}
	return v, p + 1 + size, true
}
