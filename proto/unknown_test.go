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

// TestUnknownFieldsInResponse: a response decoder (the clients') skips the same unknown
// fields: long names.
func TestUnknownFieldsInResponse(t *testing.T) {
	long := strings.Repeat("r", 300)
	for name, body := range map[string][]byte{
		"long name": mpMap(mpStr("id"), u(1), mpStr("protocol"), u(1), mpStr(long), u(1)),
		"rules[]":   mpMap(mpStr("id"), u(1), mpStr("protocol"), u(1), mpStr("rules"), append([]byte{0x91}, mpMap(mpStr(long), u(1), mpStr("name"), mpStr("n"))...)),
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
