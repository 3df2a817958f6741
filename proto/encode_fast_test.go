package proto

import (
	"bytes"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// TestEncodeCheckHeadsMatchesMsgpack: a check answer written the daemon's way — the
// deciding rule's name and limit from its RuleHead (CheckHead.Head, or BeginCheckV1 for
// an answer of the v1 fields only), each entry with a RuleHead, the v1-only ones by
// AppendRuleHeadV1 — gives msgpack/v5's bytes
// (encodeCheckRef) for random answers: values at every msgpack width, names long enough
// for str8 and str16 and heads past a block's 64 bytes, a Head that does not hold the
// rule (not used), and encoders whose buffer is full to the last byte (the grow path).
func TestEncodeCheckHeadsMatchesMsgpack(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	num := func() uint64 {
		switch rng.IntN(4) {
		case 0:
			return uint64(rng.IntN(300))
		case 1:
			return []uint64{127, 128, 255, 256, 65535, 65536, math.MaxUint32, math.MaxUint32 + 1, math.MaxUint64}[rng.IntN(9)]
		case 2:
			return rng.Uint64() >> rng.IntN(64)
		}
		return rng.Uint64()
	}
	str := func() string {
		switch rng.IntN(6) {
		case 0:
			return ""
		case 1:
			return strings.Repeat("n", 31+rng.IntN(3))
		case 2:
			return strings.Repeat("m", 250+rng.IntN(300)) // str8, str16
		case 3:
			if rng.IntN(20) == 0 {
				return strings.Repeat("l", 65530+rng.IntN(10)) // str16, str32
			}
		}
		return strings.Repeat("r", rng.IntN(40))
	}
	for i := range 3000 {
		r := Response{ID: num(), Allowed: rng.IntN(2) == 0, Rule: str(), Limit: num(), Remaining: num(),
			ResetMs: num(), RetryAfterMs: num(), Degraded: rng.IntN(2) == 0}
		if rng.IntN(4) == 0 {
			r.Reason = str()
		}
		if rng.IntN(4) == 0 {
			r.Lease = str()
		}
		r.Warning, r.Banned = rng.IntN(4) == 0, rng.IntN(4) == 0
		if rng.IntN(4) == 0 {
			r.DelayMs = num()
		}
		for range rng.IntN(18) { // past 15: an array16 header
			rr := RuleResult{Name: str(), Limit: num(), WindowMs: num(), Remaining: num(), ResetMs: num(),
				RetryAfterMs: num(), Allowed: rng.IntN(2) == 0, Shadow: rng.IntN(2) == 0}
			if rng.IntN(4) == 0 {
				rr.Reason = str()
			}
			rr.Warning, rr.Banned = rng.IntN(4) == 0, rng.IntN(4) == 0
			if rng.IntN(4) == 0 {
				rr.DelayMs = num()
			}
			rr.Unasked, rr.Concurrency, rr.Degraded = rng.IntN(4) == 0, rng.IntN(4) == 0, rng.IntN(4) == 0
			r.Rules = append(r.Rules, rr)
		}
		enc := NewEncoder()
		switch rng.IntN(3) {
		case 0: // a buffer with no room left: the first write grows it
			enc.buf.b = make([]byte, 0, rng.IntN(200))
			for len(enc.buf.b) < cap(enc.buf.b) {
				enc.buf.b = append(enc.buf.b, 0xee)
			}
		case 1:
			enc.EncodePing(1, "v")
		}
		before := enc.Len()
		prior := bytes.Clone(enc.Bytes())
		h := CheckHead{ID: r.ID, Allowed: r.Allowed, Rule: r.Rule, Limit: r.Limit, Remaining: r.Remaining,
			ResetMs: r.ResetMs, RetryAfterMs: r.RetryAfterMs, Degraded: r.Degraded, Reason: r.Reason,
			Lease: r.Lease, Warning: r.Warning, DelayMs: r.DelayMs, Banned: r.Banned}
		switch rng.IntN(4) {
		case 0: // the deciding rule's head
			h.Head = NewRuleHead(strings.Clone(r.Rule), r.Limit, num())
		case 1: // a head that is not the deciding rule's: not used
			h.Head = NewRuleHead(r.Rule+"x", r.Limit, 1)
		case 2:
			h.Head = NewRuleHead(r.Rule, r.Limit+1, 1)
		}
		// An answer of the v1 fields only, sometimes begun from its values (BeginCheckV1).
		v1 := r.Reason == "" && r.Lease == "" && !r.Warning && r.DelayMs == 0 && !r.Banned && rng.IntN(2) == 0
		if v1 {
			enc.BeginCheckV1(r.ID, r.Allowed, r.Degraded, NewRuleHead(strings.Clone(r.Rule), r.Limit, num()),
				r.Remaining, r.ResetMs, r.RetryAfterMs, len(r.Rules))
		} else {
			enc.BeginCheck(&h, len(r.Rules))
		}
		for j := range r.Rules {
			rr := r.Rules[j]
			head := NewRuleHead(rr.Name, rr.Limit, rr.WindowMs)
			if rr.Reason == "" && !rr.Warning && rr.DelayMs == 0 && !rr.Banned && !rr.Unasked && !rr.Concurrency && !rr.Degraded && rng.IntN(2) == 0 {
				enc.AppendRuleHeadV1(head, rr.Remaining, rr.ResetMs, rr.RetryAfterMs, rr.Allowed, rr.Shadow)
				continue
			}
			rr.Name, rr.Limit, rr.WindowMs = "not read", 1, 2
			enc.AppendRuleHead(head, &rr)
		}
		if v1 {
			enc.EndCheckV1()
		} else {
			enc.EndCheck(&h)
		}
		frame := enc.Bytes()[before:]
		if got, want := frame[HeaderSize:], encodeCheckRef(&r); !bytes.Equal(got, want) {
			k := 0
			for k < len(got) && got[k] == want[k] {
				k++
			}
			t.Fatalf("response %d: %d bytes unlike msgpack's %d, from byte %d: %q against %q", i, len(got), len(want), k, got[max(0, k-20):min(len(got), k+20)], want[max(0, k-20):min(len(want), k+20)])
		}
		var back Response
		if err := NewDecoder().DecodeResponse(frame[HeaderSize:], &back); err != nil || len(back.Rules) != len(r.Rules) {
			t.Fatalf("response %d decoded: %v", i, err)
		}
		for j := range r.Rules {
			if g, w := back.Rules[j], r.Rules[j]; g.Degraded != w.Degraded || g.Unasked != w.Unasked || g.Concurrency != w.Concurrency {
				t.Fatalf("response %d, rule %d decoded %+v, want %+v", i, j, g, w)
			}
		}
		if int(FrameLength(frame)) != len(frame)-HeaderSize {
			t.Fatalf("response %d: frame length %d for a %d-byte body", i, FrameLength(frame), len(frame)-HeaderSize)
		}
		if !bytes.Equal(enc.Bytes()[:before], prior) {
			t.Fatalf("response %d: the bytes before the frame changed", i)
		}
	}
}
