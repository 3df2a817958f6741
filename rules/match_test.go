package rules

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

func mustParse(t testing.TB, src string) *Set {
	t.Helper()
	set, err := Parse("test.yaml", []byte(src))
	if err != nil {
		t.Fatalf("Parse:\n%s\n%v", src, err)
	}
	return set
}

func TestGlob(t *testing.T) {
	tests := []struct {
		pattern string
		match   []string
		noMatch []string
	}{
		{"/", []string{"/"}, []string{"", "//", "/a"}},
		{"/login", []string{"/login"}, []string{"/login/", "/logins", "/Login", "login", "/login?x=1"}},
		{"/v1/*/holds", []string{"/v1/e1/holds", "/v1/a.b-c/holds"}, []string{"/v1//holds", "/v1/a/b/holds", "/v1/e1/holds/", "/v1/holds", "/v2/e1/holds"}},
		{"/v1/*", []string{"/v1/a", "/v1/abc"}, []string{"/v1", "/v1/", "/v1/a/", "/v1/a/b"}},
		{"/v1/*/", []string{"/v1/a/"}, []string{"/v1/a", "/v1//"}},
		{"/files/*.png", []string{"/files/a.png", "/files/.png", "/files/a.b.png"}, []string{"/files/a.png/x", "/files/a.jpg", "/files/x/a.png", "/files/a.pngx"}},
		{"/a*b*c", []string{"/abc", "/aXbYc", "/abbbc", "/abcbc"}, []string{"/ab", "/acb", "/a/b/c", "/abcd"}},
		{"/*x*", []string{"/x", "/axb"}, []string{"/", "/ab"}},
		{"/v1/**", []string{"/v1", "/v1/", "/v1/a", "/v1/a/b", "/v1/a/b/"}, []string{"/v1x", "/v2/a", "/", "v1"}},
		{"/**", []string{"/", "/a", "/a/b/c", "//", ""}, []string{"a"}}, // "" as /v1/** matches /v1
		{"/**/holds", []string{"/holds", "/a/holds", "/a/b/c/holds"}, []string{"/holds/", "/a/holdsx", "/a/b"}},
		{"/v1/**/x", []string{"/v1/x", "/v1/a/x", "/v1/a/b/x"}, []string{"/v1/x/y", "/v1", "/x"}},
		{"/a/**/b/**/c", []string{"/a/b/c", "/a/1/b/2/3/c", "/a/b/b/c/c", "/a/b/x/b/c"}, []string{"/a/c/b", "/a/b", "/a/b/c/d"}},
		{"/a/**/**/b", []string{"/a/b", "/a/x/y/b"}, []string{"/a"}},
		{"/**/*.png", []string{"/a.png", "/x/y/a.png"}, []string{"/x/y", "/x.png/y"}},
		{"/a//b", []string{"/a//b"}, []string{"/a/b"}},
		{"/v1/*/holds/**", []string{"/v1/e/holds", "/v1/e/holds/1/2"}, []string{"/v1/holds", "/v1/e/f/holds"}},
	}
	for _, tt := range tests {
		g, err := compileGlob(tt.pattern)
		if err != nil {
			t.Fatalf("compileGlob(%q): %v", tt.pattern, err)
		}
		for _, p := range tt.match {
			if !g.match(p) {
				t.Errorf("%q does not match %q, want a match", tt.pattern, p)
			}
		}
		for _, p := range tt.noMatch {
			if g.match(p) {
				t.Errorf("%q matches %q, want none", tt.pattern, p)
			}
		}
	}
}

func TestGlobErrors(t *testing.T) {
	for _, p := range []string{"", "v1/x", "*", "**", "/a**", "/**a", "/a/***"} {
		if _, err := compileGlob(p); err == nil {
			t.Errorf("compileGlob(%q) succeeded", p)
		}
	}
}

