package proto

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
)

func sampleRequest() Request {
	return Request{ID: 42, Op: OpCheck, Attrs: []Attr{{"method", "POST"}, {"path", "/v1/events/9/holds"}, {"user", "u-123456"}, {"ip", "203.0.113.9"}}, Cost: 1}
}

func sampleResponse() Response {
	return Response{ID: 42, Allowed: true, Rule: "holds-per-account", Limit: 5, Remaining: 3, ResetMs: 24000,
		Rules: []RuleResult{
			{Name: "per-ip", Limit: 100, WindowMs: 1000, Remaining: 97, ResetMs: 30, Allowed: true},
			{Name: "holds-per-account", Limit: 5, WindowMs: 60000, Remaining: 3, ResetMs: 24000, Allowed: true},
		}}
}

func TestRequestRoundTrip(t *testing.T) {
	req := sampleRequest()
	req.Limits = []InlineLimit{{Key: "k", Limit: 3, WindowMs: 10, Burst: 4, Algorithm: "fixed_window", Mode: "local", Name: "n"}}
	req.Cost = 0
	enc := NewEncoder()
	enc.EncodeRequest(&req)
	var got Request
	if err := NewDecoder().DecodeRequest(enc.Bytes()[HeaderSize:], &got); err != nil {
		t.Fatal(err)
	}
	if got.ID != req.ID || got.Op != req.Op || got.Cost != 0 || len(got.Attrs) != 4 || got.Attrs[2] != req.Attrs[2] || got.Limits[0] != req.Limits[0] {
		t.Fatalf("round trip: got %+v", got)
	}
}

// TestEchoedKeysBound: inline limits without a name, which the answer names by their keys,
// may hold MaxEchoedKeys bytes of keys together and no more; named ones are not counted.
// Before, a daemon whose --max-frame and --max-attr-len allowed it answered a 600,000-byte
// key with a 1,200,180-byte frame, over every client's 1 MiB: the client dropped the
// connection and its failure policy decided that request and the ones after it.
func TestEchoedKeysBound(t *testing.T) {
	for _, tc := range []struct {
		name  string
		keys  []int
		named bool
		ok    bool
	}{
		{"at the bound", []int{MaxEchoedKeys / 2, MaxEchoedKeys / 2}, false, true},
		{"one byte past", []int{MaxEchoedKeys / 2, MaxEchoedKeys/2 + 1}, false, false},
		{"one long key", []int{600000}, false, false},
		{"named", []int{600000}, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := Request{ID: 7, Op: OpCheck, Cost: 1}
			for i, n := range tc.keys {
				l := InlineLimit{Key: string(rune('a'+i)) + string(make([]byte, n-1)), Limit: 1, WindowMs: 1}
				if tc.named {
					l.Name = "n"
				}
				req.Limits = append(req.Limits, l)
			}
			enc := NewEncoder()
			enc.EncodeRequest(&req)
			d := NewDecoder()
			d.MaxAttrLen = 1 << 22
			var got Request
			err := d.DecodeRequest(enc.Bytes()[HeaderSize:], &got)
			var pe *Error
			if tc.ok && err != nil || !tc.ok && (!errors.As(err, &pe) || pe.Code != CodeAttrTooLarge) {
				t.Fatalf("got %v, want ok %v (else attr_too_large)", err, tc.ok)
			}
			if !tc.ok && got.ID != 7 {
				t.Fatalf("id %d, want 7", got.ID)
			}
		})
	}
}

