package proto

import (
	"bytes"
	"errors"
	"io"
	"math"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Default bounds a Decoder applies to a request; a request beyond them is a bad_request.
const (
	DefaultMaxAttrs       = 64
	DefaultMaxAttrNameLen = 128
	DefaultMaxAttrLen     = 65536 // a frame's worth: a long path is limited, not refused
	DefaultMaxLimits      = 16
)

// MaxAnswerFrame is the largest answer frame every client reads (Go, Python, Node and
// the Lua clients: 1 MiB); a longer one breaks their connection, and their failure
// policy then decides that request and the others on it. An answer names each inline
// limit, by its key when it has no name (the deciding one twice), so the keys of the
// inline limits without a name may hold at most MaxEchoedKeys bytes together: past it a
// request is attr_too_large, whatever --max-frame and --max-attr-len allow.
const (
	MaxAnswerFrame = 1 << 20
	MaxEchoedKeys  = MaxAnswerFrame / 4
)

// Decoder decodes request and response frame bodies. It wraps one msgpack.Decoder that
// is reset per body, so a connection reuses it for every frame. Not safe for concurrent use.
//
// The zero value is not usable; call NewDecoder.
type Decoder struct {
	// Bounds on a request; NewDecoder sets the defaults.
	MaxAttrs       int
	MaxAttrNameLen int
	MaxAttrLen     int
	MaxLimits      int

	r    bytes.Reader
	dec  *msgpack.Decoder
	body []byte // the body being decoded; request strings alias it

	// passedOn counts the requests DecodeRequest's straight path passed on to
	// decodeOther (tests read it: the shape clients send must not be among them).
	passedOn int
}

// NewDecoder returns a Decoder with the default bounds.
func NewDecoder() *Decoder {
	d := &Decoder{
		MaxAttrs:       DefaultMaxAttrs,
		MaxAttrNameLen: DefaultMaxAttrNameLen,
		MaxAttrLen:     DefaultMaxAttrLen,
		MaxLimits:      DefaultMaxLimits,
	}
	d.dec = msgpack.NewDecoder(&d.r)
	return d
}

func (d *Decoder) reset(body []byte) {
	d.body = body
	d.r.Reset(body)
	d.dec.ResetReader(&d.r)
}

// decodeOther decodes body into req when DecodeRequest's straight path (fastdecode.go)
// passes it on: decodeFast, for the usual keys in another order or form, and then
// msgpack/v5, the codec of record, for anything else and every error.
func (d *Decoder) decodeOther(body []byte, req *Request) error {
	d.passedOn++
	req.Reset()
	if d.decodeFast(body, req) {
		return nil
	}
	return d.decodeRequestMsgpack(body, req)
}

// decodeRequestMsgpack is DecodeRequest through msgpack/v5 only. A request it cannot
// read keeps its id when it has a readable one, wherever it is in the map: the error
// answer echoes it (field order does not matter on the wire).
func (d *Decoder) decodeRequestMsgpack(body []byte, req *Request) error {
	err := d.decodeFields(body, req)
	if err != nil && req.ID == 0 {
		req.ID = d.findID(body)
	}
	return err
}

// findID returns the id of a request map whose fields could not all be read: a
// top-level "id" holding an unsigned integer, found by skipping the values before it;
// 0 when there is none, or the map cannot be walked that far.
func (d *Decoder) findID(body []byte) uint64 {
	d.reset(body)
	n, err := d.mapLen("request")
	if err != nil {
		return 0
	}
	for range n {
		pos := len(d.body) - d.r.Len()
		key, err := d.key()
		if err != nil {
			// A key that is not a string (a number, nil, an array) is passed over with
			// its value, as an unknown field is, so that an id after it is echoed too:
			// before, the answer said 0 there and the id after any other fault.
			_, _ = d.r.Seek(int64(pos), io.SeekStart)
			if d.skip("map key") != nil {
				return 0
			}
			if d.skip("map key's value") != nil {
				return 0
			}
			continue
		}
		if key == "id" {
			id, err := d.uint("id")
			if err != nil {
				return 0
			}
			return id
		}
		if d.skip(key) != nil { // bounded by what the body holds, not by what a length claims
			return 0
		}
	}
	return 0
}

// decodeFields decodes body's fields into req.
func (d *Decoder) decodeFields(body []byte, req *Request) error {
	req.Reset()
	d.reset(body)
	n, err := d.mapLen("request")
	if err != nil {
		return err
	}
	var seen fieldSet
	for i := 0; i < n; i++ {
		key, err := d.key()
		if err != nil {
			return err
		}
		switch key {
		case "id":
			if err = seen.once(fieldID, "request", key); err == nil {
				req.ID, err = d.uint("id")
			}
		case "op":
			if err = seen.once(fieldOp, "request", key); err == nil {
				// Any length the frame holds: an op the server does not know, however
				// long, is unknown_op (the daemon's answer quotes the start of it).
				req.Op, err = d.str("op", math.MaxInt)
			}
		case "cost":
			if err = seen.once(fieldCost, "request", key); err == nil {
				req.Cost, err = d.uint("cost")
			}
		case "attrs":
			if err = seen.once(fieldAttrs, "request", key); err == nil {
				req.Attrs, err = d.attrs(req.Attrs)
			}
		case "limits":
			if err = seen.once(fieldLimits, "request", key); err == nil {
				req.Limits, err = d.limits(req.Limits)
			}
		case "lease":
			if err = seen.once(fieldLease, "request", key); err == nil {
				// Any length the frame holds: a longer lease than any issued is one
				// no daemon issued, released false, not an error (PROTOCOL.md).
				req.Lease, err = d.str("lease", math.MaxInt)
			}
		case "lease_ms":
			if err = seen.once(fieldLeaseMs, "request", key); err == nil {
				req.LeaseMs, err = d.uint("lease_ms")
			}
		default:
			err = d.skip(key)
		}
		if err != nil {
			return err
		}
	}
	if d.r.Len() != 0 {
		return Errorf(CodeBadRequest, "frame holds %d byte(s) after the request map; a frame holds exactly one msgpack map", d.r.Len())
	}
	if seen&fieldOp == 0 {
		return Errorf(CodeBadRequest, `request has no "op"; send "check", "ping", "release" or "renew"`)
	}
	// An op that is there but empty is an op the server does not know: unknown_op.
	return nil
}

func (d *Decoder) attrs(attrs []Attr) ([]Attr, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return attrs, d.truncated("attrs")
	}
	if c == msgpcode.Nil {
		_ = d.dec.Skip()
		return attrs, nil
	}
	n, err := d.mapLen("attrs")
	if err != nil {
		return attrs, err
	}
	// Too many attributes, or a name too long, is attr_too_large as a value too long is:
	// a gateway may take attributes from its client's headers, whose number and names
	// that client chooses (under bad_request the failure policy decided, and "open" let
	// 70 headers past every limit). A count the rest of the body cannot hold (an entry
	// takes two bytes at least) is a truncated body first: bad_request, as the contract
	// names a body that is not one complete map, whatever it claims.
	if n > d.MaxAttrs {
		if n > d.r.Len()/2 {
			return attrs, d.truncated("attrs")
		}
		return attrs, Errorf(CodeAttrTooLarge, "request has %d attrs; the limit is %d", n, d.MaxAttrs)
	}
	for i := 0; i < n; i++ {
		name, err := d.strOr("attrs key", d.MaxAttrNameLen, CodeAttrTooLarge)
		if err != nil {
			return attrs, err
		}
		value, err := d.value("attrs value")
		if err != nil {
			return attrs, err
		}
		for j := range attrs {
			if attrs[j].Name == name {
				return attrs, Errorf(CodeBadRequest, "attribute %q appears twice in attrs", name)
			}
		}
		attrs = append(attrs, Attr{Name: name, Value: value})
	}
	return attrs, nil
}

