package envoyrls

import (
	"bytes"
	"context"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
	"unsafe"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	gproto "google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// The hand-written wire code is checked against google.golang.org/protobuf, the
// reference: a random request marshaled by it parses to what its own unmarshal gives
// (through fromProto), also with unknown fields, repeated message fields to merge and
// scalars to override spliced in; a random answer encoded by appendResponse unmarshals
// to toProto's message; a malformed request is refused by both or by neither.

var words = []string{"", "a", "user", "api", "héllo", "x,y", strings.Repeat("k", 200), "\x00", "a@@@b"}

func randString(r *rand.Rand) string {
	if r.IntN(4) == 0 {
		b := make([]byte, r.IntN(300))
		for i := range b {
			b[i] = byte('a' + r.IntN(26))
		}
		return string(b)
	}
	return words[r.IntN(len(words))]
}

func randRequest(r *rand.Rand) *rlsv3.RateLimitRequest {
	req := &rlsv3.RateLimitRequest{Domain: randString(r), HitsAddend: r.Uint32N(3) * r.Uint32()}
	for range r.IntN(5) {
		d := &commonrl.RateLimitDescriptor{IsNegativeHits: r.IntN(8) == 0}
		for range r.IntN(4) {
			d.Entries = append(d.Entries, &commonrl.RateLimitDescriptor_Entry{Key: randString(r), Value: randString(r)})
		}
		if r.IntN(3) == 0 {
			d.HitsAddend = wrapperspb.UInt64(r.Uint64N(3) * r.Uint64())
		}
		if r.IntN(3) == 0 {
			d.Limit = &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: r.Uint32N(2) * r.Uint32(), Unit: typev3.RateLimitUnit(r.IntN(9) - 1)}
			if r.IntN(2) == 0 {
				d.Limit.UnitMultiplier = wrapperspb.UInt32(r.Uint32N(3))
			}
		}
		req.Descriptors = append(req.Descriptors, d)
	}
	return req
}

// noise returns wire bytes of fields the server does not read: unknown numbers of every
// wire type, and known numbers with the wrong wire type.
func noise(r *rand.Rand) []byte {
	var b []byte
	for range r.IntN(3) {
		num := protowire.Number(r.IntN(8) + 1)
		if r.IntN(2) == 0 {
			num = protowire.Number(r.IntN(1000) + 100)
		}
		switch r.IntN(5) {
		case 0:
			b = protowire.AppendVarint(protowire.AppendTag(b, num, protowire.VarintType), r.Uint64())
		case 1:
			b = protowire.AppendFixed32(protowire.AppendTag(b, num, protowire.Fixed32Type), r.Uint32())
		case 2:
			b = protowire.AppendFixed64(protowire.AppendTag(b, num, protowire.Fixed64Type), r.Uint64())
		case 3:
			if num < 5 {
				num += 100 // a bytes field of a known number would be read
			}
			b = protowire.AppendString(protowire.AppendTag(b, num, protowire.BytesType), "noise")
		case 4:
			b = protowire.AppendTag(b, num, protowire.StartGroupType)
			b = protowire.AppendVarint(protowire.AppendTag(b, 1, protowire.VarintType), 7)
			b = protowire.AppendTag(b, num, protowire.EndGroupType)
		}
	}
	return b
}

// splice marshals m with noise between its fields, at every level the server reads.
func splice(r *rand.Rand, m *rlsv3.RateLimitRequest) []byte {
	var b []byte
	b = append(b, noise(r)...)
	if m.Domain != "" {
		b = protowire.AppendString(protowire.AppendTag(b, 1, protowire.BytesType), m.Domain)
	}
	for _, d := range m.Descriptors {
		var db []byte
		for _, e := range d.Entries {
			eb := append(noise(r), marshal(e)...)
			db = protowire.AppendBytes(protowire.AppendTag(db, 1, protowire.BytesType), eb)
			db = append(db, noise(r)...)
		}
		db = append(db, marshal(&commonrl.RateLimitDescriptor{Limit: d.Limit, HitsAddend: d.HitsAddend, IsNegativeHits: d.IsNegativeHits})...)
		b = protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), db)
		b = append(b, noise(r)...)
	}
	if m.HitsAddend != 0 {
		b = protowire.AppendVarint(protowire.AppendTag(b, 3, protowire.VarintType), uint64(m.HitsAddend))
	}
	return b
}

