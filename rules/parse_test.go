package rules

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// badFixtures maps each file in testdata/bad to the errors Load must report for it, as
// substrings of the error text (every one must appear).
var badFixtures = map[string][]string{
	"empty.yaml":               {"empty.yaml: no rules: key (the file is empty)"},
	"plan_unknown_rule.yaml":   {`plan_unknown_rule.yaml:2: plans.gold.nosuch: plan "gold" names rule "nosuch", which no rules file defines`},
	"plan_bad_multiplier.yaml": {`plan_bad_multiplier.yaml:2: plans.partner: expected a multiplier like 10x or 0.5x, a number of requests, or unlimited; got a string "tenx"`},
	"plan_multiplier_range.yaml": {
		`plan_multiplier_range.yaml:2: plans.huge: multiplier "3000000x" is out of range: above 0x and at most 1000000x`,
		`plan_multiplier_range.yaml:3: plans.zero: multiplier "0x" is out of range: above 0x and at most 1000000x`,
		`plan_multiplier_range.yaml:4: plans.negative: multiplier "-2x" is out of range: above 0x and at most 1000000x`,
	},
	"split_with_hybrid.yaml": {"split_with_hybrid.yaml:6: rules[0].split: split divides a local limit among daemons; mode hybrid shares one budget already"},
	"ip_prefix_range.yaml": {
		"ip_prefix_range.yaml:4: rules[0].ip_prefix.ipv6: 129 is not a prefix length from 0 to 128",
		"ip_prefix_range.yaml:4: rules[0].ip_prefix.attr: missing: the key has several attributes (user, ip); name the one holding the address",
	},
	"split_zero.yaml":               {"split_zero.yaml:5: rules[0].split: must be at least 1, got 0 (a number of daemons, or auto)"},
	"split_word.yaml":               {`split_word.yaml:5: rules[0].split: expected a whole number, got a string "many"`},
	"comments_only.yaml":            {"comments_only.yaml: no rules: key"},
	"null_document.yaml":            {"null_document.yaml:2: no rules: key"},
	"no_rules_key.yaml":             {`no_rules_key.yaml:1: unknown field "ruels" (valid: rules, plans)`, "no_rules_key.yaml:1: no rules: key"},
	"unknown_top_field.yaml":        {`unknown_top_field.yaml:2: unknown field "version" (valid: rules, plans)`},
	"top_is_list.yaml":              {"top_is_list.yaml:1: not a rules file: its top level is a list, not a mapping with rules:"},
	"two_documents.yaml":            {"two_documents.yaml:2: a second YAML document; put all rules in one document"},
	"syntax.yaml":                   {"syntax.yaml:1: invalid YAML: did not find expected '-' indicator"},
	"rules_not_list.yaml":           {"rules_not_list.yaml:2: rules: expected a list of rules, got a mapping"},
	"rule_not_mapping.yaml":         {`rule_not_mapping.yaml:2: rules[0]: expected a mapping, got a string "just-a-name"`},
	"unknown_rule_field.yaml":       {`unknown_rule_field.yaml:5: rules[0]: unknown field "limits" (valid: name, match, key, algorithm, limit, plans, shadow, mode, on_store_failure, split, replaces, concurrency, warn_at, delay, penalty, ip_prefix)`},
	"duplicate_field.yaml":          {`duplicate_field.yaml:4: rules[0]: "name" given twice (first at line 2)`},
	"merge_key.yaml":                {"merge_key.yaml:5: rules[1]: merge keys (<<) are not supported; write the fields out"},
	"missing_name.yaml":             {"missing_name.yaml:2: rules[0].name: missing (required)"},
	"name_not_string.yaml":          {"name_not_string.yaml:2: rules[0].name: expected a string, got a list"},
	"name_invalid.yaml":             {`name_invalid.yaml:2: rules[0].name: "~inline" is not a valid rule name (a letter or digit, then letters, digits, _ . -)`},
	"name_with_brace.yaml":          {`name_with_brace.yaml:2: rules[0].name: "a{b}" is not a valid rule name`},
	"name_too_long.yaml":            {"name_too_long.yaml:2: rules[0].name: ", "is too long (65 bytes; at most 64)"},
	"duplicate_name.yaml":           {`duplicate_name.yaml:8: rules[2].name: duplicate rule name "a" (first at line 2)`},
	"missing_key.yaml":              {"missing_key.yaml:2: rules[0].key: missing (required): an attribute name, or a list of them"},
	"key_mapping.yaml":              {"key_mapping.yaml:3: rules[0].key: expected a string, got a mapping"},
	"key_empty_list.yaml":           {"key_empty_list.yaml:3: rules[0].key: empty list; give at least one value"},
	"key_repeated.yaml":             {`key_repeated.yaml:3: rules[0].key[2]: attribute "ip" listed twice`},
	"key_invalid_attr.yaml":         {`key_invalid_attr.yaml:3: rules[0].key: "client ip" is not a valid attribute name (letters, digits, _ . -)`},
	"key_bool.yaml":                 {"key_bool.yaml:3: rules[0].key[1]: expected a string, got a boolean true"},
	"unknown_algorithm.yaml":        {`unknown_algorithm.yaml:4: rules[0].algorithm: unknown algorithm "leaky_bucket" (valid: token_bucket, sliding_window, fixed_window)`},
	"missing_limit.yaml":            {"missing_limit.yaml:2: rules[0].limit: missing (required): e.g. { requests: 10, per: 1m }"},
	"limit_not_mapping.yaml":        {`limit_not_mapping.yaml:4: rules[0].limit: expected a mapping, got a string "10/s"`},
	"unknown_limit_field.yaml":      {`unknown_limit_field.yaml:4: rules[0].limit: unknown field "brust" (valid: requests, per, burst, tz)`},
	"missing_requests.yaml":         {"missing_requests.yaml:5: rules[0].limit.requests: missing (required): how many requests per window"},
	"missing_per.yaml":              {"missing_per.yaml:5: rules[0].limit.per: missing (required): the window, e.g. 1s, 1m, 1h, 1d"},
	"requests_zero.yaml":            {"requests_zero.yaml:4: rules[0].limit.requests: must be at least 1, got 0"},
	"requests_negative.yaml":        {"requests_negative.yaml:4: rules[0].limit.requests: must be at least 1, got -5"},
	"requests_leading_zero.yaml":    {"requests_leading_zero.yaml:4: rules[0].limit.requests: 010 has a leading zero, which YAML reads as octal (8): write 10, or 0o10 for 8"},
	"requests_string.yaml":          {`requests_string.yaml:4: rules[0].limit.requests: expected a whole number, got a string "10"`},
	"requests_fraction.yaml":        {"requests_fraction.yaml:4: rules[0].limit.requests: expected a whole number, got a number 1.5"},
	"requests_too_large.yaml":       {"requests_too_large.yaml:4: rules[0].limit.requests: 99999999999999999999 is too large"},
	"requests_over_max.yaml":        {"requests_over_max.yaml:4: rules[0].limit: requests 5000000000 exceed the maximum of 4294967295"},
	"per_bad_unit.yaml":             {`per_bad_unit.yaml:9: rules[1].limit.per: "60x" is not a duration (use e.g. 60s, 1m, 1h, 1d)`},
	"per_no_unit.yaml":              {`per_no_unit.yaml:4: rules[0].limit.per: "60" is not a duration (use e.g. 60s, 1m, 1h, 1d)`},
	"per_bad_days.yaml":             {`per_bad_days.yaml:4: rules[0].limit.per: "1.5d" is not a duration`},
	"per_too_short.yaml":            {`per_too_short.yaml:4: rules[0].limit.per: "500us" is too short: at least 1ms`},
	"per_zero.yaml":                 {`per_zero.yaml:4: rules[0].limit.per: "0s" is too short: at least 1ms`},
	"per_negative.yaml":             {`per_negative.yaml:4: rules[0].limit.per: "-1m" is too short: at least 1ms`},
	"per_overflow.yaml":             {`per_overflow.yaml:4: rules[0].limit.per: "999999999999d" is too long`},
	"per_fraction_ms.yaml":          {"per_fraction_ms.yaml:4: rules[0].limit: window 1.5ms is not a whole number of milliseconds"},
	"per_too_long.yaml":             {"per_too_long.yaml:4: rules[0].limit: window 9600h0m0s is longer than 366 days"},
	"rate_too_high.yaml":            {"rate_too_high.yaml:4: rules[0].limit: rate of 4000000000 per 1ms is too high"},
	"burst_zero.yaml":               {"burst_zero.yaml:4: rules[0].limit.burst: must be at least 1, got 0 (leave burst out for burst = requests)"},
	"burst_with_window.yaml":        {"burst_with_window.yaml:8: rules[0].limit.burst: only token_bucket has a burst (algorithm is fixed_window)"},
	"burst_too_large.yaml":          {"burst_too_large.yaml:4: rules[0].limit: burst 5000000000 exceeds the maximum of 4294967295"},
	"plans_not_mapping.yaml":        {"plans_not_mapping.yaml:5: rules[0].plans: expected a mapping, got a list"},
	"plan_zero.yaml":                {"plan_zero.yaml:6: rules[0].plans.partner: must be at least 1, got 0 (or unlimited)"},
	"plan_word.yaml":                {`plan_word.yaml:6: rules[0].plans.partner: expected a number of requests or unlimited, got a string "lots"`},
	"plan_unlimited_caps.yaml":      {`plan_unlimited_caps.yaml:6: rules[0].plans.partner: expected a number of requests or unlimited, got a string "Unlimited"`},
	"plan_fraction.yaml":            {"plan_fraction.yaml:5: rules[0].plans.partner: expected a whole number, got a number 1.5", "plan_fraction.yaml:5: rules[0].plans.big: 99999999999999999999 is too large"},
	"plan_over_max.yaml":            {"plan_over_max.yaml:6: rules[0].plans.partner: requests 5000000000 exceed the maximum of 4294967295"},
	"plan_empty_name.yaml":          {"plan_empty_name.yaml:6: rules[0].plans: a plan name must not be empty"},
	"plan_star_name.yaml":           {`plan_star_name.yaml:6: rules[0].plans: "*" is not a plan name: it stands for "every other rule" inside a top-level plan's map of rules (gold: { holds-per-account: 500, "*": 5x })`},
	"top_plan_star_name.yaml":       {`top_plan_star_name.yaml:2: plans: "*" is not a plan name: it stands for "every other rule" inside a top-level plan's map of rules (gold: { holds-per-account: 500, "*": 5x })`},
	"plan_duplicate.yaml":           {`plan_duplicate.yaml:7: rules[0].plans: "partner" given twice (first at line 6)`},
	"shadow_not_bool.yaml":          {`shadow_not_bool.yaml:5: rules[0].shadow: expected true or false, got a string "yes"`},
	"unknown_mode.yaml":             {`unknown_mode.yaml:5: rules[0].mode: unknown mode "distributed" (valid: local, hybrid, global)`},
	"unknown_policy.yaml":           {`unknown_policy.yaml:5: rules[0].on_store_failure: unknown on_store_failure "allow" (valid: open, closed, local)`},
	"match_list.yaml":               {"match_list.yaml:5: rules[0].match: expected a mapping, got a list"},
	"match_empty_values.yaml":       {"match_empty_values.yaml:6: rules[0].match.method: empty list; give at least one value"},
	"match_value_mapping.yaml":      {`match_value_mapping.yaml:6: rules[0].match.method: unknown field "is" (valid: glob, not, not_glob)`},
	"match_null_value_in_list.yaml": {"match_null_value_in_list.yaml:6: rules[0].match.method[1]: expected a string, got null"},
	"match_invalid_attr.yaml":       {`match_invalid_attr.yaml:6: rules[0].match: "x=y" is not a valid attribute name`},
	"glob_no_slash.yaml":            {`glob_no_slash.yaml:6: rules[0].match.path: "v1/holds": must start with /`},
	"glob_partial_doublestar.yaml":  {`glob_partial_doublestar.yaml:6: rules[0].match.path[1]: "/v1/a**": ** must be a whole segment (e.g. /v1/**)`},
	"many_errors.yaml": {
		"many_errors.yaml:4: rules[0].limit.requests: must be at least 1, got 0\n" +
			`testdata/bad/many_errors.yaml:7: rules[1].algorithm: unknown algorithm "nope" (valid: token_bucket, sliding_window, fixed_window)` + "\n" +
			`testdata/bad/many_errors.yaml:8: rules[1].limit.per: "1x" is not a duration (use e.g. 60s, 1m, 1h, 1d)` + "\n" +
			`testdata/bad/many_errors.yaml:9: rules[1].mode: unknown mode "far" (valid: local, hybrid, global)`,
	},
}