// TestGlobAgainstReference checks the index walk against a plain recursive matcher over
// strings.Split segments.
func TestGlobAgainstReference(t *testing.T) {
	var ref func(pat, path []string) bool
	ref = func(pat, path []string) bool {
		if len(pat) == 0 {
			return len(path) == 0
		}
		if pat[0] == "**" {
			for i := 0; i <= len(path); i++ {
				if ref(pat[1:], path[i:]) {
					return true
				}
			}
			return false
		}
		if len(path) == 0 {
			return false
		}
		ok := false
		switch {
		case pat[0] == "*":
			ok = path[0] != ""
		default:
			ok = wildMatch(pat[0], path[0])
		}
		return ok && ref(pat[1:], path[1:])
	}
	patterns := []string{"/**", "/a/**", "/**/b", "/a/*/b", "/*/**/*", "/**/a*/**", "/a/**/b/**", "/*/", "/a*/b",
		// without "**" (matchParts): runs of literal segments between wildcards
		"/*", "/*/*", "/a/*", "/a/*/", "/*/b", "/a/b/*", "/a*", "/*b/*", "/a/*/b/*/c", "/a/b*/", "//*", "/*//b", "/x*y/b"}
	paths := []string{"", "/", "//", "/a", "/a/", "/a/b", "/a/b/", "/ab/b", "/a/x/b", "/a/x/y/b", "/x/a/y/b/z", "/a//b", "/b",
		"/a/b/c", "/a/x/b/y/c", "/a/x/b//c", "/xy/b", "/xzy/b", "/x/b", "/bb/a", "/a/bc/", "//b", "/q//b", "/a/x/b/y/c/"}
	// And every pattern of up to three segments over a small alphabet against every path
	// of up to three segments over another, so that both matchers meet each corner.
	patSegs := []string{"a", "b", "*", "a*", "*b", "**", ""}
	pathSegs := []string{"a", "b", "ab", "", "x"}
	var gen func(segs []string, n int, prefix string, out *[]string)
	gen = func(segs []string, n int, prefix string, out *[]string) {
		*out = append(*out, prefix)
		if n == 0 {
			return
		}
		for _, s := range segs {
			gen(segs, n-1, prefix+"/"+s, out)
		}
	}
	var genPats, genPaths []string
	gen(patSegs, 3, "", &genPats)
	gen(pathSegs, 3, "", &genPaths)
	patterns = append(patterns, genPats[1:]...)
	paths = append(paths, genPaths...)
	for _, pat := range patterns {
		g, err := compileGlob(pat)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range paths {
			if got, want := g.match(p), ref(strings.Split(pat, "/"), strings.Split(p, "/")); got != want {
				t.Errorf("%q vs %q: got %v, reference %v", pat, p, got, want)
			}
		}
	}
}

func TestMatches(t *testing.T) {
	set := mustParse(t, `rules:
  - name: all
    key: ip
    limit: { requests: 1, per: 1s }
  - name: post-holds
    match: { method: POST, path: "/v1/events/*/holds" }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: lists
    match:
      method: [GET, HEAD]
      path: [/a/**, /b]
    key: ip
    limit: { requests: 1, per: 1s }
  - name: empty-value
    match: { tenant: "" }
    key: ip
    limit: { requests: 1, per: 1s }
`)
	all, holds, lists, empty := set.Rules[0], set.Rules[1], set.Rules[2], set.Rules[3]
	a := func(kv ...string) []Attr {
		var out []Attr
		for i := 0; i < len(kv); i += 2 {
			out = append(out, Attr{kv[i], kv[i+1]})
		}
		return out
	}
	tests := []struct {
		r     *Rule
		attrs []Attr
		want  bool
	}{
		{all, nil, true},
		{all, a("x", "y"), true},
		{holds, a("method", "POST", "path", "/v1/events/e1/holds"), true},
		{holds, a("path", "/v1/events/e1/holds", "method", "POST", "ip", "1"), true},
		{holds, a("method", "post", "path", "/v1/events/e1/holds"), false}, // case-sensitive
		{holds, a("method", "GET", "path", "/v1/events/e1/holds"), false},
		{holds, a("method", "POST", "path", "/v1/events/e1/holds/"), false},
		{holds, a("method", "POST"), false},                                               // no path
		{holds, a("path", "/v1/events/e1/holds"), false},                                  // no method
		{holds, a("method", "POST", "method", "GET", "path", "/v1/events/e/holds"), true}, // first wins
		{lists, a("method", "GET", "path", "/b"), true},
		{lists, a("method", "HEAD", "path", "/a"), true},
		{lists, a("method", "HEAD", "path", "/a/x/y"), true},
		{lists, a("method", "PUT", "path", "/b"), false},
		{lists, a("method", "GET", "path", "/c"), false},
		{empty, a("tenant", ""), true},
		{empty, a("tenant", "x"), false},
		{empty, nil, false},
	}
	for i, tt := range tests {
		if got := tt.r.Matches(tt.attrs); got != tt.want {
			t.Errorf("%d: %s.Matches(%v) = %v, want %v", i, tt.r.Name, tt.attrs, got, tt.want)
		}
	}
}