func TestDecodeRequestBounds(t *testing.T) {
	for _, tc := range []struct {
		name string
		mut  func(*Request)
		code string // bad_request when empty
	}{
		{"too many attrs", func(r *Request) {
			for i := 0; i < DefaultMaxAttrs+1; i++ {
				r.Attrs = append(r.Attrs, Attr{Name: string(rune('a'+i%26)) + string(rune('A'+i/26)), Value: "v"})
			}
		}, CodeAttrTooLarge}, // as many as the gateway's client sent headers: 431 too
		{"long name", func(r *Request) { r.Attrs = []Attr{{string(make([]byte, DefaultMaxAttrNameLen+1)), "v"}} }, CodeAttrTooLarge},
		// A value's length is the gateway's client's choice: a code of its own (431).
		{"long value", func(r *Request) { r.Attrs = []Attr{{"user", string(make([]byte, DefaultMaxAttrLen+1))}} }, CodeAttrTooLarge},
		{"long inline key", func(r *Request) {
			r.Limits = []InlineLimit{{Key: string(make([]byte, DefaultMaxAttrLen+1)), Limit: 1, WindowMs: 1}}
		}, CodeAttrTooLarge},
		{"duplicate attr", func(r *Request) { r.Attrs = []Attr{{"user", "a"}, {"user", "b"}} }, ""},
		// Keys an answer would echo as names past the 1 MiB the clients read.
		{"echoed keys", func(r *Request) {
			for i := 0; i < 5; i++ {
				r.Limits = append(r.Limits, InlineLimit{Key: string(rune('a'+i)) + string(make([]byte, MaxEchoedKeys/4)), Limit: 1, WindowMs: 1})
			}
		}, CodeAttrTooLarge},
		// A name is the gateway's choice, not its client's: bad_request.
		{"long inline name", func(r *Request) {
			r.Limits = []InlineLimit{{Key: "k", Limit: 1, WindowMs: 1, Name: string(make([]byte, DefaultMaxAttrNameLen+1))}}
		}, ""},
		{"too many limits", func(r *Request) {
			for i := 0; i < DefaultMaxLimits+1; i++ {
				r.Limits = append(r.Limits, InlineLimit{Key: "k", Limit: 1, WindowMs: 1})
			}
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := Request{ID: 1, Op: OpCheck, Cost: 1}
			tc.mut(&req)
			enc := NewEncoder()
			enc.EncodeRequest(&req)
			var got Request
			d := NewDecoder()
			if tc.name == "echoed keys" {
				d.MaxAttrLen = 1 << 22 // as --max-attr-len may: only the echo bound applies
			}
			err := d.DecodeRequest(enc.Bytes()[HeaderSize:], &got)
			var pe *Error
			want := tc.code
			if want == "" {
				want = CodeBadRequest
			}
			if !errors.As(err, &pe) || pe.Code != want {
				t.Fatalf("got %v, want %s", err, want)
			}
		})
	}
}

