package rules

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

func TestAppendEscaped(t *testing.T) {
	tests := []struct{ in, want string }{
		{"", ""},
		{"ann", "ann"},
		{"AZaz09-._~:@/+", "AZaz09-._~:@/+"},
		{"1.2.3.4", "1.2.3.4"},
		{"2001:db8::1", "2001:db8::1"},
		{"a b", "a%20b"},
		{"%", "%25"},
		{"|={}", "%7C%3D%7B%7D"},
		{"a|b{c}", "a%7Cb%7Bc%7D"},
		{"é", "%C3%A9"},
		{"\x00\xff", "%00%FF"},
		{"?&#,;*!", "%3F%26%23%2C%3B%2A%21"},
	}
	for _, tt := range tests {
		if got := string(AppendEscaped(nil, tt.in)); got != tt.want {
			t.Errorf("AppendEscaped(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
	if got := string(AppendEscaped([]byte("pre:"), "x y")); got != "pre:x%20y" {
		t.Errorf("AppendEscaped does not append: %q", got)
	}
}

// A value whose escaping is longer than MaxKeyValue is keyed by its digest: a key of
// bounded length, of its own (no other long value's, no short value's, whose escaping
// never holds '='), inside its braces whatever bytes the value holds, and built the same
// by every path of AppendKey. The bound is on the escaped bytes: a value of 2,047 "é"
// (4,094 bytes) escaped to 12,282.
func TestAppendEscapedLongValue(t *testing.T) {
	digest := func(s string) string {
		sum := sha256.Sum256([]byte(s))
		return "=" + hex.EncodeToString(sum[:])
	}
	at := strings.Repeat("{|=", MaxKeyValue/9) + "x" // escaped: exactly MaxKeyValue bytes
	if e := refEscapeAll(at); len(e) != MaxKeyValue || string(AppendEscaped(nil, at)) != e {
		t.Fatalf("a value escaped to MaxKeyValue bytes is not escaped as it is (%d bytes)", len(e))
	}
	over := at + "x"
	if got, want := string(AppendEscaped([]byte("pre:"), over)), "pre:"+digest(over); got != want {
		t.Fatalf("AppendEscaped(a value escaped to MaxKeyValue+1 bytes) = %q, want %q", got, want)
	}
	plain := strings.Repeat("a", MaxKeyValue)
	if got := string(AppendEscaped(nil, plain)); got != plain {
		t.Fatalf("a plain value of MaxKeyValue bytes is not written as it is")
	}
	if got := string(AppendEscaped(nil, plain+"a")); got != digest(plain+"a") {
		t.Fatalf("a plain value of MaxKeyValue+1 bytes is not written as its digest: %q", got)
	}
	accents := strings.Repeat("é", 2047)
	if got := string(AppendEscaped(nil, accents)); got != digest(accents) {
		t.Fatalf("2,047 \"é\" (%d bytes, escaped to %d) written as %d bytes, want its digest", len(accents), len(refEscapeAll(accents)), len(got))
	}
	if got := string(AppendEscaped(nil, over[:len(over)-1]+"y")); got == string(AppendEscaped(nil, over)) {
		t.Fatalf("two long values differing in their last byte share the key %q", got)
	}
	set := mustParse(t, `rules:
  - name: one
    key: user
    limit: { requests: 1, per: 1s }
  - name: two
    key: [a, b, user]
    limit: { requests: 1, per: 1s }
`)
	attrs := []Attr{{"user", over}, {"a", "}{"}, {"b", strings.Repeat("\xff", 20_000)}}
	for _, r := range set.Rules {
		fast, okf := r.AppendKey(nil, attrs)
		plain, okp := r.appendKeySlow(nil, attrs)
		s := string(fast)
		if !okf || !okp || s != string(plain) || len(s) > 3*64+100 {
			t.Fatalf("rule %s: AppendKey = %q %v, plain %q %v", r.Name, fast, okf, plain, okp)
		}
		if strings.Count(s, "{") != 1 || strings.Count(s, "}") != 1 || !strings.HasSuffix(s, "}") {
			t.Fatalf("rule %s: key %q: braces are not exactly the delimiters", r.Name, s)
		}
	}
}

func TestAppendKey(t *testing.T) {
	set := mustParse(t, `rules:
  - name: per-user
    key: user
    limit: { requests: 1, per: 1s }
  - name: combo.v2
    key: [api_key, ip]
    limit: { requests: 1, per: 1s }
`)
	one, two := set.Rules[0], set.Rules[1]
	tests := []struct {
		r     *Rule
		attrs []Attr
		want  string
		ok    bool
	}{
		{one, []Attr{{"user", "ann"}}, "per-user:{user=ann}", true},
		{one, []Attr{{"user", ""}}, "per-user:{user=}", true},
		{one, []Attr{{"user", "a}b{c|d=e%f"}}, "per-user:{user=a%7Db%7Bc%7Cd%3De%25f}", true},
		{one, []Attr{{"ip", "1"}}, "", false},
		{two, []Attr{{"ip", "::1"}, {"api_key", "k1"}}, "combo.v2:{api_key=k1|ip=::1}", true},
		{two, []Attr{{"api_key", "k1"}}, "", false},
		{two, []Attr{{"ip", "1"}}, "", false},
	}
	for _, tt := range tests {
		got, ok := tt.r.AppendKey([]byte("prefix"), tt.attrs)
		if ok != tt.ok || string(got) != "prefix"+tt.want {
			t.Errorf("%s.AppendKey(%v) = %q, %v; want %q, %v", tt.r.Name, tt.attrs, got, ok, "prefix"+tt.want, tt.ok)
		}
	}
}

// decodeKey is the inverse of AppendKey, for tests: it splits a client key into the rule
// name and its attributes, failing on anything AppendKey cannot produce.
func decodeKey(key string) (name string, attrs []Attr, err error) {
	name, rest, ok := strings.Cut(key, ":{")
	if !ok || !strings.HasSuffix(rest, "}") {
		return "", nil, fmt.Errorf("no :{...} in %q", key)
	}
	for part := range strings.SplitSeq(rest[:len(rest)-1], "|") {
		attr, val, ok := strings.Cut(part, "=")
		if !ok {
			return "", nil, fmt.Errorf("no = in %q", part)
		}
		v, err := unescape(val)
		if err != nil {
			return "", nil, err
		}
		attrs = append(attrs, Attr{attr, v})
	}
	return name, attrs, nil
}

func unescape(s string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '%':
			if i+2 >= len(s) {
				return "", fmt.Errorf("short escape in %q", s)
			}
			const hexd = "0123456789ABCDEF"
			hi, lo := strings.IndexByte(hexd, s[i+1]), strings.IndexByte(hexd, s[i+2])
			if hi < 0 || lo < 0 {
				return "", fmt.Errorf("bad escape in %q", s)
			}
			e := byte(hi<<4 | lo)
			if keep[e] {
				return "", fmt.Errorf("needless escape %%%02X in %q", e, s)
			}
			b.WriteByte(e)
			i += 2
		case keep[c]:
			b.WriteByte(c)
		default:
			return "", fmt.Errorf("unescaped byte %q in %q", c, s)
		}
	}
	return b.String(), nil
}

func TestKeyProperties(t *testing.T) {
	set := mustParse(t, `rules:
  - name: one
    key: user
    limit: { requests: 1, per: 1s }
  - name: two
    key: [a, b]
    limit: { requests: 1, per: 1s }
`)
	one, two := set.Rules[0], set.Rules[1]
	// Values from all bytes, and from a few tricky ones so that near-collisions are common.
	value := rapid.OneOf(
		rapid.Map(rapid.SliceOf(rapid.Byte()), func(b []byte) string { return string(b) }),
		rapid.Map(rapid.SliceOfN(rapid.SampledFrom([]byte("a2F7C%|={}:"+"\xc3\xa9")), 0, 6), func(b []byte) string { return string(b) }),
	)
	check := func(t *rapid.T, r *Rule, key []byte, vals ...string) {
		s := string(key)
		open, close := strings.IndexByte(s, '{'), strings.IndexByte(s, '}')
		if open != len(r.Name)+1 || close != len(s)-1 || strings.Count(s, "{") != 1 || strings.Count(s, "}") != 1 {
			t.Fatalf("key %q: braces are not exactly the delimiters", s)
		}
		name, attrs, err := decodeKey(s)
		if err != nil {
			t.Fatalf("decode %q: %v", s, err)
		}
		if name != r.Name || len(attrs) != len(vals) {
			t.Fatalf("decode %q = %q, %v", s, name, attrs)
		}
		for i, v := range vals {
			if attrs[i].Name != r.Key[i] || attrs[i].Value != v {
				t.Fatalf("decode %q: attr %d = %+v, want %s=%q", s, i, attrs[i], r.Key[i], v)
			}
		}
	}
	rapid.Check(t, func(t *rapid.T) {
		a, b := value.Draw(t, "a"), value.Draw(t, "b")
		ka, _ := one.AppendKey(nil, []Attr{{"user", a}})
		kb, _ := one.AppendKey(nil, []Attr{{"user", b}})
		if bytes.Equal(ka, kb) != (a == b) {
			t.Fatalf("key(%q) = %q, key(%q) = %q", a, ka, b, kb)
		}
		check(t, one, ka, a)

		a1, a2, b1, b2 := value.Draw(t, "a1"), value.Draw(t, "a2"), value.Draw(t, "b1"), value.Draw(t, "b2")
		k1, _ := two.AppendKey(nil, []Attr{{"b", a2}, {"a", a1}})
		k2, _ := two.AppendKey(nil, []Attr{{"a", b1}, {"b", b2}})
		if bytes.Equal(k1, k2) != (a1 == b1 && a2 == b2) {
			t.Fatalf("key(%q,%q) = %q, key(%q,%q) = %q", a1, a2, k1, b1, b2, k2)
		}
		check(t, two, k1, a1, a2)
		check(t, two, k2, b1, b2)
	})
}

func ExampleRule_AppendKey() {
	set, err := Parse("example.yaml", []byte(`rules:
  - name: per-account
    key: [user, ip]
    limit: { requests: 5, per: 1m }
`))
	if err != nil {
		panic(err)
	}
	key, ok := set.Rules[0].AppendKey(nil, []Attr{{"ip", "2001:db8::1"}, {"user", "ann|x={y}"}})
	fmt.Println(string(key), ok)
	// Output: per-account:{user=ann%7Cx%3D%7By%7D|ip=2001:db8::1} true
}

// The fast paths of key building (AppendKey's precomputed literals, AppendEscaped's
// four-byte test) write what the plain loops write, for values of any bytes, missing
// attributes and a buffer that already holds something.
func TestAppendKeyFastMatchesPlain(t *testing.T) {
	set := mustParse(t, `rules:
  - name: one
    key: user
    limit: { requests: 1, per: 1s }
  - name: two
    key: [a, b, user]
    limit: { requests: 1, per: 1s }
`)
	plainEscape := func(s string) string {
		var b strings.Builder
		for i := 0; i < len(s); i++ {
			if c := s[i]; keep[c] {
				b.WriteByte(c)
			} else {
				fmt.Fprintf(&b, "%%%02X", c)
			}
		}
		return b.String()
	}
	value := rapid.OneOf(
		rapid.Map(rapid.SliceOf(rapid.Byte()), func(b []byte) string { return string(b) }),
		rapid.StringMatching(`[a-z0-9.:-]{0,12}`),
		rapid.Map(rapid.SliceOfN(rapid.SampledFrom([]byte("ab9.%|{ \xff")), 0, 9), func(b []byte) string { return string(b) }),
	)
	rapid.Check(t, func(t *rapid.T) {
		v := value.Draw(t, "v")
		if got, want := string(AppendEscaped([]byte("x"), v)), "x"+plainEscape(v); got != want {
			t.Fatalf("AppendEscaped(%q) = %q, want %q", v, got, want)
		}
		var attrs []Attr
		for _, name := range []string{"user", "b", "a", "other"} {
			if rapid.IntRange(0, 5).Draw(t, "absent "+name) > 0 {
				attrs = append(attrs, Attr{name, value.Draw(t, name)})
			}
		}
		for _, r := range set.Rules {
			fast, okf := r.AppendKey([]byte("pre"), attrs)
			plain, okp := r.appendKeySlow([]byte("pre"), attrs)
			if okf != okp || !bytes.Equal(fast, plain) {
				t.Fatalf("rule %s, attrs %q: AppendKey = %q %v, plain = %q %v", r.Name, attrs, fast, okf, plain, okp)
			}
		}
	})
}
