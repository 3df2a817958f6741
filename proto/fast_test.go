package proto

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"
)

// fastSeeds are request bodies at the edges of the fast path: accepted shapes, shapes it
// must decline (repeated keys at every level, other integer and string encodings, inline
// limits, trailing bytes, truncation) and plain garbage.
func fastSeeds() [][]byte {
	var seeds [][]byte
	add := func(hexBody string) {
		b, err := hex.DecodeString(strings.ReplaceAll(hexBody, " ", ""))
		if err != nil {
			panic(err)
		}
		seeds = append(seeds, b)
	}
	for _, req := range []Request{
		sampleRequest(),
		{ID: 1, Op: OpPing, Cost: 1},
		{ID: 1 << 40, Op: OpCheck, Cost: 0, Attrs: []Attr{{"user", strings.Repeat("u", 40)}, {"path", strings.Repeat("/p", 200)}}},
		{ID: 300, Op: OpCheck, Cost: 70000, Attrs: []Attr{{"", ""}}},
		{ID: 2, Op: OpCheck, Cost: 1, Limits: []InlineLimit{{Key: "k", Limit: 3, WindowMs: 10}}},
		// fastAttrs' fixstr loop hands over to fastAttrsFrom mid-map: at a long value, an
		// empty name, an empty value, and with a name repeated across the hand-over.
		{ID: 3, Op: OpCheck, Cost: 1, Attrs: []Attr{{"a", "b"}, {"user", strings.Repeat("u", 40)}, {"c", "d"}}},
		{ID: 4, Op: OpCheck, Cost: 1, Attrs: []Attr{{"a", "b"}, {"", "e"}, {"c", "d"}}},
		{ID: 5, Op: OpCheck, Cost: 1, Attrs: []Attr{{"a", "b"}, {"f", ""}, {"c", "d"}}},
		{ID: 6, Op: OpCheck, Cost: 1, Attrs: []Attr{{"a", "b"}, {strings.Repeat("n", 33), "v"}, {"a", "x"}}},
		{ID: 7, Op: OpCheck, Cost: 1, Attrs: []Attr{{"a", "b"}, {"a", strings.Repeat("v", 33)}}},
		// A release's and a renew's lease (fixstr, str8, str16), and lease_ms.
		{ID: 8, Op: OpRelease, Cost: 1, Lease: "0a1b2c3d.1.abc"},
		{ID: 9, Op: OpRenew, Cost: 1, Lease: strings.Repeat("l", 40), LeaseMs: 30000},
		{ID: 10, Op: OpRenew, Cost: 1, Lease: strings.Repeat("l", 300), LeaseMs: 1 << 40},
		{ID: 11, Op: OpRelease, Cost: 1, Lease: strings.Repeat("l", MaxLeaseLen+1)},
	} {
		enc := NewEncoder()
		enc.EncodeRequest(&req)
		seeds = append(seeds, append([]byte(nil), enc.Bytes()[HeaderSize:]...))
	}
	add("83 a2 6964 01 a2 6f70 a7 72656c65617365 a5 6c65617365 a0")                                                                            // empty lease
	add("83 a2 6964 01 a2 6f70 a7 72656c65617365 a5 6c65617365 c0")                                                                            // nil lease
	add("83 a2 6964 01 a2 6f70 a7 72656c65617365 a5 6c65617365 c4 01 61")                                                                      // bin lease
	add("83 a2 6964 01 a2 6f70 a7 72656c65617365 a5 6c65617365 01")                                                                            // number lease
	add("84 a2 6964 01 a2 6f70 a7 72656c65617365 a5 6c65617365 a1 61 a5 6c65617365 a1 62")                                                     // lease twice
	add("84 a2 6964 01 a2 6f70 a5 72656e6577 a5 6c65617365 a1 61 a8 6c656173655f6d73 cb 40 e3 88 00 00 00 00 00")                              // lease_ms a float
	add("85 a2 6964 01 a2 6f70 a5 72656e6577 a5 6c65617365 a1 61 a8 6c656173655f6d73 05 a8 6c656173655f6d73 06")                               // lease_ms twice
	add("83 a2 6964 01 a2 6f70 a5 72656e6577 a8 6c656173655f6d73 ff")                                                                          // negative lease_ms
	add("83 a2 6964 01 a2 6f70 a5 72656e6577 a5 6c65617365 a1")                                                                                // truncated lease
	add("83 a2 6964 01 a2 6f70 a5 72656e6577 a5 6c65617378 a1 61")                                                                             // "leasx"
	add("83 a2 6964 01 a2 6f70 a5 72656e6577 a8 6c656173655f6d78 05")                                                                          // "lease_mx"
	add("83 a2 6964 01 a2 6f70 a5 636865636b a2 6964 02")                                                                                      // id twice
	add("83 a2 6f70 a5 636865636b a2 6f70 a4 70696e67 a2 6964 01")                                                                             // op twice
	add("84 a2 6964 01 a4 636f7374 02 a4 636f7374 03 a2 6f70 a5 636865636b")                                                                   // cost twice
	add("84 a2 6964 01 a2 6f70 a5 636865636b a5 6174747273 81 a1 61 a1 62 a5 6174747273 80")                                                   // attrs twice
	add("83 a2 6964 01 a2 6f70 a5 636865636b a5 6174747273 82 a1 61 a1 62 a1 61 a1 63")                                                        // attr name twice
	add("84 a2 6964 01 a2 6f70 a5 636865636b a6 6c696d697473 c0 a6 6c696d697473 c0")                                                           // limits twice
	add("83 a2 6964 01 a2 6f70 a5 636865636b a6 6c696d697473 91 84 a3 6b6579 a1 6b a5 6c696d6974 01 a9 77696e646f775f6d73 01 a3 6b6579 a1 6c") // limits[].key twice
	add("83 a2 6964 01 a2 6f70 a5 636865636b a6 6c696d697473 c0")                                                                              // limits nil
	add("82 a2 6964 d0 05 a2 6f70 a5 636865636b")                                                                                              // int8 id
	add("82 a2 6964 ff a2 6f70 a5 636865636b")                                                                                                 // negative id
	add("82 a2 6964 cc 05 a2 6f70 c4 05 636865636b")                                                                                           // bin op
	add("82 a2 6964 cd 0102 a2 6f70 d9 05 636865636b")                                                                                         // str8 op
	add("82 a2 6964 cf 0102030405060708 a2 6f70 da 0005 636865636b")                                                                           // str16 op, uint64 id
	add("82 d9 02 6964 01 a2 6f70 a5 636865636b")                                                                                              // str8 key
	add("82 a2 6964 01 a2 6f70 a5 636865636b 00")                                                                                              // trailing byte
	add("82 a2 6964 01 a2 6f70 a5 636865")                                                                                                     // truncated
	add("82 a2 6964 ce 0102 a2")                                                                                                               // truncated uint32
	add("81 a2 6964 01")                                                                                                                       // no op
	add("82 a2 6f70 a0 a2 6964 01")                                                                                                            // empty op
	add("83 a2 6964 01 a2 6f70 a5 636865636b a5 6174747273 c0")                                                                                // attrs nil
	add("83 a2 6964 01 a2 6f70 a5 636865636b a5 6174747273 90")                                                                                // attrs array
	add("83 a2 6964 01 a2 6f70 a5 636865636b a5 6174747273 81 a1 61 01")                                                                       // attr value int
	add("83 a2 6964 01 a2 6f70 a5 636865636b a3 78797a 01")                                                                                    // unknown key
	add("de 0002 a2 6964 01 a2 6f70 a5 636865636b")                                                                                            // map16
	add("83 a2 6964 01 a2 6f70 a4 70696e67 a2 7473 d6 ff 00000001")                                                                            // unknown key: a Timestamp
	add("83 a2 6964 01 a2 6f70 a4 70696e67 a1 78 92 d4 01 02 c7 02 05 c1 c1")                                                                  // unknown key: exts in an array
	add("83 a2 6964 01 a2 6f70 a4 70696e67 a1 78 c9 ffffffff 01")                                                                              // unknown key: an ext past the body
	add("83 a2 6964 01 a2 6f70 a5 636865636b a5 6174747273 d4 01 80")                                                                          // attrs: an ext holding a map
	add("c7 0e 01 82 a2 6964 01 a2 6f70 a4 70696e67")                                                                                          // an ext holding the request
	seeds = append(seeds, []byte("\x83\xa2id\x01\xa2op\xa4ping\xda\x01\x01"+strings.Repeat("k", 257)+"\x01"))                                  // unknown key of 257 bytes
	seeds = append(seeds, []byte("\x82\xa2id\x01\xa2op\xd9\x41"+strings.Repeat("x", 65)))                                                      // op of 65 bytes
	add("")
	add("c0")
	seeds = append(seeds, checkSeeds()...)
	return seeds
}