func TestBadFixtures(t *testing.T) {
	files, err := filepath.Glob("testdata/bad/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, path := range files {
		name := filepath.Base(path)
		seen[name] = true
		t.Run(name, func(t *testing.T) {
			want, ok := badFixtures[name]
			if !ok {
				t.Fatalf("no expected error for %s in badFixtures", name)
			}
			set, err := Load(path)
			if err == nil {
				t.Fatalf("Load(%s) = %d rules, want an error", path, len(set.Rules))
			}
			msg := err.Error()
			for _, w := range want {
				if !strings.Contains(msg, w) {
					t.Errorf("error\n%s\ndoes not contain\n%s", msg, w)
				}
			}
			var es Errors
			if !errors.As(err, &es) || len(es) == 0 {
				t.Fatalf("error %T is not a non-empty Errors", err)
			}
			for _, e := range es {
				if e.File != path {
					t.Errorf("error %q names file %q, want %q", e, e.File, path)
				}
			}
			// Deterministic: the same input gives the same report.
			if _, err2 := Load(path); err2.Error() != msg {
				t.Errorf("second Load differs:\n%s\nvs\n%s", err2, msg)
			}
		})
	}
	for name := range badFixtures {
		if !seen[name] {
			t.Errorf("badFixtures lists %s, which is not in testdata/bad", name)
		}
	}
}