func marshal(m gproto.Message) []byte {
	b, err := gproto.Marshal(m)
	if err != nil {
		panic(err)
	}
	// The word "a@@@b" becomes bytes that are not UTF-8, of the same length (protobuf
	// does not marshal such strings): a value of them is read as it is, a domain or a
	// key is refused (parseEntry).
	return bytes.ReplaceAll(b, []byte("@@@"), []byte("\xff\xfe\xfd"))
}

// agree parses b with parseRequest and with google.golang.org/protobuf (then fromProto),
// and fails unless both refuse it or both read the same call.
//
// The one departure: an entry's value need not be valid UTF-8 (parseEntry). When
// parseRequest reads a call with such values, protobuf reads b with each of them
// overwritten in place by as many 'x's (its strings alias the copy parseRequest read, so
// their offsets are known), and the calls must agree with the values put back.
func agree(t *testing.T, b []byte) {
	t.Helper()
	var got call
	buf := append([]byte(nil), b...)
	gotErr := parseRequest(buf, &got)
	var patched []int // entries whose values were overwritten
	if gotErr == nil {
		var fixed []byte
		for i, e := range got.entries {
			if utf8.ValidString(e.value) {
				continue
			}
			if fixed == nil {
				fixed = append([]byte(nil), b...)
			}
			off := int(uintptr(unsafe.Pointer(unsafe.StringData(e.value))) - uintptr(unsafe.Pointer(&buf[0])))
			copy(fixed[off:], strings.Repeat("x", len(e.value)))
			patched = append(patched, i)
		}
		if fixed != nil {
			b = fixed
		}
	}
	var ref rlsv3.RateLimitRequest
	refErr := gproto.Unmarshal(b, &ref)
	if (gotErr != nil) != (refErr != nil) {
		t.Fatalf("parseRequest(%x): error %v; protobuf: error %v", b, gotErr, refErr)
	}
	if gotErr != nil {
		return
	}
	var want call
	if err := fromProto(&ref, &want); err != nil {
		t.Fatalf("fromProto: %v", err)
	}
	for _, i := range patched {
		if i >= len(want.entries) || want.entries[i].value != strings.Repeat("x", len(got.entries[i].value)) {
			t.Fatalf("parseRequest(%x): entry %d's value %q is not where protobuf reads one", b, i, got.entries[i].value)
		}
		want.entries[i].value = got.entries[i].value
	}
	if !reflect.DeepEqual(norm(got), norm(want)) {
		t.Fatalf("parseRequest(%x)\n got %+v\nwant %+v", b, got, want)
	}
}

// norm makes empty and nil slices alike.
func norm(c call) call {
	if len(c.descs) == 0 {
		c.descs = nil
	}
	if len(c.entries) == 0 {
		c.entries = nil
	}
	return c
}

func TestParseRequestMatchesProtobuf(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 1))
	for range 3000 {
		req := randRequest(r)
		agree(t, marshal(req))
		agree(t, splice(r, req))
		// Two messages back to back merge: scalars overridden, repeated fields appended,
		// message fields merged.
		agree(t, append(marshal(req), splice(r, randRequest(r))...))
	}
}

func TestParseRequestMergesOverrides(t *testing.T) {
	// The same descriptor's limit and hits_addend given twice: merged field by field.
	var d []byte
	d = protowire.AppendBytes(protowire.AppendTag(d, 2, protowire.BytesType), marshal(&commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 5, UnitMultiplier: wrapperspb.UInt32(3)}))
	d = protowire.AppendBytes(protowire.AppendTag(d, 2, protowire.BytesType), marshal(&commonrl.RateLimitDescriptor_RateLimitOverride{Unit: typev3.RateLimitUnit_MINUTE}))
	d = protowire.AppendBytes(protowire.AppendTag(d, 3, protowire.BytesType), marshal(wrapperspb.UInt64(9)))
	d = protowire.AppendBytes(protowire.AppendTag(d, 3, protowire.BytesType), nil)
	b := protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), d)
	agree(t, b)
	var c call
	if err := parseRequest(b, &c); err != nil {
		t.Fatal(err)
	}
	want := desc{hasHits: true, hits: 9, hasLimit: true, rpu: 5, unit: int32(typev3.RateLimitUnit_MINUTE), hasMult: true, mult: 3}
	if c.descs[0] != want {
		t.Fatalf("merged descriptor %+v, want %+v", c.descs[0], want)
	}
}