// checkSeeds are bodies at the edges of DecodeRequest's straight path (id, op, attrs,
// cost) and of fixAttrs' loop: every string form of names and values (fixstr, str8, str16,
// bin, empty, at each length bound), keys out of order, unknown and repeated keys, nil and
// wrongly typed values, names that share a bit of fixAttrs' set, truncation at every
// attribute, lengths beyond the body, negative and largest integers.
func checkSeeds() [][]byte {
	var seeds [][]byte
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	str := func(s string) []byte { // fixstr, or str8 from 32 bytes on
		if len(s) < 32 {
			return append([]byte{0xa0 | byte(len(s))}, s...)
		}
		return append([]byte{0xd9, byte(len(s))}, s...)
	}
	str8 := func(s string) []byte { return append([]byte{0xd9, byte(len(s))}, s...) }
	str16 := func(s string) []byte { return append([]byte{0xda, byte(len(s) >> 8), byte(len(s))}, s...) }
	bin8 := func(s string) []byte { return append([]byte{0xc4, byte(len(s))}, s...) }
	head := func(n int) []byte {
		return cat([]byte{0x80 | byte(n)}, str("id"), []byte{0x07}, str("op"), str("check"))
	}
	attrs := func(pairs ...[]byte) []byte {
		return cat(str("attrs"), []byte{0x80 | byte(len(pairs)/2)}, cat(pairs...))
	}
	cost := func(v ...byte) []byte { return cat(str("cost"), v) }
	long := func(n int) string { return strings.Repeat("x", n) }
	std := attrs(str("method"), str("GET"), str("path"), str("/a/b"), str("user"), str("u-1"), str("ip"), str("10.0.0.1"))
	for _, b := range [][]byte{
		cat(head(2)),                  // a ping or a check without attrs
		cat(head(3), std),             // the common shape
		cat(head(4), std, cost(0x05)), // with a cost
		cat(head(4), std, cost(0x00)), // cost 0
		cat(head(4), std, cost(0x7f)), // the largest fixint
		cat(head(4), std, cost(0xcc, 0x80)),
		cat(head(4), std, cost(0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff)), // uint64 max
		cat(head(4), std, cost(0xff)), // negative fixint
		cat(head(4), std, cost(0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff)), // int64 -1
		cat(head(4), std, cost(0xc0)),                  // nil cost
		cat(head(4), std, cost(0xa1, '1')),             // string cost
		cat(head(4), cost(0x02), std),                  // cost before attrs
		cat(head(4), std, str("xyz"), []byte{0x01}),    // unknown key last
		cat(head(4), std, str("attrs"), []byte{0x80}),  // attrs twice
		cat(head(4), std, str("limits"), []byte{0xc0}), // limits nil
		cat(head(3), std, []byte{0x00}),                // a trailing byte
		cat(head(2), []byte{0x00}),
		cat(head(3), str("attrs"), []byte{0xc0}),                           // attrs nil
		cat(head(3), str("attrs"), []byte{0x80}),                           // attrs empty
		cat(head(3), str("attrs"), []byte{0x90}),                           // attrs an array
		cat(head(3), str("attrs"), []byte{0xde, 0, 1}, str("a"), str("b")), // map16 attrs
		cat(head(3), attrs(str("a"), str("b"), str("a"), str("c"))),        // a repeated name
		cat(head(3), attrs(str("ab"), str("1"), str("ab"), str(long(40)))),
		cat(head(3), attrs(str("a"), str(long(31)), str("b"), str(long(32)), str("c"), str(long(255)))),
		cat(head(3), attrs(str("a"), str8("x"), str("b"), str8(""), str("c"), str16("y"))), // str8, empty str8, str16 values
		cat(head(3), attrs(str8("a"), str("x"))),                                           // a str8 name
		cat(head(3), attrs(str16("a"), str("x"))),                                          // a str16 name
		cat(head(3), attrs(str(long(31)), str("x"), str(long(32)), str("y"))),              // names at the fixstr bound
		cat(head(3), attrs(str(long(128)), str("x"))),                                      // a name at MaxAttrNameLen
		cat(head(3), attrs(str(long(129)), str("x"))),                                      // beyond it
		cat(head(3), attrs(str("a"), str16(long(4096)))),                                   // a value at MaxAttrLen
		cat(head(3), attrs(str("a"), str16(long(4097)))),                                   // beyond it
		cat(head(3), attrs(str(""), str("x"))),                                             // an empty name
		cat(head(3), attrs(str("a"), str(""))),                                             // an empty value
		cat(head(3), attrs(str("a"), bin8("x"))),                                           // a bin value
		cat(head(3), attrs(bin8("a"), str("x"))),                                           // a bin name
		cat(head(3), attrs(str("a"), []byte{0xc0})),                                        // a nil value
		cat(head(3), attrs(str("a"), []byte{0x01})),                                        // an integer value
		cat(head(3), attrs([]byte{0x01}, str("x"))),                                        // an integer name
		cat(head(3), attrs(str("ab"), str("1"), str("Uf"), str("2"))),                      // names sharing a bit of fixAttrs' set
		cat(head(3), attrs(str("path"), str("1"), str("plan"), str("2"), str("path"), str("3"))),
		cat(head(3), str("attrs"), []byte{0x8f}, bytes.Repeat(cat(str("k"), str("v")), 15)),                         // 15 attrs, all "k"
		cat(head(3), str("attrs"), []byte{0x82}, str("a"), []byte{0xd9, 0xff}, []byte("short")),                     // a str8 longer than the body
		cat(head(3), str("attrs"), []byte{0x82}, str("a"), []byte{0xda, 0xff, 0xff}, []byte("short")),               // a str16 longer than the body
		cat(head(3), str("attrs"), []byte{0x82}, str("a"), []byte{0xbf}, []byte("short")),                           // a fixstr longer than the body
		cat([]byte{0x83, 0xa2, 'i', 'd', 0xcc, 0xff, 0xa2, 'o', 'p', 0xa5}, []byte("check"), std),                   // a uint8 id
		cat([]byte{0x83, 0xa2, 'i', 'd', 0xcd, 0x01, 0x02, 0xa2, 'o', 'p', 0xa5}, []byte("check"), std),             // a uint16 id
		cat([]byte{0x82, 0xa2, 'i', 'd', 0xcd, 0x01, 0x02, 0xa2, 'o', 'p', 0xa4}, []byte("ping")),                   // a ping, just long enough
		cat([]byte{0x83, 0xa2, 'i', 'd', 0xce, 0x01, 0x02, 0x03, 0x04, 0xa2, 'o', 'p', 0xa5}, []byte("check"), std), // a uint32 id
		cat([]byte{0x83, 0xa2, 'i', 'd', 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xa2, 'o', 'p', 0xa5}, []byte("check"), std),
		cat([]byte{0x83, 0xa2, 'i', 'd', 0xe0, 0xa2, 'o', 'p', 0xa5}, []byte("check"), std),         // a negative id
		cat([]byte{0x83, 0xa2, 'i', 'd', 0x01, 0xa2, 'o', 'p', 0xa0}, std),                          // an empty op
		cat([]byte{0x83, 0xa2, 'i', 'd', 0x01, 0xa2, 'o', 'p', 0xd9, 5}, []byte("check"), std),      // a str8 op
		cat([]byte{0x83, 0xa2, 'i', 'd', 0x01, 0xa2, 'o', 'p', 0xbf}, []byte("check"), std),         // an op longer than the body
		cat([]byte{0x83, 0xa2, 'o', 'p', 0xa5}, []byte("check"), []byte{0xa2, 'i', 'd', 0x01}, std), // op before id
		cat([]byte{0x83, 0xa2, 'i', 'd', 0x01, 0xa2, 'i', 'd', 0x02}, std),                          // id twice
		cat([]byte{0x82, 0xa2, 'i', 'd', 0x01, 0xa2, 'o', 'x', 0xa5}, []byte("check")),              // a key like op
		cat([]byte{0x85}, head(4)[1:], std, cost(0x01), str("lease"), str("t")),                     // five keys
	} {
		seeds = append(seeds, b)
		for _, cut := range []int{1, 2, 7, 8, 9, 10} { // truncated, inside each part
			if cut < len(b) {
				seeds = append(seeds, b[:len(b)-cut])
			}
		}
	}
	return seeds
}