func TestGoodFixtures(t *testing.T) {
	files, _ := filepath.Glob("testdata/good/*.yaml")
	if len(files) == 0 {
		t.Fatal("no good fixtures")
	}
	for _, path := range files {
		if _, err := Load(path); err != nil {
			t.Errorf("Load(%s): %v", path, err)
		}
	}
}

func TestLoadMissingFile(t *testing.T) {
	_, err := Load("testdata/nope.yaml")
	if err == nil || !strings.Contains(err.Error(), "testdata/nope.yaml") || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Load(missing) = %v", err)
	}
}

func TestParseFull(t *testing.T) {
	data, err := os.ReadFile("testdata/good/full.yaml")
	if err != nil {
		t.Fatal(err)
	}
	set, err := Parse("full.yaml", data)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if set.Source != "full.yaml" || set.Version != hex.EncodeToString(sum[:])[:12] || len(set.Version) != 12 {
		t.Errorf("Source, Version = %q, %q", set.Source, set.Version)
	}
	type want struct {
		name      string
		key       string
		alg       localbucket.Algorithm
		requests  uint64
		per       time.Duration
		burst     uint64
		shadow    bool
		mode      Mode
		onFailure FailurePolicy
		line      int
	}
	wants := []want{
		{"holds-per-account", "user", localbucket.TokenBucket, 5, time.Minute, 5, false, ModeLocal, FailLocal, 3},
		{"per-key.partner_v2", "api_key,ip", localbucket.TokenBucket, 1000, time.Minute, 1500, true, ModeHybrid, FailClosed, 12},
		{"daily", "user", localbucket.FixedWindow, 10000, 24 * time.Hour, 0, false, ModeGlobal, FailOpen, 30},
		{"sliding", "ip", localbucket.SlidingWindow, 3, 36 * time.Hour, 0, false, ModeDefault, FailLocal, 37},
	}
	if len(set.Rules) != len(wants) {
		t.Fatalf("%d rules, want %d", len(set.Rules), len(wants))
	}
	for i, w := range wants {
		r := set.Rules[i]
		got := want{r.Name, strings.Join(r.Key, ","), r.Algorithm, r.Requests, r.Per, r.Burst, r.Shadow, r.Mode, r.OnStoreFailure, r.Line}
		if got != w {
			t.Errorf("rule %d = %+v, want %+v", i, got, w)
		}
		if r.File != "full.yaml" {
			t.Errorf("rule %d File = %q", i, r.File)
		}
	}
	// match: { user: 42 } matches the text "42".
	if !set.Rules[3].Matches([]Attr{{"user", "42"}}) {
		t.Error("numeric match value does not match its text")
	}
}