func (d *Decoder) limits(limits []InlineLimit) ([]InlineLimit, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return limits, d.truncated("limits")
	}
	if c == msgpcode.Nil {
		_ = d.dec.Skip()
		return limits, nil
	}
	n, err := d.dec.DecodeArrayLen()
	if err != nil || n < 0 {
		return limits, Errorf(CodeBadRequest, `field "limits" must be an array of maps`)
	}
	if n > d.MaxLimits {
		return limits, Errorf(CodeBadRequest, "request has %d inline limits; the limit is %d", n, d.MaxLimits)
	}
	echoed := 0 // bytes of the keys the answer names inline limits by (MaxEchoedKeys)
	for i := 0; i < n; i++ {
		var l InlineLimit
		m, err := d.mapLen("limits[]")
		if err != nil {
			return limits, err
		}
		var seen fieldSet
		for j := 0; j < m; j++ {
			key, err := d.key()
			if err != nil {
				return limits, err
			}
			f := limitField(key)
			if f != 0 {
				if err := seen.once(f, "limits[]", key); err != nil {
					return limits, err
				}
			}
			if f >= limitBurst && d.skipNil() {
				continue // an optional field left out, as a JavaScript encoder writes undefined
			}
			switch f {
			case limitKey:
				l.Key, err = d.value("limits[].key")
			case limitLimit:
				l.Limit, err = d.uint("limits[].limit")
			case limitWindow:
				l.WindowMs, err = d.uint("limits[].window_ms")
			case limitBurst:
				l.Burst, err = d.uint("limits[].burst")
			case limitAlgorithm:
				// Algorithm and mode: any length the frame holds, as op; one the
				// limiter does not know, however long, is invalid_limit.
				l.Algorithm, err = d.str("limits[].algorithm", math.MaxInt)
			case limitMode:
				l.Mode, err = d.str("limits[].mode", math.MaxInt)
			case limitName:
				l.Name, err = d.str("limits[].name", d.MaxAttrNameLen)
			default:
				err = d.skip(key)
			}
			if err != nil {
				return limits, err
			}
		}
		if l.Name == "" {
			echoed += len(l.Key)
		}
		limits = append(limits, l)
	}
	if echoed > MaxEchoedKeys {
		return limits, Errorf(CodeAttrTooLarge, "the inline limits without a name have keys of %d bytes, which the answer names them by; at most %d (an answer over %d bytes is more than the clients read): give them a name", echoed, MaxEchoedKeys, MaxAnswerFrame)
	}
	return limits, nil
}

