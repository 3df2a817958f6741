package daemon

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// The reference for Server.answer: the answer as it was mapped from a Decision before the
// encoder's fast paths (every field through a proto.Response), written by msgpack/v5's
// Encoder in the protocol's fixed field order. TestAnswerMatchesReference compares the
// bytes.

// responseRef is the Response the answer to d encodes: what answer wrote before its fast
// paths (the old answer, kept here as the reference).
func responseRef(s *Server, req *proto.Request, d *limiter.Decision) proto.Response {
	resp := proto.Response{ID: req.ID, Allowed: d.Allowed, Degraded: d.Degraded, Warning: d.Warning,
		DelayMs: ceilMsRef(d.Delay), Banned: d.Banned}
	if d.Deciding >= 0 {
		r := &d.Results[d.Deciding]
		resp.Rule, resp.Limit, resp.Remaining = r.Name, r.Limit, r.Remaining
		resp.ResetMs, resp.RetryAfterMs = ceilMsRef(r.Reset), ceilMsRef(r.RetryAfter)
		if r.Impossible {
			resp.Reason = proto.ReasonCostExceedsCapacity
		}
	}
	resp.Lease = s.lim.LeaseToken(d)
	resp.Rules = []proto.RuleResult{}
	for i := range d.Results {
		r := &d.Results[i]
		rr := proto.RuleResult{Name: r.Name, Limit: r.Limit, WindowMs: uint64(r.Window / time.Millisecond),
			Remaining: r.Remaining, ResetMs: ceilMsRef(r.Reset), RetryAfterMs: ceilMsRef(r.RetryAfter),
			Allowed: r.Allowed, Shadow: r.Shadow, Warning: r.Warning, Banned: r.Banned, DelayMs: ceilMsRef(r.Delay),
			Unasked: r.Unasked, Concurrency: r.Rule != nil && r.Rule.Concurrency}
		if r.Impossible {
			rr.Reason = proto.ReasonCostExceedsCapacity
		}
		resp.Rules = append(resp.Rules, rr)
	}
	return resp
}

// ceilMsRef is ceilMs by its definition: the least whole number of milliseconds not
// shorter than d (0 for d <= 0), with no overflow.
func ceilMsRef(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	q, r := uint64(d)/uint64(time.Millisecond), uint64(d)%uint64(time.Millisecond)
	if r != 0 {
		q++
	}
	return q
}

// encodeRef writes resp as a check answer's frame body through proto's Response encoder
// (Encoder.EncodeCheck), whose bytes proto's own tests hold to msgpack/v5's at every
// width boundary (TestEncodeCheckMatchesMsgpack): the answer written straight from a
// decision must be the same bytes, and decode (proto.Decoder) to the same Response.
func encodeRef(resp *proto.Response) []byte {
	enc := proto.NewEncoder()
	enc.EncodeCheck(resp)
	return append([]byte(nil), enc.Bytes()[proto.HeaderSize:]...)
}

// answerRules are two generations of a rule set (the second a reload: the same names at
// the same indexes, other limits), so that answers mix rules of both, as after a reload.
var answerRules = []string{`
plans: { gold: { per-user: 500, per-ip: 50 } }
rules:
  - name: per-ip
    key: ip
    limit: { requests: 10, per: 1s }
  - name: per-user
    key: user
    limit: { requests: 100, per: 1m }
  - name: a-rule-name-longer-than-thirty-one-bytes
    key: user
    shadow: true
    limit: { requests: 1000000000, per: 1h }
  - name: uploads
    match: { path: /upload }
    key: ip
    concurrency: { max: 2, lease: 30s }
`, `
rules:
  - name: per-ip
    key: ip
    limit: { requests: 20, per: 2s }
  - name: per-user
    key: user
    limit: { requests: 7, per: 1500ms }
  - name: a-rule-name-longer-than-thirty-one-bytes
    key: user
    limit: { requests: 3, per: 24h }
  - name: uploads
    match: { path: /upload }
    key: ip
    concurrency: { max: 3, lease: 1m }
`}

func parseAnswerRules(t testing.TB) []*rules.Rule {
	var all []*rules.Rule
	for i, src := range answerRules {
		set, err := rules.Parse(fmt.Sprintf("answer%d.yaml", i), []byte(src))
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, set.Rules...)
	}
	return all
}

