package rules

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// linearMatching is the reference matcher: every rule of the set in file order, kept
// when Rule.Matches holds. The index must give exactly this.
func linearMatching(set *Set, attrs []Attr) []*Rule {
	var out []*Rule
	for _, r := range set.Rules {
		if r.Matches(attrs) {
			out = append(out, r)
		}
	}
	return out
}

func names(rs []*Rule) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.Name
	}
	return out
}

// checkSame fails when the index and the linear matcher disagree on attrs.
func checkSame(t interface {
	Helper()
	Fatalf(string, ...any)
}, set *Set, attrs []Attr) {
	t.Helper()
	want := linearMatching(set, attrs)
	got := set.AppendMatching(nil, attrs)
	if !slices.Equal(got, want) {
		t.Fatalf("attrs %v:\nindex  %v\nlinear %v", attrs, names(got), names(want))
	}
	// Appending keeps what dst held.
	pre := []*Rule{nil}
	if got := set.AppendMatching(pre, attrs); len(got) != len(want)+1 || got[0] != nil || !slices.Equal(got[1:], want) {
		t.Fatalf("attrs %v: appending after one element gave %v", attrs, names(got[1:]))
	}
}

func TestAppendMatchingTable(t *testing.T) {
	set := mustParse(t, `rules:
  - name: all
    key: ip
    limit: { requests: 1, per: 1s }
  - name: post-holds
    match: { method: POST, path: "/v1/events/*/holds" }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: v1-tree
    match: { path: "/v1/**" }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: pngs
    match: { path: ["/files/*.png", "/**/*.png"] }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: gets
    match: { method: [GET, HEAD] }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: ann
    match: { user: ann, method: GET }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: deep-holds
    match: { path: "/**/holds" }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: exact-login
    match: { path: /login, method: POST }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: tenant-empty
    match: { tenant: "" }
    key: ip
    limit: { requests: 1, per: 1s }
`)
	a := func(kv ...string) []Attr {
		var out []Attr
		for i := 0; i < len(kv); i += 2 {
			out = append(out, Attr{kv[i], kv[i+1]})
		}
		return out
	}
	tests := []struct {
		attrs []Attr
		want  []string
	}{
		{nil, []string{"all"}},
		{a("method", "POST", "path", "/v1/events/e1/holds"), []string{"all", "post-holds", "v1-tree", "deep-holds"}},
		{a("method", "GET", "path", "/v1"), []string{"all", "v1-tree", "gets"}},
		{a("method", "GET", "path", "/files/a.png", "user", "ann"), []string{"all", "pngs", "gets", "ann"}},
		{a("path", "/v1/x/y.png"), []string{"all", "v1-tree", "pngs"}},
		{a("path", "/holds"), []string{"all", "deep-holds"}},
		{a("method", "POST", "path", "/login"), []string{"all", "exact-login"}},
		{a("method", "POST", "path", "/login/"), []string{"all"}},
		{a("tenant", ""), []string{"all", "tenant-empty"}},
		{a("method", "HEAD", "method", "POST", "path", "/login"), []string{"all", "gets"}}, // first value wins
	}
	for _, tt := range tests {
		if got := names(set.AppendMatching(nil, tt.attrs)); !slices.Equal(got, tt.want) {
			t.Errorf("%v: got %v, want %v", tt.attrs, got, tt.want)
		}
		checkSame(t, set, tt.attrs)
	}
}

// A Set assembled by hand (no index yet, or Index fields not matching positions) still
// matches correctly.
func TestAppendMatchingHandBuiltSet(t *testing.T) {
	parsed := mustParse(t, `rules:
  - { name: a, match: { method: GET }, key: ip, limit: { requests: 1, per: 1s } }
  - { name: b, match: { path: "/x/**" }, key: ip, limit: { requests: 1, per: 1s } }
`)
	attrs := []Attr{{"method", "GET"}, {"path", "/x/y"}}
	fresh := &Set{Rules: parsed.Rules}
	checkSame(t, fresh, attrs)
	reversed := &Set{Rules: []*Rule{parsed.Rules[1], parsed.Rules[0]}}
	if got := names(reversed.AppendMatching(nil, attrs)); !slices.Equal(got, []string{"b", "a"}) {
		t.Errorf("reversed set: got %v", got)
	}
}