func TestReadFrame(t *testing.T) {
	enc := NewEncoder()
	req := sampleRequest()
	enc.EncodeRequest(&req)
	enc.EncodeRequest(&req)
	r := bufio.NewReader(bytes.NewReader(enc.Bytes()))
	var buf []byte
	for i := 0; i < 2; i++ {
		var err error
		buf, err = ReadFrame(r, buf, DefaultMaxFrame)
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ReadFrame(r, buf, DefaultMaxFrame); err == nil {
		t.Fatal("want EOF")
	}
	_, err := ReadFrame(bufio.NewReader(bytes.NewReader([]byte{0, 1, 0, 1})), nil, DefaultMaxFrame)
	var tl *FrameTooLargeError
	if !errors.As(err, &tl) || tl.Length != 65537 {
		t.Fatalf("got %v", err)
	}
}

// The steady state of a connection allocates nothing: decode a request, encode an answer.
func TestCodecAllocs(t *testing.T) {
	req := sampleRequest()
	enc := NewEncoder()
	enc.EncodeRequest(&req)
	frame := append([]byte(nil), enc.Bytes()[HeaderSize:]...)
	resp := sampleResponse()
	dec := NewDecoder()
	var got Request
	out := NewEncoder()
	allocs := testing.AllocsPerRun(1000, func() {
		if err := dec.DecodeRequest(frame, &got); err != nil {
			t.Fatal(err)
		}
		out.Reset()
		out.EncodeCheck(&resp)
	})
	if allocs != 0 {
		t.Fatalf("%v allocs per decode+encode, want 0", allocs)
	}
}

func BenchmarkDecodeRequest(b *testing.B) {
	req := sampleRequest()
	enc := NewEncoder()
	enc.EncodeRequest(&req)
	frame := enc.Bytes()[HeaderSize:]
	dec := NewDecoder()
	var got Request
	b.ReportAllocs()
	for b.Loop() {
		if err := dec.DecodeRequest(frame, &got); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkEncodeCheck(b *testing.B) {
	resp := sampleResponse()
	enc := NewEncoder()
	b.ReportAllocs()
	for b.Loop() {
		enc.Reset()
		enc.EncodeCheck(&resp)
	}
}

// BenchmarkEncodeCheckHeads is BenchmarkEncodeCheck as the daemon encodes the common
// answer (its v1 fields only): written from its values (BeginCheckV1, AppendRuleHeadV1,
// EndCheckV1), each rule's name, limit and window — and the deciding rule's name and
// limit — pre-encoded in a RuleHead, no Response or CheckHead built.
func BenchmarkEncodeCheckHeads(b *testing.B) {
	resp := sampleResponse()
	heads := make([]*RuleHead, len(resp.Rules))
	for i, rr := range resp.Rules {
		heads[i] = NewRuleHead(rr.Name, rr.Limit, rr.WindowMs)
	}
	deciding := heads[1] // holds-per-account
	enc := NewEncoder()
	b.ReportAllocs()
	for b.Loop() {
		enc.Reset()
		enc.BeginCheckV1(resp.ID, resp.Allowed, resp.Degraded, deciding, resp.Remaining, resp.ResetMs, resp.RetryAfterMs, len(resp.Rules))
		for i := range resp.Rules {
			rr := &resp.Rules[i]
			enc.AppendRuleHeadV1(heads[i], rr.Remaining, rr.ResetMs, rr.RetryAfterMs, rr.Allowed, rr.Shadow)
		}
		enc.EndCheckV1()
	}
}

// TestEncodeCheckHeadsBenchmarkBytes: what BenchmarkEncodeCheckHeads writes is the sample
// answer's msgpack.
func TestEncodeCheckHeadsBenchmarkBytes(t *testing.T) {
	resp := sampleResponse()
	enc := NewEncoder()
	enc.BeginCheckV1(resp.ID, resp.Allowed, resp.Degraded, NewRuleHead(resp.Rule, resp.Limit, 60000), resp.Remaining, resp.ResetMs, resp.RetryAfterMs, len(resp.Rules))
	for i := range resp.Rules {
		rr := &resp.Rules[i]
		enc.AppendRuleHeadV1(NewRuleHead(rr.Name, rr.Limit, rr.WindowMs), rr.Remaining, rr.ResetMs, rr.RetryAfterMs, rr.Allowed, rr.Shadow)
	}
	enc.EndCheckV1()
	if got, want := enc.Bytes()[HeaderSize:], encodeCheckRef(&resp); !bytes.Equal(got, want) {
		t.Fatalf("got %x\nwant %x", got, want)
	}
}

func FuzzDecodeRequest(f *testing.F) {
	for _, req := range []Request{sampleRequest(), {ID: 1, Op: OpPing, Cost: 1}} {
		enc := NewEncoder()
		enc.EncodeRequest(&req)
		f.Add(enc.Bytes()[HeaderSize:])
	}
	for _, m := range malformedFrames() {
		if b, err := hex.DecodeString(m.Hex); err == nil && len(b) >= HeaderSize {
			f.Add(b[HeaderSize:])
		}
	}
	f.Add([]byte{0x92, 0x01, 0x02})
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff})
	dec := NewDecoder()
	f.Fuzz(func(t *testing.T, body []byte) {
		var req Request
		err := dec.DecodeRequest(body, &req)
		if err != nil {
			var pe *Error
			if !errors.As(err, &pe) || pe.Code != CodeBadRequest {
				t.Fatalf("decode error is not a bad_request *Error: %v", err)
			}
			return
		}
		// What decodes re-encodes and decodes to the same request.
		enc := NewEncoder()
		enc.EncodeRequest(&req)
		var again Request
		if err := NewDecoder().DecodeRequest(enc.Bytes()[HeaderSize:], &again); err != nil {
			t.Fatalf("re-decoding %x: %v", enc.Bytes(), err)
		}
		if again.ID != req.ID || again.Op != req.Op || again.Cost != req.Cost || len(again.Attrs) != len(req.Attrs) || len(again.Limits) != len(req.Limits) {
			t.Fatalf("round trip changed the request: %+v vs %+v", req, again)
		}
	})
}

func FuzzReadFrame(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 0x80})
	f.Add([]byte{0, 1, 0, 1})
	f.Add([]byte{0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bufio.NewReader(bytes.NewReader(data))
		var buf []byte
		for {
			var err error
			buf, err = ReadFrame(r, buf, 1024)
			if err != nil {
				return
			}
			if len(buf) > 1024 {
				t.Fatalf("body of %d bytes above the max", len(buf))
			}
		}
	})
}