func sameRequest(a, b *Request) bool {
	return a.ID == b.ID && a.Op == b.Op && a.Cost == b.Cost && a.Lease == b.Lease && a.LeaseMs == b.LeaseMs &&
		len(a.Attrs) == len(b.Attrs) && (len(a.Attrs) == 0 || reflect.DeepEqual(a.Attrs, b.Attrs)) &&
		len(a.Limits) == len(b.Limits) && (len(a.Limits) == 0 || reflect.DeepEqual(a.Limits, b.Limits))
}

// checkDifferential is the property: DecodeRequest (fast path, msgpack fallback) and the
// msgpack path alone give the same request or the same error for body; and whenever the
// fast path accepts, msgpack accepts the same request.
func checkDifferential(t *testing.T, body []byte) {
	t.Helper()
	checkDifferentialWith(t, body, NewDecoder)
}

// checkDifferentialWith is checkDifferential with decoders from newDecoder (other bounds).
func checkDifferentialWith(t *testing.T, body []byte, newDecoder func() *Decoder) {
	t.Helper()
	fast, slow, both, check := newDecoder(), newDecoder(), newDecoder(), newDecoder()
	var fr, sr, br, cr Request
	fr.Reset()
	accepted := fast.decodeFast(body, &fr)
	serr := slow.decodeRequestMsgpack(body, &sr)
	berr := both.DecodeRequest(body, &br)
	if accepted {
		if serr != nil {
			t.Fatalf("%x: fast path accepted %+v, msgpack says %v", body, fr, serr)
		}
		if !sameRequest(&fr, &sr) {
			t.Fatalf("%x: fast path decoded %+v, msgpack %+v", body, fr, sr)
		}
	}
	// DecodeRequest into a request holding another's fields: the straight path, when it
	// takes the body (check.passedOn stays 0), sets every field as msgpack does.
	cr = Request{ID: 99, Op: "stale", Cost: 99, Lease: "stale", LeaseMs: 99, Attrs: []Attr{{"stale", "x"}}, Limits: []InlineLimit{{Key: "stale"}}}
	cerr := check.DecodeRequest(body, &cr)
	if check.passedOn == 0 {
		if serr != nil || cerr != nil {
			t.Fatalf("%x: the straight path accepted %+v (error %v), msgpack says %v", body, cr, cerr, serr)
		}
		if !sameRequest(&cr, &sr) || cr.Lease != sr.Lease || cr.LeaseMs != sr.LeaseMs {
			t.Fatalf("%x: the straight path decoded %+v, msgpack %+v", body, cr, sr)
		}
	}
	if serr == nil && (cerr != nil || !sameRequest(&cr, &sr) || cr.Lease != sr.Lease || cr.LeaseMs != sr.LeaseMs) {
		t.Fatalf("%x: DecodeRequest over a used request decoded %+v (error %v), msgpack %+v", body, cr, cerr, sr)
	}
	if (serr == nil) != (berr == nil) || (serr != nil && serr.Error() != berr.Error()) {
		t.Fatalf("%x: DecodeRequest says %v, msgpack %v", body, berr, serr)
	}
	if serr == nil && (!sameRequest(&br, &sr) || br.Lease != sr.Lease || br.LeaseMs != sr.LeaseMs) {
		t.Fatalf("%x: DecodeRequest decoded %+v, msgpack %+v", body, br, sr)
	}
	if serr != nil && br.ID != sr.ID {
		t.Fatalf("%x: after an error DecodeRequest has id %d, msgpack %d", body, br.ID, sr.ID)
	}
}