// ruleGen draws one rule's YAML: a random match over a few attributes with overlapping
// values, path globs with "*", "*.png"-like segments and "**" anywhere, lists of values,
// and keys naming attributes a request may lack.
var (
	segPool    = []string{"", "a", "b", "ab", "x.png", "*", "**", "a*", "*.png", "*b*"}
	pathPool   = []string{"", "a", "b", "ab", "x.png", ".png", "c"}
	valuePool  = []string{"GET", "POST", "ann", "bob", ""}
	attrPool   = []string{"method", "user", "plan", "ip"}
	keyPool    = []string{"ip", "user", "api_key", "tenant"}
	globDrawer = rapid.Custom(func(t *rapid.T) string {
		n := rapid.IntRange(1, 5).Draw(t, "segments")
		var b strings.Builder
		for range n {
			b.WriteByte('/')
			b.WriteString(rapid.SampledFrom(segPool).Draw(t, "seg"))
		}
		return b.String()
	})
)

func quoteList(vals []string) string {
	q := make([]string, len(vals))
	for i, v := range vals {
		q[i] = strconv.Quote(v)
	}
	return "[" + strings.Join(q, ", ") + "]"
}

func drawRuleSet(t *rapid.T) string {
	n := rapid.IntRange(0, 40).Draw(t, "rules")
	var b strings.Builder
	b.WriteString("rules:\n")
	if n == 0 {
		return "rules:\n"
	}
	for i := range n {
		fmt.Fprintf(&b, "  - name: r%d\n", i)
		var conds []string
		for _, attr := range attrPool {
			if rapid.IntRange(0, 2).Draw(t, "has-"+attr) == 0 {
				vals := rapid.SliceOfNDistinct(rapid.SampledFrom(valuePool), 1, 3, rapid.ID[string]).Draw(t, attr)
				conds = append(conds, attr+": "+quoteList(vals))
			}
		}
		if rapid.IntRange(0, 2).Draw(t, "has-path") > 0 {
			globs := rapid.SliceOfN(globDrawer, 1, 3).Draw(t, "globs")
			conds = append(conds, "path: "+quoteList(globs))
		}
		if len(conds) > 0 {
			fmt.Fprintf(&b, "    match: { %s }\n", strings.Join(conds, ", "))
		}
		keys := rapid.SliceOfNDistinct(rapid.SampledFrom(keyPool), 1, 2, rapid.ID[string]).Draw(t, "key")
		fmt.Fprintf(&b, "    key: %s\n    limit: { requests: 1, per: 1s }\n", quoteList(keys))
	}
	return b.String()
}

func drawAttrs(t *rapid.T) []Attr {
	var attrs []Attr
	for _, name := range append([]string{"path"}, attrPool...) {
		if rapid.IntRange(0, 3).Draw(t, "has-"+name) == 0 {
			continue
		}
		var v string
		if name == "path" {
			n := rapid.IntRange(0, 6).Draw(t, "path-segments")
			var b strings.Builder
			for j := range n {
				if j > 0 || rapid.IntRange(0, 9).Draw(t, "no-leading-slash") > 0 {
					b.WriteByte('/')
				}
				b.WriteString(rapid.SampledFrom(pathPool).Draw(t, "path-seg"))
			}
			v = b.String()
		} else {
			v = rapid.SampledFrom(valuePool).Draw(t, name)
		}
		attrs = append(attrs, Attr{name, v})
	}
	// Sometimes a repeated attribute: the first value is the one that counts.
	if len(attrs) > 0 && rapid.Bool().Draw(t, "repeat") {
		attrs = append(attrs, Attr{attrs[0].Name, rapid.SampledFrom(valuePool).Draw(t, "repeat-value")})
	}
	rapid.Permutation(attrs).Draw(t, "order")
	return attrs
}

// TestIndexMatchesLinear: on random rule sets and random requests the index returns the
// same rules, in the same order, as the linear matcher.
func TestIndexMatchesLinear(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		src := drawRuleSet(t)
		set, err := Parse("prop.yaml", []byte(src))
		if err != nil {
			t.Fatalf("generated rules do not parse: %v\n%s", err, src)
		}
		if ix := set.idx.Load(); ix == nil || ix.linear != (len(set.Rules) < minIndexed) {
			t.Fatal("a parsed set has no index")
		}
		indexed := &Set{Rules: set.Rules} // the index even below minIndexed rules
		indexed.idx.Store(buildIndex(set.Rules, 0))
		for range 20 {
			attrs := drawAttrs(t)
			checkSame(t, set, attrs)
			checkSame(t, indexed, attrs)
		}
	})
}