func TestLookup(t *testing.T) {
	attrs := []Attr{{"a", "1"}, {"b", ""}, {"a", "2"}}
	if v, ok := Lookup(attrs, "a"); !ok || v != "1" {
		t.Errorf("Lookup a = %q, %v", v, ok)
	}
	if v, ok := Lookup(attrs, "b"); !ok || v != "" {
		t.Errorf("Lookup b = %q, %v", v, ok)
	}
	if _, ok := Lookup(attrs, "c"); ok {
		t.Error("Lookup c found")
	}
	if _, ok := Lookup(nil, "a"); ok {
		t.Error("Lookup in nil found")
	}
}

func TestPlans(t *testing.T) {
	set := mustParse(t, `rules:
  - name: with-burst
    key: user
    limit: { requests: 100, per: 1m, burst: 150 }
    plans: { partner: 1000, tiny: 1, odd: 3, internal: unlimited }
  - name: no-burst
    key: user
    limit: { requests: 100, per: 1m }
    plans: { partner: 1000 }
  - name: window
    key: user
    algorithm: sliding_window
    limit: { requests: 10, per: 1h }
    plans: { partner: 20 }
  - name: no-plans
    key: user
    limit: { requests: 7, per: 1s }
`)
	tests := []struct {
		rule      int
		plan      string
		hasPlan   bool
		requests  uint64
		burst     uint64
		unlimited bool
	}{
		{0, "", false, 100, 150, false},
		{0, "", true, 100, 150, false},         // empty plan value: not listed → default
		{0, "free", true, 100, 150, false},     // unknown plan → default
		{0, "partner", false, 100, 150, false}, // plan ignored when absent
		{0, "partner", true, 1000, 1500, false},
		{0, "tiny", true, 1, 2, false}, // ⌈1.5⌉
		{0, "odd", true, 3, 5, false},  // ⌈4.5⌉
		{0, "internal", true, 0, 0, true},
		{0, "Partner", true, 100, 150, false}, // case-sensitive
		{1, "partner", true, 1000, 1000, false},
		{1, "x", true, 100, 100, false},
		{2, "partner", true, 20, 20, false},
		{3, "partner", true, 7, 7, false},
	}
	for _, tt := range tests {
		r := set.Rules[tt.rule]
		lim, unl := r.LimitFor(tt.plan, tt.hasPlan)
		if unl != tt.unlimited {
			t.Errorf("%s.LimitFor(%q, %v) unlimited = %v", r.Name, tt.plan, tt.hasPlan, unl)
			continue
		}
		if unl {
			if lim != nil {
				t.Errorf("%s.LimitFor(%q): unlimited with a limit", r.Name, tt.plan)
			}
			continue
		}
		if lim.Requests() != tt.requests || lim.Burst() != tt.burst || lim.Window() != r.Per || lim.Algorithm() != r.Algorithm {
			t.Errorf("%s.LimitFor(%q, %v) = %d burst %d per %v, want %d burst %d", r.Name, tt.plan, tt.hasPlan,
				lim.Requests(), lim.Burst(), lim.Window(), tt.requests, tt.burst)
		}
		// Stable: the same pointer every time.
		if again, _ := r.LimitFor(tt.plan, tt.hasPlan); again != lim {
			t.Errorf("%s.LimitFor(%q) returns a new pointer per call", r.Name, tt.plan)
		}
	}
}

func TestScaleBurst(t *testing.T) {
	const max = ^uint64(0)
	tests := []struct {
		burst, plan, reqs, want uint64
		ok                      bool
	}{
		{0, 1000, 100, 0, true},
		{150, 1000, 100, 1500, true},
		{150, 1, 100, 2, true},
		{1, 1, 1000, 1, true}, // min 1
		{10, 1, 100, 1, true},
		{max, max, 1, 0, false},
		{max, 2, 2, max, true},
		{max, 3, 2, 0, false},
	}
	for _, tt := range tests {
		got, ok := scaleBurst(tt.burst, tt.plan, tt.reqs)
		if got != tt.want || ok != tt.ok {
			t.Errorf("scaleBurst(%d, %d, %d) = %d, %v; want %d, %v", tt.burst, tt.plan, tt.reqs, got, ok, tt.want, tt.ok)
		}
	}
}