// drawDecision draws a decision as the limiter could make one, and beyond: 0–8 results of
// rules (of either generation) and inline limits, each allowed or refused, shadow,
// impossible, warning, banned or delayed, with values from 0 to the largest (every
// msgpack width), limits varying by plan, and a deciding result or none.
func drawDecision(t *rapid.T, all []*rules.Rule) (proto.Request, limiter.Decision) {
	dur := rapid.OneOf(
		rapid.Just(int64(0)),
		rapid.Int64Range(-int64(time.Hour), int64(time.Hour)),
		rapid.SampledFrom([]int64{1, int64(time.Millisecond) - 1, int64(time.Millisecond), int64(time.Millisecond) + 1,
			127 * int64(time.Millisecond), 128 * int64(time.Millisecond), 65536 * int64(time.Millisecond),
			math.MaxInt64, math.MaxInt64 - 1, math.MinInt64}),
	)
	durOf := func(label string) time.Duration { return time.Duration(dur.Draw(t, label)) }
	num := rapid.OneOf(
		rapid.Uint64Range(0, 300),
		rapid.SampledFrom([]uint64{127, 128, 255, 256, 65535, 65536, math.MaxUint32, math.MaxUint32 + 1, math.MaxUint64}),
		rapid.Uint64(),
	)
	name := rapid.OneOf(
		rapid.StringN(0, 40, -1),
		rapid.StringOfN(rapid.RuneFrom([]rune("ab")), 250, 300, -1), // str8 and str16 names
	)
	n := rapid.IntRange(0, 8).Draw(t, "rules")
	// The policy fields are rarer, as in real answers (most answers have none: answer's
	// common case).
	rare := func(label string) bool { return rapid.IntRange(0, 3).Draw(t, label) == 0 }
	d := limiter.Decision{Allowed: rapid.Bool().Draw(t, "allowed"), Degraded: rapid.Bool().Draw(t, "degraded"),
		Warning: rare("warning"), Banned: rare("banned"), Deciding: rapid.IntRange(-1, n-1).Draw(t, "deciding")}
	if rare("delayed") {
		d.Delay = durOf("delay")
	}
	if rapid.IntRange(0, 3).Draw(t, "leased") == 0 {
		d.Lease = rapid.Uint64Range(1, math.MaxUint64).Draw(t, "lease")
	}
	for i := range n {
		r := limiter.Result{Remaining: num.Draw(t, "remaining"), Reset: durOf("reset"), RetryAfter: durOf("retry"),
			Allowed: rapid.Bool().Draw(t, "rallowed"), Shadow: rapid.Bool().Draw(t, "shadow")}
		if rare("policies") {
			r.Impossible, r.Warning, r.Banned = rapid.Bool().Draw(t, "impossible"), rapid.Bool().Draw(t, "rwarning"), rapid.Bool().Draw(t, "rbanned")
			r.Delay = durOf("rdelay")
		}
		switch rapid.IntRange(0, 4).Draw(t, "kind") {
		case 0: // an inline limit
			r.Name, r.Limit, r.Window = name.Draw(t, "name"), num.Draw(t, "limit"), durOf("window")
		case 1: // a rule's result named otherwise than its rule (not cached)
			r.Rule = rapid.SampledFrom(all).Draw(t, "rule")
			r.Name, r.Limit, r.Window = name.Draw(t, "name"), r.Rule.Requests, r.Rule.Per
		default: // a rule's result: its limit and window, or a plan's, or a split's
			r.Rule = rapid.SampledFrom(all).Draw(t, "rule")
			r.Name, r.Limit, r.Window = r.Rule.Name, r.Rule.Requests, r.Rule.Per
			if rapid.Bool().Draw(t, "plan") {
				r.Limit = rapid.SampledFrom([]uint64{5, 50, 500, 128, 65536, math.MaxUint64}).Draw(t, "planLimit")
			}
			if rapid.IntRange(0, 5).Draw(t, "odd window") == 0 {
				r.Window = durOf("window")
			}
		}
		_ = i
		d.Results = append(d.Results, r)
	}
	return proto.Request{ID: num.Draw(t, "id"), Op: proto.OpCheck}, d
}

// TestAnswerMatchesReference: the fast answer — each rule's constant part from the
// ruleHeads cache, the common entries written from the results' fields — gives the same
// bytes as the reference, msgpack/v5's encoding of the Response the old answer built,
// for random decisions; the bytes decode (msgpack/v5, the client's decoder) to that
// Response; and answers appended after others in one buffer are the same bytes too.
func TestAnswerMatchesReference(t *testing.T) {
	cn := newTestConn(t)
	s := cn.s
	all := parseAnswerRules(t)
	dec := proto.NewDecoder()
	rapid.Check(t, func(t *rapid.T) {
		enc := proto.NewEncoder()
		if rapid.Bool().Draw(t, "prefilled") { // an encoder that has answered before
			enc.EncodePing(1, "v")
		}
		for a := range rapid.IntRange(1, 4).Draw(t, "answers") {
			req, d := drawDecision(t, all)
			want := responseRef(s, &req, &d)
			wantBytes := encodeRef(&want)
			start := enc.Len()
			s.answer(enc, &req, &d, nil, nil)
			frame := enc.Bytes()[start:]
			if len(frame) < proto.HeaderSize || int(proto.FrameLength(frame)) != len(frame)-proto.HeaderSize {
				t.Fatalf("answer %d: frame length %d for %d bytes", a, proto.FrameLength(frame), len(frame))
			}
			if got := frame[proto.HeaderSize:]; !bytes.Equal(got, wantBytes) {
				t.Fatalf("answer %d: bytes differ from the reference\n got %x\nwant %x", a, got, wantBytes)
			}
			var got proto.Response
			if err := dec.DecodeResponse(frame[proto.HeaderSize:], &got); err != nil {
				t.Fatalf("answer %d: decoding: %v", a, err)
			}
			if len(got.Rules) == 0 && len(want.Rules) == 0 {
				got.Rules, want.Rules = nil, nil // none either way
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("answer %d: decoded\n%+v\nwant\n%+v", a, got, want)
			}
		}
	})
}

