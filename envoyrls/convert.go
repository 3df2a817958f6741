package envoyrls

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/rlsidecar/rlsidecar/rules"
)

// Convert reads envoyproxy/ratelimit configuration files and returns an rlsidecar rules
// file doing the same (rlsidecar import-envoy). Each descriptor with a rate_limit becomes
// one rule that matches exactly the descriptors Envoy's lookup would give that limit:
//
//   - domain: the file's domain; descriptor: the keys of the descriptor path, in order,
//     joined by "," (so a descriptor longer or shorter than the path, or with other keys,
//     does not match, as in Envoy);
//   - for each level, the entry's value: a value given is matched exactly; a wildcard
//     value (one holding '*', each matching any run of bytes, as envoyproxy/ratelimit
//     matches it since #1085; with ConvertOptions.Wildcards "trailing", as its earlier
//     builds did, only a value ending with '*', a prefix, a '*' elsewhere a literal
//     character) as a glob that none of the level's exact values (and no
//     earlier wildcard) takes first; a key without value as any value that none of the level's
//     exact values or wildcards takes — Envoy tries key and value first, then the
//     wildcards in order, then the key alone, and never backtracks;
//   - the key: the path's entry keys (each value counts apart), except entries with
//     share_threshold (all values matching the wildcard share one counter); the domain
//     when no entry is left;
//   - the limit: requests_per_unit per unit (month 30d, year 365d) in windows aligned to
//     the epoch like Envoy's (algorithm, default fixed_window); unlimited: true becomes
//     limit: unlimited, requests_per_unit: 0 becomes limit: deny (a block list);
//   - rate_limit.name becomes the rule's name (else one is made from the domain and the
//     path), replaces the rule's replaces, shadow_mode (and quota_mode, which never
//     refuses either) the rule's shadow.
//
// detailed_metric and value_to_metric only shape Envoy's metric names; rlsidecar's
// metrics are per rule, and the output says so where they appear. shadow_mode on a
// descriptor without rate_limit does nothing in envoyproxy/ratelimit (it marks the
// descriptor's own rate_limit, and the descriptors nested in it are not shadowed): the
// output says so at its top, and gives no rule for it. Anything else that cannot be
// converted is an error naming the file, the line and the field.
//
// Convert is ConvertWith with the algorithm alone.
func Convert(files []File, algorithm string) ([]byte, error) {
	return ConvertWith(files, ConvertOptions{Algorithm: algorithm})
}

// ConvertOptions are what Convert writes besides the configuration's own: the zero value
// writes fixed windows in the daemon's default mode.
type ConvertOptions struct {
	// Algorithm of the rules that limit: fixed_window (Envoy's, the default "" too),
	// sliding_window or token_bucket.
	Algorithm string
	// Mode of the rules that limit: local, hybrid or global; "" names none, so the
	// daemon's default applies (hybrid with Redis). envoyproxy/ratelimit counts every
	// hit in Redis, exactly across its replicas: global does too.
	Mode string
	// Wildcards is how a '*' in a descriptor value matches: WildcardsAnywhere (the
	// default, "" too) as envoyproxy/ratelimit matches it since commit 6bcd4d2 (#1085,
	// March 2026): each '*' matches any run of bytes, wherever it is in the value;
	// WildcardsTrailing as its earlier builds did: only a '*' that ends the value is a
	// wildcard (a prefix), a '*' before the end is a literal character.
	Wildcards string
}

// The values of ConvertOptions.Wildcards.
const (
	WildcardsAnywhere = "anywhere"
	WildcardsTrailing = "trailing"
)