// skipNil reads a nil, if one is next, and reports whether it did.
func (d *Decoder) skipNil() bool {
	if c, err := d.dec.PeekCode(); err != nil || c != msgpcode.Nil {
		return false
	}
	return d.dec.Skip() == nil
}

// fieldSet records which known fields of one map were read: a map that repeats a known
// field is a bad_request, so a request cannot pass a bound twice (two "attrs" maps of 40
// entries each under a cap of 64) or say two things at once. Unknown fields are skipped
// and not tracked.
type fieldSet uint16

// Known fields of the request map and of an inline-limit map.
const (
	fieldID fieldSet = 1 << iota
	fieldOp
	fieldCost
	fieldAttrs
	fieldLimits
	fieldLease
	fieldLeaseMs
)

const (
	limitKey fieldSet = 1 << iota
	limitLimit
	limitWindow
	limitBurst
	limitAlgorithm
	limitMode
	limitName
)

func limitField(key string) fieldSet {
	switch key {
	case "key":
		return limitKey
	case "limit":
		return limitLimit
	case "window_ms":
		return limitWindow
	case "burst":
		return limitBurst
	case "algorithm":
		return limitAlgorithm
	case "mode":
		return limitMode
	case "name":
		return limitName
	}
	return 0
}

// once marks f as read, or reports that the map already held it.
func (s *fieldSet) once(f fieldSet, where, key string) error {
	if *s&f != 0 {
		return Errorf(CodeBadRequest, "%s map holds %q twice; a key may appear once", where, key)
	}
	*s |= f
	return nil
}

func (d *Decoder) truncated(field string) error {
	return Errorf(CodeBadRequest, "frame ends inside %s: the body is not one complete msgpack map", field)
}