// FuzzDecodeFastDifferential: the fast request decoder and msgpack/v5 agree on every input.
// Plain `go test` replays the seeds below and testdata/fuzz/FuzzDecodeFastDifferential;
// `go test -fuzz FuzzDecodeFastDifferential ./proto` searches for more.
func FuzzDecodeFastDifferential(f *testing.F) {
	for _, s := range fastSeeds() {
		f.Add(s)
	}
	for _, m := range malformedFrames() {
		if b, err := hex.DecodeString(m.Hex); err == nil && len(b) >= HeaderSize {
			f.Add(b[HeaderSize:])
		}
	}
	f.Fuzz(checkDifferential)
}

// TestFastPathTakesCommonShape: the shape clients send is decoded by the fast path (or the
// benchmark would measure the fallback).
func TestFastPathTakesCommonShape(t *testing.T) {
	for _, req := range []Request{sampleRequest(), {ID: 1, Op: OpPing, Cost: 1}, {ID: 1 << 62, Op: OpCheck, Cost: 0},
		{ID: 2, Op: OpRelease, Cost: 1, Lease: "0a1b2c3d.1.abc"}, {ID: 3, Op: OpRenew, Cost: 1, Lease: "0a1b2c3d.1.abc", LeaseMs: 60000}} {
		enc := NewEncoder()
		enc.EncodeRequest(&req)
		var got Request
		got.Reset()
		if !NewDecoder().decodeFast(enc.Bytes()[HeaderSize:], &got) || !sameRequest(&got, &req) {
			t.Fatalf("fast path declined or changed %+v: %+v", req, got)
		}
	}
}

