package envoyrls

import (
	"context"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

var update = flag.Bool("update", false, "rewrite the expected conversions in testdata/readme")

func convertFile(t *testing.T, path, alg string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out, err := Convert([]File{{Name: filepath.Base(path), Data: data}}, alg)
	if err != nil {
		t.Fatalf("Convert(%s): %v", path, err)
	}
	return out
}

// Every example of envoyproxy/ratelimit's README, written out by hand, converts to the
// rules in its .rules.yaml, and those rules load.
func TestConvertReadmeExamples(t *testing.T) {
	files, _ := filepath.Glob("testdata/readme/ex*.yaml")
	n := 0
	for _, path := range files {
		if strings.HasSuffix(path, ".rules.yaml") {
			continue
		}
		n++
		t.Run(filepath.Base(path), func(t *testing.T) {
			out := convertFile(t, path, "")
			golden := strings.TrimSuffix(path, ".yaml") + ".rules.yaml"
			if *update {
				if err := os.WriteFile(golden, out, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatal(err)
			}
			if string(out) != string(want) {
				t.Errorf("conversion differs from %s:\n%s", golden, out)
			}
			if _, err := rules.Parse(golden, out); err != nil {
				t.Errorf("converted rules do not load: %v", err)
			}
		})
	}
	if n < 14 {
		t.Fatalf("%d README examples; the README has 14 configurations", n)
	}
}

func TestConvertAlgorithm(t *testing.T) {
	out := convertFile(t, "testdata/readme/ex1.yaml", "token_bucket")
	if !strings.Contains(string(out), "algorithm: token_bucket") || strings.Contains(string(out), "fixed_window") {
		t.Errorf("--algorithm token_bucket:\n%s", out)
	}
	if _, err := Convert(nil, "leaky"); err == nil {
		t.Error("unknown algorithm: no error")
	}
}

// --mode writes the mode on every rule that limits (envoyproxy/ratelimit's counters are
// exact across its replicas: global), none on unlimited and deny rules; no mode leaves
// the daemon's default.
func TestConvertMode(t *testing.T) {
	data, err := os.ReadFile("testdata/readme/ex3.yaml") // a limit and a block list
	if err != nil {
		t.Fatal(err)
	}
	files := []File{{Name: "ex3.yaml", Data: data}}
	for _, tt := range []struct {
		mode string
		want int
	}{{"", 0}, {"local", 1}, {"hybrid", 1}, {"global", 1}} {
		out, err := ConvertWith(files, ConvertOptions{Mode: tt.mode})
		if err != nil {
			t.Fatalf("%q: %v", tt.mode, err)
		}
		if n := strings.Count(string(out), "    mode: "+tt.mode+"\n"); tt.mode != "" && n != tt.want || strings.Count(string(out), "mode:") != tt.want {
			t.Errorf("--mode %q: want %d rule with it:\n%s", tt.mode, tt.want, out)
		}
		if _, err := rules.Parse("converted.yaml", out); err != nil {
			t.Errorf("--mode %q: %v", tt.mode, err)
		}
	}
	if _, err := ConvertWith(files, ConvertOptions{Mode: "exact"}); err == nil || !strings.Contains(err.Error(), `--mode "exact"`) {
		t.Errorf("unknown mode: %v", err)
	}
}

// Bad configurations are errors naming the file, the line and the field.
func TestConvertErrors(t *testing.T) {
	want := map[string]string{
		"unit.yaml":              `unit.yaml:5: descriptors[0].rate_limit.unit: unknown unit "fortnight"`,
		"unknown_field.yaml":     `unknown_field.yaml:4: descriptors[0]: unknown field "rate_limits"`,
		"unlimited_unit.yaml":    `unlimited_unit.yaml:6: descriptors[0].rate_limit.unit: an unlimited rate_limit has no unit`,
		"replaces_unknown.yaml":  `replaces_unknown.yaml:8: replaces[0].name: no rate_limit is named "nobody"`,
		"bad_key.yaml":           `bad_key.yaml:3: descriptors[0].key: "a b" cannot be an rlsidecar attribute name`,
		"share_no_wildcard.yaml": `share_no_wildcard.yaml:5: descriptors[0].share_threshold: share_threshold needs a wildcard value`,
		"negative.yaml":          `negative.yaml:6: descriptors[0].rate_limit.requests_per_unit: expected a whole number from 0 to 4294967295, got "-1"`,
		// envoyproxy/ratelimit's YAML decoder (YAML 1.1) reads 010 as octal: 8, not 10.
		"octal.yaml":          `octal.yaml:6: descriptors[0].rate_limit.requests_per_unit: "010" is octal to envoyproxy/ratelimit, whose YAML 1.1 decoder reads a leading 0 so: 8 requests`,
		"no_domain.yaml":      `no_domain.yaml:1: domain: missing (required)`,
		"duplicate.yaml":      `duplicate.yaml:5: descriptors[1]: key "k" value "v" is already described at line 3`,
		"repeated_key.yaml":   `repeated_key.yaml:5: descriptors[0].descriptors[0].key: key "k" appears twice in one descriptor path`,
		"reserved_key.yaml":   `reserved_key.yaml:3: descriptors[0].key: "domain" is the attribute rlsidecar gives the call's domain`,
		"duplicate_name.yaml": `duplicate_name.yaml:10: descriptors[1].rate_limit.name: name "same" is already used at duplicate_name.yaml:5`,
		// envoyproxy/ratelimit reads only the first document; the converter read only it too, silently.
		"two_documents.yaml": `two_documents.yaml:6: a second YAML document: envoyproxy/ratelimit reads only a file's first`,
		// Under --wildcards trailing (envoyproxy/ratelimit before #1085), a '*' before the
		// end of a value is a literal character.
		"path_literal_star.yaml":   `path_literal_star.yaml:4: descriptors[0].value: "/api/*/action": envoyproxy/ratelimit matches only this exact value`,
		"inner_star_wildcard.yaml": `inner_star_wildcard.yaml:4: descriptors[0].value: "/api/*/v*": envoyproxy/ratelimit matches the values starting with "/api/*/v"`,
	}
	files, _ := filepath.Glob("testdata/bad/*.yaml")
	if len(files) != len(want) {
		t.Errorf("%d bad fixtures, %d expectations", len(files), len(want))
	}
	for _, path := range files {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		w := want[filepath.Base(path)]
		opts := ConvertOptions{}
		if strings.Contains(path, "star") {
			// By default each '*' is a wildcard, as envoyproxy/ratelimit since #1085.
			if _, err := ConvertWith([]File{{Name: filepath.Base(path), Data: data}}, opts); err != nil {
				t.Errorf("%s: %v\nwant no error by default", path, err)
			}
			opts.Wildcards = WildcardsTrailing
		}
		_, err = ConvertWith([]File{{Name: filepath.Base(path), Data: data}}, opts)
		if err == nil || w == "" || !strings.Contains(err.Error(), w) {
			t.Errorf("%s: %v\nwant an error containing %s", path, err, w)
		}
	}
	// One domain in two files.
	a := []byte("domain: d\ndescriptors: []\n")
	if _, err := Convert([]File{{"a.yaml", a}, {"b.yaml", a}}, ""); err == nil || !strings.Contains(err.Error(), `b.yaml:1: domain: domain "d" is already defined at a.yaml:1`) {
		t.Errorf("domain twice: %v", err)
	}
}

// serverFor converts the examples and returns a server deciding with the rules.
func serverFor(t *testing.T, paths ...string) *Server {
	t.Helper()
	var files []File
	for _, p := range paths {
		data, err := os.ReadFile(filepath.Join("testdata/readme", p))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, File{Name: p, Data: data})
	}
	out, err := Convert(files, "")
	if err != nil {
		t.Fatal(err)
	}
	return serverOf(t, out)
}

// serverOf returns a server deciding with the converted rules out.
func serverOf(t *testing.T, out []byte) *Server {
	t.Helper()
	set, err := rules.Parse("converted.yaml", out)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Addr: "unused:0"}, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		t.Fatal(err)
	}
	// A clock that stands still: limits per second are counted exactly, however slowly
	// a loaded machine (and the race detector) runs the calls.
	s.now = func() int64 { return 1_700_000_000_000_000_000 }
	return s
}