func TestParseEmptyRules(t *testing.T) {
	for _, src := range []string{"rules: []\n", "rules:\n", "---\nrules: []\n"} {
		set, err := Parse("r.yaml", []byte(src))
		if err != nil {
			t.Fatalf("Parse(%q): %v", src, err)
		}
		if len(set.Rules) != 0 {
			t.Errorf("Parse(%q) = %d rules", src, len(set.Rules))
		}
	}
}

// A file that ends with `---` (an empty document after its rules), as files joined or
// generated by tools often do, holds its rules; a second document with anything in it,
// an explicit null included, is still refused. Before, the trailing `---` was refused
// as a second document.
func TestParseEmptyTrailingDocument(t *testing.T) {
	const one = "rules:\n  - { name: a, key: user, limit: { requests: 1, per: 1s } }\n"
	for _, src := range []string{one + "---\n", one + "---\n---\n", one + "---\n# the end\n", one + "---"} {
		if set, err := Parse("r.yaml", []byte(src)); err != nil || len(set.Rules) != 1 {
			t.Errorf("Parse(%q): %v", src, err)
		}
	}
	for _, src := range []string{one + "---\n~\n", one + "---\nnull\n", one + "---\n---\nrules: []\n", one + "---\nrules: []\n"} {
		if _, err := Parse("r.yaml", []byte(src)); err == nil || !strings.Contains(err.Error(), "a second YAML document") {
			t.Errorf("Parse(%q): %v, want a second document refused", src, err)
		}
	}
}

