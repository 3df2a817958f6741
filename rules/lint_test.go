package rules

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

func TestWarningsShadowed(t *testing.T) {
	const a = `  - name: a
    match: { method: [GET, HEAD, POST], path: "/v1/**" }
    key: [user, ip]
    limit: { requests: 10, per: 1m }
`
	tests := []struct {
		name string
		b    string // the later rule
		warn bool
	}{
		{"identical", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 10, per: 1m }", true},
		{"looser, values reordered and repeated, key reordered", "match: { path: \"/v1/**\", method: [POST, GET, HEAD, GET] }\n    key: [ip, user]\n    limit: { requests: 20, per: 1m, burst: 30 }", true},
		{"tighter", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 5, per: 1m }", false},
		{"smaller burst", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1m, burst: 5 }", false},
		{"other per", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1h }", false},
		{"other key", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: user\n    limit: { requests: 20, per: 1m }", false},
		{"narrower match", "match: { method: [GET, HEAD], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1m }", false},
		{"other glob", "match: { method: [GET, HEAD, POST], path: \"/v1/*\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1m }", false},
		{"other algorithm", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    algorithm: fixed_window\n    limit: { requests: 20, per: 1m }", false},
		{"other failure policy", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    on_store_failure: closed\n    limit: { requests: 20, per: 1m }", false},
		{"shadow", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    shadow: true\n    limit: { requests: 20, per: 1m }", false},
		{"a plan only b raises", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1m }\n    plans: { partner: 100 }", true},
		{"a plan b makes unlimited", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1m }\n    plans: { internal: unlimited }", true},
		{"a plan b lowers", "match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1m }\n    plans: { free: 5 }", false},
	}
	for _, tt := range tests {
		src := "rules:\n" + a + "  - name: b\n    " + tt.b + "\n"
		set := mustParse(t, src)
		ws := set.Warnings()
		if got := len(ws) > 0; got != tt.warn {
			t.Errorf("%s: warnings %v, want a warning: %v", tt.name, ws, tt.warn)
			continue
		}
		if tt.warn && (ws[0].Line != 6 || !strings.Contains(ws[0].Error(), `test.yaml:6: rule "b": never decides: rule "a" (line 2)`)) {
			t.Errorf("%s: %v", tt.name, ws[0])
		}
	}
	// An unlimited plan on the earlier rule is not tighter than a limit on the later one.
	set := mustParse(t, "rules:\n"+strings.Replace(a, "per: 1m }", "per: 1m }\n    plans: { internal: unlimited }", 1)+
		"  - name: b\n    match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1m }\n")
	if ws := set.Warnings(); len(ws) != 0 {
		t.Errorf("unlimited plan on a: %v", ws)
	}
	// A rule replacing a but not b leaves b deciding alone where it applies; one
	// replacing both, or a shadow one replacing a, changes nothing.
	for _, c := range []struct {
		replaces string
		warn     bool
	}{{"[a]", false}, {"[a, b]", true}, {"[a]\n    shadow: true", true}} {
		set := mustParse(t, "rules:\n"+a+"  - name: b\n    match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1m }\n"+
			"  - name: c\n    match: { path: /v1/x }\n    key: user\n    limit: { requests: 100, per: 1m }\n    replaces: "+c.replaces+"\n")
		if ws := set.Warnings(); (len(ws) > 0) != c.warn {
			t.Errorf("c replaces %s: warnings %v, want a warning: %v", c.replaces, ws, c.warn)
		}
	}
	// A shadow rule shadows nothing.
	set = mustParse(t, "rules:\n"+strings.Replace(a, "key:", "shadow: true\n    key:", 1)+"  - name: b\n    match: { method: [GET, HEAD, POST], path: \"/v1/**\" }\n    key: [user, ip]\n    limit: { requests: 20, per: 1m }\n")
	if ws := set.Warnings(); len(ws) != 0 {
		t.Errorf("shadow a: %v", ws)
	}
}

// The mapping form's operators are part of a rule's match: rules that differ in them
// match different requests, and neither shadows the other (every operator match on one
// attribute looked alike, and the later rule was said never to decide).
func TestWarningsShadowedOperators(t *testing.T) {
	tests := []struct {
		name, a, b string
		warn       bool
	}{
		{"other glob", `{ glob: "ab*" }`, `{ glob: "a*" }`, false},
		{"glob, then glob and not_glob", `{ glob: "ab*" }`, `{ glob: "a*", not_glob: "ab*" }`, false},
		{"other not", `{ not: [y] }`, `{ not: [x] }`, false},
		{"not and not_glob", `{ not: [x] }`, `{ not_glob: "x" }`, false},
		{"the same, reordered", `{ glob: ["a*", "b*"], not: [ax, bx] }`, `{ not: [bx, ax], glob: ["b*", "a*", "a*"] }`, true},
	}
	for _, tt := range tests {
		src := "rules:\n  - name: a\n    match: { tenant: " + tt.a + " }\n    key: user\n    limit: { requests: 5, per: 1m }\n" +
			"  - name: b\n    match: { tenant: " + tt.b + " }\n    key: user\n    limit: { requests: 7, per: 1m }\n"
		ws := mustParse(t, src).Warnings()
		if got := len(ws) > 0; got != tt.warn {
			t.Errorf("%s: warnings %v, want a warning: %v", tt.name, ws, tt.warn)
		}
	}
}

// A split above the rule's requests cannot divide it: each daemon enforces at least 1.
func TestWarningsSplitAboveRequests(t *testing.T) {
	for _, tt := range []struct {
		limit string
		split int
		warn  bool
	}{{"{ requests: 1, per: 1m }", 5, true}, {"{ requests: 10, per: 1m }", 5, false}, {"{ requests: 5, per: 1m }", 5, false}} {
		src := fmt.Sprintf("rules:\n  - name: s\n    key: ip\n    limit: %s\n    split: %d\n", tt.limit, tt.split)
		ws := mustParse(t, src).Warnings()
		if got := len(ws) > 0 && strings.Contains(ws[0].Error(), "split"); got != tt.warn {
			t.Errorf("%s split %d: warnings %v, want a split warning: %v", tt.limit, tt.split, ws, tt.warn)
		}
		// The count reads right in the singular ("its 1 requests" before).
		if want := "split 5 is more than its 1 request: each daemon"; tt.warn && !strings.Contains(ws[0].Error(), want) {
			t.Errorf("%s split %d: %q, want it to say %q", tt.limit, tt.split, ws[0].Error(), want)
		}
	}
}

// A well-known attribute in another case never matches what the clients send.
func TestWarningsAttributeCase(t *testing.T) {
	ws := mustParse(t, "rules:\n  - name: a\n    match: { Method: GET }\n    key: User\n    limit: { requests: 1, per: 1m }\n"+
		"  - name: b\n    match: { method: [GET, HEAD], X-Tenant: t }\n    key: [user, Tenant]\n    limit: { requests: 1, per: 1m }\n").Warnings()
	var msgs []string
	for _, w := range ws {
		msgs = append(msgs, w.Error())
	}
	if len(ws) != 2 || !strings.Contains(msgs[0], `attribute "Method"`) || !strings.Contains(msgs[1], `attribute "User"`) {
		t.Fatalf("warnings %q, want one for Method and one for User, none for rule b", msgs)
	}
}

func TestWarningsDeadGlobs(t *testing.T) {
	dead := []string{"/search?q=*", "/a#top", "/v1/.*", `/v1/\d+`, "/items$", "/users/{id}", "/users/:id/posts",
		"/^v1/**", "/files/[0-9]*",
		// A path arrives with runs of '/' merged and '.' and '..' segments removed.
		"/api//v1/*", "//login", "/a/**//b", "/static/../admin", "/a/./b", "/a/..", "/.", "/v1/**/./x"}
	// A path arrives with each %XX decoded once (clients/testdata/paths.json), so a space,
	// or any other byte, can be in it: /my%20files/a is /my files/a.
	live := []string{"/", "/**", "/v1/*/holds", "/files/*.png", "/$metadata", "/v1/projects/p:run", "/a+b", "/{", "/a.b", "/:", "/a(b)",
		"/my files/*", "/a b", "/a\tb", "/a\x00b", "/.hidden/*", "/a..b/...", "/a/", "/v1/**/", "/...", "/a./.b"}
	for _, g := range dead {
		if deadGlob(g) == "" {
			t.Errorf("%q: no warning", g)
		}
	}
	for _, g := range live {
		if why := deadGlob(g); why != "" {
			t.Errorf("%q: %s", g, why)
		}
	}
	set := mustParse(t, `rules:
  - name: ok
    match: { path: "/v1/**" }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: template
    match: { path: ["/v1/x", "/users/{id}"] }
    key: ip
    limit: { requests: 1, per: 1s }
`)
	ws := set.Warnings()
	if len(ws) != 1 || ws[0].Line != 6 || !strings.Contains(ws[0].Error(), `"/users/{id}" matches no request path: segment "{id}" looks like a route template`) {
		t.Errorf("warnings %v", ws)
	}
}

// Every path the clients send in the canonical cases (clients/testdata/paths.json) is
// matched by itself as a glob, so validate must not say such a glob matches no request
// path: it said so of a space ("/my files/*" for /my%20files/...), which the clients
// decode, and a user who escaped it as %20 to quiet the warning wrote a rule that then
// matched nothing. '?' and '#' stay warned of: though %3F and %23 decode to them, a glob
// holding them is a query string or a fragment written by mistake far more often.
func TestWarningsDeadGlobsDecodedPaths(t *testing.T) {
	b, err := os.ReadFile("../clients/testdata/paths.json")
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Cases []struct{ Raw, Path string }
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	// paths.json writes each byte of a path as one rune (\u00c3 is the byte C3).
	bytesOf := func(s string) string {
		out := make([]byte, 0, len(s))
		for _, r := range s {
			out = append(out, byte(r))
		}
		return string(out)
	}
	for _, c := range append(doc.Cases, struct{ Raw, Path string }{"/my%20files/a", "/my files/a"}) {
		p := bytesOf(c.Path)
		if strings.ContainsAny(p, "?#*") {
			continue
		}
		g, err := compileGlob(p)
		if err != nil {
			t.Fatalf("%q: %v", p, err)
		}
		if !g.match(p) {
			t.Fatalf("glob %q does not match the path %q", p, p)
		}
		if why := deadGlob(p); why != "" {
			t.Errorf("glob %q (the path of request %q) said to match no request path: %s", p, c.Raw, why)
		}
	}
}

// The built-in rules and the fixtures that should be clean are.
func TestWarningsNoneOnDefault(t *testing.T) {
	if ws := Default().Warnings(); len(ws) != 0 {
		t.Errorf("built-in rules: %v", ws)
	}
}

// Looking for rules that never decide compares each rule with the earlier ones of its
// match and key, plan by plan: bounded, and said so when the bound stops it, so that a
// file of many such rules with many plans does not hold a reload for seconds.
func TestWarningsShadowCheckBounded(t *testing.T) {
	var b strings.Builder
	b.WriteString("plans:\n")
	for p := range 300 {
		fmt.Fprintf(&b, "  p%d: 2x\n", p)
	}
	b.WriteString("rules:\n")
	for r := range 300 {
		fmt.Fprintf(&b, "  - name: r%d\n    key: user\n    limit: { requests: %d, per: 1m }\n", r, 1000-r)
	}
	set, err := Parse("many.yaml", []byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	ws := set.Warnings()
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Warnings took %v", d)
	}
	if !strings.Contains(ws.Error(), "stopped looking for rules that never decide") {
		t.Fatalf("no word of the check stopping: %v", ws)
	}
}

// Rules that replace each other in a cycle warn: a request matching them all was charged
// to none (rules: [], allowed without limit), and validate said nothing. One warning per
// group, at its first rule, naming a cycle; a chain, or a cycle through a shadow rule
// (which replaces nothing), does not warn.
func TestWarningsReplacesCycle(t *testing.T) {
	rule := func(name, key string, extra string) string {
		return "  - { name: " + name + ", key: " + key + ", limit: { requests: 3, per: 1h }" + extra + " }\n"
	}
	tests := []struct {
		name, src string
		want      []string // substrings of the one warning; nil: none
	}{
		{"two", rule("a", "ip", ", replaces: [b]") + rule("b", "user", ", replaces: [a]"),
			[]string{`test.yaml:2: rule "a" replaces: rules replace each other in a cycle: "a" replaces "b", which replaces "a": a request that matches all of them is limited by none`}},
		{"three", rule("x", "plan", "") + rule("a", "ip", ", replaces: [b]") + rule("b", "user", ", replaces: [c]") + rule("c", "api_key", ", replaces: [a]"),
			[]string{`test.yaml:3: rule "a" replaces: rules replace each other in a cycle: "a" replaces "b", which replaces "c", which replaces "a":`}},
		{"group", rule("a", "ip", ", replaces: [b, c]") + rule("b", "user", ", replaces: [a]") + rule("c", "api_key", ", replaces: [a]"),
			[]string{`"a" replaces "b", which replaces "a" (and rules "c" are in cycles with them)`}},
		{"chain", rule("a", "ip", ", replaces: [b]") + rule("b", "user", ", replaces: [c]") + rule("c", "api_key", ""), nil},
		{"through a shadow rule", rule("a", "ip", ", replaces: [b]") + rule("b", "user", ", replaces: [a], shadow: true"), nil},
	}
	for _, tt := range tests {
		ws := mustParse(t, "rules:\n"+tt.src).Warnings()
		if tt.want == nil {
			if len(ws) != 0 {
				t.Errorf("%s: %v, want no warning", tt.name, ws)
			}
			continue
		}
		if len(ws) != 1 {
			t.Errorf("%s: %v, want one warning", tt.name, ws)
			continue
		}
		for _, want := range tt.want {
			if !strings.Contains(ws[0].Error(), want) {
				t.Errorf("%s: %v, want %s", tt.name, ws[0], want)
			}
		}
	}
	// Two separate cycles: two warnings, in file order.
	ws := mustParse(t, "rules:\n"+rule("a", "ip", ", replaces: [b]")+rule("c", "api_key", ", replaces: [d]")+
		rule("b", "user", ", replaces: [a]")+rule("d", "method", ", replaces: [c]")).Warnings()
	if len(ws) != 2 || ws[0].Line != 2 || ws[1].Line != 3 || !strings.Contains(ws[1].Error(), `"c" replaces "d", which replaces "c"`) {
		t.Errorf("two cycles: %v", ws)
	}
	// A ring of 5,000 rules: found without deep recursion, and named in a bounded line.
	var ring strings.Builder
	const n = 5_000
	for i := range n {
		fmt.Fprintf(&ring, "  - { name: r%d, match: { path: /p%d }, key: ip, limit: { requests: 3, per: 1h }, replaces: [r%d] }\n", i, i, (i+1)%n)
	}
	ws = mustParse(t, "rules:\n"+ring.String()).Warnings()
	if len(ws) != 1 || len(ws[0].Error()) > 400 || !strings.Contains(ws[0].Error(), `"r0" replaces "r1", which replaces`) ||
		!strings.Contains(ws[0].Error(), `and so on through 4991 more rules, which replaces "r0"`) {
		t.Errorf("ring: %v", ws)
	}
}

// A match written with no condition applies the rule to every request: said, as its
// conditions were likely commented out. No match at all is every request, on purpose.
func TestWarningsEmptyMatch(t *testing.T) {
	for _, tt := range []struct {
		match string
		warn  bool
	}{
		{"    match:\n    #  path: /v1/orders/*\n", true},
		{"    match: ~\n", true},
		{"    match: {}\n", true},
		{"", false},
		{"    match: { method: [GET, HEAD] }\n", false},
	} {
		src := "rules:\n  - name: m\n" + tt.match + "    key: ip\n    limit: { requests: 1, per: 1m }\n"
		ws := mustParse(t, src).Warnings()
		if got := len(ws) == 1 && strings.Contains(ws[0].Error(), "every request"); got != tt.warn || len(ws) > 1 {
			t.Errorf("%q: warnings %v, want one saying it applies to every request: %v", tt.match, ws, tt.warn)
		}
	}
}

// TestWarningsShadowedReplacer: a later rule that replaces another has an effect even when
// an earlier, tighter rule rejects whatever it would: where it applies, the rule it
// replaces is not charged. validate said it "never decides" (remove it), and removing it
// put that rule back in force. An earlier rule replacing the same rules covers it.
func TestWarningsShadowedReplacer(t *testing.T) {
	const zz = "  - name: zz\n    key: ip\n    limit: { requests: 1, per: 1m }\n"
	for _, c := range []struct {
		aReplaces string
		warn      bool
	}{
		{"", false},
		{"    replaces: [zz]\n", true},
	} {
		set := mustParse(t, "rules:\n  - name: a\n    key: user\n    limit: { requests: 5, per: 1m }\n"+c.aReplaces+
			"  - name: b\n    key: user\n    limit: { requests: 10, per: 1m }\n    replaces: [zz]\n"+zz)
		var never []string
		for _, w := range set.Warnings() {
			if strings.Contains(w.Error(), "never decides") {
				never = append(never, w.Error())
			}
		}
		if got := len(never) > 0; got != c.warn {
			t.Errorf("a replaces %q: never-decides warnings %v, want one: %v", strings.TrimSpace(c.aReplaces), never, c.warn)
		}
	}
}

// A method list with GET and not HEAD: net/http, Express, Starlette and Flask run the GET
// handler for a HEAD, which the rule does not match, so HEAD requests ran the limited
// handler unlimited, without a word from validate.
func TestWarningsGetWithoutHead(t *testing.T) {
	for _, tt := range []struct {
		match string
		warn  bool
	}{
		{"{ method: GET, path: /export }", true},
		{"{ method: [GET, POST] }", true},
		{"{ method: [GET, HEAD] }", false},
		{"{ method: [HEAD, GET, POST] }", false},
		{"{ method: POST, path: /login }", false},
		{"{ method: { not: POST } }", false},
		{"{ path: /export }", false},
	} {
		src := "rules:\n  - name: m\n    match: " + tt.match + "\n    key: ip\n    limit: { requests: 1, per: 1m }\n"
		ws := mustParse(t, src).Warnings()
		got := len(ws) == 1 && strings.Contains(ws[0].Error(), `test.yaml:2: rule "m" match.method: GET without HEAD`)
		if got != tt.warn || len(ws) > 1 {
			t.Errorf("%s: warnings %v, want one for GET without HEAD: %v", tt.match, ws, tt.warn)
		}
	}
}

// A method in lower case: the clients send the request's method as it came (GET), and
// matching is exact, so a rule on "get" never applied and validate said nothing.
func TestWarningsLowerCaseMethod(t *testing.T) {
	for _, tt := range []struct {
		match string
		warn  string // "" for none
	}{
		{"{ method: post, path: /login }", `"post": methods are case-sensitive`},
		{"{ method: [GET, HEAD, Post] }", `"Post": methods are case-sensitive`},
		{"{ method: { not: options } }", `"options": methods are case-sensitive`},
		{"{ method: [POST, PUT] }", ""},
		{"{ method: { not: OPTIONS } }", ""},
	} {
		src := "rules:\n  - name: m\n    match: " + tt.match + "\n    key: ip\n    limit: { requests: 1, per: 1m }\n"
		var got []string
		for _, w := range mustParse(t, src).Warnings() {
			if strings.Contains(w.Error(), "case-sensitive") {
				got = append(got, w.Error())
			}
		}
		if tt.warn == "" && len(got) > 0 || tt.warn != "" && (len(got) != 1 || !strings.Contains(got[0], `test.yaml:2: rule "m" match.method: `+tt.warn)) {
			t.Errorf("%s: warnings %q, want %q", tt.match, got, tt.warn)
		}
	}
}

// The shipped rules (built in, and the Debian package's rules.yaml) limit a login
// whichever path a server runs the /login handler for: before, POST /login/, which
// Express serves with the /login handler, was not limited.
func TestShippedLoginRuleCoversTrailingSlash(t *testing.T) {
	data, err := os.ReadFile("../deploy/debian/rules.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for name, set := range map[string]*Set{"built-in": Default(), "deploy/debian/rules.yaml": mustParse(t, string(data))} {
		var login *Rule
		for _, r := range set.Rules {
			if r.Name == "login" {
				login = r
			}
		}
		if login == nil {
			t.Fatalf("%s: no login rule", name)
		}
		for _, p := range []string{"/login", "/login/"} {
			if !login.Matches([]Attr{{"ip", "192.0.2.1"}, {"method", "POST"}, {"path", p}}) {
				t.Errorf("%s: the login rule does not match POST %s", name, p)
			}
		}
	}
}

// A match value holding a character the file does not show as what it matches is
// warned of: a right-to-left override or a zero-width space written as itself (a value
// that reads as another: "Trojan Source"), or a line feed a block scalar ends the value
// with; the same characters written as escapes (seen) are not, nor an ordinary value.
// Before, none was.
func TestWarningsUnseenCharacters(t *testing.T) {
	const rule = "rules:\n  - name: a\n    match: { path: %s, user: { not: %s } }\n    key: user\n    limit: { requests: 1, per: 1s }\n"
	for _, c := range []struct {
		path, not string
		want      []string
	}{
		{"\"/admin\u202e/x\"", "bob", []string{`match.path: "/admin\u202e/x" holds U+202E`}},
		{"/x", "\"bob\u200b\"", []string{`match.user: "bob\u200b" holds U+200B`}},
		{"/x", "\u2066bob", []string{`match.user: "\u2066bob" holds U+2066`}},
		{"\"/admin\\u202e/x\"", "\"bob\\u200b\"", nil}, // escapes: seen
		{"/x/*", "bob", nil},
		{"/ünïcödé/*", "bob", nil},
	} {
		src := fmt.Sprintf(rule, c.path, c.not)
		var got []string
		for _, w := range mustParse(t, src).Warnings() {
			got = append(got, w.Error())
		}
		if len(got) != len(c.want) {
			t.Errorf("%s: warnings %q, want %q", src, got, c.want)
			continue
		}
		for i := range got {
			if !strings.Contains(got[i], c.want[i]) {
				t.Errorf("%s: warning %q, want %q in it", src, got[i], c.want[i])
			}
		}
	}
	block := "rules:\n  - name: a\n    match:\n      path: >\n        /folded\n    key: user\n    limit: { requests: 1, per: 1s }\n"
	if ws := mustParse(t, block).Warnings(); len(ws) != 1 || !strings.Contains(ws[0].Error(), `"/folded\n" holds U+000A`) {
		t.Errorf("a folded block scalar's value: warnings %v", ws)
	}
}