type envoyCall struct {
	domain string
	descs  [][]string // each a list of "key=value"
}

func (s *Server) ask(t *testing.T, c envoyCall) *rlsv3.RateLimitResponse {
	t.Helper()
	req := &rlsv3.RateLimitRequest{Domain: c.domain}
	for _, d := range c.descs {
		rd := &commonrl.RateLimitDescriptor{}
		for _, kv := range d {
			k, v, _ := strings.Cut(kv, "=")
			rd.Entries = append(rd.Entries, &commonrl.RateLimitDescriptor_Entry{Key: k, Value: v})
		}
		req.Descriptors = append(req.Descriptors, rd)
	}
	resp, err := s.ShouldRateLimit(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// admitted asks c n+1 times and reports how many were admitted (OVERALL OK).
func (s *Server) admitted(t *testing.T, c envoyCall, n int) int {
	t.Helper()
	ok := 0
	for range n {
		if s.ask(t, c).OverallCode == rlsv3.RateLimitResponse_OK {
			ok++
		}
	}
	return ok
}

func limitOf(resp *rlsv3.RateLimitResponse, i int) uint32 {
	if cl := resp.Statuses[i].CurrentLimit; cl != nil {
		return cl.RequestsPerUnit
	}
	return math.MaxUint32 // no limit
}

const none = math.MaxUint32

// The converted examples decide as the README of envoyproxy/ratelimit says Envoy's do.
func TestConvertedSemantics(t *testing.T) {
	t.Run("ex2 nested and multiple descriptors", func(t *testing.T) {
		s := serverFor(t, "ex2.yaml")
		mk := envoyCall{"messaging", [][]string{{"message_type=marketing", "to_number=2061111111"}, {"to_number=2061111111"}}}
		r := s.ask(t, mk)
		if limitOf(r, 0) != 5 || limitOf(r, 1) != 100 {
			t.Fatalf("limits: %v", r)
		}
		if got := s.admitted(t, mk, 10); got != 4 {
			t.Errorf("marketing to one number: %d more admitted, want 4", got)
		}
		if limitOf(s.ask(t, envoyCall{"messaging", [][]string{{"message_type=other", "to_number=1"}}}), 0) != none {
			t.Error("message_type=other matched")
		}
	})
	t.Run("ex3 most specific match", func(t *testing.T) {
		s := serverFor(t, "ex3.yaml")
		if got := s.admitted(t, envoyCall{"edge_proxy_per_ip", [][]string{{"remote_address=50.0.0.5"}}}, 3); got != 0 {
			t.Errorf("black-listed IP admitted %d", got)
		}
		if got := s.admitted(t, envoyCall{"edge_proxy_per_ip", [][]string{{"remote_address=50.0.0.1"}}}, 12); got != 10 {
			t.Errorf("other IP admitted %d, want 10", got)
		}
	})
	t.Run("ex4 depth", func(t *testing.T) {
		two := envoyCall{"example4", [][]string{{"key=value", "subkey=subvalue"}}}
		if l := limitOf(serverFor(t, "ex4a.yaml").ask(t, two), 0); l != none {
			t.Errorf("ex4a matched a deeper descriptor: %d", l)
		}
		if l := limitOf(serverFor(t, "ex4b.yaml").ask(t, two), 0); l != 300 {
			t.Errorf("ex4b: %d, want 300", l)
		}
	})
	t.Run("ex5 unlimited", func(t *testing.T) {
		s := serverFor(t, "ex5.yaml")
		r := s.ask(t, envoyCall{"internal", [][]string{{"ldap=x"}, {"azure=y"}}})
		if r.Statuses[0].LimitRemaining != math.MaxUint32 || r.Statuses[0].CurrentLimit != nil || limitOf(r, 1) != 100 {
			t.Errorf("unlimited: %v", r)
		}
	})
	t.Run("ex6 shadow", func(t *testing.T) {
		s := serverFor(t, "ex6.yaml")
		if got := s.admitted(t, envoyCall{"example6", [][]string{{"service=auth-service", "user=user-a"}}}, 15); got != 15 {
			t.Errorf("shadow user-a admitted %d of 15", got)
		}
		if got := s.admitted(t, envoyCall{"example6", [][]string{{"service=auth-service", "user=user-b"}}}, 25); got != 20 {
			t.Errorf("user-b admitted %d, want 20", got)
		}
	})
	t.Run("ex7 replaces", func(t *testing.T) {
		s := serverFor(t, "ex7.yaml")
		both := envoyCall{"example7", [][]string{{"key_1=value_1", "user=bkthomps"}, {"key_2=value_2", "user=bkthomps"}}}
		if got := s.admitted(t, both, 12); got != 10 {
			t.Errorf("both: %d admitted, want 10 (the replacing limit)", got)
		}
		if got := s.admitted(t, envoyCall{"example7", [][]string{{"key_1=value_1", "user=bkthomps"}}}, 7); got != 5 {
			t.Errorf("the replaced limit was affected: %d admitted, want 5", got)
		}
	})
	t.Run("ex8", func(t *testing.T) {
		s := serverFor(t, "ex8.yaml")
		if l := limitOf(s.ask(t, envoyCall{"example8", [][]string{{"key1=value1"}}}), 0); l != 20 {
			t.Errorf("key1=value1: %d", l)
		}
		if l := limitOf(s.ask(t, envoyCall{"example8", [][]string{{"key1=other"}}}), 0); l != 10 {
			t.Errorf("key1=other: %d", l)
		}
	})
	t.Run("ex9 wildcards", func(t *testing.T) {
		for _, c := range []struct {
			file, key, value string
			want             uint32
		}{
			{"ex9a.yaml", "key1", "valueXYZ", 20}, {"ex9a.yaml", "key1", "valu", none},
			// The README's middle and multiple wildcards (envoyproxy/ratelimit#1085).
			{"ex9b.yaml", "path", "/api/123/action", 20}, {"ex9b.yaml", "path", "/api/user-id/action", 20},
			{"ex9b.yaml", "path", "/api/123/other", none},
			{"ex9c.yaml", "route", "/api/v1/resource/123/action", 20}, {"ex9c.yaml", "route", "/api/v2/resource/456/action", 20},
			{"ex9c.yaml", "route", "/api/v1/resource/123", none},
		} {
			if l := limitOf(serverFor(t, c.file).ask(t, envoyCall{"example9", [][]string{{c.key + "=" + c.value}}}), 0); l != c.want {
				t.Errorf("%s %s=%s: %d, want %d", c.file, c.key, c.value, l, c.want)
			}
		}
	})
	t.Run("ex11 share_threshold", func(t *testing.T) {
		s := serverFor(t, "ex11a.yaml")
		one := func(v string) envoyCall { return envoyCall{"example11", [][]string{{"files=" + v}}} }
		s.admitted(t, one("files/a.pdf"), 5)
		s.admitted(t, one("files/b.csv"), 5)
		if got := s.admitted(t, one("files/c.txt"), 1); got != 0 {
			t.Error("shared threshold not shared")
		}
		iso := func(v string) envoyCall { return envoyCall{"example11", [][]string{{"files_no_share=" + v}}} }
		if got := s.admitted(t, iso("files_no_share/a.pdf"), 11); got != 10 {
			t.Errorf("isolated a.pdf: %d", got)
		}
		if got := s.admitted(t, iso("files_no_share/b.csv"), 1); got != 1 {
			t.Error("isolated thresholds shared")
		}
	})
}

// A descriptor with shadow_mode and no rate_limit loads in envoyproxy/ratelimit, where
// shadow_mode only marks the descriptor's own rate_limit: it does nothing there, and the
// descriptors nested in it are not shadowed. The conversion gives no rule for it, says so
// in a comment, and converts the nested descriptors as written.
func TestConvertShadowWithoutLimit(t *testing.T) {
	cfg := []byte(`domain: d
descriptors:
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: par
    shadow_mode: true
    descriptors:
      - key: user
        rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: leaf
    shadow_mode: true
`)
	out, err := Convert([]File{{Name: "ev.yaml", Data: cfg}}, "")
	if err != nil {
		t.Fatalf("Convert: %v", err)
	}
	for _, note := range []string{
		"# ev.yaml:6: descriptors[1].shadow_mode: descriptor (par) has no rate_limit",
		"# ev.yaml:11: descriptors[2].shadow_mode: descriptor (leaf) has no rate_limit",
	} {
		if !strings.Contains(string(out), note) {
			t.Errorf("output lacks the note %q:\n%s", note, out)
		}
	}
	if strings.Contains(string(out), "shadow: true") || strings.Count(string(out), "  - name: ") != 2 {
		t.Errorf("want two rules (user, par/user), neither shadow:\n%s", out)
	}
	s := serverOf(t, out)
	if got := s.admitted(t, envoyCall{"d", [][]string{{"par=x", "user=a"}}}, 3); got != 1 {
		t.Errorf("par/user admitted %d of 3; want 1 (its limit, not shadowed)", got)
	}
	if got := s.admitted(t, envoyCall{"d", [][]string{{"user=a"}}}, 3); got != 2 {
		t.Errorf("user admitted %d of 3; want 2", got)
	}
	if l := limitOf(s.ask(t, envoyCall{"d", [][]string{{"leaf=x"}}}), 0); l != none {
		t.Errorf("leaf has a limit (%d); want none", l)
	}
}

// Values match as envoyproxy/ratelimit matches them. By default as it has since #1085
// (March 2026; its Example 9): each '*' matches any run of bytes, '/' included, wherever it
// is in the value. Under --wildcards trailing as its builds before (checked against the
// binary the differential phase runs): a value ending with '*' is a prefix, with any bytes
// after it, '/' included; a '*' anywhere else is a literal character, so that value
// matches only itself. Both: an exact value is itself whatever the key, path included
// (whose plain rule values are path globs, starting with '/'); an exact value is tried
// before the wildcards, and they in order.
func TestConvertWildcardsAsEnvoy(t *testing.T) {
	cfg := `domain: w
descriptors:
  - key: route
    value: /api/*/resource/*/action
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: k
    value: "a*b"
    rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: k
    value: "a*"
    rate_limit: { unit: minute, requests_per_unit: 3 }
  - key: k
    rate_limit: { unit: minute, requests_per_unit: 4 }
  - key: path
    value: api/v1
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: path
    value: /files/*
    rate_limit: { unit: minute, requests_per_unit: 6 }
  - key: path
    value: /exact
    rate_limit: { unit: minute, requests_per_unit: 7 }
`
	type want struct {
		kv   string
		want uint32
	}
	for _, m := range []struct {
		wildcards string
		extra     string // configuration only this way converts
		cases     []want
	}{
		{"", `  - key: path
    value: /v2/*/users
    rate_limit: { unit: minute, requests_per_unit: 8 }
`, []want{
			{"route=/api/*/resource/*/action", 1},
			{"route=/api/v1/resource/123/action", 1},
			{"route=/api/v1/resource/123/other", none},
			{"k=a*b", 2},
			{"k=axb", 2},
			{"k=ab", 2},
			{"k=axbx", 3},
			{"k=a", 3},
			{"k=b", 4},
			{"path=api/v1", 5},
			{"path=/files/a/b.pdf", 6},
			{"path=/exact", 7},
			{"path=/v2/a/b/users", 8},
			{"path=/v2/users", none},
		}},
		{WildcardsTrailing, "", []want{
			{"route=/api/*/resource/*/action", 1},
			{"route=/api/v1/resource/123/action", none},
			{"k=a*b", 2},
			{"k=axb", 3},
			{"k=a", 3},
			{"k=b", 4},
			{"path=api/v1", 5},
			{"path=api/v1/x", none},
			{"path=/files/a/b.pdf", 6},
			{"path=/files", none},
			{"path=/exact", 7},
			{"path=/exact/", none},
		}},
	} {
		out, err := ConvertWith([]File{{Name: "w.yaml", Data: []byte(cfg + m.extra)}}, ConvertOptions{Wildcards: m.wildcards})
		if err != nil {
			t.Fatalf("Convert (wildcards %q): %v", m.wildcards, err)
		}
		s := serverOf(t, out)
		for _, c := range m.cases {
			if l := limitOf(s.ask(t, envoyCall{"w", [][]string{{c.kv}}}), 0); l != c.want {
				t.Errorf("wildcards %q: %s: limit %d, want %d\n%s", m.wildcards, c.kv, l, c.want, out)
			}
		}
	}
	if _, err := ConvertWith([]File{{Name: "w.yaml", Data: []byte(cfg)}}, ConvertOptions{Wildcards: "middle"}); err == nil || !strings.Contains(err.Error(), `--wildcards "middle"`) {
		t.Errorf("--wildcards middle: %v", err)
	}
}

// quota_mode: envoyproxy/ratelimit answers such a limit OK past it (naming it in its
// dynamic metadata): a shadow rule, said in the output; quota_mode: false is nothing, and
// quota_mode without a rate_limit does nothing there either.
func TestConvertQuotaMode(t *testing.T) {
	cfg := []byte(`domain: q
descriptors:
  - key: k
    quota_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: f
    quota_mode: false
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: p
    quota_mode: true
    descriptors:
      - key: u
        rate_limit: { unit: minute, requests_per_unit: 1 }
`)
	out, err := Convert([]File{{Name: "q.yaml", Data: cfg}}, "")
	if err != nil {
		t.Fatalf("Convert: %v", err)
	}
	for _, want := range []string{"# quota_mode (line 4): never refuses", "# q.yaml:10: descriptors[2].quota_mode: descriptor (p) has no rate_limit"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Count(string(out), "shadow: true") != 1 {
		t.Errorf("want one shadow rule (k):\n%s", out)
	}
	s := serverOf(t, out)
	for _, c := range []struct {
		kv   string
		want int
	}{{"k=a", 3}, {"f=a", 1}, {"p=x,u=a", 1}} {
		if got := s.admitted(t, envoyCall{"q", [][]string{strings.Split(c.kv, ",")}}, 3); got != c.want {
			t.Errorf("%s: %d of 3 admitted, want %d", c.kv, got, c.want)
		}
	}
}

// YAML anchors, aliases and merge keys ("<<") are read as envoyproxy/ratelimit's YAML
// decoder reads them: a configuration that uses them converts to the rules of the same
// configuration written out in full. They were refused ("expected a mapping", "unknown
// field \"<<\"", "expected a string"). An alias that contains itself, or aliasing that
// would expand past what the decoder allows, is an error, not a hang.
func TestConvertYAMLAliases(t *testing.T) {
	aliased := `domain: anchors
descriptors:
  - key: user
    rate_limit: &per_minute
      unit: minute
      requests_per_unit: 10
  - key: tenant
    value: &acme acme
    descriptors: &users
      - key: user
        rate_limit: *per_minute
        shadow_mode: &yes true
      - key: ip
        rate_limit:
          <<: *per_minute
          requests_per_unit: 20
  - <<: &globex
      key: tenant
      value: globex
    descriptors: *users
  - key: plan
    value: *acme
    detailed_metric: *yes
    rate_limit:
      <<: [*per_minute, {unit: hour, name: plan_acme}]
      unlimited: false
  - key: x
    <<: [{key: region}, {key: other, value: eu}]
    rate_limit: *per_minute
`
	// As gopkg.in/yaml.v2 (envoyproxy/ratelimit's) decodes it: in document order, a merge
	// key's mappings over the keys before it and under those after it, the first of a
	// list over the later ones.
	expanded := `domain: anchors
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit:
          unit: minute
          requests_per_unit: 10
        shadow_mode: true
      - key: ip
        rate_limit:
          unit: minute
          requests_per_unit: 20
  - key: tenant
    value: globex
    descriptors:
      - key: user
        rate_limit:
          unit: minute
          requests_per_unit: 10
        shadow_mode: true
      - key: ip
        rate_limit:
          unit: minute
          requests_per_unit: 20
  - key: plan
    value: acme
    detailed_metric: true
    rate_limit:
      unit: minute
      requests_per_unit: 10
      name: plan_acme
      unlimited: false
  - key: region
    value: eu
    rate_limit:
      unit: minute
      requests_per_unit: 10
`
	// The rules alone: the comments name the lines of each file.
	rulesOf := func(src string) string {
		t.Helper()
		out, err := Convert([]File{{Name: "c.yaml", Data: []byte(src)}}, "")
		if err != nil {
			t.Fatalf("Convert: %v", err)
		}
		var kept []string
		for _, l := range strings.Split(string(out), "\n") {
			if !strings.HasPrefix(strings.TrimSpace(l), "#") {
				kept = append(kept, l)
			}
		}
		return strings.Join(kept, "\n")
	}
	got, want := rulesOf(aliased), rulesOf(expanded)
	if got != want {
		t.Errorf("with aliases:\n%s\nwritten out:\n%s", got, want)
	}
	if !strings.Contains(want, `name: "plan_acme"`) || strings.Count(want, "- name:") != 7 {
		t.Errorf("the expanded configuration's rules are not the seven expected:\n%s", want)
	}

	for name, src := range map[string]string{
		"contains itself": "domain: d\ndescriptors:\n  - &m\n    key: a\n    <<: *m\n",
		"excessive": func() string {
			// Eight lists of ten descriptors, each nesting the one before: 10^8 paths.
			var b strings.Builder
			b.WriteString("domain: d\ndescriptors:\n  - key: d0\n    descriptors: &l0\n")
			for j := range 10 {
				fmt.Fprintf(&b, "      - { key: k0_%d, rate_limit: { unit: second, requests_per_unit: 1 } }\n", j)
			}
			for i := 1; i < 8; i++ {
				fmt.Fprintf(&b, "  - key: d%d\n    descriptors: &l%d\n", i, i)
				for j := range 10 {
					fmt.Fprintf(&b, "      - { key: k%d_%d, descriptors: *l%d }\n", i, j, i-1)
				}
			}
			return b.String()
		}(),
	} {
		if _, err := Convert([]File{{Name: "c.yaml", Data: []byte(src)}}, ""); err == nil || !strings.Contains(err.Error(), "c.yaml") {
			t.Errorf("%s: %v, want an error naming the file", name, err)
		}
	}
}