// TestCheckPathTakesCommonShape: the requests clients send for a check or a ping are
// decoded by DecodeRequest's straight path whole (long and short strings, any number of
// attributes up to a fixmap's 15, a cost), so the benchmarks measure it, not a fallback.
func TestCheckPathTakesCommonShape(t *testing.T) {
	many := make([]Attr, 15)
	for i := range many {
		many[i] = Attr{Name: "attr-" + string(rune('a'+i)), Value: strings.Repeat("v", i*17)}
	}
	many[0].Value = "v"
	for _, req := range []Request{
		sampleRequest(),
		{ID: 1, Op: OpPing, Cost: 1},
		{ID: 127, Op: OpCheck, Cost: 0, Attrs: []Attr{{"api_key", strings.Repeat("k", 40)}, {"plan", "pro"}, {"path", strings.Repeat("/p", 100)}}},
		{ID: 3, Op: OpCheck, Cost: 100, Attrs: many},
	} {
		enc := NewEncoder()
		enc.EncodeRequest(&req)
		var got Request
		dec := NewDecoder()
		if err := dec.DecodeRequest(enc.Bytes()[HeaderSize:], &got); err != nil || dec.passedOn != 0 || !sameRequest(&got, &req) {
			t.Fatalf("the straight path passed on (%d) or changed %+v: %+v, %v", dec.passedOn, req, got, err)
		}
	}
}

// TestDifferentialSmallBounds: with bounds below what fixAttrs reads unchecked (names
// under 31 bytes, values under 255), every decoder still agrees with msgpack, which then
// refuses the longer strings.
func TestDifferentialSmallBounds(t *testing.T) {
	for _, bounds := range [][2]int{{4, 4096}, {128, 8}, {1, 1}, {30, 254}} {
		newDecoder := func() *Decoder {
			d := NewDecoder()
			d.MaxAttrNameLen, d.MaxAttrLen, d.MaxAttrs = bounds[0], bounds[1], 3
			return d
		}
		for _, b := range fastSeeds() {
			checkDifferentialWith(t, b, newDecoder)
		}
	}
}

// TestNameBits: the usual attribute names take different bits of fixAttrs' set of names,
// so a request holding several of them stays on the loop; two names that share a bit (or
// a repeated name) end the loop, and fastAttrsFrom, which compares names, reads on
// (checked by the seeds "ab"/"Uf" and "path"/"plan"/"path").
func TestNameBits(t *testing.T) {
	seen := map[uint]string{}
	for _, name := range []string{"method", "path", "user", "ip", "api_key", "plan", "host", "tenant", "route",
		"country", "key", "client", "org", "region", "user_agent", "service", "endpoint", "token", "account", "app"} {
		bit := nameBit(name[0], name[len(name)-1])
		if other, ok := seen[bit]; ok {
			t.Errorf("%q and %q share bit %d", name, other, bit)
		}
		seen[bit] = name
	}
	// fixAttrs uses nameBit (written out): it stops at the second of two names that share
	// a bit, and reads two that do not.
	if nameBit('a', 'b') != nameBit('U', 'f') {
		t.Fatal(`the seeds' "ab" and "Uf" no longer share a bit: change them`)
	}
	for _, tc := range []struct {
		body string
		want int
	}{{"\xa2ab\xa11\xa2Uf\xa12", 1}, {"\xa2ab\xa11\xa2Ug\xa12", 2}} {
		body := []byte(tc.body)
		if _, i := fixAttrs(frame{unsafe.Pointer(&body[0]), len(body)}, 0, make([]Attr, 2)); i != tc.want {
			t.Errorf("fixAttrs read %d attributes of %q, want %d", i, tc.body, tc.want)
		}
	}
}

// TestFastPathDeclinesRepeatedKeys: a key repeated at the top level, in attrs or in a
// limits entry is never accepted by the fast path, so the msgpack path's verdict (a
// bad_request) is the only one.
func TestFastPathDeclinesRepeatedKeys(t *testing.T) {
	for _, h := range []string{
		"83a2696401a26f70a5636865636ba2696402",
		"84a2696401a4636f737402a4636f737403a26f70a5636865636b",
		"84a2696401a26f70a5636865636ba56174747273" + "81a161a162" + "a56174747273" + "80",
		"83a2696401a26f70a5636865636ba56174747273" + "82a161a162a161a163",
		"84a2696401a26f70a5636865636ba66c696d697473c0a66c696d697473c0",
	} {
		b, _ := hex.DecodeString(h)
		var r Request
		r.Reset()
		if NewDecoder().decodeFast(b, &r) {
			t.Errorf("%s: fast path accepted a repeated key: %+v", h, r)
		}
		checkDifferential(t, b)
	}
}