// ConvertWith is Convert with options.
func ConvertWith(files []File, opts ConvertOptions) ([]byte, error) {
	algorithm := opts.Algorithm
	switch algorithm {
	case "":
		algorithm = "fixed_window"
	case "fixed_window", "sliding_window", "token_bucket":
	default:
		return nil, fmt.Errorf("--algorithm %q: use fixed_window (Envoy's), sliding_window or token_bucket", algorithm)
	}
	if opts.Mode != "" {
		if _, err := rules.ParseMode(opts.Mode); err != nil {
			return nil, fmt.Errorf("--mode %q: use local, hybrid or global (or none: the daemon's default)", opts.Mode)
		}
	}
	var trailing bool
	switch opts.Wildcards {
	case "", WildcardsAnywhere:
	case WildcardsTrailing:
		trailing = true
	default:
		return nil, fmt.Errorf("--wildcards %q: use anywhere (envoyproxy/ratelimit since #1085) or trailing (its builds before)", opts.Wildcards)
	}
	c := &converter{alg: algorithm, mode: opts.Mode, trailing: trailing, names: map[string]*outRule{}, domains: map[string]string{}}
	for _, f := range files {
		c.file(f)
	}
	c.resolve()
	if len(c.errs) > 0 {
		return nil, errors.Join(c.errs...)
	}
	var b bytes.Buffer
	names := make([]string, len(files))
	for i, f := range files {
		names[i] = f.Name
	}
	fmt.Fprintf(&b, "# Converted by rlsidecar import-envoy from %s.\n", strings.Join(names, ", "))
	b.WriteString("# Checked over Envoy's rate limit service API (serve --envoy-rls), descriptors are\n")
	b.WriteString("# matched on the attributes domain, descriptor (the keys, joined by \",\") and each entry.\n")
	for _, n := range c.notes {
		fmt.Fprintf(&b, "# %s\n", n)
	}
	b.WriteString("rules:\n")
	if len(c.rules) == 0 {
		b.Truncate(b.Len() - len("rules:\n"))
		b.WriteString("rules: []\n")
	}
	for _, r := range c.rules {
		r.write(&b, c.alg, c.mode)
	}
	return b.Bytes(), nil
}

// File is one configuration file: its name (for errors) and contents.
type File struct {
	Name string
	Data []byte
}

type converter struct {
	alg      string
	mode     string
	trailing bool // only a '*' ending a value is a wildcard (ConvertOptions.Wildcards)
	errs     []error
	rules    []*outRule
	names    map[string]*outRule
	domains  map[string]string // domain → file:line of first definition
	notes    []string          // about the whole output, written at its top
}

// level is one entry of a descriptor path, as matched.
type level struct {
	key      string
	value    string // exact value, or the glob
	glob     bool
	not      []string
	notGlobs []string
	shared   bool     // share_threshold
	notes    []string // flags with no rlsidecar meaning, said in the output
}

type outRule struct {
	name      string
	named     bool // the name came from rate_limit.name
	file      string
	line      int
	domain    string
	path      []level
	requests  uint64
	per       string
	unlimited bool
	shadow    bool
	replaces  []string
	replLines []int
	notes     []string
}

func (c *converter) errorf(file string, n *yaml.Node, field, format string, args ...any) {
	line := 0
	if n != nil {
		line = n.Line
	}
	msg := fmt.Sprintf(format, args...)
	if field != "" {
		msg = field + ": " + msg
	}
	c.errs = append(c.errs, fmt.Errorf("%s:%d: %s", file, line, msg))
}

var (
	topFields   = []string{"domain", "descriptors"}
	descFields  = []string{"key", "value", "rate_limit", "shadow_mode", "detailed_metric", "value_to_metric", "share_threshold", "descriptors", "quota_mode", "metadata"}
	rlFields    = []string{"unit", "requests_per_unit", "unlimited", "name", "replaces"}
	attrName    = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)
	ruleName    = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)
	unitWindows = map[string]string{"second": "1s", "minute": "1m", "hour": "1h", "day": "1d", "week": "7d", "month": "30d", "year": "365d"}
)

