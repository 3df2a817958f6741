package main

// The msgpack of the wire-protocol audit (wirefuzz_e2e_test.go), written from the msgpack
// spec and shared/PROTOCOL.md alone, not from proto/: an encoder that picks any valid
// encoding of a value (every integer width, str or bin, float for whole numbers) and can
// write what is not valid, and a decoder of the daemon's answers that keeps each map's
// key order and whether a string came as str.

import (
	be "encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"unicode/utf8"
)

// wfEnc appends msgpack to b, choosing among equivalent encodings at random.
type wfEnc struct {
	b []byte
	r *rand.Rand
}

// uint writes v in any encoding that holds it: its shortest, a wider unsigned one, a
// signed one, or a float holding exactly v.
func (e *wfEnc) uint(v uint64) {
	type opt func()
	var opts []opt
	if v <= 0x7f {
		opts = append(opts, func() { e.b = append(e.b, byte(v)) })
		opts = append(opts, func() { e.b = append(e.b, 0xd0, byte(v)) })
	}
	if v <= math.MaxUint8 {
		opts = append(opts, func() { e.b = append(e.b, 0xcc, byte(v)) })
	}
	if v <= math.MaxUint16 {
		opts = append(opts, func() { e.b = be.BigEndian.AppendUint16(append(e.b, 0xcd), uint16(v)) })
	}
	if v <= math.MaxInt16 {
		opts = append(opts, func() { e.b = be.BigEndian.AppendUint16(append(e.b, 0xd1), uint16(v)) })
	}
	if v <= math.MaxUint32 {
		opts = append(opts, func() { e.b = be.BigEndian.AppendUint32(append(e.b, 0xce), uint32(v)) })
	}
	if v <= math.MaxInt32 {
		opts = append(opts, func() { e.b = be.BigEndian.AppendUint32(append(e.b, 0xd2), uint32(v)) })
	}
	if v <= math.MaxInt64 {
		opts = append(opts, func() { e.b = be.BigEndian.AppendUint64(append(e.b, 0xd3), v) })
	}
	opts = append(opts, func() { e.b = be.BigEndian.AppendUint64(append(e.b, 0xcf), v) })
	if f := float64(v); f < 0x1p64 && uint64(f) == v {
		opts = append(opts, func() { e.b = be.BigEndian.AppendUint64(append(e.b, 0xcb), math.Float64bits(f)) })
	}
	if f := float32(v); float64(f) < 0x1p64 && uint64(f) == v {
		opts = append(opts, func() { e.b = be.BigEndian.AppendUint32(append(e.b, 0xca), math.Float32bits(f)) })
	}
	// The shortest, half the time: what most encoders write.
	if e.r.IntN(2) == 0 {
		e.uintShortest(v)
		return
	}
	opts[e.r.IntN(len(opts))]()
}

