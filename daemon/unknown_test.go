package daemon

import (
	"bytes"
	"context"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/rlsidecar/rlsidecar/proto"
)

// rawStr is s as a msgpack str in its shortest form.
func rawStr(s string) []byte {
	b, err := msgpack.Marshal(s)
	if err != nil {
		panic(err)
	}
	return b
}

// rawMap is a fixmap of the given pairs, each key and value already encoded.
func rawMap(kv ...[]byte) []byte {
	return append([]byte{0x80 | byte(len(kv)/2)}, bytes.Join(kv, nil)...)
}

// TestUnknownFieldsAndLongValues is the contract (shared/PROTOCOL.md) on what the server
// ignores and which code it answers: an unknown field is ignored whatever its value
// (extension values included, nested or not) and whatever the length of its name, at the
// top level or in an inline limit; any op but the four is unknown_op and an inline
// limit's unknown algorithm or mode is invalid_limit, however long. The answers quote no
// more than the start of a long value. The connection stays usable throughout.
func TestUnknownFieldsAndLongValues(t *testing.T) {
	s := startServer(t, Config{})
	defer s.Shutdown(context.Background())
	c, br := dialServer(t, s)
	long := strings.Repeat("k", 257)
	limit := func(kv ...[]byte) []byte {
		return append([]byte{0x91}, rawMap(append([][]byte{rawStr("key"), rawStr("k"), rawStr("limit"), {1}, rawStr("window_ms"), {0xcd, 0x03, 0xe8}}, kv...)...)...)
	}
	for _, tc := range []struct {
		name string
		body []byte
		code string // "" for a ping or check answer
		msg  string // a part of the error message
	}{
		{"ext fixext1", []byte("\x83\xa2id\x01\xa2op\xa4ping\xa1x\xd4\x01\x02"), "", ""},
		{"ext timestamp", []byte("\x83\xa2id\x02\xa2op\xa4ping\xa2ts\xd6\xff\x00\x00\x00\x01"), "", ""},
		{"ext nested in array", []byte("\x83\xa2id\x03\xa2op\xa4ping\xa1x\x91\xd4\x01\x02"), "", ""},
		{"ext nested in map", []byte("\x83\xa2id\x04\xa2op\xa4ping\xa1x\x81\xa1t\xc7\x0c\xff\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01"), "", ""},
		{"ext in inline limit", rawMap(rawStr("id"), []byte{5}, rawStr("op"), rawStr("check"), rawStr("limits"), limit(rawStr("ts"), []byte{0xd6, 0xff, 0, 0, 0, 1})), "", ""},
		{"ext in known field", rawMap(rawStr("id"), []byte{6}, rawStr("op"), rawStr("check"), rawStr("attrs"), []byte{0xd4, 0x01, 0x80}), proto.CodeBadRequest, "attrs"},
		{"long unknown name", rawMap(rawStr("id"), []byte{7}, rawStr("op"), rawStr("ping"), rawStr(long), []byte{1}), "", ""},
		{"very long unknown name", rawMap(rawStr("id"), []byte{8}, rawStr("op"), rawStr("ping"), rawStr(strings.Repeat("n", 60_000)), []byte{1}), "", ""},
		{"long unknown name in inline limit", rawMap(rawStr("id"), []byte{9}, rawStr("op"), rawStr("check"), rawStr("limits"), limit(rawStr(long), []byte{1})), "", ""},
		{"op of 65 bytes", rawMap(rawStr("id"), []byte{10}, rawStr("op"), rawStr(strings.Repeat("x", 65))), proto.CodeUnknownOp, `unknown op "` + strings.Repeat("x", 64) + `"… (65 bytes)`},
		{"op of 60,000 bytes", rawMap(rawStr("id"), []byte{11}, rawStr("op"), rawStr(strings.Repeat("x", 60_000))), proto.CodeUnknownOp, "(60000 bytes)"},
		{"algorithm of 65 bytes", rawMap(rawStr("id"), []byte{12}, rawStr("op"), rawStr("check"), rawStr("limits"), limit(rawStr("algorithm"), rawStr(strings.Repeat("a", 65)))), proto.CodeInvalidLimit, `unknown algorithm "` + strings.Repeat("a", 64) + `"… (65 bytes)`},
		{"short unknown algorithm", rawMap(rawStr("id"), []byte{13}, rawStr("op"), rawStr("check"), rawStr("limits"), limit(rawStr("algorithm"), rawStr("leaky"))), proto.CodeInvalidLimit, `unknown algorithm "leaky"`},
		{"mode of 65 bytes", rawMap(rawStr("id"), []byte{14}, rawStr("op"), rawStr("check"), rawStr("limits"), limit(rawStr("mode"), rawStr(strings.Repeat("m", 65)))), proto.CodeInvalidLimit, `unknown mode "` + strings.Repeat("m", 64) + `"… (65 bytes)`},
		{"short unknown mode", rawMap(rawStr("id"), []byte{15}, rawStr("op"), rawStr("check"), rawStr("limits"), limit(rawStr("mode"), rawStr("nope"))), proto.CodeInvalidLimit, `unknown mode "nope"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			frame := binary.BigEndian.AppendUint32(nil, uint32(len(tc.body)))
			if _, err := c.Write(append(frame, tc.body...)); err != nil {
				t.Fatal(err)
			}
			r := readResponse(t, br)
			switch {
			case tc.code == "" && r.IsError():
				t.Fatalf("got error %s: %s", r.Err.Code, r.Err.Message)
			case tc.code != "" && (r.Err.Code != tc.code || !strings.Contains(r.Err.Message, tc.msg)):
				t.Fatalf("got %+v, want %s with a message holding %q", r.Err, tc.code, tc.msg)
			case len(r.Err.Message) > 300:
				t.Fatalf("a message of %d bytes: %.300s", len(r.Err.Message), r.Err.Message)
			}
			if r.ID == 0 {
				t.Fatalf("id 0: the request's id was not read")
			}
		})
	}
	if r := roundTrip(t, c, br, &proto.Request{ID: 99, Op: proto.OpPing, Cost: 1}); r.IsError() || r.ID != 99 || r.Protocol != proto.Version {
		t.Fatalf("ping after: %+v", r)
	}
}