// An op that is present is read as sent, even empty: the server answers an op it does
// not know unknown_op ("" included, as PROTOCOL.md's error table says); only a request
// without "op" is a bad_request. Before, "op": "" was reported as missing.
func TestDecodeRequestOp(t *testing.T) {
	for _, tc := range []struct {
		name string
		body []byte
		op   string
		code string // "" when it decodes
	}{
		{"ping", []byte("\x82\xa2id\x01\xa2op\xa4ping"), OpPing, ""},
		{"empty op", []byte("\x82\xa2id\x01\xa2op\xa0"), "", ""},
		{"empty op as bin", []byte("\x82\xa2id\x01\xa2op\xc4\x00"), "", ""},
		{"unknown op", []byte("\x82\xa2id\x01\xa2op\xa4frob"), "frob", ""},
		{"no op", []byte("\x81\xa2id\x01"), "", CodeBadRequest},
		{"empty map", []byte("\x80"), "", CodeBadRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var req Request
			err := NewDecoder().DecodeRequest(tc.body, &req)
			var pe *Error
			switch {
			case tc.code == "" && err != nil:
				t.Fatalf("got %v, want op %q", err, tc.op)
			case tc.code == "" && req.Op != tc.op:
				t.Fatalf("op %q, want %q", req.Op, tc.op)
			case tc.code != "" && (!errors.As(err, &pe) || pe.Code != tc.code):
				t.Fatalf("got %v, want %s", err, tc.code)
			}
		})
	}
}

// A whole number written as a float is that number wherever an unsigned integer belongs:
// msgpack-lite (JavaScript) writes every number outside the int32 range as a float64 — a
// window of 30 days, an id past 2^31 — so a gateway using it had every such request
// refused bad_request (an id so written came back 0, matching no request). A fraction, a
// negative, NaN, an infinity or 2^64 and above stay a wrong type.
func TestDecodeRequestWholeFloats(t *testing.T) {
	f32 := func(v float32) string {
		return "\xca" + string(binary.BigEndian.AppendUint32(nil, math.Float32bits(v)))
	}
	f64 := func(v float64) string {
		return "\xcb" + string(binary.BigEndian.AppendUint64(nil, math.Float64bits(v)))
	}
	// body is a check (id 9) with the inline limit {key: "k", limit, window_ms, burst},
	// then cost and lease_ms, each field's value given as its msgpack bytes.
	body := func(id, limit, window, burst, cost, leaseMs string) []byte {
		return []byte("\x85\xa2id" + id + "\xa2op\xa5check" +
			"\xa6limits\x91\x84\xa3key\xa1k\xa5limit" + limit + "\xa9window_ms" + window + "\xa5burst" + burst +
			"\xa4cost" + cost + "\xa8lease_ms" + leaseMs)
	}
	for _, tc := range []struct {
		name                                 string
		id, limit, window, burst, cost, ms   string
		wantID, wantLimit, wantWindow, wantB uint64
		wantCost, wantMs                     uint64
	}{
		{"float64 ones", f64(1), f64(1), f64(1), f64(1), f64(1), f64(1), 1, 1, 1, 1, 1, 1},
		{"float32 ones", f32(1), f32(1), f32(1), f32(1), f32(1), f32(1), 1, 1, 1, 1, 1, 1},
		{"msgpack-lite past int32", f64(3e9), f64(5), f64(2592e6), f64(7), f64(0), f64(1e6), 3e9, 5, 2592e6, 7, 0, 1e6},
		{"negative zero", "\x09", "\x05", "\x05", f64(math.Copysign(0, -1)), "\x01", "\x00", 9, 5, 5, 0, 1, 0},
		{"largest whole float64", f64(math.Nextafter(1<<64, 0)), "\x05", "\x05", "\x00", "\x01", "\x00", 1<<64 - 2048, 5, 5, 0, 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var req Request
			if err := NewDecoder().DecodeRequest(body(tc.id, tc.limit, tc.window, tc.burst, tc.cost, tc.ms), &req); err != nil {
				t.Fatal(err)
			}
			l := req.Limits[0]
			if req.ID != tc.wantID || l.Limit != tc.wantLimit || l.WindowMs != tc.wantWindow || l.Burst != tc.wantB || req.Cost != tc.wantCost || req.LeaseMs != tc.wantMs {
				t.Fatalf("got id %d limit %d window_ms %d burst %d cost %d lease_ms %d", req.ID, l.Limit, l.WindowMs, l.Burst, req.Cost, req.LeaseMs)
			}
		})
	}
	names := []string{"id", "limits[].limit", "limits[].window_ms", "limits[].burst", "cost", "lease_ms"}
	ints := []string{"\x09", "\x05", "\x05", "\x00", "\x01", "\x00"}
	var req Request
	if err := NewDecoder().DecodeRequest(body(ints[0], ints[1], ints[2], ints[3], ints[4], ints[5]), &req); err != nil {
		t.Fatalf("with integers: %v", err)
	}
	for _, v := range []string{f64(1.5), f32(0.5), f64(-1), f32(-3), f64(math.NaN()), f64(math.Inf(1)), f64(math.Inf(-1)), f64(1 << 64), f64(1e30)} {
		for field := 0; field < 6; field++ {
			vals := slices.Clone(ints)
			vals[field] = v
			t.Run("", func(t *testing.T) {
				var req Request
				err := NewDecoder().DecodeRequest(body(vals[0], vals[1], vals[2], vals[3], vals[4], vals[5]), &req)
				var pe *Error
				if !errors.As(err, &pe) || pe.Code != CodeBadRequest || !strings.HasPrefix(pe.Message, names[field]+" must be an unsigned integer") && !strings.HasSuffix(pe.Message, "inside "+names[field]+": the body is not one complete msgpack map") {
					t.Fatalf("field %d as % x: got %v, want bad_request", field, v, err)
				}
				if field > 0 && req.ID != 9 {
					t.Fatalf("field %d as % x: id %d, want 9", field, v, req.ID)
				}
			})
		}
	}
}