func TestParseRequestMalformed(t *testing.T) {
	valid := marshal(&rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{
		{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: "u1"}}, HitsAddend: wrapperspb.UInt64(2)}}})
	tests := []struct {
		name string
		b    []byte
	}{
		{"bad UTF-8 domain", protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "\xff")},
		{"bad UTF-8 key", protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType),
			protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "a\xc3")))},
		{"field number 0", []byte{0x00, 0x01}},
		{"stray end group", protowire.AppendTag(nil, 9, protowire.EndGroupType)},
		{"unterminated group", protowire.AppendTag(nil, 9, protowire.StartGroupType)},
		{"length past the end", []byte{0x0a, 0x05, 'a'}},
		{"varint cut", []byte{0x18, 0x80}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c call
			if err := parseRequest(tt.b, &c); err == nil {
				t.Fatalf("parseRequest accepted %x", tt.b)
			}
			agree(t, tt.b)
		})
	}
	// Every truncation of a valid message is refused or read exactly as protobuf reads it.
	for i := range valid {
		agree(t, valid[:i])
	}
}

func FuzzParseRequest(f *testing.F) {
	r := rand.New(rand.NewPCG(1, 13))
	for range 20 {
		f.Add(splice(r, randRequest(r)))
	}
	f.Fuzz(func(t *testing.T, b []byte) { agree(t, b) })
}

func randAnswer(r *rand.Rand) *answer {
	a := &answer{over: r.IntN(2) == 0}
	for range r.IntN(5) {
		s := dstatus{over: r.IntN(2) == 0, remaining: r.Uint32N(2) * r.Uint32()}
		if r.IntN(3) > 0 {
			s.hasLimit = true
			s.rpu = r.Uint32N(2) * r.Uint32()
			s.unit = rlsv3.RateLimitResponse_RateLimit_Unit(r.IntN(8))
			s.name = randString(r)
			s.reset = time.Duration(r.Int64N(3) * r.Int64N(400*24*int64(time.Hour)))
			if r.IntN(10) == 0 {
				s.reset = -s.reset
			}
		}
		a.statuses = append(a.statuses, s)
	}
	for range r.IntN(4) {
		a.headers = append(a.headers, hdr{randString(r), []byte(randString(r))})
	}
	if r.IntN(2) == 0 {
		a.body = []byte(randString(r))
	}
	return a
}

func TestAppendResponseMatchesProtobuf(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 2))
	for range 3000 {
		a := randAnswer(r)
		prefix := []byte("junk")
		b := appendResponse(prefix, a)
		if string(b[:len(prefix)]) != "junk" {
			t.Fatalf("appendResponse changed the bytes before it")
		}
		var got rlsv3.RateLimitResponse
		if err := gproto.Unmarshal(b[len(prefix):], &got); err != nil {
			t.Fatalf("appendResponse(%+v): protobuf cannot read it: %v", a, err)
		}
		want := toProto(a)
		if !gproto.Equal(&got, want) {
			t.Fatalf("appendResponse(%+v) reads as\n%v\nwant\n%v", a, &got, want)
		}
		// Deterministic protobuf output is the same bytes: fields in number order, zeros
		// left out.
		ref, err := gproto.MarshalOptions{Deterministic: true}.Marshal(want)
		if err != nil {
			t.Fatal(err)
		}
		if string(ref) != string(b[len(prefix):]) {
			t.Fatalf("appendResponse(%+v)\n= %x\nprotobuf writes %x", a, b[len(prefix):], ref)
		}
	}
}