func (c *converter) file(f File) {
	dec := yaml.NewDecoder(bytes.NewReader(f.Data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			c.errorf(f.Name, nil, "", "empty file: no domain")
		} else {
			c.errs = append(c.errs, fmt.Errorf("%s: invalid YAML: %w", f.Name, err))
		}
		return
	}
	if len(doc.Content) != 1 || doc.Content[0].Kind != yaml.MappingNode {
		c.errorf(f.Name, &doc, "", "expected a mapping with domain and descriptors")
		return
	}
	if hasAlias(&doc) {
		// Aliases are followed where they stand (node); decoding the document first
		// refuses, as envoyproxy/ratelimit's YAML decoder does, an alias that contains
		// itself (which would be followed forever) and aliasing that expands a small
		// file past what the decoder allows.
		var v any
		if err := doc.Decode(&v); err != nil {
			c.errs = append(c.errs, fmt.Errorf("%s: invalid YAML: %w", f.Name, err))
			return
		}
	}
	// envoyproxy/ratelimit reads a file's first YAML document and ignores the rest; a
	// conversion that did the same would drop limits without a word, and one that took
	// them all would enforce limits Envoy never did. The user decides: one file each.
	var next yaml.Node
	if err := dec.Decode(&next); err == nil && len(next.Content) > 0 && next.Content[0].Tag != "!!null" {
		c.errorf(f.Name, next.Content[0], "", "a second YAML document: envoyproxy/ratelimit reads only a file's first and ignores the rest; put each domain in a file of its own (or delete the ones Envoy never used)")
		return
	} else if err != nil && !errors.Is(err, io.EOF) {
		c.errs = append(c.errs, fmt.Errorf("%s: invalid YAML: %w", f.Name, err))
		return
	}
	top := c.fields(f.Name, doc.Content[0], "", topFields)
	if top == nil {
		return
	}
	dn := top["domain"]
	domain, ok := c.str(f.Name, dn, "domain")
	if dn == nil || !ok || domain == "" {
		c.errorf(f.Name, doc.Content[0], "domain", "missing (required)")
		return
	}
	if first, dup := c.domains[domain]; dup {
		c.errorf(f.Name, dn, "domain", "domain %q is already defined at %s (Envoy refuses it too without MERGE_DOMAIN_CONFIG; merge the files)", domain, first)
		return
	}
	c.domains[domain] = fmt.Sprintf("%s:%d", f.Name, dn.Line)
	if ds := top["descriptors"]; ds != nil {
		c.descriptors(f.Name, domain, ds, "descriptors", nil)
	}
}

// fields checks that n is a mapping whose keys are among valid; it returns the values.
// A merge key ("<<: *anchor", or a list of them) gives the keys of the mappings it names,
// read in document order as envoyproxy/ratelimit's decoder (gopkg.in/yaml.v2) reads
// them: over the keys before it, under those after it, the first mapping of a list over
// the later ones.
func (c *converter) fields(file string, n *yaml.Node, field string, valid []string) map[string]*yaml.Node {
	n = node(n)
	if n.Kind != yaml.MappingNode {
		c.errorf(file, n, field, "expected a mapping")
		return nil
	}
	out := map[string]*yaml.Node{}
	given := map[string]bool{} // the keys n gives itself, null values included
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := node(n.Content[i]), n.Content[i+1]
		if isMergeKey(k) {
			for mk, mv := range c.merged(file, v, field, valid) {
				out[mk] = mv
			}
			continue
		}
		if !slices.Contains(valid, k.Value) {
			c.errorf(file, k, field, "unknown field %q (valid: %s)", k.Value, strings.Join(valid, ", "))
			continue
		}
		if given[k.Value] {
			c.errorf(file, k, field, "%q given twice", k.Value)
			continue
		}
		given[k.Value] = true
		if vn := node(v); vn.Kind == yaml.ScalarNode && vn.ShortTag() == "!!null" {
			delete(out, k.Value)
			continue
		}
		out[k.Value] = v
	}
	return out
}

// merged is the fields of a merge key's value: a mapping, or a list of them, the first
// of a list over the later ones.
func (c *converter) merged(file string, v *yaml.Node, field string, valid []string) map[string]*yaml.Node {
	v = node(v)
	sources := []*yaml.Node{v}
	if v.Kind == yaml.SequenceNode {
		sources = v.Content
	}
	out := map[string]*yaml.Node{}
	for _, src := range sources {
		if node(src).Kind != yaml.MappingNode {
			c.errorf(file, src, field+".<<", "a merge key takes a mapping or a list of mappings")
			continue
		}
		for k, fv := range c.fields(file, src, field, valid) {
			if _, ok := out[k]; !ok {
				out[k] = fv
			}
		}
	}
	return out
}

// node is n, or for an alias (*name) the node its anchor (&name) marks.
func node(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
}

// isMergeKey reports whether k is YAML's merge key, an untagged <<.
func isMergeKey(k *yaml.Node) bool {
	return k.Kind == yaml.ScalarNode && k.Value == "<<" && (k.Tag == "" || k.Tag == "!" || k.ShortTag() == "!!merge")
}

// hasAlias reports whether the tree under n holds an alias.
func hasAlias(n *yaml.Node) bool {
	if n.Kind == yaml.AliasNode {
		return true
	}
	return slices.ContainsFunc(n.Content, hasAlias)
}

