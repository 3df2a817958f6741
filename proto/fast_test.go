package proto

import (
	"bytes"
	"encoding/hex"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

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
	} {
		enc := NewEncoder()
		enc.EncodeRequest(&req)
		seeds = append(seeds, append([]byte(nil), enc.Bytes()[HeaderSize:]...))
	}
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
	add("")
	add("c0")
	return seeds
}

func sameRequest(a, b *Request) bool {
	return a.ID == b.ID && a.Op == b.Op && a.Cost == b.Cost &&
		len(a.Attrs) == len(b.Attrs) && (len(a.Attrs) == 0 || reflect.DeepEqual(a.Attrs, b.Attrs)) &&
		len(a.Limits) == len(b.Limits) && (len(a.Limits) == 0 || reflect.DeepEqual(a.Limits, b.Limits))
}

// checkDifferential is the property: DecodeRequest (fast path, msgpack fallback) and the
// msgpack path alone give the same request or the same error for body; and whenever the
// fast path accepts, msgpack accepts the same request.
func checkDifferential(t *testing.T, body []byte) {
	t.Helper()
	fast, slow, both := NewDecoder(), NewDecoder(), NewDecoder()
	var fr, sr, br Request
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
	if (serr == nil) != (berr == nil) || (serr != nil && serr.Error() != berr.Error()) {
		t.Fatalf("%x: DecodeRequest says %v, msgpack %v", body, berr, serr)
	}
	if serr == nil && !sameRequest(&br, &sr) {
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
	for _, req := range []Request{sampleRequest(), {ID: 1, Op: OpPing, Cost: 1}, {ID: 1 << 62, Op: OpCheck, Cost: 0}} {
		enc := NewEncoder()
		enc.EncodeRequest(&req)
		var got Request
		got.Reset()
		if !NewDecoder().decodeFast(enc.Bytes()[HeaderSize:], &got) || !sameRequest(&got, &req) {
			t.Fatalf("fast path declined or changed %+v: %+v", req, got)
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