// TestAnswerLimiterDecisions: answers to the limiter's own decisions — rules with plans,
// a shadow rule, clients from a Zipf draw over a million keys beside a hot one, refusals
// as the small limits run out, impossible costs — are the reference's bytes, before and
// after a reload that changes the rules' limits and windows.
func TestAnswerLimiterDecisions(t *testing.T) {
	sets := make([]*rules.Set, len(answerRules))
	for i, src := range answerRules {
		set, err := rules.Parse(fmt.Sprintf("answer%d.yaml", i), []byte(src))
		if err != nil {
			t.Fatal(err)
		}
		sets[i] = set
	}
	lim := limiter.New(sets[0], localbucket.NewStore(localbucket.Options{}))
	s, err := New(Config{Socket: "unused"}, lim)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	zipf := rand.NewZipf(rng, 1.1, 1, 1_000_000)
	enc := proto.NewEncoder()
	dec := proto.NewDecoder()
	conc := map[bool]int{} // the concurrency rule's entries, allowed and refused
	var d limiter.Decision
	now := time.Now().UnixNano()
	for i := range 20_000 {
		if i == 10_000 {
			lim.SetRules(sets[1])
		}
		user := fmt.Sprintf("user-%d", zipf.Uint64())
		if rng.IntN(4) == 0 {
			user = "hot"
		}
		attrs := []rules.Attr{{Name: "user", Value: user}, {Name: "ip", Value: fmt.Sprintf("10.0.%d.%d", rng.IntN(4), rng.IntN(256))}}
		if rng.IntN(3) == 0 {
			attrs = append(attrs, rules.Attr{Name: "plan", Value: "gold"})
		}
		if rng.IntN(10) == 0 { // a concurrency rule too: its leases are held, so it refuses some
			attrs = append(attrs, rules.Attr{Name: "path", Value: "/upload"})
		}
		cost := uint64(1)
		if rng.IntN(50) == 0 {
			cost = 1_000_000 // more than any limit: impossible
		}
		in := limiter.Input{Attrs: attrs, Cost: cost}
		if rng.IntN(10) == 0 {
			in.Limits = []limiter.Inline{{Key: "inline-" + user, Name: "inline", Limit: 3, WindowMs: 1000}}
		}
		req := proto.Request{ID: uint64(i), Op: proto.OpCheck}
		err := lim.Check(now+int64(i)*int64(time.Millisecond), &in, &d)
		if err != nil {
			t.Fatalf("check %d: %v", i, err)
		}
		want := responseRef(s, &req, &d)
		enc.Reset()
		s.answer(enc, &req, &d, nil, nil)
		if got, wantBytes := enc.Bytes()[proto.HeaderSize:], encodeRef(&want); !bytes.Equal(got, wantBytes) {
			t.Fatalf("check %d (%+v): bytes differ from the reference\n got %x\nwant %x", i, d.Results, got, wantBytes)
		}
		var got proto.Response
		if err := dec.DecodeResponse(enc.Bytes()[proto.HeaderSize:], &got); err != nil {
			t.Fatalf("check %d: decoding: %v", i, err)
		}
		for _, rr := range got.Rules {
			if rr.Concurrency != (rr.Name == "uploads") {
				t.Fatalf("check %d: entry %+v: concurrency is the concurrency rule's only", i, rr)
			}
			if rr.Concurrency {
				conc[rr.Allowed]++
			}
		}
	}
	if conc[true] == 0 || conc[false] == 0 {
		t.Errorf("the concurrency rule allowed %d and refused %d: want some of each", conc[true], conc[false])
	}
}

// TestCeilMsMatchesDivision: ceilMs, the compiler's multiply-and-shift for the division by
// a millisecond, is the exact ceiling for every duration: around each multiple of a
// millisecond across the range, and for random ones.
func TestCeilMsMatchesDivision(t *testing.T) {
	for k := int64(0); k <= math.MaxInt64/int64(time.Millisecond); k = k*2 + 1 {
		for _, d := range []int64{k * int64(time.Millisecond), k*int64(time.Millisecond) - 1, k*int64(time.Millisecond) + 1} {
			if got, want := ceilMs(time.Duration(d)), ceilMsRef(time.Duration(d)); got != want {
				t.Fatalf("ceilMs(%d) = %d, want %d", d, got, want)
			}
		}
	}
	rapid.Check(t, func(t *rapid.T) {
		d := time.Duration(rapid.Int64().Draw(t, "d"))
		if got, want := ceilMs(d), ceilMsRef(d); got != want {
			t.Fatalf("ceilMs(%d) = %d, want %d", d, got, want)
		}
	})
}