func (c *converter) str(file string, n *yaml.Node, field string) (string, bool) {
	if n == nil {
		return "", false
	}
	n = node(n)
	if n.Kind == yaml.ScalarNode && n.ShortTag() != "!!null" && n.ShortTag() != "!!map" {
		return n.Value, true
	}
	c.errorf(file, n, field, "expected a string")
	return "", false
}

func (c *converter) boolean(file string, n *yaml.Node, field string) bool {
	if n == nil {
		return false
	}
	var v bool
	n = node(n)
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!bool" || n.Decode(&v) != nil {
		c.errorf(file, n, field, "expected true or false")
	}
	return v
}

// descriptors converts one descriptor list whose parent path is parent.
func (c *converter) descriptors(file, domain string, n *yaml.Node, field string, parent []level) {
	n = node(n)
	if n.Kind != yaml.SequenceNode {
		c.errorf(file, n, field, "expected a list of descriptors")
		return
	}
	type sib struct {
		key, value string
		node       *yaml.Node
		f          map[string]*yaml.Node
		field      string
	}
	var sibs []sib
	seen := map[string]int{}
	for i, item := range n.Content {
		df := fmt.Sprintf("%s[%d]", field, i)
		f := c.fields(file, item, df, descFields)
		if f == nil {
			continue
		}
		key, ok := c.str(file, f["key"], df+".key")
		if f["key"] == nil || !ok || key == "" {
			c.errorf(file, item, df+".key", "missing (required)")
			continue
		}
		value := ""
		if v := f["value"]; v != nil {
			value, _ = c.str(file, v, df+".value")
		}
		if first, dup := seen[key+"\x00"+value]; dup {
			c.errorf(file, item, df, "key %q value %q is already described at line %d", key, value, first)
			continue
		}
		seen[key+"\x00"+value] = item.Line
		sibs = append(sibs, sib{key, value, item, f, df})
	}
	for si, s := range sibs {
		lv := level{key: s.key, value: s.value}
		switch {
		case s.key == DomainAttribute || s.key == DescriptorAttribute:
			c.errorf(file, s.f["key"], s.field+".key", "%q is the attribute rlsidecar gives the call's %s; a descriptor key cannot use it", s.key, s.key)
			continue
		case !attrName.MatchString(s.key):
			c.errorf(file, s.f["key"], s.field+".key", "%q cannot be an rlsidecar attribute name (letters, digits, _ . -, at most 64)", s.key)
			continue
		}
		if slices.ContainsFunc(parent, func(l level) bool { return l.key == s.key }) {
			c.errorf(file, s.f["key"], s.field+".key", "key %q appears twice in one descriptor path; rlsidecar attributes are looked up by name", s.key)
			continue
		}
		lv.glob = c.isWildcard(s.value)
		switch {
		case !c.trailing:
			if lv.glob && !strings.HasSuffix(s.value, "*") || strings.Count(s.value, "*") > 1 {
				lv.notes = append(lv.notes, fmt.Sprintf("value %q (line %d): each '*' matches any run of characters, as in envoyproxy/ratelimit since #1085 (March 2026); its builds before matched a '*' before the end literally (import-envoy --wildcards trailing converts as they decide)", s.value, s.f["value"].Line))
			}
		case lv.glob && strings.Contains(s.value[:len(s.value)-1], "*"):
			c.errorf(file, s.f["value"], s.field+".value", "%q: envoyproxy/ratelimit matches the values starting with %q, its '*' before the end a literal character; rlsidecar's glob cannot match a literal '*'", s.value, s.value[:len(s.value)-1])
			continue
		case !lv.glob && s.key == rules.PathAttribute && strings.Contains(s.value, "*"):
			c.errorf(file, s.f["value"], s.field+".value", "%q: envoyproxy/ratelimit matches only this exact value (a '*' before the end is a literal character); rlsidecar cannot match a literal '*' in the path attribute", s.value)
			continue
		}
		// What Envoy tries before this entry at this level: the exact values, then the
		// wildcards in order. Nothing comes before an exact value: only an empty value
		// and a wildcard look (each exact value looking at every sibling made a level of
		// many exact values quadratic).
		for oi, o := range sibs {
			if o.key != s.key || oi == si || s.value != "" && !lv.glob {
				continue
			}
			switch {
			case o.value == "":
			case !c.isWildcard(o.value):
				if s.value == "" || lv.glob {
					lv.not = append(lv.not, o.value)
				}
			case s.value == "" || lv.glob && oi < si:
				lv.notGlobs = append(lv.notGlobs, o.value)
			}
		}
		if sh := s.f["share_threshold"]; sh != nil && c.boolean(file, sh, s.field+".share_threshold") {
			if !lv.glob {
				c.errorf(file, sh, s.field+".share_threshold", "share_threshold needs a wildcard value (%s), as in Envoy", c.wildcardText())
				continue
			}
			lv.shared = true
		}
		if m := s.f["metadata"]; m != nil {
			c.errorf(file, m, s.field+".metadata", "descriptor metadata is not supported by rlsidecar")
		}
		for _, k := range []string{"detailed_metric", "value_to_metric"} {
			if v := s.f[k]; v != nil && c.boolean(file, v, s.field+"."+k) {
				lv.notes = append(lv.notes, fmt.Sprintf("%s (line %d): Envoy's metric names only; rlsidecar's metrics are per rule (rlsidecar_checks_total{rule=...}) and /top lists the most rejected clients", k, v.Line))
			}
		}
		path := append(slices.Clone(parent), lv)
		if rl := s.f["rate_limit"]; rl != nil {
			c.rateLimit(file, domain, rl, s.field+".rate_limit", path, s.f)
		} else {
			for _, k := range []string{"shadow_mode", "quota_mode"} {
				if v := s.f[k]; v != nil && c.boolean(file, v, s.field+"."+k) {
					c.notes = append(c.notes, fmt.Sprintf("%s:%d: %s.%s: descriptor (%s) has no rate_limit: its %s does nothing, as in envoyproxy/ratelimit, where it marks the descriptor's own rate_limit only (the descriptors nested in it are not affected); no rule for it",
						file, v.Line, s.field, k, describePath(path), k))
				}
			}
		}
		if ds := s.f["descriptors"]; ds != nil {
			c.descriptors(file, domain, ds, s.field+".descriptors", path)
		}
	}
}