// FuzzIndexMatchesLinear compares the index with the linear matcher on a fixed rule set
// full of overlapping globs and any path and method the fuzzer finds.
func FuzzIndexMatchesLinear(f *testing.F) {
	var b strings.Builder
	b.WriteString("rules:\n")
	globs := []string{"/", "/**", "/a/**", "/**/b", "/a/*/b", "/*/**/*", "/**/a*/**", "/a/**/b/**", "/*/",
		"/a*/b", "/files/*.png", "/**/*.png", "/a//b", "/v1/*/holds/**", "/a/b", "/a/**/**/b"}
	for i, g := range globs {
		fmt.Fprintf(&b, "  - { name: g%d, match: { path: %q }, key: ip, limit: { requests: 1, per: 1s } }\n", i, g)
		fmt.Fprintf(&b, "  - { name: m%d, match: { path: %q, method: [GET, POST] }, key: ip, limit: { requests: 1, per: 1s } }\n", i, g)
	}
	b.WriteString("  - { name: get, match: { method: GET }, key: ip, limit: { requests: 1, per: 1s } }\n")
	b.WriteString("  - { name: all, key: ip, limit: { requests: 1, per: 1s } }\n")
	set := mustParse(f, b.String())
	for _, p := range []string{"", "/", "//", "/a", "/a/b", "/a/x/b", "/files/x.png", "/a/a/a/b/b/b", "/v1/e/holds/x"} {
		f.Add(p, "GET")
	}
	f.Fuzz(func(t *testing.T, path, method string) {
		checkSame(t, set, []Attr{{"method", method}, {"path", path}})
		checkSame(t, set, []Attr{{"path", path}})
	})
}

// manyRules is the rule set: n rules r0 … r(n-1), each
// { method: GET, path: "/v1/svcI/**" } keyed by user, then one rule for /v1/items that a
// request for /v1/items matches, and a rule for every request.
func manyRules(n int) string {
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range n {
		fmt.Fprintf(&b, "  - { name: r%d, match: { method: GET, path: \"/v1/svc%d/**\" }, key: user, limit: { requests: 100, per: 1m } }\n", i, i)
	}
	b.WriteString("  - { name: items, match: { method: GET, path: /v1/items }, key: user, limit: { requests: 100, per: 1m } }\n")
	b.WriteString("  - { name: all, key: user, limit: { requests: 1000, per: 1m } }\n")
	return b.String()
}

// The index narrows: with 1,000 path rules a request visits only the rules filed under
// its own path, and querying does not allocate.
func TestIndexNarrows(t *testing.T) {
	set := mustParse(t, manyRules(1000))
	ix := set.idx.Load()
	cand, _ := ix.matchPath(nil, "/v1/svc42/x/y")
	if got := len(cand); got != 1 || set.Rules[cand[0]].Name != "r42" {
		t.Errorf("candidates for /v1/svc42/x/y: %d, want just r42", got)
	}
	if len(ix.always) != 1 || len(ix.attrs) != 0 {
		t.Errorf("always %d rules, %d attribute maps; want 1 and 0", len(ix.always), len(ix.attrs))
	}
	attrs := []Attr{{"method", "GET"}, {"path", "/v1/items"}, {"user", "ann"}}
	dst := make([]*Rule, 0, 8)
	if got := names(set.AppendMatching(dst, attrs)); !slices.Equal(got, []string{"items", "all"}) {
		t.Errorf("got %v", got)
	}
	if n := testing.AllocsPerRun(100, func() { dst = set.AppendMatching(dst[:0], attrs) }); n != 0 {
		t.Errorf("AppendMatching allocates %v times per call", n)
	}
	// Per-user overrides under one wide path: filed by user, not all under /api/**.
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range 300 {
		fmt.Fprintf(&b, "  - { name: u%d, match: { path: \"/**\", user: u%d }, key: user, limit: { requests: 1, per: 1s } }\n", i, i)
	}
	set = mustParse(t, b.String())
	if ix := set.idx.Load(); ix.root != nil || len(ix.attrs) != 1 || len(ix.attrs[0].byValue["u7"]) != 1 {
		t.Errorf("per-user rules under /**: root %v, attrs %d; want all filed by user", ix.root != nil, len(ix.attrs))
	}
	checkSame(t, set, []Attr{{"user", "u7"}, {"path", "/a"}})
}