// An inline limit's optional fields (burst, algorithm, mode, name) given as nil are left
// out, as a JavaScript encoder writes a property set to undefined ({burst: opts.burst});
// before, each was bad_request. A required field as nil, and nil anywhere else the table
// does not allow it, stays a wrong type.
func TestDecodeRequestNilOptionalLimitFields(t *testing.T) {
	body := func(extra string, n byte) []byte {
		return []byte("\x83\xa2id\x07\xa2op\xa5check\xa6limits\x91" + string([]byte{0x80 + n}) +
			"\xa3key\xa1k\xa5limit\x05\xa9window_ms\xcd\x03\xe8" + extra)
	}
	all := "\xa5burst\xc0\xa9algorithm\xc0\xa4mode\xc0\xa4name\xc0"
	var req Request
	if err := NewDecoder().DecodeRequest(body(all, 7), &req); err != nil {
		t.Fatal(err)
	}
	if l := req.Limits[0]; l != (InlineLimit{Key: "k", Limit: 5, WindowMs: 1000}) {
		t.Fatalf("got %+v", l)
	}
	// Left out once is still once: a second burst after the nil is a repeated field.
	if err := NewDecoder().DecodeRequest(body("\xa5burst\xc0\xa5burst\x03", 5), &req); err == nil || !strings.Contains(err.Error(), "burst") {
		t.Fatalf("burst nil then 3: %v, want a repeated field's bad_request", err)
	}
	for _, tc := range []struct{ name, body string }{
		{"key", "\x83\xa2id\x07\xa2op\xa5check\xa6limits\x91\x83\xa3key\xc0\xa5limit\x05\xa9window_ms\x05"},
		{"limit", "\x83\xa2id\x07\xa2op\xa5check\xa6limits\x91\x83\xa3key\xa1k\xa5limit\xc0\xa9window_ms\x05"},
		{"window_ms", "\x83\xa2id\x07\xa2op\xa5check\xa6limits\x91\x83\xa3key\xa1k\xa5limit\x05\xa9window_ms\xc0"},
		{"cost", "\x83\xa2id\x07\xa2op\xa5check\xa4cost\xc0"},
	} {
		err := NewDecoder().DecodeRequest([]byte(tc.body), &req)
		var pe *Error
		if !errors.As(err, &pe) || pe.Code != CodeBadRequest || !strings.Contains(pe.Message, tc.name) {
			t.Errorf("%s as nil: %v, want bad_request naming it", tc.name, err)
		}
	}
}