// TestDifferentialRandom mutates valid requests byte by byte, a cheap always-on sample of
// what the fuzzer explores.
func TestDifferentialRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	seeds := fastSeeds()
	for i := 0; i < 20000; i++ {
		b := append([]byte(nil), seeds[rng.IntN(len(seeds))]...)
		for k := rng.IntN(3); k >= 0 && len(b) > 0; k-- {
			switch rng.IntN(3) {
			case 0:
				b[rng.IntN(len(b))] = byte(rng.Uint32())
			case 1:
				b = b[:rng.IntN(len(b))]
			default:
				j := rng.IntN(len(b))
				b = append(b[:j], append([]byte{byte(rng.Uint32())}, b[j:]...)...)
			}
		}
		checkDifferential(t, b)
	}
}

// encodeCheckRef is EncodeCheck written with msgpack.Encoder: the reference bytes.
func encodeCheckRef(r *Response) []byte {
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	n := 9 + policyFields(r.Warning, r.DelayMs, r.Banned)
	if r.Reason != "" {
		n++
	}
	if r.Lease != "" {
		n++
	}
	_ = e.EncodeMapLen(n)
	kv := func(k string, v any) {
		_ = e.EncodeString(k)
		switch v := v.(type) {
		case uint64:
			_ = e.EncodeUint(v)
		case bool:
			_ = e.EncodeBool(v)
		case string:
			_ = e.EncodeString(v)
		}
	}
	policies := func(warning bool, delayMs uint64, banned bool) {
		if warning {
			kv("warning", true)
		}
		if delayMs != 0 {
			kv("delay_ms", delayMs)
		}
		if banned {
			kv("banned", true)
		}
	}
	kv("id", r.ID)
	kv("allowed", r.Allowed)
	kv("rule", r.Rule)
	kv("limit", r.Limit)
	kv("remaining", r.Remaining)
	kv("reset_ms", r.ResetMs)
	kv("retry_after_ms", r.RetryAfterMs)
	kv("degraded", r.Degraded)
	_ = e.EncodeString("rules")
	_ = e.EncodeArrayLen(len(r.Rules))
	for _, rr := range r.Rules {
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
		_ = e.EncodeMapLen(m)
		kv("name", rr.Name)
		kv("limit", rr.Limit)
		kv("window_ms", rr.WindowMs)
		kv("remaining", rr.Remaining)
		kv("reset_ms", rr.ResetMs)
		kv("retry_after_ms", rr.RetryAfterMs)
		kv("allowed", rr.Allowed)
		kv("shadow", rr.Shadow)
		if rr.Reason != "" {
			kv("reason", rr.Reason)
		}
		policies(rr.Warning, rr.DelayMs, rr.Banned)
		if rr.Unasked {
			kv("unasked", true)
		}
		if rr.Concurrency {
			kv("concurrency", true)
		}
		if rr.Degraded {
			kv("degraded", true)
		}
	}
	if r.Reason != "" {
		kv("reason", r.Reason)
	}
	if r.Lease != "" {
		kv("lease", r.Lease)
	}
	policies(r.Warning, r.DelayMs, r.Banned)
	return buf.Bytes()
}

