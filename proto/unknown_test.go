package proto

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"
)

// The contract (shared/PROTOCOL.md, proto/PROTOCOL.md "Requests"): the server ignores
// unknown fields whatever their value, and answers any op but the four unknown_op; an
// inline limit's unknown algorithm or mode is invalid_limit. The decoder must therefore
// skip, not refuse, an unknown field holding an extension value or named by a long
// string, and must read an op, algorithm or mode of any length (the daemon answers them).

// mpStr is s as a msgpack str in its shortest form.
func mpStr(s string) []byte {
	n := len(s)
	var b []byte
	switch {
	case n < 32:
		b = []byte{0xa0 | byte(n)}
	case n < 256:
		b = []byte{0xd9, byte(n)}
	case n < 1<<16:
		b = []byte{0xda, byte(n >> 8), byte(n)}
	default:
		b = []byte{0xdb, 0, 0, 0, 0}
		binary.BigEndian.PutUint32(b[1:], uint32(n))
	}
	return append(b, s...)
}

// mpMap is a fixmap of the given pairs, each key and value already encoded.
func mpMap(kv ...[]byte) []byte {
	b := []byte{0x80 | byte(len(kv)/2)}
	for _, x := range kv {
		b = append(b, x...)
	}
	return b
}

// u is a positive fixint.
func u(v byte) []byte { return []byte{v} }

// Extension values of every msgpack ext format, including the Timestamp extension (-1)
// in its three sizes.
var extValues = map[string][]byte{
	"fixext1":      {0xd4, 0x01, 0x02},
	"fixext2":      {0xd5, 0x7f, 0x01, 0x02},
	"fixext4":      {0xd6, 0x05, 0x01, 0x02, 0x03, 0x04},
	"fixext8":      {0xd7, 0x80, 1, 2, 3, 4, 5, 6, 7, 8},
	"fixext16":     append([]byte{0xd8, 0x01}, make([]byte, 16)...),
	"ext8-empty":   {0xc7, 0x00, 0x01},
	"ext8":         {0xc7, 0x03, 0x01, 0xc1, 0xc1, 0xc1}, // ext data is opaque: never-used bytes included
	"ext16":        append([]byte{0xc8, 0x01, 0x00, 0x0a}, make([]byte, 256)...),
	"ext32":        append([]byte{0xc9, 0x00, 0x00, 0x00, 0x05, 0x22}, 0x90, 0x91, 0x92, 0x80, 0xdf),
	"timestamp32":  {0xd6, 0xff, 0x00, 0x00, 0x00, 0x01},
	"timestamp64":  {0xd7, 0xff, 0, 0, 0, 4, 0x65, 0x00, 0x00, 0x00},
	"timestamp96":  append([]byte{0xc7, 0x0c, 0xff}, make([]byte, 12)...),
	"ext8-map":     {0xc7, 0x01, 0x01, 0x80}, // an ext whose data looks like a map
	"fixext1-map":  {0xd4, 0x01, 0x80},
	"fixext1-nil":  {0xd4, 0x01, 0xc0},
	"fixext4-str":  {0xd6, 0x01, 0xa3, 'a', 'b', 'c'},
	"fixext2-uint": {0xd5, 0x01, 0xcc, 0x05},
}

func decodeReq(t *testing.T, body []byte) (Request, error) {
	t.Helper()
	checkDifferential(t, body)
	var req Request
	err := NewDecoder().DecodeRequest(body, &req)
	return req, err
}

func wantCode(t *testing.T, err error, code string) {
	t.Helper()
	var pe *Error
	if !errors.As(err, &pe) || pe.Code != code {
		t.Fatalf("got %v, want %s", err, code)
	}
}

