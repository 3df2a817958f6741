package rlclient

import (
	"encoding/base64"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A strict parser of RFC 9651 (RFC 8941) Lists, enough to check the fields SetHeaders
// writes: every RateLimit-Policy, RateLimit and RateLimit-Warning value must parse as a
// List (a Dictionary or Inner List, a Decimal, a Date or a Display String is refused, as
// none is written), and the items must be what draft-ietf-httpapi-ratelimit-headers (-11)
// asks for: a String naming the policy; in RateLimit-Policy a non-negative Integer q, a
// positive Integer w when there is one, a registered String qu; in RateLimit a
// non-negative Integer r and t. The other clients write the same bytes for the shared
// vectors (clients/testdata/http_headers.json), which TestStructuredFieldVectors parses.

// sfItem is one List member: a bare item (a string, an int64, an sfToken, []byte or a
// bool) and its parameters, in order.
type sfItem struct {
	value  any
	params []sfParam
}

type sfParam struct {
	key   string
	value any
}

type sfToken string

func (it *sfItem) param(key string) (any, bool) {
	for _, p := range it.params {
		if p.key == key {
			return p.value, true
		}
	}
	return nil, false
}

type sfParser struct {
	s string
	i int
}

func (p *sfParser) fail(format string, a ...any) error {
	return fmt.Errorf("%q at %d: %s", p.s, p.i, fmt.Sprintf(format, a...))
}

func (p *sfParser) peek() byte {
	if p.i < len(p.s) {
		return p.s[p.i]
	}
	return 0
}

func (p *sfParser) skip(set string) {
	for p.i < len(p.s) && strings.IndexByte(set, p.s[p.i]) >= 0 {
		p.i++
	}
}

// parseSFList parses s as an RFC 9651 List (§4.2, §4.2.1): leading and trailing spaces
// allowed, members separated by OWS "," OWS, no trailing comma, and at least one member
// (an empty field value is no field).
func parseSFList(s string) ([]sfItem, error) {
	p := &sfParser{s: s}
	p.skip(" ")
	var out []sfItem
	for p.i < len(p.s) {
		if p.peek() == '(' {
			return nil, p.fail("an inner list")
		}
		v, err := p.bareItem()
		if err != nil {
			return nil, err
		}
		it := sfItem{value: v}
		if it.params, err = p.parameters(); err != nil {
			return nil, err
		}
		out = append(out, it)
		p.skip(" \t")
		if p.i == len(p.s) {
			break
		}
		if p.peek() != ',' {
			return nil, p.fail("',' expected")
		}
		p.i++
		p.skip(" \t")
		if p.i == len(p.s) {
			return nil, p.fail("a trailing comma")
		}
	}
	if len(out) == 0 {
		return nil, errors.New("an empty list")
	}
	return out, nil
}

func (p *sfParser) parameters() ([]sfParam, error) {
	var ps []sfParam
	for p.peek() == ';' {
		p.i++
		p.skip(" ")
		st := p.i
		if c := p.peek(); !(c >= 'a' && c <= 'z' || c == '*') {
			return nil, p.fail("a parameter key must start with a lower-case letter or *")
		}
		for c := p.peek(); c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || strings.IndexByte("_-.*", c) >= 0 && c != 0; c = p.peek() {
			p.i++
		}
		prm := sfParam{key: p.s[st:p.i], value: true}
		if p.peek() == '=' {
			p.i++
			v, err := p.bareItem()
			if err != nil {
				return nil, err
			}
			prm.value = v
		}
		for _, q := range ps {
			if q.key == prm.key {
				return nil, p.fail("parameter %q twice", prm.key) // legal (the last wins), but never meant
			}
		}
		ps = append(ps, prm)
	}
	return ps, nil
}

func (p *sfParser) bareItem() (any, error) {
	switch c := p.peek(); {
	case c == '-' || c >= '0' && c <= '9':
		return p.integer()
	case c == '"':
		return p.str()
	case c == ':':
		p.i++
		end := strings.IndexByte(p.s[p.i:], ':')
		if end < 0 {
			return nil, p.fail("an unterminated byte sequence")
		}
		b, err := base64.StdEncoding.DecodeString(p.s[p.i : p.i+end])
		p.i += end + 1
		return b, err
	case c == '?':
		if p.i+1 < len(p.s) && (p.s[p.i+1] == '0' || p.s[p.i+1] == '1') {
			p.i += 2
			return p.s[p.i-1] == '1', nil
		}
		return nil, p.fail("a bad boolean")
	case c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c == '*':
		st := p.i
		for p.i++; p.i < len(p.s) && (isTchar(p.s[p.i]) || p.s[p.i] == ':' || p.s[p.i] == '/'); p.i++ {
		}
		return sfToken(p.s[st:p.i]), nil
	default:
		return nil, p.fail("no bare item (a Date or a Display String is not expected)")
	}
}

func isTchar(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// integer parses an sf-integer: at most 15 digits (§3.3.1); a Decimal is refused.
func (p *sfParser) integer() (any, error) {
	st := p.i
	if p.peek() == '-' {
		p.i++
	}
	ds := p.i
	for c := p.peek(); c >= '0' && c <= '9'; c = p.peek() {
		p.i++
	}
	switch {
	case p.i == ds:
		return nil, p.fail("no digits")
	case p.i-ds > 15:
		return nil, p.fail("an integer of %d digits (at most 15)", p.i-ds)
	case p.peek() == '.':
		return nil, p.fail("a decimal")
	}
	n, err := strconv.ParseInt(p.s[st:p.i], 10, 64)
	return n, err
}

// str parses an sf-string: printable ASCII only, `\` escaping only `"` and `\`.
func (p *sfParser) str() (any, error) {
	var b strings.Builder
	for p.i++; p.i < len(p.s); p.i++ {
		switch c := p.s[p.i]; {
		case c == '\\':
			p.i++
			if p.i == len(p.s) || p.s[p.i] != '"' && p.s[p.i] != '\\' {
				return nil, p.fail("a bad escape")
			}
			b.WriteByte(p.s[p.i])
		case c == '"':
			p.i++
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return nil, p.fail("byte %#x in a string", c)
		default:
			b.WriteByte(c)
		}
	}
	return nil, p.fail("an unterminated string")
}

// checkRateLimitFields parses the RateLimit fields of h strictly and checks them against
// the draft; it returns the items of RateLimit-Policy and RateLimit (nil when absent).
func checkRateLimitFields(h http.Header) (pol, cur []sfItem, err error) {
	nonNegInt := func(v any, ok bool) bool { n, isInt := v.(int64); return ok && isInt && n >= 0 }
	for _, name := range []string{"RateLimit-Policy", "RateLimit", "RateLimit-Warning"} {
		vs := h.Values(name)
		if len(vs) == 0 {
			continue
		}
		if len(vs) > 1 {
			return nil, nil, fmt.Errorf("%s: %d field lines", name, len(vs))
		}
		items, err := parseSFList(vs[0])
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %v", name, err)
		}
		for _, it := range items {
			if _, ok := it.value.(string); !ok {
				return nil, nil, fmt.Errorf("%s: %q: a policy is named by a String (draft §3, §4.1), got %T", name, vs[0], it.value)
			}
			switch name {
			case "RateLimit-Policy":
				if !nonNegInt(it.param("q")) {
					return nil, nil, fmt.Errorf("%s: %q: no non-negative Integer q", name, vs[0])
				}
				if w, ok := it.param("w"); ok {
					if n, isInt := w.(int64); !isInt || n <= 0 {
						return nil, nil, fmt.Errorf("%s: %q: w is not a positive Integer", name, vs[0])
					}
				}
				if qu, ok := it.param("qu"); ok && qu != "requests" && qu != "content-bytes" && qu != "concurrent-requests" {
					return nil, nil, fmt.Errorf("%s: %q: qu is not a registered quota unit String", name, vs[0])
				}
				pol = items
			case "RateLimit":
				if !nonNegInt(it.param("r")) {
					return nil, nil, fmt.Errorf("%s: %q: no non-negative Integer r", name, vs[0])
				}
				if t, ok := it.param("t"); ok && !nonNegInt(t, ok) {
					return nil, nil, fmt.Errorf("%s: %q: t is not a non-negative Integer", name, vs[0])
				}
				cur = items
			default:
				if len(it.params) > 0 {
					return nil, nil, fmt.Errorf("%s: %q: parameters", name, vs[0])
				}
			}
		}
	}
	// RateLimit names the policies of RateLimit-Policy in its order, the first first; a
	// policy whose figures were not read (an unasked rule) has no RateLimit item.
	j := 0
	for i := range pol {
		if j < len(cur) && pol[i].value == cur[j].value {
			j++
		} else if i == 0 {
			return nil, nil, fmt.Errorf("RateLimit-Policy's first item %q is not RateLimit's first", pol[0].value)
		}
	}
	if j != len(cur) {
		return nil, nil, fmt.Errorf("RateLimit item %d (%q) names no RateLimit-Policy item in order", j, cur[j].value)
	}
	if ra := h.Values("Retry-After"); len(ra) > 0 {
		if n, err := strconv.ParseUint(ra[0], 10, 64); len(ra) > 1 || err != nil || n < 1 || ra[0][0] == '+' {
			return nil, nil, fmt.Errorf("Retry-After %q: not one delay-seconds of at least 1", ra)
		}
	}
	return pol, cur, nil
}

func TestSFParser(t *testing.T) {
	for _, s := range []string{`"a";q=5;w=60`, `"a";q=5, "b";q=0;qu="concurrent-requests"`, ` "a\"b\\c";r=0 `, `tok;x=?1;y=:AQI=:`} {
		if _, err := parseSFList(s); err != nil {
			t.Errorf("%q: %v", s, err)
		}
	}
	for _, s := range []string{``, `"a";q=5,`, `"a" "b"`, `"a\tb"`, `"a\qb"`, "\"ключ\"", `"a";q=1234567890123456`,
		`"a";q=1.5`, `"a";Q=1`, `("a" "b")`, `"a";q=@1`, `%"a"`, `"unterminated`, `"a";q=1;q=2`} {
		if _, err := parseSFList(s); err == nil {
			t.Errorf("%q parses", s)
		}
	}
}

// Every header of every shared vector, as SetHeaders writes it, is a valid structured
// field as the draft asks for it.
func TestStructuredFieldVectors(t *testing.T) {
	for _, v := range loadHeaderVectors(t) {
		r := v.response()
		d := decision(&r)
		if _, _, err := checkRateLimitFields(Headers(&d)); err != nil {
			t.Errorf("%s: %v", v.Name, err)
		}
	}
}

// Random decisions, names of any bytes and figures up to the largest a daemon answers:
// every field SetHeaders writes parses strictly, each item names its rule (each byte
// outside printable ASCII as _), and its figures are the rule's.
func TestStructuredFieldsRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const maxWindow = 366 * 24 * time.Hour
	name := func() string {
		b := make([]byte, rng.IntN(12))
		for i := range b {
			switch rng.IntN(4) {
			case 0:
				b[i] = byte(rng.IntN(256))
			case 1:
				b[i] = `"\;,= ()`[rng.IntN(8)]
			default:
				b[i] = byte('a' + rng.IntN(26))
			}
		}
		return string(b)
	}
	dur := func() time.Duration { // 0, under a second (a limit deny's window is 0), or up to 366 days
		switch rng.IntN(3) {
		case 0:
			return 0
		case 1:
			return time.Duration(rng.Int64N(int64(time.Second)))
		}
		return time.Duration(rng.Int64N(int64(maxWindow)))
	}
	for n := 0; n < 20000; n++ {
		d := Decision{Allowed: rng.IntN(2) == 0}
		for range 1 + rng.IntN(4) {
			r := RuleDecision{Name: name(), Limit: uint64(rng.IntN(1<<32)) * uint64(rng.IntN(2)), Window: dur(),
				Remaining: uint64(rng.IntN(1 << 32)), Reset: dur(), Allowed: rng.IntN(3) > 0,
				Shadow: rng.IntN(5) == 0, Warning: rng.IntN(3) == 0, Concurrency: rng.IntN(4) == 0}
			if !r.Allowed {
				r.RetryAfter = dur()
				d.Allowed = false
			} else {
				r.Unasked = !d.Allowed && rng.IntN(3) == 0
			}
			d.Rules = append(d.Rules, r)
		}
		dr := d.Rules[rng.IntN(len(d.Rules))]
		if rng.IntN(10) == 0 {
			dr = RuleDecision{Name: name() + "x", Limit: 7, Remaining: 3, Reset: time.Second, RetryAfter: 2 * time.Second} // not in Rules
		}
		d.Rule, d.Limit, d.Remaining, d.Reset, d.RetryAfter = dr.Name, dr.Limit, dr.Remaining, dr.Reset, dr.RetryAfter
		if d.Rule == "" {
			d.Rule = "r"
		}
		if rng.IntN(8) == 0 {
			d.Reason = "cost_exceeds_capacity"
		}
		// The first item: the deciding rule, or, allowed, of the non-shadow rules with its
		// remaining, the one with the longest reset, the deciding rule among equals, else
		// the first listed.
		first, unasked, di := d.Rule, 0, decidingRule(&d)
		for i, r := range d.Rules {
			if r.Unasked && !r.Shadow && i != di {
				unasked++
			}
		}
		if d.Allowed && di >= 0 {
			var longest time.Duration
			for _, r := range d.Rules {
				if !r.Shadow && r.Remaining == d.Rules[di].Remaining {
					longest = max(longest, r.Reset)
				}
			}
			if d.Rules[di].Reset != longest {
				for _, r := range d.Rules {
					if !r.Shadow && r.Remaining == d.Rules[di].Remaining && r.Reset == longest {
						first = r.Name
						break
					}
				}
			}
		}
		h := Headers(&d)
		pol, cur, err := checkRateLimitFields(h)
		if err != nil {
			t.Fatalf("decision %+v: %v", d, err)
		}
		if !d.Allowed && d.Reason == "" && len(h.Values("Retry-After")) != 1 {
			t.Fatalf("decision %+v: no Retry-After", d)
		}
		for i := range pol {
			nm := pol[i].value.(string)
			for j := 0; j < len(nm); j++ {
				if nm[j] < 0x20 || nm[j] > 0x7e {
					t.Fatalf("name %q", nm)
				}
			}
			if i == 0 && nm != sanitized(first) {
				t.Fatalf("decision %+v: first item %q, want %q", d, nm, sanitized(first))
			}
			if q, _ := pol[i].param("q"); q.(int64) < 0 || q.(int64) > 1<<32 {
				t.Fatalf("q %v", q)
			}
		}
		for i := range cur {
			if r, _ := cur[i].param("r"); r.(int64) < 0 {
				t.Fatalf("r %v", r)
			}
		}
		if len(pol)-len(cur) != unasked {
			t.Fatalf("decision %+v: %d RateLimit-Policy items, %d RateLimit items, %d unasked", d, len(pol), len(cur), unasked)
		}
	}
}

// sanitized is name as an item names it: each byte outside printable ASCII as _.
func sanitized(name string) string {
	b := []byte(name)
	for i, c := range b {
		if c < 0x20 || c > 0x7e {
			b[i] = '_'
		}
	}
	return string(b)
}