// TestEncodeCheckMatchesMsgpack: the direct encoder writes msgpack/v5's bytes for values
// at every width boundary.
func TestEncodeCheckMatchesMsgpack(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	nums := []uint64{0, 1, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, 1<<64 - 1}
	lens := []int{0, 1, 31, 32, 255, 256, 65535, 65536}
	num := func() uint64 { return nums[rng.IntN(len(nums))] }
	str := func() string { return strings.Repeat("x", lens[rng.IntN(len(lens))]) }
	enc := NewEncoder()
	for i := 0; i < 500; i++ {
		r := Response{ID: num(), Allowed: rng.IntN(2) == 0, Rule: str(), Limit: num(), Remaining: num(),
			ResetMs: num(), RetryAfterMs: num(), Degraded: rng.IntN(2) == 0}
		if rng.IntN(3) == 0 {
			r.Reason = str()
		}
		if rng.IntN(3) == 0 {
			r.Lease = str()
		}
		r.Warning, r.Banned = rng.IntN(3) == 0, rng.IntN(3) == 0
		if rng.IntN(3) == 0 {
			r.DelayMs = num()
		}
		nr := []int{0, 1, 2, 15, 16, 17}[rng.IntN(6)]
		for j := 0; j < nr; j++ {
			rr := RuleResult{Name: str(), Limit: num(), WindowMs: num(), Remaining: num(), ResetMs: num(),
				RetryAfterMs: num(), Allowed: rng.IntN(2) == 0, Shadow: rng.IntN(2) == 0}
			if rng.IntN(3) == 0 {
				rr.Reason = str()
			}
			rr.Warning, rr.Banned = rng.IntN(3) == 0, rng.IntN(3) == 0
			if rng.IntN(3) == 0 {
				rr.DelayMs = num()
			}
			rr.Unasked, rr.Concurrency = rng.IntN(3) == 0, rng.IntN(3) == 0
			r.Rules = append(r.Rules, rr)
		}
		enc.Reset()
		enc.EncodeCheck(&r)
		if got, want := enc.Bytes()[HeaderSize:], encodeCheckRef(&r); !bytes.Equal(got, want) {
			t.Fatalf("response %d: direct encoder wrote %d bytes unlike msgpack's %d", i, len(got), len(want))
		}
		if int(FrameLength(enc.Bytes())) != enc.Len()-HeaderSize {
			t.Fatalf("frame length %d for a %d-byte body", FrameLength(enc.Bytes()), enc.Len()-HeaderSize)
		}
		// The same answer with each rule's constant part pre-encoded (a RuleHead), after
		// another frame in the buffer: the same bytes.
		enc.Reset()
		enc.EncodePing(1, "v")
		before := enc.Len()
		h := CheckHead{ID: r.ID, Allowed: r.Allowed, Rule: r.Rule, Limit: r.Limit, Remaining: r.Remaining,
			ResetMs: r.ResetMs, RetryAfterMs: r.RetryAfterMs, Degraded: r.Degraded, Reason: r.Reason,
			Lease: r.Lease, Warning: r.Warning, DelayMs: r.DelayMs, Banned: r.Banned}
		enc.BeginCheck(&h, len(r.Rules))
		for j := range r.Rules {
			rr := r.Rules[j]
			head := NewRuleHead(rr.Name, rr.Limit, rr.WindowMs)
			if !head.Is(rr.Name, rr.Limit, rr.WindowMs) || head.Is(rr.Name+"x", rr.Limit, rr.WindowMs) ||
				head.Is(rr.Name, rr.Limit+1, rr.WindowMs) || head.Is(rr.Name, rr.Limit, rr.WindowMs+1) {
				t.Fatalf("response %d: RuleHead.Is is wrong for %q %d %d", i, rr.Name, rr.Limit, rr.WindowMs)
			}
			rr.Name, rr.Limit, rr.WindowMs = "not read", 1, 2
			enc.AppendRuleHead(head, &rr)
		}
		enc.EndCheck(&h)
		frame := enc.Bytes()[before:]
		if got, want := frame[HeaderSize:], encodeCheckRef(&r); !bytes.Equal(got, want) {
			t.Fatalf("response %d: with rule heads, %d bytes unlike msgpack's %d", i, len(got), len(want))
		}
		if int(FrameLength(frame)) != len(frame)-HeaderSize {
			t.Fatalf("with rule heads: frame length %d for a %d-byte body", FrameLength(frame), len(frame)-HeaderSize)
		}
	}
}

