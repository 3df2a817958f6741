package envoyrls

import (
	"errors"
	"fmt"
	"time"
	"unicode/utf8"
	"unsafe"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/durationpb"
)

// The wire path. grpc-go's generated handler decodes a RateLimitRequest by reflection into
// a tree of allocated messages and encodes the response the same way; here the server's
// codec (codec, below) hands the handler the request's bytes, which parseRequest reads
// into a pooled call with no allocation (its strings alias the copied bytes), and the
// handler's answer is encoded by appendResponse. Both follow protobuf's rules as
// google.golang.org/protobuf does (unknown fields skipped, a message field seen twice
// merged, a scalar seen twice: the last wins, proto3 strings valid UTF-8), which
// wire_test.go checks on random messages, with one exception: an entry's value is read
// as the bytes it is, UTF-8 or not (parseEntry says why). The generated types remain the model:
// fromProto and toProto map between them and call/answer, for Server.ShouldRateLimit.

// call is one ShouldRateLimit request: what the server reads of a RateLimitRequest.
type call struct {
	domain  string
	hits    uint32
	descs   []desc
	entries []entry
}

// desc is one descriptor: its entries are call.entries[lo:hi].
type desc struct {
	lo, hi   int
	hasHits  bool // hits_addend present (then hits, which may be 0)
	hits     uint64
	hasLimit bool // a limit override (rpu, unit, and unit_multiplier when hasMult)
	rpu      uint32
	unit     int32
	hasMult  bool
	mult     uint32
	negative bool // is_negative_hits
}

type entry struct{ key, value string }

// errUTF8 is protobuf's rule for proto3 strings, as google.golang.org/protobuf applies it.
var errUTF8 = errors.New("string field contains invalid UTF-8")