func TestZeroAllocs(t *testing.T) {
	set := mustParse(t, benchRules)
	r := set.Rules[0]
	attrs := benchAttrs
	buf := make([]byte, 0, 256)
	if n := testing.AllocsPerRun(100, func() { r.Matches(attrs) }); n != 0 {
		t.Errorf("Matches: %v allocs", n)
	}
	if n := testing.AllocsPerRun(100, func() { buf, _ = r.AppendKey(buf[:0], attrs) }); n != 0 {
		t.Errorf("AppendKey: %v allocs", n)
	}
	if n := testing.AllocsPerRun(100, func() { r.LimitFor("partner", true) }); n != 0 {
		t.Errorf("LimitFor: %v allocs", n)
	}
}

const benchRules = `rules:
  - name: holds-per-account
    match: { method: POST, path: "/v1/events/*/holds/**" }
    key: [user, ip]
    limit: { requests: 5, per: 1m }
    plans: { partner: 50 }
`

var benchAttrs = []Attr{
	{"method", "POST"},
	{"path", "/v1/events/ev-2026-06-01/holds/abc/def"},
	{"ip", "2001:db8::1"},
	{"user", "ann@example.com|x{y}"},
	{"plan", "partner"},
}

func BenchmarkMatches(b *testing.B) {
	r := mustParse(b, benchRules).Rules[0]
	b.ReportAllocs()
	for b.Loop() {
		if !r.Matches(benchAttrs) {
			b.Fatal("no match")
		}
	}
}

func BenchmarkAppendKey(b *testing.B) {
	r := mustParse(b, benchRules).Rules[0]
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		buf := make([]byte, 0, 256)
		for pb.Next() {
			var ok bool
			if buf, ok = r.AppendKey(buf[:0], benchAttrs); !ok {
				panic("no key")
			}
		}
	})
}

func TestSplitLimitFor(t *testing.T) {
	set, err := Parse("split.yaml", []byte(`
rules:
  - name: s
    key: user
    limit: { requests: 100, per: 1m, burst: 150 }
    plans: { partner: 1000, internal: unlimited }
    split: 20
  - name: auto
    key: user
    algorithm: fixed_window
    limit: { requests: 7, per: 1s }
    split: auto
`))
	if err != nil {
		t.Fatal(err)
	}
	s, auto := set.Rules[0], set.Rules[1]
	if s.Split != 20 || s.Mode != ModeLocal || !auto.SplitAuto || auto.Mode != ModeLocal {
		t.Fatalf("parsed %+v %+v", s, auto)
	}
	l, _ := s.SplitLimitFor("", false, 20)
	if l.Requests() != 5 || l.Burst() != 8 || l.Window() != time.Minute {
		t.Fatalf("100/min burst 150 over 20: %d burst %d", l.Requests(), l.Burst())
	}
	if l, _ := s.SplitLimitFor("partner", true, 20); l.Requests() != 50 {
		t.Fatalf("partner over 20: %d", l.Requests())
	}
	if _, unlimited := s.SplitLimitFor("internal", true, 20); !unlimited {
		t.Fatal("internal plan not unlimited")
	}
	if l, _ := auto.SplitLimitFor("", false, 3); l.Requests() != 3 { // ceil(7/3)
		t.Fatalf("7 over 3: %d", l.Requests())
	}
	if l, _ := auto.SplitLimitFor("", false, 100); l.Requests() != 1 {
		t.Fatalf("7 over 100: %d, want at least 1", l.Requests())
	}
	// A steady daemon count allocates nothing.
	if a := testing.AllocsPerRun(100, func() { s.SplitLimitFor("partner", true, 20) }); a != 0 {
		t.Fatalf("%v allocs", a)
	}
}

// Rule.Match is the match conditions as written, in the file's order (matching reorders
// its compiled conditions, cheapest first); a rule without match has none.
func TestMatchAsWritten(t *testing.T) {
	set := mustParse(t, `
rules:
  - name: r
    match: { path: /login, method: [POST, PUT], user: 42, tenant: { glob: "acme-*", not: [acme-test, acme-dev], not_glob: "*-tmp" } }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: all
    key: ip
    limit: { requests: 1, per: 1s }
`)
	want := []MatchCond{
		{Attr: "path", Values: []string{"/login"}},
		{Attr: "method", Values: []string{"POST", "PUT"}},
		{Attr: "user", Values: []string{"42"}},
		{Attr: "tenant", Glob: []string{"acme-*"}, Not: []string{"acme-test", "acme-dev"}, NotGlob: []string{"*-tmp"}},
	}
	if got := set.Rules[0].Match; !reflect.DeepEqual(got, want) {
		t.Errorf("Match = %+v\nwant %+v", got, want)
	}
	if got := set.Rules[1].Match; got != nil {
		t.Errorf("a rule without match: Match = %+v; want nil", got)
	}
}