// TestWriteFastCorpus (re)writes the committed seed corpus when RLSIDECAR_WRITE_CORPUS=1.
func TestWriteFastCorpus(t *testing.T) {
	if os.Getenv("RLSIDECAR_WRITE_CORPUS") != "1" {
		t.Skip("set RLSIDECAR_WRITE_CORPUS=1 to rewrite testdata/fuzz/FuzzDecodeFastDifferential")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzDecodeFastDifferential")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for i, s := range fastSeeds() {
		body := "go test fuzz v1\n[]byte(" + quoteBytes(s) + ")\n"
		if err := os.WriteFile(filepath.Join(dir, "seed"+string(rune('a'+i/26))+string(rune('a'+i%26))), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func quoteBytes(b []byte) string {
	var sb strings.Builder
	sb.WriteByte('"')
	for _, c := range b {
		sb.WriteString(`\x`)
		sb.WriteString(hex.EncodeToString([]byte{c}))
	}
	sb.WriteByte('"')
	return sb.String()
}

// BenchmarkDecodeRequestMsgpack is BenchmarkDecodeRequest through msgpack/v5 only: the
// difference is the fast path's gain.
func BenchmarkDecodeRequestMsgpack(b *testing.B) {
	req := sampleRequest()
	enc := NewEncoder()
	enc.EncodeRequest(&req)
	body := enc.Bytes()[HeaderSize:]
	dec := NewDecoder()
	var got Request
	b.ReportAllocs()
	for b.Loop() {
		if err := dec.decodeRequestMsgpack(body, &got); err != nil {
			b.Fatal(err)
		}
	}
}

// mixedFrames are n request bodies shaped like real traffic rather than one repeated
// request: users drawn Zipf-distributed from a million beside a few hot ones, paths short
// and long (past the 31 bytes of a fixstr), an API key on some, a plan and a host on
// others, 2 to 7 attributes in varying order, a cost on a tenth, an occasional ping.
func mixedFrames(n int) [][]byte {
	rng := rand.New(rand.NewPCG(5, 6))
	zipf := rand.NewZipf(rng, 1.1, 1, 1_000_000)
	methods := []string{"GET", "GET", "GET", "POST", "PUT", "DELETE"}
	plans := []string{"free", "pro", "partner", "enterprise"}
	enc := NewEncoder()
	frames := make([][]byte, n)
	for i := range frames {
		req := Request{ID: uint64(i), Op: OpCheck, Cost: 1}
		switch {
		case rng.IntN(100) == 0:
			req.Op = OpPing
		case rng.IntN(10) == 0:
			req.Cost = uint64(rng.IntN(500))
		}
		if req.Op == OpCheck {
			user := zipf.Uint64()
			if rng.IntN(20) == 0 {
				user = uint64(rng.IntN(3)) // a hot client
			}
			path := "/v1/events/" + strconv.Itoa(rng.IntN(100000)) + "/holds"
			if rng.IntN(3) == 0 {
				path = "/api/v2/customers/" + strconv.Itoa(rng.IntN(1e6)) + "/orders/" + strconv.Itoa(rng.IntN(1e6)) + "/items"
			}
			attrs := []Attr{
				{"method", methods[rng.IntN(len(methods))]},
				{"path", path},
				{"user", "user-" + strconv.FormatUint(user, 10)},
				{"ip", strconv.Itoa(rng.IntN(256)) + "." + strconv.Itoa(rng.IntN(256)) + "." + strconv.Itoa(rng.IntN(256)) + "." + strconv.Itoa(rng.IntN(256))},
			}
			if rng.IntN(3) == 0 {
				attrs = append(attrs, Attr{"api_key", fmt.Sprintf("sk_live_%032x", rng.Uint64())})
			}
			if rng.IntN(3) == 0 {
				attrs = append(attrs, Attr{"plan", plans[rng.IntN(len(plans))]})
			}
			if rng.IntN(4) == 0 {
				attrs = append(attrs, Attr{"host", "api" + strconv.Itoa(rng.IntN(9)) + ".example.com"})
			}
			rng.Shuffle(len(attrs), func(a, b int) { attrs[a], attrs[b] = attrs[b], attrs[a] })
			req.Attrs = attrs[:2+rng.IntN(len(attrs)-1)]
		}
		enc.Reset()
		enc.EncodeRequest(&req)
		frames[i] = append([]byte(nil), enc.Bytes()[HeaderSize:]...)
	}
	return frames
}

// TestMixedFramesDecode: every frame of the mixed benchmark decodes as msgpack decodes
// it, and all of them on DecodeRequest's straight path (what clients send, in the order
// they send it, with ids of any width, long values and costs).
func TestMixedFramesDecode(t *testing.T) {
	frames := mixedFrames(4096)
	dec := NewDecoder()
	var req Request
	for _, b := range frames {
		checkDifferential(t, b)
		if err := dec.DecodeRequest(b, &req); err != nil {
			t.Fatal(err)
		}
	}
	if dec.passedOn != 0 {
		t.Errorf("the straight path passed on %d of %d frames", dec.passedOn, len(frames))
	}
}

// BenchmarkDecodeRequestMixed decodes 4,096 requests shaped like real traffic (see
// mixedFrames) in turn: the fast paths' gain must hold beyond BenchmarkDecodeRequest's one
// request.
func BenchmarkDecodeRequestMixed(b *testing.B) {
	benchmarkDecodeMixed(b, (*Decoder).DecodeRequest)
}

// BenchmarkDecodeRequestMixedMsgpack is BenchmarkDecodeRequestMixed through msgpack/v5
// only.
func BenchmarkDecodeRequestMixedMsgpack(b *testing.B) {
	benchmarkDecodeMixed(b, (*Decoder).decodeRequestMsgpack)
}

func benchmarkDecodeMixed(b *testing.B, decode func(*Decoder, []byte, *Request) error) {
	frames := mixedFrames(4096)
	dec := NewDecoder()
	var got Request
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if err := decode(dec, frames[i&4095], &got); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// TestEncodeReleaseRenewMatchMsgpack: the release and renew answers, written directly,
// are the bytes msgpack/v5 writes for the same fields in the same order, and whole
// frames.
func TestEncodeReleaseRenewMatchMsgpack(t *testing.T) {
	nums := []uint64{0, 1, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, 1<<64 - 1}
	ref := func(fields ...any) []byte {
		var b bytes.Buffer
		m := msgpack.NewEncoder(&b)
		_ = m.EncodeMapLen(len(fields) / 2)
		for i := 0; i < len(fields); i += 2 {
			_ = m.EncodeString(fields[i].(string))
			switch v := fields[i+1].(type) {
			case uint64:
				_ = m.EncodeUint(v)
			case bool:
				_ = m.EncodeBool(v)
			}
		}
		return b.Bytes()
	}
	enc := NewEncoder()
	check := func(what string, want []byte) {
		t.Helper()
		b := enc.Bytes()
		if int(FrameLength(b)) != len(b)-HeaderSize || !bytes.Equal(b[HeaderSize:], want) {
			t.Fatalf("%s: wrote % x, msgpack % x", what, b, want)
		}
	}
	for _, id := range nums {
		for _, ok := range []bool{true, false} {
			enc.Reset()
			enc.EncodeRelease(id, ok)
			check(fmt.Sprintf("release %d %v", id, ok), ref("id", id, "released", ok))
			for _, ms := range nums {
				enc.Reset()
				enc.EncodeRenew(id, ok, ms)
				check(fmt.Sprintf("renew %d %v %d", id, ok, ms), ref("id", id, "renewed", ok, "expires_ms", ms))
			}
		}
	}
	// After another frame: each frame's length is its own.
	enc.Reset()
	enc.EncodeRelease(1, true)
	first := len(enc.Bytes())
	enc.EncodeRenew(2, false, 300)
	if b := enc.Bytes()[first:]; int(FrameLength(b)) != len(b)-HeaderSize {
		t.Fatalf("second frame's length %d for %d bytes", FrameLength(b), len(b)-HeaderSize)
	}
}