// A length or count that the rest of the body cannot hold is a truncated body, whatever it
// claims: bad_request, the code the contract gives a body that is not one complete msgpack
// map, not attr_too_large (which a gateway answers with 431 as though its client had sent
// too much). Before, an attrs map or a string claiming 4G was judged by its bound first.
func TestDecodeTruncatedClaimIsBadRequest(t *testing.T) {
	head := []byte{0x83, 0xa2, 'i', 'd', 0x07, 0xa2, 'o', 'p', 0xa5, 'c', 'h', 'e', 'c', 'k'}
	// Each body its own copy: appends to one prefix would share its array.
	attrs := slices.Clip(append(slices.Clone(head), 0xa5, 'a', 't', 't', 'r', 's'))
	limits := slices.Clip(append(slices.Clone(head), 0xa6, 'l', 'i', 'm', 'i', 't', 's', 0x91, 0x81, 0xa3, 'k', 'e', 'y'))
	for _, tc := range []struct {
		name string
		body []byte
	}{
		{"attrs map claiming 4G entries", append(attrs, 0xdf, 0xff, 0xff, 0xff, 0xff, 0xa4, 'u', 's', 'e', 'r')},
		{"attrs map claiming 65 entries, holding 1", append(attrs, 0xde, 0x00, 65, 0xa4, 'u', 's', 'e', 'r', 0xa1, 'u')},
		{"attr value claiming 4G bytes", append(attrs, 0x81, 0xa4, 'u', 's', 'e', 'r', 0xdb, 0xff, 0xff, 0xff, 0xff, 'x')},
		{"attr name claiming 4G bytes", append(attrs, 0x81, 0xdb, 0xff, 0xff, 0xff, 0xff, 'x')},
		{"inline key claiming 4G bytes", append(limits, 0xdb, 0xff, 0xff, 0xff, 0xff, 'x')},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got Request
			err := NewDecoder().DecodeRequest(tc.body, &got)
			var pe *Error
			if !errors.As(err, &pe) || pe.Code != CodeBadRequest || !strings.Contains(pe.Message, "frame ends inside") {
				t.Fatalf("got %v; want bad_request, the frame ending inside it", err)
			}
			if got.ID != 7 {
				t.Fatalf("id %d, want 7 echoed", got.ID)
			}
		})
	}
}

// An error answer echoes the request's id wherever it is in the map, also after a key
// that is not a string: before, such a key stopped the search, and the answer said 0
// where any other fault before the id left it echoed.
func TestDecodeErrorEchoesIDAfterANonStringKey(t *testing.T) {
	rest := []byte{0xa2, 'i', 'd', 0xcd, 0x01, 0x2c, 0xa2, 'o', 'p', 0xa4, 'p', 'i', 'n', 'g'} // id 300, op ping
	for _, tc := range []struct {
		name string
		key  []byte
	}{
		{"a number", []byte{0x05, 0x01}},
		{"nil", []byte{0xc0, 0xa1, 'v'}},
		{"an array", []byte{0x92, 0x01, 0xa1, 'x', 0x80}},
		{"a map", []byte{0x81, 0xa1, 'k', 0x02, 0xc3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := slices.Concat([]byte{0x83}, tc.key, rest)
			var got Request
			err := NewDecoder().DecodeRequest(body, &got)
			var pe *Error
			if !errors.As(err, &pe) || pe.Code != CodeBadRequest {
				t.Fatalf("got %v; want bad_request", err)
			}
			if got.ID != 300 {
				t.Fatalf("id %d, want 300 echoed (%v)", got.ID, err)
			}
		})
	}
	// A key that cannot be passed over (truncated) leaves no id to echo.
	var got Request
	if err := NewDecoder().DecodeRequest([]byte{0x82, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xa2, 'i', 'd', 0x07}, &got); err == nil || got.ID != 0 {
		t.Fatalf("a key claiming 4G items: id %d, err %v; want 0 and an error", got.ID, err)
	}
}