func TestParseAliases(t *testing.T) {
	set, err := Load("testdata/good/aliases.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(set.Rules) != 2 || set.Rules[1].Key[0] != "ip" || set.Rules[1].Requests != 1 {
		t.Errorf("aliases not followed: %+v", set.Rules)
	}
}

func TestErrorsText(t *testing.T) {
	var src strings.Builder
	src.WriteString("rules:\n")
	for range 25 {
		src.WriteString("  - name: a\n    key: ip\n    limit: { requests: 0, per: 1s }\n")
	}
	_, err := Parse("r.yaml", []byte(src.String()))
	var es Errors
	if !errors.As(err, &es) || len(es) != 25 {
		t.Fatalf("want 25 errors, got %v", err)
	}
	lines := strings.Split(err.Error(), "\n")
	if len(lines) != maxShown+1 || lines[maxShown] != "... and 5 more" {
		t.Errorf("Error() = %q", err.Error())
	}
	var one *Error
	if !errors.As(err, &one) || one.Line != 4 || one.Field != "rules[0].limit.requests" {
		t.Errorf("first *Error = %+v", one)
	}
}

func TestParsePer(t *testing.T) {
	tests := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"1ms", time.Millisecond, true},
		{"60s", time.Minute, true},
		{"1m30s", 90 * time.Second, true},
		{"1h", time.Hour, true},
		{"1d", 24 * time.Hour, true},
		{"7d", 7 * 24 * time.Hour, true},
		{"1d12h", 36 * time.Hour, true},
		{"0d1s", time.Second, true},
		{"d", 0, false},
		{"1d-1h", 0, false},
		{"1.5d", 0, false},
		{"-1d", 0, false},
		{"1", 0, false},
		{"", 0, false},
		{"0", 0, false},
		{"999us", 0, false},
		{"1dd", 0, false},
		{"106751d", 106751 * 24 * time.Hour, true}, // the longest whole-day duration
		{"106751d24h", 0, false},
	}
	for _, tt := range tests {
		got, msg := parsePer(tt.in)
		if (msg == "") != tt.ok || (tt.ok && got != tt.want) {
			t.Errorf("parsePer(%q) = %v, %q; want %v, ok=%v", tt.in, got, msg, tt.want, tt.ok)
		}
	}
}