func (c *converter) rateLimit(file, domain string, n *yaml.Node, field string, path []level, df map[string]*yaml.Node) {
	f := c.fields(file, n, field, rlFields)
	if f == nil {
		return
	}
	r := &outRule{file: file, line: n.Line, domain: domain, path: path}
	r.unlimited = c.boolean(file, f["unlimited"], field+".unlimited")
	if r.unlimited {
		for _, k := range []string{"unit", "requests_per_unit"} {
			if f[k] != nil {
				c.errorf(file, f[k], field+"."+k, "an unlimited rate_limit has no %s (Envoy refuses it too)", k)
				return
			}
		}
	} else {
		u, ok := c.str(file, f["unit"], field+".unit")
		if f["unit"] == nil {
			c.errorf(file, n, field+".unit", "missing (required unless unlimited)")
			return
		}
		if !ok {
			return
		}
		per, known := unitWindows[strings.ToLower(u)]
		if !known {
			c.errorf(file, f["unit"], field+".unit", "unknown unit %q (second, minute, hour, day, week, month, year)", u)
			return
		}
		r.per = per
		rpu := f["requests_per_unit"]
		if rpu == nil {
			c.errorf(file, n, field+".requests_per_unit", "missing (required unless unlimited)")
			return
		}
		rpu = node(rpu)
		v, err := strconv.ParseUint(rpu.Value, 10, 32)
		if rpu.Kind != yaml.ScalarNode || rpu.ShortTag() != "!!int" || err != nil {
			c.errorf(file, rpu, field+".requests_per_unit", "expected a whole number from 0 to 4294967295, got %q", rpu.Value)
			return
		}
		// envoyproxy/ratelimit's YAML decoder (gopkg.in/yaml.v2, YAML 1.1) reads digits
		// after a leading 0 as octal: 010 is 8 requests there. Converted as 10, the rule
		// would admit more than Envoy did; as 8, less than the file seems to say.
		if oct, err := strconv.ParseUint(rpu.Value, 8, 32); err == nil && rpu.Value[0] == '0' && oct != v {
			c.errorf(file, rpu, field+".requests_per_unit", "%q is octal to envoyproxy/ratelimit, whose YAML 1.1 decoder reads a leading 0 so: %d requests; write the number meant without the leading 0", rpu.Value, oct)
			return
		}
		r.requests = v
	}
	if nn := f["name"]; nn != nil {
		name, ok := c.str(file, nn, field+".name")
		if !ok {
			return
		}
		if !ruleName.MatchString(name) {
			c.errorf(file, nn, field+".name", "%q cannot be an rlsidecar rule name (a letter or digit, then letters, digits, _ . -; at most 64)", name)
			return
		}
		if o := c.names[name]; o != nil && o.named {
			c.errorf(file, nn, field+".name", "name %q is already used at %s:%d; rlsidecar rule names are unique (give each its own and list both where it is replaced)", name, o.file, o.line)
			return
		}
		r.name, r.named = name, true
	}
	if rp := node(f["replaces"]); rp != nil {
		if rp.Kind != yaml.SequenceNode {
			c.errorf(file, rp, field+".replaces", "expected a list of {name: ...}")
			return
		}
		for i, item := range rp.Content {
			rf := fmt.Sprintf("%s.replaces[%d]", field, i)
			ff := c.fields(file, item, rf, []string{"name"})
			if ff == nil {
				return
			}
			name, ok := c.str(file, ff["name"], rf+".name")
			if ff["name"] == nil || !ok || name == "" {
				c.errorf(file, item, rf+".name", "missing (required)")
				return
			}
			r.replaces = append(r.replaces, name)
			r.replLines = append(r.replLines, item.Line)
		}
	}
	r.shadow = c.boolean(file, df["shadow_mode"], "shadow_mode")
	if q := df["quota_mode"]; c.boolean(file, q, "quota_mode") {
		// envoyproxy/ratelimit answers a quota-mode limit OK past it, and names the
		// descriptor in its dynamic metadata: a shadow rule decides the same.
		r.shadow = true
		r.notes = append(r.notes, fmt.Sprintf("quota_mode (line %d): never refuses, as in envoyproxy/ratelimit before #1059 (March 2026); a shadow rule here, its refusals counted in rlsidecar_checks_total{result=\"shadow_rejected\"} (envoyproxy/ratelimit reports them in its dynamic metadata, which rlsidecar does not send). envoyproxy/ratelimit since #1059 refuses a call whose quota_mode descriptors are all past their limits (one alone: like a plain limit), which no rlsidecar rule can say: remove quota_mode where that refusal is wanted", q.Line))
	}
	if r.shadow && len(r.replaces) > 0 {
		r.notes = append(r.notes, "a shadow rule replaces nothing in rlsidecar (a dry run changes no decision): the limits it names keep deciding the requests it matches until shadow_mode is removed, where envoyproxy/ratelimit stops applying them")
	}
	for _, l := range path {
		r.notes = append(r.notes, l.notes...)
	}
	c.rules = append(c.rules, r)
	if r.named {
		c.names[r.name] = r
	}
}