// TestUnknownFieldExtensionIgnored: an unknown field holding an extension value, at the
// top level, nested in an unknown field's array or map (as a value or as a key), or in an
// inline limit, is skipped like any other value.
func TestUnknownFieldExtensionIgnored(t *testing.T) {
	for name, ext := range extValues {
		for _, tc := range []struct {
			where string
			body  []byte
		}{
			{"top", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("ping"), mpStr("x"), ext)},
			{"first", mpMap(mpStr("x"), ext, mpStr("id"), u(1), mpStr("op"), mpStr("ping"))},
			{"in array", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("ping"), mpStr("x"), append(append([]byte{0x92}, ext...), ext...))},
			{"map value", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("ping"), mpStr("x"), mpMap(mpStr("t"), ext))},
			{"map key", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("ping"), mpStr("x"), mpMap(ext, u(1)))},
			{"deep", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("ping"), mpStr("x"), append([]byte{0x91, 0x91, 0x81, 0xa1, 'a', 0x91}, ext...))},
			{"inline limit", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("check"), mpStr("limits"),
				append([]byte{0x91}, mpMap(mpStr("key"), mpStr("k"), mpStr("limit"), u(1), mpStr("window_ms"), u(100), mpStr("ts"), ext)...))},
		} {
			t.Run(name+"/"+tc.where, func(t *testing.T) {
				req, err := decodeReq(t, tc.body)
				if err != nil {
					t.Fatalf("%x: %v", tc.body, err)
				}
				if req.ID != 1 || (req.Op != OpPing && req.Op != OpCheck) {
					t.Fatalf("%x: decoded %+v", tc.body, req)
				}
				if tc.where == "inline limit" && (len(req.Limits) != 1 || req.Limits[0] != (InlineLimit{Key: "k", Limit: 1, WindowMs: 100})) {
					t.Fatalf("%x: limits %+v", tc.body, req.Limits)
				}
			})
		}
	}
}

// TestUnknownFieldExtensionMalformed: an extension that the body cannot hold is a
// truncated body, however long it claims to be; the id read before it is kept.
func TestUnknownFieldExtensionMalformed(t *testing.T) {
	head := mpMap(mpStr("id"), u(3), mpStr("op"), mpStr("ping"), mpStr("x"))
	for name, ext := range map[string][]byte{
		"fixext16 short": {0xd8, 0x01, 0x00},
		"ext8 short":     {0xc7, 0x05, 0x01, 0x00},
		"ext16 short":    {0xc8, 0xff, 0xff, 0x01},
		"ext32 4GB":      {0xc9, 0xff, 0xff, 0xff, 0xff, 0x01},
		"no type":        {0xd4},
		"no length":      {0xc8, 0x01},
	} {
		t.Run(name, func(t *testing.T) {
			body := append(append([]byte(nil), head...), ext...)
			req, err := decodeReq(t, body)
			wantCode(t, err, CodeBadRequest)
			if req.ID != 3 {
				t.Fatalf("id %d, want 3", req.ID)
			}
		})
	}
}

// TestKnownFieldExtensionRefused: an extension value where a known field belongs is a
// wrong type, whatever its data looks like (msgpack/v5's DecodeMapLen reads an extension
// holding a map as that map: the decoder must not).
func TestKnownFieldExtensionRefused(t *testing.T) {
	lim := func(kv ...[]byte) []byte { return append([]byte{0x91}, mpMap(kv...)...) }
	for name, ext := range extValues {
		for _, tc := range []struct {
			where string
			body  []byte
		}{
			{"id", mpMap(mpStr("id"), ext, mpStr("op"), mpStr("ping"))},
			{"op", mpMap(mpStr("id"), u(1), mpStr("op"), ext)},
			{"cost", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("check"), mpStr("cost"), ext)},
			{"attrs", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("check"), mpStr("attrs"), ext)},
			{"attrs value", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("check"), mpStr("attrs"), mpMap(mpStr("user"), ext))},
			{"limits", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("check"), mpStr("limits"), ext)},
			{"limits[]", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("check"), mpStr("limits"), append([]byte{0x91}, ext...))},
			{"limits[].key", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("check"), mpStr("limits"), lim(mpStr("key"), ext, mpStr("limit"), u(1), mpStr("window_ms"), u(1)))},
			{"limits[].limit", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("check"), mpStr("limits"), lim(mpStr("key"), mpStr("k"), mpStr("limit"), ext, mpStr("window_ms"), u(1)))},
			{"limits[].algorithm", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("check"), mpStr("limits"), lim(mpStr("key"), mpStr("k"), mpStr("limit"), u(1), mpStr("window_ms"), u(1), mpStr("algorithm"), ext))},
			{"lease", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("release"), mpStr("lease"), ext)},
			{"key", mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("ping"), ext, u(1))},
		} {
			t.Run(name+"/"+tc.where, func(t *testing.T) {
				_, err := decodeReq(t, tc.body)
				wantCode(t, err, CodeBadRequest)
			})
		}
	}
	// The request itself: an extension wrapping a request map is not a map.
	for _, body := range [][]byte{
		append([]byte{0xc7, 0x0e, 0x01}, mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("ping"))...),
		append([]byte{0xd4, 0x01}, mpMap(mpStr("id"), u(1), mpStr("op"), mpStr("ping"))...),
	} {
		_, err := decodeReq(t, body)
		wantCode(t, err, CodeBadRequest)
	}
}