func (d *Decoder) mapLen(what string) (int, error) {
	// msgpack/v5's DecodeMapLen reads an extension whose data starts with a map as that
	// map: an extension value is not a map (a wrong type wherever a map belongs).
	if p := len(d.body) - d.r.Len(); p < len(d.body) && msgpcode.IsExt(d.body[p]) {
		return 0, Errorf(CodeBadRequest, "%s must be a msgpack map with string keys", what)
	}
	n, err := d.dec.DecodeMapLen()
	if err != nil || n < 0 {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, d.truncated(what)
		}
		return 0, Errorf(CodeBadRequest, "%s must be a msgpack map with string keys", what)
	}
	return n, nil
}

// key reads a map key as a string aliasing the body: fine for a switch. A key may be any
// length the frame holds: the known keys are short, and an unknown field is ignored
// whatever its name. Nothing is allocated for a key, and no more than a few bytes of an
// unknown one are quoted in an error message (Quote).
func (d *Decoder) key() (string, error) {
	return d.str("map key", math.MaxInt)
}

// str reads a msgpack str (or bin) and returns a string aliasing the body: the decoder
// reads from a bytes.Reader over the body, so the string's bytes are the body's.
func (d *Decoder) str(field string, maxLen int) (string, error) {
	return d.strOr(field, maxLen, CodeBadRequest)
}

// value is str for an attribute's value or an inline limit's key, whose length a client
// of the gateway chooses (a path, a header): longer than MaxAttrLen is attr_too_large,
// which a gateway answers with 431 whatever its failure policy (under bad_request the
// policy decided, and "open" let such requests past every limit).
func (d *Decoder) value(field string) (string, error) {
	return d.strOr(field, d.MaxAttrLen, CodeAttrTooLarge)
}

// strOr is str, with code for a string longer than maxLen.
func (d *Decoder) strOr(field string, maxLen int, code string) (string, error) {
	n, err := d.dec.DecodeBytesLen()
	if err != nil || n < 0 {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return "", d.truncated(field)
		}
		return "", Errorf(CodeBadRequest, "%s must be a string", field)
	}
	// A length past the body's end is a truncated body before it is a long string (see
	// attrs): a string's bound is for one that is there.
	rest := d.r.Len()
	if n > rest {
		return "", d.truncated(field)
	}
	if n > maxLen {
		return "", Errorf(code, "%s is %d bytes long; the limit is %d", field, n, maxLen)
	}
	if n == 0 {
		return "", nil
	}
	pos := len(d.body) - rest
	_, _ = d.r.Seek(int64(n), io.SeekCurrent)
	return unsafe.String(&d.body[pos], n), nil
}

// uint reads a non-negative integer of any msgpack integer width, or a float32 or
// float64 holding a whole number: msgpack-lite, a JavaScript encoder, writes every number
// outside the int32 range as a float64 (a window of 30 days, 2,592,000,000 ms; an id past
// 2^31), and other encoders write a JavaScript or Lua number as a float when asked to. A
// float with a fraction, a NaN, an infinity or one of 2^64 or more is a wrong type.
func (d *Decoder) uint(field string) (uint64, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, d.truncated(field)
	}
	switch {
	case c <= msgpcode.PosFixedNumHigh, c == msgpcode.Uint8, c == msgpcode.Uint16, c == msgpcode.Uint32, c == msgpcode.Uint64:
		v, err := d.dec.DecodeUint64()
		if err != nil {
			return 0, d.truncated(field)
		}
		return v, nil
	case c >= msgpcode.NegFixedNumLow, c == msgpcode.Int8, c == msgpcode.Int16, c == msgpcode.Int32, c == msgpcode.Int64:
		v, err := d.dec.DecodeInt64()
		if err != nil {
			return 0, d.truncated(field)
		}
		if v < 0 {
			return 0, Errorf(CodeBadRequest, "%s must be an unsigned integer, not %d", field, v)
		}
		return uint64(v), nil
	case c == msgpcode.Float, c == msgpcode.Double:
		f, err := d.dec.DecodeFloat64()
		if err != nil {
			return 0, d.truncated(field)
		}
		// -0 is 0; NaN fails f >= 0.
		if f >= 0 && f < 1<<64 && f == math.Trunc(f) {
			return uint64(f), nil
		}
		return 0, Errorf(CodeBadRequest, "%s must be an unsigned integer, not %v", field, f)
	}
	return 0, Errorf(CodeBadRequest, "%s must be an unsigned integer", field)
}