// A path walking many overlapping "**" branches costs states, never backtracking, and
// spills past the stack buffers correctly.
func TestIndexManyStates(t *testing.T) {
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range 40 {
		fmt.Fprintf(&b, "  - { name: s%d, match: { path: \"/**/a%d*/**/b\" }, key: ip, limit: { requests: 1, per: 1s } }\n", i, i)
	}
	set := mustParse(t, b.String())
	var p strings.Builder
	for i := range 40 {
		fmt.Fprintf(&p, "/a%d", i)
	}
	for range 200 {
		p.WriteString("/a1")
	}
	p.WriteString("/b")
	attrs := []Attr{{"path", p.String()}}
	checkSame(t, set, attrs)
	if got := len(set.AppendMatching(nil, attrs)); got != 40 {
		t.Errorf("matched %d rules, want 40", got)
	}
}

// nRules is an n-rule file of four shapes: per-endpoint limits by method
// and path prefix, uploads by glob, per-user overrides, and "**" globs with a plan list.
func nRules(n int) []byte {
	var src strings.Builder
	src.WriteString("rules:\n")
	for i := range n {
		switch i % 4 {
		case 0:
			fmt.Fprintf(&src, "  - { name: r%d, match: { method: GET, path: \"/v1/svc%d/**\" }, key: user, limit: { requests: 100, per: 1m } }\n", i, i)
		case 1:
			fmt.Fprintf(&src, "  - { name: r%d, match: { method: [POST, PUT], path: \"/v1/svc%d/*/items/*.json\" }, key: user, limit: { requests: 100, per: 1m } }\n", i, i)
		case 2:
			fmt.Fprintf(&src, "  - { name: r%d, match: { user: u%d }, key: user, limit: { requests: 100, per: 1m } }\n", i, i)
		default:
			fmt.Fprintf(&src, "  - { name: r%d, match: { path: \"/**/t%d\", plan: [free, gold] }, key: user, limit: { requests: 100, per: 1m } }\n", i, i)
		}
	}
	return []byte(src.String())
}

// BenchmarkIndexBuild10k: building the index of 10,000 rules, the part of a reload this
// index adds (target: under 200 ms). Parse builds it with the new Set; the daemon swaps
// the Set in one atomic store, so checks go on against the old set meanwhile.
func BenchmarkIndexBuild10k(b *testing.B) {
	set, err := Parse("10k.yaml", nRules(10000))
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		_ = buildIndex(set.Rules, minIndexed)
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/1e3/float64(b.N), "ms/build")
}

// BenchmarkReload10k: the whole reload of a 10,000-rule file: YAML, validation and the
// index.
func BenchmarkReload10k(b *testing.B) {
	data := nRules(10000)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse("10k.yaml", data); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/1e3/float64(b.N), "ms/reload")
}

// Checks run against a Set while another is built: the index is immutable once built.
func TestIndexQueriedWhileBuilding(t *testing.T) {
	old := mustParse(t, manyRules(100))
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, err := Parse("new.yaml", nRules(400)); err != nil {
			t.Error(err)
		}
	}()
	attrs := []Attr{{"method", "GET"}, {"path", "/v1/svc7/a"}, {"user", "ann"}}
	dst := make([]*Rule, 0, 8)
	for {
		dst = old.AppendMatching(dst[:0], attrs)
		if got := names(dst); !slices.Equal(got, []string{"r7", "all"}) {
			t.Fatalf("got %v", got)
		}
		select {
		case <-done:
			return
		default:
		}
	}
}

func BenchmarkAppendMatching(b *testing.B) {
	for _, n := range []int{2, 5000} {
		set := mustParse(b, manyRules(n))
		attrs := []Attr{{"method", "GET"}, {"path", "/v1/items"}, {"user", "ann"}}
		b.Run(strconv.Itoa(n+2)+"rules", func(b *testing.B) {
			b.ReportAllocs()
			dst := make([]*Rule, 0, 8)
			for b.Loop() {
				dst = set.AppendMatching(dst[:0], attrs)
			}
		})
	}
}