func (e *wfEnc) uintShortest(v uint64) {
	switch {
	case v <= 0x7f:
		e.b = append(e.b, byte(v))
	case v <= math.MaxUint8:
		e.b = append(e.b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		e.b = be.BigEndian.AppendUint16(append(e.b, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		e.b = be.BigEndian.AppendUint32(append(e.b, 0xce), uint32(v))
	default:
		e.b = be.BigEndian.AppendUint64(append(e.b, 0xcf), v)
	}
}

// neg writes a negative integer -n (n ≥ 1).
func (e *wfEnc) neg(n uint64) {
	v := -int64(min(n, 1<<63))
	switch {
	case v >= -32 && e.r.IntN(2) == 0:
		e.b = append(e.b, byte(int8(v)))
	case v >= math.MinInt8:
		e.b = append(e.b, 0xd0, byte(int8(v)))
	case v >= math.MinInt16:
		e.b = be.BigEndian.AppendUint16(append(e.b, 0xd1), uint16(int16(v)))
	case v >= math.MinInt32:
		e.b = be.BigEndian.AppendUint32(append(e.b, 0xd2), uint32(int32(v)))
	default:
		e.b = be.BigEndian.AppendUint64(append(e.b, 0xd3), uint64(v))
	}
}

func (e *wfEnc) float(f float64) {
	e.b = be.BigEndian.AppendUint64(append(e.b, 0xcb), math.Float64bits(f))
}

// str writes s as a msgpack str (when it is UTF-8) or bin, in any header width that
// holds it.
func (e *wfEnc) str(s string) {
	n := len(s)
	asBin := !utf8.ValidString(s) || e.r.IntN(4) == 0
	if asBin {
		e.binHdr(n)
	} else {
		e.strHdr(n)
	}
	e.b = append(e.b, s...)
}

// strStr writes s as a msgpack str, whatever its bytes.
func (e *wfEnc) strStr(s string) {
	e.strHdr(len(s))
	e.b = append(e.b, s...)
}

func (e *wfEnc) strHdr(n int) {
	var opts []int
	if n < 32 {
		opts = append(opts, 0)
	}
	if n <= math.MaxUint8 {
		opts = append(opts, 1)
	}
	if n <= math.MaxUint16 {
		opts = append(opts, 2)
	}
	opts = append(opts, 4)
	switch opts[e.r.IntN(len(opts))] {
	case 0:
		e.b = append(e.b, 0xa0|byte(n))
	case 1:
		e.b = append(e.b, 0xd9, byte(n))
	case 2:
		e.b = be.BigEndian.AppendUint16(append(e.b, 0xda), uint16(n))
	default:
		e.b = be.BigEndian.AppendUint32(append(e.b, 0xdb), uint32(n))
	}
}

func (e *wfEnc) binHdr(n int) {
	var opts []int
	if n <= math.MaxUint8 {
		opts = append(opts, 1)
	}
	if n <= math.MaxUint16 {
		opts = append(opts, 2)
	}
	opts = append(opts, 4)
	switch opts[e.r.IntN(len(opts))] {
	case 1:
		e.b = append(e.b, 0xc4, byte(n))
	case 2:
		e.b = be.BigEndian.AppendUint16(append(e.b, 0xc5), uint16(n))
	default:
		e.b = be.BigEndian.AppendUint32(append(e.b, 0xc6), uint32(n))
	}
}

func (e *wfEnc) mapHdr(n int) {
	switch {
	case n < 16 && e.r.IntN(3) > 0:
		e.b = append(e.b, 0x80|byte(n))
	case n <= math.MaxUint16 && e.r.IntN(2) == 0:
		e.b = be.BigEndian.AppendUint16(append(e.b, 0xde), uint16(n))
	default:
		e.b = be.BigEndian.AppendUint32(append(e.b, 0xdf), uint32(n))
	}
}

func (e *wfEnc) arrHdr(n int) {
	switch {
	case n < 16 && e.r.IntN(3) > 0:
		e.b = append(e.b, 0x90|byte(n))
	case n <= math.MaxUint16 && e.r.IntN(2) == 0:
		e.b = be.BigEndian.AppendUint16(append(e.b, 0xdc), uint16(n))
	default:
		e.b = be.BigEndian.AppendUint32(append(e.b, 0xdd), uint32(n))
	}
}

func (e *wfEnc) nil_() { e.b = append(e.b, 0xc0) }

func (e *wfEnc) bool_(v bool) {
	if v {
		e.b = append(e.b, 0xc3)
	} else {
		e.b = append(e.b, 0xc2)
	}
}

// ext writes an extension value of type typ holding data, in a fixext or ext header.
func (e *wfEnc) ext(typ int8, data []byte) {
	switch n := len(data); {
	case n == 1 || n == 2 || n == 4 || n == 8 || n == 16:
		code := map[int]byte{1: 0xd4, 2: 0xd5, 4: 0xd6, 8: 0xd7, 16: 0xd8}[n]
		e.b = append(e.b, code, byte(typ))
	case n <= math.MaxUint8:
		e.b = append(e.b, 0xc7, byte(n), byte(typ))
	case n <= math.MaxUint16:
		e.b = be.BigEndian.AppendUint16(append(e.b, 0xc8), uint16(n))
		e.b = append(e.b, byte(typ))
	default:
		e.b = be.BigEndian.AppendUint32(append(e.b, 0xc9), uint32(n))
		e.b = append(e.b, byte(typ))
	}
	e.b = append(e.b, data...)
}

// any writes a random well-formed value nesting at most depth containers: what an
// unknown field may hold.
func (e *wfEnc) any(depth int) {
	k := e.r.IntN(12)
	if depth <= 0 && k >= 10 {
		k = e.r.IntN(10)
	}
	switch k {
	case 0:
		e.nil_()
	case 1:
		e.bool_(e.r.IntN(2) == 0)
	case 2:
		e.uint(e.r.Uint64() >> e.r.IntN(64))
	case 3:
		e.neg(1 + e.r.Uint64()>>e.r.IntN(64))
	case 4:
		e.float(e.r.NormFloat64() * 1e6)
	case 5:
		e.str(randASCII(e.r, e.r.IntN(40)))
	case 6:
		e.binHdr(3)
		e.b = append(e.b, 0xff, 0x00, 0xc1)
	case 7:
		e.ext(int8(e.r.IntN(256)-128), randBytes(e.r, e.r.IntN(20)))
	case 8:
		e.ext(-1, be.BigEndian.AppendUint32(nil, uint32(e.r.Uint64()))) // a Timestamp 32
	case 9:
		e.float(math.NaN())
	case 10:
		n := e.r.IntN(4)
		e.arrHdr(n)
		for range n {
			e.any(depth - 1)
		}
	default:
		n := e.r.IntN(4)
		e.mapHdr(n)
		for range n {
			if e.r.IntN(5) == 0 {
				e.uint(uint64(e.r.IntN(100))) // a map of an unknown value may have any keys
			} else {
				e.str(randASCII(e.r, e.r.IntN(8)))
			}
			e.any(depth - 1)
		}
	}
}

// nested writes depth containers, each holding the next, around a nil.
func (e *wfEnc) nested(depth int) {
	for range depth {
		if e.r.IntN(2) == 0 {
			e.arrHdr(1)
		} else {
			e.mapHdr(1)
			e.str("k")
		}
	}
	e.nil_()
}

func randASCII(r *rand.Rand, n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:= "
	b := make([]byte, n)
	for i := range b {
		b[i] = letters[r.IntN(len(letters))]
	}
	return string(b)
}

func randBytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// randUTF8 is n bytes or a little more of UTF-8 with multi-byte runes.
func randUTF8(r *rand.Rand, n int) string {
	runes := []rune("aé€𝄞ñ中\u0000\u007f\u00a0\ufeff")
	var b []byte
	for len(b) < n {
		b = utf8.AppendRune(b, runes[r.IntN(len(runes))])
	}
	return string(b)
}

// mpStr is a decoded string: its bytes and whether it came as str.
type mpStr struct {
	s   string
	str bool
}

// mpMap is a decoded map: its keys in the order of the frame (string keys only).
type mpMap struct {
	keys []string
	vals map[string]any
}

// wfDecode decodes exactly one value filling b.
func wfDecode(b []byte) (any, error) {
	d := &wfDec{b: b}
	v, err := d.value(0)
	if err != nil {
		return nil, err
	}
	if d.off != len(b) {
		return nil, fmt.Errorf("%d bytes after the value", len(b)-d.off)
	}
	return v, nil
}

type wfDec struct {
	b   []byte
	off int
}

var errShort = errors.New("truncated")

func (d *wfDec) take(n int) ([]byte, error) {
	if n < 0 || d.off+n > len(d.b) {
		return nil, errShort
	}
	p := d.b[d.off : d.off+n]
	d.off += n
	return p, nil
}

func (d *wfDec) n(size int) (uint64, error) {
	p, err := d.take(size)
	if err != nil {
		return 0, err
	}
	var v uint64
	for _, c := range p {
		v = v<<8 | uint64(c)
	}
	return v, nil
}

func (d *wfDec) value(depth int) (any, error) {
	if depth > 64 {
		return nil, errors.New("nested too deep")
	}
	p, err := d.take(1)
	if err != nil {
		return nil, err
	}
	c := p[0]
	switch {
	case c <= 0x7f:
		return uint64(c), nil
	case c >= 0xe0:
		return int64(int8(c)), nil
	case c&0xf0 == 0x80:
		return d.mapOf(int(c&0x0f), depth)
	case c&0xf0 == 0x90:
		return d.arrOf(int(c&0x0f), depth)
	case c&0xe0 == 0xa0:
		return d.strOf(int(c&0x1f), true)
	}
	switch c {
	case 0xc0:
		return nil, nil
	case 0xc2:
		return false, nil
	case 0xc3:
		return true, nil
	case 0xcc, 0xcd, 0xce, 0xcf:
		return d.n(1 << (c - 0xcc))
	case 0xd0, 0xd1, 0xd2, 0xd3:
		size := 1 << (c - 0xd0)
		v, err := d.n(size)
		shift := 64 - 8*size
		return int64(v<<shift) >> shift, err
	case 0xca:
		v, err := d.n(4)
		return float64(math.Float32frombits(uint32(v))), err
	case 0xcb:
		v, err := d.n(8)
		return math.Float64frombits(v), err
	case 0xd9, 0xda, 0xdb:
		n, err := d.n(1 << (c - 0xd9))
		if err != nil {
			return nil, err
		}
		return d.strOf(int(n), true)
	case 0xc4, 0xc5, 0xc6:
		n, err := d.n(1 << (c - 0xc4))
		if err != nil {
			return nil, err
		}
		return d.strOf(int(n), false)
	case 0xdc, 0xdd:
		n, err := d.n(2 << (c - 0xdc))
		if err != nil {
			return nil, err
		}
		return d.arrOf(int(n), depth)
	case 0xde, 0xdf:
		n, err := d.n(2 << (c - 0xde))
		if err != nil {
			return nil, err
		}
		return d.mapOf(int(n), depth)
	}
	return nil, fmt.Errorf("type byte %#x in an answer", c)
}

func (d *wfDec) strOf(n int, str bool) (any, error) {
	p, err := d.take(n)
	if err != nil {
		return nil, err
	}
	return mpStr{s: string(p), str: str}, nil
}

func (d *wfDec) arrOf(n int, depth int) (any, error) {
	if n > len(d.b)-d.off {
		return nil, errShort
	}
	out := make([]any, 0, n)
	for range n {
		v, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

func (d *wfDec) mapOf(n int, depth int) (any, error) {
	if n > len(d.b)-d.off {
		return nil, errShort
	}
	m := &mpMap{vals: make(map[string]any, n)}
	for range n {
		k, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		ks, ok := k.(mpStr)
		if !ok || !ks.str {
			return nil, fmt.Errorf("map key %#v is not a str", k)
		}
		if _, dup := m.vals[ks.s]; dup {
			return nil, fmt.Errorf("map key %q twice", ks.s)
		}
		v, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		m.keys = append(m.keys, ks.s)
		m.vals[ks.s] = v
	}
	return m, nil
}