func (d *Decoder) boolean(field string) (bool, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return false, d.truncated(field)
	}
	if c != msgpcode.True && c != msgpcode.False {
		return false, Errorf(CodeBadRequest, "%s must be a boolean", field)
	}
	return d.dec.DecodeBool()
}

// maxDepth bounds the nesting of values a decoder skips.
const maxDepth = 32

// skip passes over an unknown field's value, whatever it is: any well-formed msgpack
// value, extension values (a Timestamp, say) included, is ignored. Unlike msgpack's Skip
// it never trusts a length the body cannot hold: a str, bin or ext announcing 4 GB in a
// 12-byte frame is a truncated body, not a reason to grow a buffer.
func (d *Decoder) skip(field string) error {
	return d.skipValue(field, 0)
}

func (d *Decoder) skipValue(field string, depth int) error {
	c, err := d.dec.PeekCode()
	if err != nil {
		return d.truncated("field " + Quote(field))
	}
	switch {
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		n, err := d.dec.DecodeBytesLen()
		if err != nil || n > d.r.Len() {
			return d.truncated("field " + Quote(field))
		}
		if n > 0 {
			_, _ = d.r.Seek(int64(n), io.SeekCurrent)
		}
		return nil
	case (msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32 ||
		msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32) && depth >= maxDepth:
		// The 33rd array or map, counting the value itself: up to 32 levels (before,
		// the bound counted the scalars inside too, and let 33 arrays through).
		return Errorf(CodeBadRequest, "field %s nests deeper than %d levels", Quote(field), maxDepth)
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err := d.dec.DecodeArrayLen()
		if err != nil || n > d.r.Len() { // every element takes at least a byte
			return d.truncated("field " + Quote(field))
		}
		for i := 0; i < n; i++ {
			if err := d.skipValue(field, depth+1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err := d.dec.DecodeMapLen()
		if err != nil || n > d.r.Len()/2 {
			return d.truncated("field " + Quote(field))
		}
		for i := 0; i < 2*n; i++ {
			if err := d.skipValue(field, depth+1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsExt(c):
		// Its length and type, then its data, opaque: passed over, whatever its type.
		_, n, err := d.dec.DecodeExtHeader()
		if err != nil || n > d.r.Len() {
			return d.truncated("field " + Quote(field))
		}
		if n > 0 {
			_, _ = d.r.Seek(int64(n), io.SeekCurrent)
		}
		return nil
	}
	if err := d.dec.Skip(); err != nil { // a scalar of fixed size
		return d.truncated("field " + Quote(field))
	}
	return nil
}

// DecodeResponse decodes one response frame body into resp, which it resets first.
// Unlike DecodeRequest, the strings it stores are allocated and stay valid.
func (d *Decoder) DecodeResponse(body []byte, resp *Response) error {
	resp.Reset()
	d.reset(body)
	n, err := d.mapLen("response")
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		key, err := d.key()
		if err != nil {
			return err
		}
		switch key {
		case "id":
			resp.ID, err = d.uint("id")
		case "allowed":
			resp.Allowed, err = d.boolean("allowed")
		case "rule":
			resp.Rule, err = d.ownedStr("rule")
		case "limit":
			resp.Limit, err = d.uint("limit")
		case "remaining":
			resp.Remaining, err = d.uint("remaining")
		case "reset_ms":
			resp.ResetMs, err = d.uint("reset_ms")
		case "retry_after_ms":
			resp.RetryAfterMs, err = d.uint("retry_after_ms")
		case "degraded":
			resp.Degraded, err = d.boolean("degraded")
		case "reason":
			resp.Reason, err = d.ownedStr("reason")
		case "lease":
			resp.Lease, err = d.ownedStr("lease")
		case "released":
			resp.Released, err = d.boolean("released")
		case "renewed":
			resp.Renewed, err = d.boolean("renewed")
		case "expires_ms":
			resp.ExpiresMs, err = d.uint("expires_ms")
		case "warning":
			resp.Warning, err = d.boolean("warning")
		case "delay_ms":
			resp.DelayMs, err = d.uint("delay_ms")
		case "banned":
			resp.Banned, err = d.boolean("banned")
		case "rules":
			err = d.ruleResults(resp)
		case "version":
			resp.Version, err = d.ownedStr("version")
		case "protocol":
			resp.Protocol, err = d.uint("protocol")
		case "error":
			err = d.errorBody(&resp.Err)
		default:
			err = d.skip(key)
		}
		if err != nil {
			return err
		}
	}
	if d.r.Len() != 0 {
		return Errorf(CodeBadRequest, "frame holds %d bytes after the response map", d.r.Len())
	}
	return nil
}

// ownedStr reads a string the caller keeps (a copy), trusting no length the body
// cannot hold.
func (d *Decoder) ownedStr(field string) (string, error) {
	n, err := d.dec.DecodeBytesLen()
	if err != nil || n < 0 {
		return "", Errorf(CodeBadRequest, "%s must be a string", field)
	}
	if n > d.r.Len() {
		return "", d.truncated(field)
	}
	pos := len(d.body) - d.r.Len()
	_, _ = d.r.Seek(int64(n), io.SeekCurrent)
	return string(d.body[pos : pos+n]), nil
}

func (d *Decoder) ruleResults(resp *Response) error {
	n, err := d.dec.DecodeArrayLen()
	if err != nil {
		return Errorf(CodeBadRequest, `field "rules" must be an array of maps`)
	}
	for i := 0; i < n; i++ {
		var rr RuleResult
		m, err := d.mapLen("rules[]")
		if err != nil {
			return err
		}
		for j := 0; j < m; j++ {
			key, err := d.key()
			if err != nil {
				return err
			}
			switch key {
			case "name":
				rr.Name, err = d.ownedStr("rules[].name")
			case "limit":
				rr.Limit, err = d.uint("rules[].limit")
			case "window_ms":
				rr.WindowMs, err = d.uint("rules[].window_ms")
			case "remaining":
				rr.Remaining, err = d.uint("rules[].remaining")
			case "reset_ms":
				rr.ResetMs, err = d.uint("rules[].reset_ms")
			case "retry_after_ms":
				rr.RetryAfterMs, err = d.uint("rules[].retry_after_ms")
			case "allowed":
				rr.Allowed, err = d.boolean("rules[].allowed")
			case "shadow":
				rr.Shadow, err = d.boolean("rules[].shadow")
			case "reason":
				rr.Reason, err = d.ownedStr("rules[].reason")
			case "warning":
				rr.Warning, err = d.boolean("rules[].warning")
			case "delay_ms":
				rr.DelayMs, err = d.uint("rules[].delay_ms")
			case "banned":
				rr.Banned, err = d.boolean("rules[].banned")
			case "unasked":
				rr.Unasked, err = d.boolean("rules[].unasked")
			case "concurrency":
				rr.Concurrency, err = d.boolean("rules[].concurrency")
			case "degraded":
				rr.Degraded, err = d.boolean("rules[].degraded")
			default:
				err = d.skip(key)
			}
			if err != nil {
				return err
			}
		}
		resp.Rules = append(resp.Rules, rr)
	}
	return nil
}

func (d *Decoder) errorBody(e *Error) error {
	m, err := d.mapLen("error")
	if err != nil {
		return err
	}
	for j := 0; j < m; j++ {
		key, err := d.key()
		if err != nil {
			return err
		}
		switch key {
		case "code":
			e.Code, err = d.ownedStr("error.code")
		case "message":
			e.Message, err = d.ownedStr("error.message")
		default:
			err = d.skip(key)
		}
		if err != nil {
			return err
		}
	}
	if e.Code == "" {
		return Errorf(CodeBadRequest, "error response without a code")
	}
	return nil
}