// resolve names the unnamed rules and checks replaces.
func (c *converter) resolve() {
	for _, r := range c.rules {
		if r.named {
			continue
		}
		var b strings.Builder
		b.WriteString(r.domain)
		for _, l := range r.path {
			b.WriteByte('.')
			b.WriteString(l.key)
			if l.value != "" {
				b.WriteByte('_')
				b.WriteString(l.value)
			}
		}
		name := sanitize(b.String())
		base := name
		for i := 2; c.names[name] != nil; i++ {
			name = fitName(base, "-"+strconv.Itoa(i))
		}
		r.name = name
		c.names[name] = r
	}
	for _, r := range c.rules {
		for i, name := range r.replaces {
			o := c.names[name]
			switch {
			case o == nil || !o.named:
				c.errs = append(c.errs, fmt.Errorf("%s:%d: replaces[%d].name: no rate_limit is named %q", r.file, r.replLines[i], i, name))
			case o == r:
				c.errs = append(c.errs, fmt.Errorf("%s:%d: replaces[%d].name: a rate_limit cannot replace itself (Envoy refuses it too)", r.file, r.replLines[i], i))
			}
		}
	}
}

// sanitize makes s a valid rule name: other bytes become '_', a leading one that is not
// a letter or digit gets an "r" before it, and a name too long is cut and given a hash.
func sanitize(s string) string {
	b := []byte(s)
	for i, ch := range b {
		if !(ch >= 'a' && ch <= 'z' || ch >= 'A' && ch <= 'Z' || ch >= '0' && ch <= '9' || ch == '_' || ch == '.' || ch == '-') {
			b[i] = '_'
		}
	}
	out := string(b)
	if out == "" || !(out[0] >= 'a' && out[0] <= 'z' || out[0] >= 'A' && out[0] <= 'Z' || out[0] >= '0' && out[0] <= '9') {
		out = "r" + out
	}
	if len(out) > 64 {
		sum := sha256.Sum256([]byte(s))
		out = fitName(out, "-"+hex.EncodeToString(sum[:4]))
	}
	return out
}

