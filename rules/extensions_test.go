package rules

import (
	"strings"
	"testing"
)

func TestWildcard(t *testing.T) {
	tests := []struct {
		pattern        string
		match, noMatch []string
	}{
		{"value*", []string{"value", "value1", "valueXYZ"}, []string{"valu", "xvalue"}},
		{"/api/*/action", []string{"/api/123/action", "/api//action", "/api/a/b/action"}, []string{"/api/123/other", "/api/action"}},
		{"/api/*/resource/*/action", []string{"/api/v1/resource/123/action"}, []string{"/api/v1/resource/action", "/api/v1/x/123/action"}},
		{"*", []string{"", "a"}, nil},
		{"a*a", []string{"aa", "aba"}, []string{"a"}},
		{"exact", []string{"exact"}, []string{"exact2", "exac"}},
	}
	for _, tt := range tests {
		w := compileWildcard(tt.pattern)
		for _, v := range tt.match {
			if !w.match(v) {
				t.Errorf("%q should match %q", tt.pattern, v)
			}
		}
		for _, v := range tt.noMatch {
			if w.match(v) {
				t.Errorf("%q should not match %q", tt.pattern, v)
			}
		}
	}
}

func TestMatchOperators(t *testing.T) {
	set := mustParse(t, `
rules:
  - name: not
    match: { ip: { not: [1.1.1.1, 2.2.2.2], not_glob: "10.*" } }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: glob
    match: { path: { glob: "/api/*/action" } }
    key: path
    limit: { requests: 1, per: 1s }
`)
	tests := []struct {
		rule  int
		attrs []Attr
		want  bool
	}{
		{0, []Attr{{"ip", "3.3.3.3"}}, true},
		{0, []Attr{{"ip", "1.1.1.1"}}, false},
		{0, []Attr{{"ip", "10.0.0.1"}}, false},
		{0, nil, false},                                // absent attribute: the condition fails
		{1, []Attr{{"path", "/api/a/b/action"}}, true}, // crosses '/', unlike a path glob
		{1, []Attr{{"path", "/api/a/other"}}, false},
	}
	for _, tt := range tests {
		if got := set.Rules[tt.rule].Matches(tt.attrs); got != tt.want {
			t.Errorf("%s.Matches(%v) = %v, want %v", set.Rules[tt.rule].Name, tt.attrs, got, tt.want)
		}
	}
}

func TestUnlimitedDenyReplaces(t *testing.T) {
	set := mustParse(t, `
rules:
  - name: free
    key: user
    limit: unlimited
  - name: blocked
    key: ip
    limit: deny
  - name: wide
    key: user
    limit: { requests: 5, per: 1s }
  - name: narrow
    key: user
    limit: { requests: 10, per: 1s }
    replaces: [wide]
`)
	if lim, unl := set.Rules[0].LimitFor("", false); lim != nil || !unl || !set.Rules[0].Unlimited {
		t.Errorf("unlimited rule: LimitFor = %v, %v", lim, unl)
	}
	if b := set.Rules[1]; !b.Deny {
		t.Errorf("limit: deny: Deny = %v", b.Deny)
	}
	if !set.AnyReplaces() || len(set.Rules[3].ReplacesIdx) != 1 || set.Rules[3].ReplacesIdx[0] != 2 {
		t.Errorf("replaces: AnyReplaces %v, idx %v", set.AnyReplaces(), set.Rules[3].ReplacesIdx)
	}
}

func TestExtensionErrors(t *testing.T) {
	tests := []struct{ src, want string }{
		{"rules:\n  - name: a\n    key: u\n    limit: { requests: 1, per: 1s }\n    replaces: [nope]\n", `test.yaml:5: rules[0].replaces[0]: rule "a" replaces "nope", which no rule is called`},
		{"rules:\n  - name: a\n    key: u\n    limit: { requests: 1, per: 1s }\n    replaces: a\n", `replaces itself`},
		{"rules:\n  - name: a\n    key: u\n    limit: unlimited\n    plans: { x: 5 }\n", `test.yaml:5: rules[0].plans: a rule whose limit is unlimited or deny has no plans`},
		{"rules:\n  - name: a\n    key: u\n    match: { u: { nah: x } }\n    limit: { requests: 1, per: 1s }\n", `unknown field "nah"`},
		{"rules:\n  - name: a\n    key: u\n    match: { u: {} }\n    limit: { requests: 1, per: 1s }\n", `needs at least one of glob, not, not_glob`},
		{"rules:\n  - name: a\n    key: u\n    limit: limitless\n", `rules[0].limit: expected a mapping`},
	}
	for _, tt := range tests {
		_, err := Parse("test.yaml", []byte(tt.src))
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Parse(%q) = %v, want an error containing %q", tt.src, err, tt.want)
		}
	}
}