func TestModeAndPolicyStrings(t *testing.T) {
	for _, m := range []Mode{ModeLocal, ModeHybrid, ModeGlobal} {
		if got, err := ParseMode(m.String()); err != nil || got != m {
			t.Errorf("ParseMode(%q) = %v, %v", m, got, err)
		}
	}
	if ModeDefault.String() != "default" || Mode(9).String() != "Mode(9)" {
		t.Error("Mode.String")
	}
	if _, err := ParseMode("default"); err == nil {
		t.Error(`ParseMode("default") succeeded`)
	}
	for _, p := range []FailurePolicy{FailLocal, FailOpen, FailClosed} {
		if got, err := ParseFailurePolicy(p.String()); err != nil || got != p {
			t.Errorf("ParseFailurePolicy(%q) = %v, %v", p, got, err)
		}
	}
	if FailurePolicy(7).String() != "FailurePolicy(7)" {
		t.Error("FailurePolicy.String")
	}
}

func TestDefault(t *testing.T) {
	set := Default()
	if set.Source != "built-in" || len(set.Version) != 12 {
		t.Errorf("Source, Version = %q, %q", set.Source, set.Version)
	}
	var names []string
	for _, r := range set.Rules {
		names = append(names, r.Name)
	}
	if want := []string{"per-ip", "login", "per-user", "per-api-key"}; !slices.Equal(names, want) {
		t.Fatalf("rules %v, want %v", names, want)
	}
	perIP, login, perUser, perKey := set.Rules[0], set.Rules[1], set.Rules[2], set.Rules[3]

	// `rlsidecar check ip=1.2.3.4`: only per-ip applies.
	attrs := []Attr{{"ip", "1.2.3.4"}}
	var applied []string
	for _, r := range set.Rules {
		if _, ok := r.AppendKey(nil, attrs); ok && r.Matches(attrs) {
			applied = append(applied, r.Name)
		}
	}
	if !slices.Equal(applied, []string{"per-ip"}) {
		t.Errorf("ip=1.2.3.4 applies %v, want [per-ip]", applied)
	}
	if perIP.Requests != 20 || perIP.Per != 10*time.Second {
		t.Errorf("per-ip = %d per %v", perIP.Requests, perIP.Per)
	}
	if !login.Matches([]Attr{{"method", "POST"}, {"path", "/login"}}) || login.Matches([]Attr{{"method", "GET"}, {"path", "/login"}}) {
		t.Error("login matching")
	}
	if login.OnStoreFailure != FailClosed || login.Requests != 5 || login.Per != time.Minute {
		t.Errorf("login = %+v", login)
	}
	if lim, _ := perUser.LimitFor("partner", true); lim.Requests() != 1000 {
		t.Errorf("per-user partner = %d", lim.Requests())
	}
	if _, unl := perUser.LimitFor("internal", true); !unl {
		t.Error("per-user internal is not unlimited")
	}
	if perKey.Algorithm != localbucket.SlidingWindow || perKey.Key[0] != "api_key" {
		t.Errorf("per-api-key = %+v", perKey)
	}
	if Default() == set {
		t.Error("Default returns a shared Set")
	}
}