// str aliases b: valid while b's array is neither changed nor reused.
func str(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// field reads one field's tag; value, for a length-delimited field, its bytes; n the
// bytes consumed in all, negative on malformed input.
func field(b []byte) (num protowire.Number, typ protowire.Type, v uint64, value []byte, n int) {
	num, typ, n = protowire.ConsumeTag(b)
	if n < 0 {
		return 0, 0, 0, nil, n
	}
	var m int
	switch typ {
	case protowire.VarintType:
		v, m = protowire.ConsumeVarint(b[n:])
	case protowire.BytesType:
		value, m = protowire.ConsumeBytes(b[n:])
	default:
		m = protowire.ConsumeFieldValue(num, typ, b[n:])
	}
	if m < 0 {
		return 0, 0, 0, nil, m
	}
	return num, typ, v, value, n + m
}

// parseRequest reads a RateLimitRequest's wire bytes into c, reusing c's slices. c's
// strings alias b.
func parseRequest(b []byte, c *call) error {
	*c = call{descs: c.descs[:0], entries: c.entries[:0]}
	for len(b) > 0 {
		num, typ, v, val, n := field(b)
		if n < 0 {
			return fmt.Errorf("RateLimitRequest: %w", protowire.ParseError(n))
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType:
			if !utf8.Valid(val) {
				return fmt.Errorf("RateLimitRequest.domain: %w", errUTF8)
			}
			c.domain = str(val)
		case num == 2 && typ == protowire.BytesType:
			if err := c.parseDescriptor(val); err != nil {
				return fmt.Errorf("RateLimitRequest.descriptors[%d]: %w", len(c.descs), err)
			}
		case num == 3 && typ == protowire.VarintType:
			c.hits = uint32(v)
		}
	}
	return nil
}

// parseDescriptor appends one RateLimitDescriptor and its entries to c.
func (c *call) parseDescriptor(b []byte) error {
	d := desc{lo: len(c.entries)}
	for len(b) > 0 {
		num, typ, v, val, n := field(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		var err error
		switch {
		case num == 1 && typ == protowire.BytesType:
			err = c.parseEntry(val)
		case num == 2 && typ == protowire.BytesType:
			d.hasLimit = true
			err = d.parseOverride(val)
		case num == 3 && typ == protowire.BytesType:
			d.hasHits = true
			d.hits, err = wrapped(val, d.hits)
		case num == 4 && typ == protowire.VarintType:
			d.negative = v != 0
		}
		if err != nil {
			return err
		}
	}
	d.hi = len(c.entries)
	c.descs = append(c.descs, d)
	return nil
}

// parseEntry appends one RateLimitDescriptor.Entry to c.
func (c *call) parseEntry(b []byte) error {
	var e entry
	for len(b) > 0 {
		num, typ, _, val, n := field(b)
		if n < 0 {
			return fmt.Errorf("entries: %w", protowire.ParseError(n))
		}
		b = b[n:]
		if typ != protowire.BytesType || (num != 1 && num != 2) {
			continue
		}
		// A key must be valid UTF-8, as protobuf requires of a string (keys come from
		// the gateway's configuration). A value is taken as the bytes it is: Envoy copies
		// request headers into values, and an HTTP header may carry bytes that are not
		// UTF-8 (obs-text); refusing the call would let a client whose header holds one
		// such byte pass unlimited, under Envoy's default failure_mode_deny: false.
		if num == 1 && !utf8.Valid(val) {
			return fmt.Errorf("entries: %w", errUTF8)
		}
		if num == 1 {
			e.key = str(val)
		} else {
			e.value = str(val)
		}
	}
	c.entries = append(c.entries, e)
	return nil
}

// parseOverride merges a RateLimitOverride into d.
func (d *desc) parseOverride(b []byte) error {
	for len(b) > 0 {
		num, typ, v, val, n := field(b)
		if n < 0 {
			return fmt.Errorf("limit: %w", protowire.ParseError(n))
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			d.rpu = uint32(v)
		case num == 2 && typ == protowire.VarintType:
			d.unit = int32(v)
		case num == 3 && typ == protowire.BytesType:
			d.hasMult = true
			m, err := wrapped(val, uint64(d.mult))
			if err != nil {
				return fmt.Errorf("limit.unit_multiplier: %w", err)
			}
			d.mult = uint32(m)
		}
	}
	return nil
}

// wrapped merges a google.protobuf.UInt64Value or UInt32Value (field 1, a varint) into
// old.
func wrapped(b []byte, old uint64) (uint64, error) {
	for len(b) > 0 {
		num, typ, v, _, n := field(b)
		if n < 0 {
			return 0, protowire.ParseError(n)
		}
		b = b[n:]
		if num == 1 && typ == protowire.VarintType {
			old = v
		}
	}
	return old, nil
}

// fromProto reads req into c, reusing c's slices (strings shared with req).
func fromProto(req *rlsv3.RateLimitRequest, c *call) error {
	*c = call{domain: req.Domain, hits: req.HitsAddend, descs: c.descs[:0], entries: c.entries[:0]}
	for i, pd := range req.Descriptors {
		if pd == nil {
			return fmt.Errorf("descriptors[%d] is null", i)
		}
		d := desc{lo: len(c.entries), negative: pd.IsNegativeHits}
		for _, e := range pd.Entries {
			c.entries = append(c.entries, entry{e.GetKey(), e.GetValue()})
		}
		d.hi = len(c.entries)
		if pd.HitsAddend != nil {
			d.hasHits, d.hits = true, pd.HitsAddend.Value
		}
		if o := pd.Limit; o != nil {
			d.hasLimit, d.rpu, d.unit = true, o.RequestsPerUnit, int32(o.Unit)
			if o.UnitMultiplier != nil {
				d.hasMult, d.mult = true, o.UnitMultiplier.Value
			}
		}
		c.descs = append(c.descs, d)
	}
	return nil
}

// answer is one ShouldRateLimit response: what the server writes of a
// RateLimitResponse.
type answer struct {
	over     bool
	statuses []dstatus
	headers  []hdr
	body     []byte
}

// dstatus is one descriptor's status; limit and reset are present when hasLimit.
type dstatus struct {
	over      bool
	hasLimit  bool
	rpu       uint32
	unit      rlsv3.RateLimitResponse_RateLimit_Unit
	name      string
	remaining uint32
	reset     time.Duration
}

type hdr struct {
	key   string
	value []byte
}

func code(over bool) uint64 {
	if over {
		return uint64(rlsv3.RateLimitResponse_OVER_LIMIT)
	}
	return uint64(rlsv3.RateLimitResponse_OK)
}

// appendResponse appends a's RateLimitResponse wire bytes to b, fields in number order
// and zero scalars left out, as google.golang.org/protobuf writes them.
func appendResponse(b []byte, a *answer) []byte {
	b = protowire.AppendTag(b, 1, protowire.VarintType)
	b = protowire.AppendVarint(b, code(a.over))
	for i := range a.statuses {
		s := &a.statuses[i]
		var st, m int
		b, st = beginMessage(b, 2)
		b = protowire.AppendTag(b, 1, protowire.VarintType)
		b = protowire.AppendVarint(b, code(s.over))
		if s.hasLimit {
			b, m = beginMessage(b, 2)
			b = appendVarintField(b, 1, uint64(s.rpu))
			b = appendVarintField(b, 2, uint64(s.unit))
			b = appendStringField(b, 3, s.name)
			b = endMessage(b, m)
		}
		b = appendVarintField(b, 3, uint64(s.remaining))
		if s.hasLimit {
			b, m = beginMessage(b, 4)
			// durationpb.New: seconds and nanoseconds of the same sign.
			b = appendVarintField(b, 1, uint64(int64(s.reset/time.Second)))
			b = appendVarintField(b, 2, uint64(int64(int32(s.reset%time.Second))))
			b = endMessage(b, m)
		}
		b = endMessage(b, st)
	}
	for _, h := range a.headers {
		var m int
		b, m = beginMessage(b, 3)
		b = appendStringField(b, 1, h.key)
		if len(h.value) > 0 {
			b = protowire.AppendTag(b, 2, protowire.BytesType)
			b = protowire.AppendBytes(b, h.value)
		}
		b = endMessage(b, m)
	}
	if len(a.body) > 0 {
		b = protowire.AppendTag(b, 5, protowire.BytesType)
		b = protowire.AppendBytes(b, a.body)
	}
	return b
}

func appendVarintField(b []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	return protowire.AppendVarint(protowire.AppendTag(b, num, protowire.VarintType), v)
}

func appendStringField(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	return protowire.AppendString(protowire.AppendTag(b, num, protowire.BytesType), s)
}

// beginMessage appends a message field's tag and a one-byte length to fill in; it
// returns where the message's bytes start, for endMessage.
func beginMessage(b []byte, num protowire.Number) ([]byte, int) {
	b = protowire.AppendTag(b, num, protowire.BytesType)
	b = append(b, 0)
	return b, len(b)
}

// endMessage writes the length of the message begun at start, moving its bytes when the
// length takes more than one byte.
func endMessage(b []byte, start int) []byte {
	n := len(b) - start
	if n < 0x80 {
		b[start-1] = byte(n)
		return b
	}
	k := protowire.SizeVarint(uint64(n))
	b = append(b, make([]byte, k-1)...)
	copy(b[start+k-1:], b[start:start+n])
	protowire.AppendVarint(b[:start-1], uint64(n))
	return b
}

// toProto is a as the generated type.
func toProto(a *answer) *rlsv3.RateLimitResponse {
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_Code(code(a.over)),
		Statuses: make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(a.statuses))}
	for i := range a.statuses {
		s := &a.statuses[i]
		st := &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_Code(code(s.over)), LimitRemaining: s.remaining}
		if s.hasLimit {
			st.CurrentLimit = &rlsv3.RateLimitResponse_RateLimit{Name: s.name, RequestsPerUnit: s.rpu, Unit: s.unit}
			st.DurationUntilReset = durationpb.New(s.reset)
		}
		resp.Statuses[i] = st
	}
	for _, h := range a.headers {
		resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, &corev3.HeaderValue{Key: h.key, Value: string(h.value)})
	}
	if len(a.body) > 0 {
		resp.RawBody = append([]byte(nil), a.body...)
	}
	return resp
}

// encoded is a response's wire bytes, as the wire handler returns it to the codec.
type encoded []byte

// codec is the server's: a ShouldRateLimit call's request is parsed by parseRequest into
// the scratch the handler passes, and its response is the handler's encoded bytes; every
// other message (the health service's) goes through grpc-go's proto codec.
type codec struct{ proto encoding.CodecV2 }

func newCodec() codec { return codec{proto: encoding.GetCodecV2("proto")} }

func (codec) Name() string { return "proto" }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if e, ok := v.(*encoded); ok {
		return mem.BufferSlice{mem.SliceBuffer(*e)}, nil
	}
	return c.proto.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	sc, ok := v.(*scratch)
	if !ok {
		return c.proto.Unmarshal(data, v)
	}
	n := data.Len()
	if cap(sc.raw) < n {
		sc.raw = make([]byte, n)
	}
	sc.raw = sc.raw[:n]
	data.CopyTo(sc.raw)
	return parseRequest(sc.raw, &sc.call)
}