// TestWireMatchesShouldRateLimit: the gRPC handler's path (request bytes in, response
// bytes out) answers as ShouldRateLimit does with the generated types, on two servers
// with the same rules and the same calls.
func TestWireMatchesShouldRateLimit(t *testing.T) {
	typed, wire := testServer(t), testServer(t)
	var now int64 = 1_700_000_000_123_456_789
	clock := func() int64 { return now }
	typed.now, wire.now = clock, clock
	r := rand.New(rand.NewPCG(13, 3))
	users := []string{"u1", "u2", "u3"}
	for i := range 300 {
		req := randomRequest(r, users)
		now += int64(r.IntN(300)) * int64(time.Millisecond)
		want, wantErr := typed.ShouldRateLimit(context.Background(), req)
		var got rlsv3.RateLimitResponse
		out, gotErr := wireHandler(wire, context.Background(), func(v any) error {
			return newCodec().Unmarshal(memSlice(marshal(req)), v)
		}, nil)
		if (gotErr != nil) != (wantErr != nil) || (gotErr != nil && gotErr.Error() != wantErr.Error()) {
			t.Fatalf("call %d: wire error %v, typed error %v", i, gotErr, wantErr)
		}
		if gotErr != nil {
			continue
		}
		bs, err := newCodec().Marshal(out)
		if err != nil {
			t.Fatal(err)
		}
		if err := gproto.Unmarshal(bs.Materialize(), &got); err != nil {
			t.Fatal(err)
		}
		if !gproto.Equal(&got, want) {
			t.Fatalf("call %d: wire answer\n%v\ntyped answer\n%v", i, &got, want)
		}
	}
}

func memSlice(b []byte) mem.BufferSlice { return mem.BufferSlice{mem.SliceBuffer(b)} }

// testServer is a server (not listening) with per-user limits of two algorithms, a
// shadow rule and a concurrency-free deny rule.
func testServer(t testing.TB) *Server {
	t.Helper()
	set, err := rules.Parse("t.yaml", []byte(`
rules:
  - name: per-user
    match: { domain: api, descriptor: user }
    key: [domain, user]
    algorithm: fixed_window
    limit: { requests: 5, per: 1s }
  - name: per-user-bucket
    match: { domain: api, descriptor: user }
    key: user
    algorithm: token_bucket
    limit: { requests: 8, per: 2s }
  - name: watch
    match: { domain: api, descriptor: user }
    key: user
    shadow: true
    limit: { requests: 2, per: 1m }
`))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Addr: "unused:0"}, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// randomRequest draws a ShouldRateLimit call of 1–3 descriptors on users: now and then
// with a limit override, or with an empty key (refused as malformed), and hits_addend
// 0–2. The differential tests send the same draws to two servers.
func randomRequest(r *rand.Rand, users []string) *rlsv3.RateLimitRequest {
	req := &rlsv3.RateLimitRequest{Domain: "api", HitsAddend: r.Uint32N(3)}
	for range 1 + r.IntN(3) {
		d := &commonrl.RateLimitDescriptor{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: users[r.IntN(len(users))]}}}
		if r.IntN(5) == 0 {
			d.Limit = &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 3, Unit: typev3.RateLimitUnit_HOUR}
		}
		if r.IntN(20) == 0 {
			d.Entries[0].Key = "" // refused by both
		}
		req.Descriptors = append(req.Descriptors, d)
	}
	return req
}

// A value is read as the bytes it is (an HTTP header copied by Envoy may hold obs-text);
// a key that is not UTF-8 is refused, as protobuf refuses it.
func TestParseRequestValueBytes(t *testing.T) {
	entry := func(k, v string) []byte {
		var e []byte
		e = protowire.AppendString(protowire.AppendTag(e, 1, protowire.BytesType), k)
		e = protowire.AppendString(protowire.AppendTag(e, 2, protowire.BytesType), v)
		d := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), e)
		return protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), d)
	}
	var c call
	if err := parseRequest(entry("path", "/bad\xff\xfe\x00utf8"), &c); err != nil {
		t.Fatalf("a value that is not UTF-8: %v", err)
	}
	if len(c.entries) != 1 || c.entries[0].value != "/bad\xff\xfe\x00utf8" {
		t.Fatalf("entries %q", c.entries)
	}
	agree(t, entry("path", "/bad\xff\xfe\x00utf8"))
	if err := parseRequest(entry("pa\xffth", "v"), &c); err == nil {
		t.Fatal("a key that is not UTF-8 accepted")
	}
}