// BenchmarkSmallSetRatio: the index against the linear scan on a 3-rule set, alternating
// batches in one run; reports the median ratio index/linear.
func BenchmarkSmallSetRatio(b *testing.B) {
	set := mustParse(b, `rules:
  - { name: per-ip, key: ip, limit: { requests: 1, per: 1s } }
  - { name: holds, match: { method: POST, path: "/v1/events/*/holds" }, key: user, limit: { requests: 1, per: 1s } }
  - { name: login, match: { method: POST, path: /login }, key: ip, limit: { requests: 1, per: 1s } }
`)
	ix := buildIndex(set.Rules, 0)
	attrs := []Attr{{"method", "POST"}, {"path", "/v1/events/7/holds"}, {"user", "u-12345"}, {"ip", "203.0.113.9"}}
	dst := make([]*Rule, 0, 8)
	const batch = 5000
	var ratios []float64
	for b.Loop() {
		start := time.Now()
		for range batch {
			dst = ix.appendMatching(set.Rules, dst[:0], attrs)
		}
		ti := time.Since(start)
		start = time.Now()
		for range batch {
			dst = dst[:0]
			for _, r := range set.Rules {
				if r.Matches(attrs) {
					dst = append(dst, r)
				}
			}
		}
		ratios = append(ratios, float64(ti)/float64(time.Since(start)))
	}
	slices.Sort(ratios)
	b.ReportMetric(ratios[len(ratios)/2], "index/linear")
}

// LoadDir builds the index over the rules of all files, positions running across them.
func TestIndexLoadDir(t *testing.T) {
	dir := t.TempDir()
	for f, body := range map[string]string{"a.yaml": manyRules(10), "b.yaml": strings.ReplaceAll(strings.ReplaceAll(manyRules(10), "name: r", "name: b"), "name: items", "name: b-items")} {
		body = strings.ReplaceAll(body, "name: all", "name: all-"+f[:1])
		if err := os.WriteFile(filepath.Join(dir, f), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	set, err := LoadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if ix := set.idx.Load(); ix == nil || ix.linear || len(set.Rules) != 24 {
		t.Fatalf("%d rules, index %+v", len(set.Rules), ix)
	}
	attrs := []Attr{{"method", "GET"}, {"path", "/v1/svc3/x"}}
	checkSame(t, set, attrs)
	if got := names(set.AppendMatching(nil, attrs)); !slices.Equal(got, []string{"r3", "all-a", "b3", "all-b"}) {
		t.Errorf("got %v", got)
	}
}

// A rule whose only conditions are operator mappings (glob, not, not_glob: the Envoy
// extensions) names no value to file it under: the index checks it on every request, and
// one with an operator beside an exact value is filed under the value.
func TestIndexOperatorConditions(t *testing.T) {
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range 10 {
		fmt.Fprintf(&b, "  - name: r%d\n    match: { path: \"/v1/svc%d/**\" }\n    key: ip\n    limit: { requests: 1, per: 1s }\n", i, i)
	}
	b.WriteString(`  - name: ops-only
    match: { tenant: { glob: "acme-*" } }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: not-only
    match: { tenant: { not: [acme-1] } }
    key: ip
    limit: { requests: 1, per: 1s }
  - name: ops-and-value
    match: { method: GET, tenant: { not_glob: "acme-*" } }
    key: ip
    limit: { requests: 1, per: 1s }
`)
	set := mustParse(t, b.String())
	for _, attrs := range [][]Attr{
		{{"tenant", "acme-1"}},
		{{"tenant", "acme-2"}, {"path", "/v1/svc3/x"}},
		{{"tenant", "other"}, {"method", "GET"}},
		{{"method", "GET"}},
		{{"tenant", "acme-9"}, {"method", "GET"}},
	} {
		checkSame(t, set, attrs)
	}
	if got := names(set.AppendMatching(nil, []Attr{{"tenant", "acme-2"}})); !slices.Equal(got, []string{"ops-only", "not-only"}) {
		t.Fatalf("tenant acme-2 matched %v, want [ops-only not-only]", got)
	}
}