// A tab in a line's indentation is named on its line: the YAML library named the line
// before it ("g.yaml:6: invalid YAML: found a tab character that violates indentation"
// for a tab on line 7), an editor's jump to the error landing on a line with none.
func TestTabIndentationLine(t *testing.T) {
	data := "rules:\n  - name: a\n    key: user\n    limit: { requests: 5, per: 1m }\n  - name: b\n    key: ip\n\tlimit: { requests: 5, per: 1m }\n"
	_, err := Parse("g.yaml", []byte(data))
	if want := "g.yaml:7: invalid YAML: a tab in the indentation (YAML indents with spaces only)"; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("got %v, want %s", err, want)
	}
}

// A file that is not text is refused as such, at its first offending byte: binary
// garbage was refused with "invalid YAML: control characters are not allowed", no line
// nor byte named (a stray control character in a long file had to be hunted down), and a
// file of a byte-order mark or blank space alone was said to be empty.
func TestNotTextFile(t *testing.T) {
	const rule = "  - { name: a, key: ip, limit: { requests: 3, per: 1h } }\n"
	tests := []struct {
		name, data, want string
	}{
		{"binary garbage", "\x00\x01\x02\xff\xfe", "g.yaml:1: invalid YAML: a control character (U+0000) at column 1; a rules file is text (YAML, in UTF-8): is this one?"},
		{"a NUL after the rules", "rules:\n" + rule + "\x00" + rule, "g.yaml:3: invalid YAML: a control character (U+0000) at column 1;"},
		{"a bell in a name", "rules:\n  - { name: a\x07, key: ip }\n", "g.yaml:2: invalid YAML: a control character (U+0007) at column 14;"},
		{"Latin-1", "rules:\n  - { name: caf\xe9, key: ip, limit: { requests: 3, per: 1h } }\n", "g.yaml:2: invalid YAML: byte 0xe9 at column 16 is not UTF-8;"},
		{"empty", "", "g.yaml: no rules: key (the file is empty)"},
		{"blank space", "\n  \n\n", "g.yaml: no rules: key (the file holds only blank space)"},
		{"a byte-order mark alone", "\xff\xfe", "g.yaml: no rules: key (the file holds no YAML document)"},
	}
	dir := t.TempDir()
	for _, tt := range tests {
		path := filepath.Join(dir, "g.yaml")
		if err := os.WriteFile(path, []byte(tt.data), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := Load(path)
		if err == nil || !strings.Contains(err.Error(), filepath.Join(dir, tt.want)) {
			t.Errorf("%s: %v, want %s", tt.name, err, tt.want)
		}
	}
	// Text in UTF-16, with its byte-order mark, is still read.
	le := []byte{0xff, 0xfe}
	for _, c := range "rules:\n" + rule {
		le = append(le, byte(c), 0)
	}
	if set, err := Parse("u16.yaml", le); err != nil || len(set.Rules) != 1 {
		t.Errorf("UTF-16: %v", err)
	}
}

// A file that is not a rules file (the rules link pointed at a password file, a salt,
// /etc/shadow) is refused without a byte of it in the error, which goes to the daemon's
// log and validate's output: readers who may not read the file. Before, the error quoted
// its first 40 bytes ("got a string ...", "unknown field ...").
func TestNotRulesFileQuotesNothing(t *testing.T) {
	dir := t.TempDir()
	for _, content := range []string{
		"Pr3fix-S3cret #suffix\n",
		"SaltS3cretValue0123456789\n",
		"root:$6$S3cretHash$abc:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
		`{"password": "S3cret", "S3cretKey": 1}`,
		"- S3cret\n- other\n",
		"S3cret: [1, 2]\nmore: S3cret\n",
		"12345678\n",
		"*S3cretPw\n", "!S3cretPw\n", "!S3cret rest\n", "&S3cret x\n", "a: *S3cret\n", "- *S3cret\n", "S3cret: {\n", "\"S3cret\n", "[S3cret\n",
	} {
		path := filepath.Join(dir, "f.yaml")
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := Load(path)
		if err == nil {
			t.Fatalf("%q loaded as rules", content)
		}
		if msg := err.Error(); strings.Contains(msg, "S3cret") || strings.Contains(msg, "password") || strings.Contains(msg, "12345678") {
			t.Errorf("the error quotes the file: %s", msg)
		}
	}
	// A key a typo away from rules: is still named.
	path := filepath.Join(dir, "typo.yaml")
	if err := os.WriteFile(path, []byte("Rules:\n  - name: a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path); err == nil || !strings.Contains(err.Error(), `unknown field "Rules"`) {
		t.Errorf("a misspelt rules: key: %v", err)
	}
}

// FormatPer writes what a rules file would, and parsePer reads it back.
func TestFormatPer(t *testing.T) {
	for d, want := range map[time.Duration]string{
		time.Minute: "1m", 100 * time.Second: "1m40s", 24 * time.Hour: "1d", 36 * time.Hour: "1d12h",
		2*time.Hour + 30*time.Second: "2h30s", 7 * 24 * time.Hour: "7d", 1500 * time.Millisecond: "1.5s",
		250 * time.Millisecond: "250ms", 160 * time.Minute: "2h40m",
	} {
		got := FormatPer(d)
		if got != want {
			t.Errorf("FormatPer(%v) = %q, want %q", d, got, want)
		}
		if back, msg := parsePer(got); msg != "" || back != d {
			t.Errorf("parsePer(%q) = %v %q, want %v", got, back, msg, d)
		}
	}
}

// IsEmptyFile tells a file of no bytes (a writer's truncation, read before its bytes)
// from every other refusal, a file of blank space or comments only included.
func TestIsEmptyFile(t *testing.T) {
	for _, tt := range []struct {
		file string
		want bool
	}{
		{"testdata/bad/empty.yaml", true},
		{"testdata/bad/comments_only.yaml", false},
		{"testdata/bad/requests_zero.yaml", false},
	} {
		_, err := Load(tt.file)
		if got := IsEmptyFile(err); got != tt.want {
			t.Errorf("IsEmptyFile(Load(%s)) = %v, want %v (%v)", tt.file, got, tt.want, err)
		}
	}
	if IsEmptyFile(nil) {
		t.Error("IsEmptyFile(nil)")
	}
}

// A count written with a leading zero is refused with what to write: a digit past 7
// (0900, 08) makes it no octal, a float to YAML, which was refused as "too large"; 00 is
// 0, and an underscore after the zero (0_10) was suggested as "_10".
func TestCountLeadingZeroMessages(t *testing.T) {
	for v, want := range map[string]string{
		"010":  "010 has a leading zero, which YAML reads as octal (8): write 10, or 0o10 for 8",
		"0_10": "0_10 has a leading zero, which YAML reads as octal (8): write 10, or 0o10 for 8",
		"0900": "0900 has a leading zero: write 900",
		"08":   "08 has a leading zero: write 8",
		"00":   "must be at least 1, got 00",
	} {
		_, err := Parse("t.yaml", []byte("rules:\n  - { name: r, key: user, limit: { requests: "+v+", per: 1h } }\n"))
		if got, w := errString(err), "t.yaml:2: rules[0].limit.requests: "+want; got != w {
			t.Errorf("requests: %s:\n got %s\nwant %s", v, got, w)
		}
	}
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