// TestUnknownFieldLongNameIgnored: an unknown field's name may be any length the frame
// holds, at the top level and in an inline limit; the request is decoded without
// allocating for it.
func TestUnknownFieldLongNameIgnored(t *testing.T) {
	for _, n := range []int{256, 257, 1000, 1 << 16, DefaultMaxFrame - 64} {
		long := strings.Repeat("k", n)
		limit := mpMap(mpStr("key"), mpStr("k"), mpStr(long), mpMap(mpStr(long), u(1)), mpStr("limit"), u(1), mpStr("window_ms"), u(100))
		for _, tc := range []struct {
			where string
			body  []byte
		}{
			{"top", mpMap(mpStr("id"), u(4), mpStr("op"), mpStr("ping"), mpStr(long), u(1))},
			{"top first", mpMap(mpStr(long), u(1), mpStr("id"), u(4), mpStr("op"), mpStr("ping"))},
			{"nested", mpMap(mpStr("id"), u(4), mpStr("op"), mpStr("ping"), mpStr("x"), mpMap(mpStr(long), mpStr(long)))},
			{"inline limit", mpMap(mpStr("id"), u(4), mpStr("op"), mpStr("check"), mpStr("limits"), append([]byte{0x91}, limit...))},
		} {
			t.Run(tc.where, func(t *testing.T) {
				req, err := decodeReq(t, tc.body)
				if err != nil {
					t.Fatalf("name of %d bytes: %v", n, err)
				}
				if req.ID != 4 || (tc.where == "inline limit" && (len(req.Limits) != 1 || req.Limits[0] != (InlineLimit{Key: "k", Limit: 1, WindowMs: 100}))) {
					t.Fatalf("name of %d bytes: decoded %+v", n, req)
				}
				dec := NewDecoder()
				var got Request
				if a := testing.AllocsPerRun(20, func() { _ = dec.DecodeRequest(tc.body, &got) }); a != 0 {
					t.Fatalf("name of %d bytes: %v allocs per decode, want 0", n, a)
				}
			})
		}
	}
	// A long unknown name before the id: an error later in the request still echoes it.
	long := strings.Repeat("k", 300)
	req, err := decodeReq(t, mpMap(mpStr(long), u(1), mpStr("id"), u(9), mpStr("cost"), mpStr("x")))
	wantCode(t, err, CodeBadRequest)
	if req.ID != 9 {
		t.Fatalf("id %d, want 9", req.ID)
	}
	// A name longer than the body holds is a truncated body, and its error message quotes
	// no more than a little of it.
	body := mpMap(mpStr("id"), u(5), mpStr("op"), mpStr("ping"), mpStr(long), u(1))
	_, err = decodeReq(t, body[:len(body)-2])
	wantCode(t, err, CodeBadRequest)
	body = mpMap(mpStr("id"), u(5), mpStr("op"), mpStr("ping"), mpStr(long), []byte{0x91})
	_, err = decodeReq(t, body)
	wantCode(t, err, CodeBadRequest)
	if len(err.Error()) > 200 {
		t.Fatalf("message of %d bytes quotes the whole name: %s", len(err.Error()), err)
	}
}

// TestLongOpAlgorithmMode: op, an inline limit's algorithm and its mode are read whatever
// their length (bounded by the frame), so the daemon answers unknown_op and
// invalid_limit for them as it does for short unknown values.
func TestLongOpAlgorithmMode(t *testing.T) {
	for _, n := range []int{64, 65, 255, 256, 1000, 1 << 16} {
		long := strings.Repeat("x", n)
		req, err := decodeReq(t, mpMap(mpStr("id"), u(6), mpStr("op"), mpStr(long)))
		if err != nil || req.Op != long || req.ID != 6 {
			t.Fatalf("op of %d bytes: %v (op of %d bytes)", n, err, len(req.Op))
		}
		// as bin
		bin := append([]byte{0xc5, byte(n >> 8), byte(n)}, long...)
		if n < 256 {
			bin = append([]byte{0xc4, byte(n)}, long...)
		}
		if n < 1<<16 {
			req, err = decodeReq(t, mpMap(mpStr("id"), u(6), mpStr("op"), bin))
			if err != nil || req.Op != long {
				t.Fatalf("op of %d bytes as bin: %v", n, err)
			}
		}
		for _, field := range []string{"algorithm", "mode"} {
			body := mpMap(mpStr("id"), u(7), mpStr("op"), mpStr("check"), mpStr("limits"),
				append([]byte{0x91}, mpMap(mpStr("key"), mpStr("k"), mpStr("limit"), u(1), mpStr("window_ms"), u(100), mpStr(field), mpStr(long))...))
			req, err := decodeReq(t, body)
			if err != nil || len(req.Limits) != 1 {
				t.Fatalf("%s of %d bytes: %v", field, n, err)
			}
			got := req.Limits[0].Algorithm
			if field == "mode" {
				got = req.Limits[0].Mode
			}
			if got != long {
				t.Fatalf("%s of %d bytes decoded as %d bytes", field, n, len(got))
			}
		}
	}
}