func fitName(base, suffix string) string {
	if len(base)+len(suffix) > 64 {
		base = base[:64-len(suffix)]
	}
	return base + suffix
}

// isWildcard reports whether an envoyproxy/ratelimit descriptor value is a wildcard: it
// holds a '*', each matching any run of bytes (envoyproxy/ratelimit since #1085); with
// c.trailing, it ends with '*' and matches the values starting with what comes before (its
// builds before trimmed that one '*' and compared prefixes, a '*' anywhere else a literal
// character).
func (c *converter) isWildcard(v string) bool {
	if c.trailing {
		return strings.HasSuffix(v, "*")
	}
	return strings.Contains(v, "*")
}

// wildcardText says what makes a value a wildcard, for errors.
func (c *converter) wildcardText() string {
	if c.trailing {
		return "ending with *"
	}
	return "holding a *"
}

func q(s string) string {
	b, _ := json.Marshal(s) // a JSON string is a YAML double-quoted scalar
	return string(b)
}

func qlist(vs []string) string {
	if len(vs) == 1 {
		return q(vs[0])
	}
	parts := make([]string, len(vs))
	for i, v := range vs {
		parts[i] = q(v)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

// describePath writes a descriptor path as the output's comments do: "key=value, key".
func describePath(path []level) string {
	desc := make([]string, len(path))
	for i, l := range path {
		desc[i] = l.key
		if l.value != "" {
			desc[i] += "=" + l.value
		}
	}
	return strings.Join(desc, ", ")
}

func (r *outRule) write(b *bytes.Buffer, alg, mode string) {
	fmt.Fprintf(b, "\n  # %s:%d: domain %s, descriptor (%s)\n", r.file, r.line, r.domain, describePath(r.path))
	for _, n := range r.notes {
		fmt.Fprintf(b, "  # %s\n", n)
	}
	fmt.Fprintf(b, "  - name: %s\n", q(r.name))
	keys := make([]string, len(r.path))
	for i, l := range r.path {
		keys[i] = l.key
	}
	b.WriteString("    match:\n")
	fmt.Fprintf(b, "      domain: %s\n", q(r.domain))
	fmt.Fprintf(b, "      descriptor: %s\n", q(strings.Join(keys, ",")))
	var key []string
	for _, l := range r.path {
		if !l.shared {
			key = append(key, l.key)
		}
		var ops []string
		switch {
		case l.value != "" && !l.glob && l.key == rules.PathAttribute:
			// A plain value of path is a path glob (it must start with '/'); a glob
			// without '*' is the value itself, whatever it is.
			fmt.Fprintf(b, "      %s: { glob: %s }\n", l.key, q(l.value))
			continue
		case l.value != "" && !l.glob:
			fmt.Fprintf(b, "      %s: %s\n", l.key, q(l.value))
			continue
		case l.glob:
			ops = append(ops, "glob: "+q(l.value))
		}
		if len(l.not) > 0 {
			ops = append(ops, "not: "+qlist(l.not))
		}
		if len(l.notGlobs) > 0 {
			ops = append(ops, "not_glob: "+qlist(l.notGlobs))
		}
		if len(ops) > 0 {
			fmt.Fprintf(b, "      %s: { %s }\n", l.key, strings.Join(ops, ", "))
		}
	}
	if len(key) == 0 {
		key = []string{DomainAttribute}
	}
	fmt.Fprintf(b, "    key: [%s]\n", strings.Join(key, ", "))
	switch {
	case r.unlimited:
		b.WriteString("    limit: unlimited\n")
	case r.requests == 0:
		b.WriteString("    limit: deny\n")
	default:
		fmt.Fprintf(b, "    algorithm: %s\n", alg)
		if mode != "" {
			fmt.Fprintf(b, "    mode: %s\n", mode)
		}
		fmt.Fprintf(b, "    limit: { requests: %d, per: %s }\n", r.requests, r.per)
	}
	if r.shadow {
		b.WriteString("    shadow: true\n")
	}
	if len(r.replaces) > 0 {
		parts := make([]string, len(r.replaces))
		for i, n := range r.replaces {
			parts[i] = q(n)
		}
		fmt.Fprintf(b, "    replaces: [%s]\n", strings.Join(parts, ", "))
	}
}