// TestUnknownFieldsInResponse: a response decoder (the clients') skips the same unknown
// fields: extension values and long names.
func TestUnknownFieldsInResponse(t *testing.T) {
	long := strings.Repeat("r", 300)
	for name, body := range map[string][]byte{
		"ext":       mpMap(mpStr("id"), u(1), mpStr("protocol"), u(1), mpStr("x"), extValues["timestamp64"]),
		"long name": mpMap(mpStr("id"), u(1), mpStr("protocol"), u(1), mpStr(long), u(1)),
		"rules[]":   mpMap(mpStr("id"), u(1), mpStr("protocol"), u(1), mpStr("rules"), append([]byte{0x91}, mpMap(mpStr(long), extValues["fixext1"], mpStr("name"), mpStr("n"))...)),
	} {
		t.Run(name, func(t *testing.T) {
			var resp Response
			if err := NewDecoder().DecodeResponse(body, &resp); err != nil || resp.ID != 1 || resp.Protocol != 1 {
				t.Fatalf("%x: %v, %+v", body, err, resp)
			}
		})
	}
}

// TestQuote: a value from a request is quoted whole up to MaxQuoted bytes, else its start
// (never half a character) and its length.
func TestQuote(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", `""`},
		{"frob", `"frob"`},
		{strings.Repeat("x", 64), `"` + strings.Repeat("x", 64) + `"`},
		{strings.Repeat("x", 65), `"` + strings.Repeat("x", 64) + `"… (65 bytes)`},
		{strings.Repeat("x", 62) + "ключ", `"` + strings.Repeat("x", 62) + `к"… (70 bytes)`},
		{strings.Repeat("x", 63) + "ключ", `"` + strings.Repeat("x", 63) + `"… (71 bytes)`},
		{strings.Repeat("\xff", 65), `"` + strings.Repeat(`\xff`, 64) + `"… (65 bytes)`},
	} {
		if got := Quote(tc.in); got != tc.want {
			t.Errorf("Quote(%.20q…) = %s, want %s", tc.in, got, tc.want)
		}
	}
}

// TestUnknownFieldNestingBound: an unknown field's value nests up to 32 levels of arrays
// and maps, as proto/PROTOCOL.md says; 33 is bad_request (before, 33 passed and 34 did
// not). In an inline limit the same.
func TestUnknownFieldNestingBound(t *testing.T) {
	// levels arrays (or maps), each holding the next; the innermost holds nil, or is
	// empty (then the scalars inside no longer counted: 33 empty-ended levels passed).
	value := func(maps, empty bool, levels int) []byte {
		var b []byte
		for range levels - 1 {
			if maps {
				b = append(b, 0x81, 0xc0) // {nil: the next level}
			} else {
				b = append(b, 0x91) // [the next level]
			}
		}
		switch {
		case empty && maps:
			return append(b, 0x80)
		case empty:
			return append(b, 0x90)
		case maps:
			return append(b, 0x81, 0xc0, 0xc0)
		}
		return append(b, 0x91, 0xc0)
	}
	for _, c := range []struct{ maps, empty bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
		maps := c.maps
		for _, levels := range []int{32, 33} {
			v := value(maps, c.empty, levels)
			for _, where := range []string{"top", "inline limit"} {
				body := mpMap(mpStr("id"), u(4), mpStr("op"), mpStr("ping"), mpStr("x"), v)
				if where == "inline limit" {
					limit := mpMap(mpStr("key"), mpStr("k"), mpStr("x"), v, mpStr("limit"), u(1), mpStr("window_ms"), u(100))
					body = mpMap(mpStr("id"), u(4), mpStr("op"), mpStr("check"), mpStr("limits"), append([]byte{0x91}, limit...))
				}
				_, err := decodeReq(t, body)
				if levels <= 32 && err != nil {
					t.Errorf("maps %v, empty %v, %d levels, %s: %v", maps, c.empty, levels, where, err)
				}
				if levels > 32 && err == nil {
					t.Errorf("maps %v, empty %v, %d levels, %s: no error", maps, c.empty, levels, where)
				}
				if levels > 32 {
					wantCode(t, err, CodeBadRequest)
				}
			}
		}
	}
}
