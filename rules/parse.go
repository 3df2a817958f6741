package rules

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// Error is one problem in a rules file. Its text is "file:line: field: message", as in
//
//	rules.yaml:7: rules[1].limit.per: "60x" is not a duration (use e.g. 60s, 1m, 1h, 1d)
type Error struct {
	File  string
	Line  int    // 1-based; 0 when the problem has no line (an empty file)
	Field string // e.g. "rules[1].limit.per"; "" for the file as a whole
	Msg   string
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		b.WriteByte(':')
		b.WriteString(strconv.Itoa(e.Line))
	}
	b.WriteString(": ")
	if e.Field != "" {
		b.WriteString(e.Field)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// Errors is every problem Parse found in a file, ordered by line. Parse returns it as its
// error; errors.As finds it, and each *Error in it.
type Errors []*Error

// maxShown bounds how many problems Errors.Error spells out.
const maxShown = 20

// Error returns one problem per line.
func (es Errors) Error() string {
	var b strings.Builder
	for i, e := range es {
		if i == maxShown {
			fmt.Fprintf(&b, "\n... and %d more", len(es)-maxShown)
			break
		}
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(e.Error())
	}
	return b.String()
}

// Unwrap returns the problems, for errors.Is and errors.As.
func (es Errors) Unwrap() []error {
	out := make([]error, len(es))
	for i, e := range es {
		out[i] = e
	}
	return out
}

// Load reads and parses the rules file at path, or every *.yaml file of the directory at
// path (see LoadDir). Every error names its file.
func Load(path string) (*Set, error) {
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return LoadDir(path)
	}
	data, err := readFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(path, data)
}

// Parse parses and validates a rules file; filename is used in errors and as the Set's
// Source. It reports every problem it finds (as [Errors]), not just the first, and returns
// a Set only when there are none.
func Parse(filename string, data []byte) (*Set, error) {
	p := &parser{file: filename}
	rules := p.parse(data)
	if len(p.errs) == 0 {
		p.applyPlans(rules, p.top)
		p.errs = append(p.errs, resolveReplaces(rules)...)
	}
	if len(p.errs) > 0 {
		slices.SortStableFunc(p.errs, func(a, b *Error) int { return a.Line - b.Line })
		return nil, p.errs
	}
	sum := sha256.Sum256(data)
	return newSet(rules, filename, hex.EncodeToString(sum[:])[:12]), nil
}

type parser struct {
	file string
	errs Errors
	// literal is the unseen runes (lint.go) the file holds as themselves, not as escapes.
	literal map[rune]bool
	// plans are the file's top-level plan definitions; inDir allows a file with plans
	// and no rules (one file of a directory).
	top   map[string]*topPlan
	inDir bool
}

func (p *parser) errorf(n *yaml.Node, field, format string, args ...any) {
	line := 0
	if n != nil {
		line = n.Line
	}
	p.errs = append(p.errs, &Error{File: p.file, Line: line, Field: field, Msg: fmt.Sprintf(format, args...)})
}

var yamlLine = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// yamlError reports err, the YAML library's error about data. Its reader's errors
// (a control character, bytes that are not UTF-8) name no line: for those, the first
// such byte of data is found and named, with its line and column.
// yamlQuoted matches a quoted run of two or more characters in a YAML library message.
var yamlQuoted = regexp.MustCompile(`'[^']{2,}'`)

func (p *parser) yamlError(err error, data []byte) {
	msg := err.Error()
	if strings.Contains(msg, "control characters are not allowed") || strings.Contains(msg, "UTF-8") ||
		strings.Contains(msg, "invalid Unicode character") {
		if line, why := notText(data); why != "" {
			p.errs = append(p.errs, &Error{File: p.file, Line: line, Msg: "invalid YAML: " + why + "; a rules file is text (YAML, in UTF-8): is this one?"})
			return
		}
	}
	if !bytes.Contains(data, []byte("rules:")) && !bytes.Contains(data, []byte("plans:")) {
		// Not a rules file, by the look of it: the YAML library's message may quote it
		// (an anchor's name: "unknown anchor 'S3cret' referenced"), and the file may be
		// another's secret (see parse). Quoted runs of more than one character go.
		msg = yamlQuoted.ReplaceAllString(msg, "'…'")
	}
	if m := yamlLine.FindStringSubmatch(msg); m != nil {
		line, _ := strconv.Atoi(m[1])
		why := m[2]
		if strings.Contains(why, "tab character") {
			// The library names the line before the tab's, at times: name the tab's.
			if l := tabIndented(data, line); l > 0 {
				line, why = l, "a tab in the indentation (YAML indents with spaces only)"
			}
		}
		p.errs = append(p.errs, &Error{File: p.file, Line: line, Msg: "invalid YAML: " + why})
		return
	}
	p.errs = append(p.errs, &Error{File: p.file, Msg: "invalid YAML: " + strings.TrimPrefix(msg, "yaml: ")})
}

// tabIndented returns the number of the first line of data, from line from on, whose
// indentation holds a tab; 0 when none does.
func tabIndented(data []byte, from int) int {
	for i, l := range bytes.Split(data, []byte("\n")) {
		if i+1 < from {
			continue
		}
		if indent := l[:len(l)-len(bytes.TrimLeft(l, " \t"))]; bytes.IndexByte(indent, '\t') >= 0 {
			return i + 1
		}
	}
	return 0
}

// notText finds the first character of data that YAML does not allow in UTF-8 text (a
// control character other than tab, line feed and carriage return, or bytes that are
// not UTF-8) and says where it is and what it is; "" when there is none, or when data
// starts with a UTF-16 byte-order mark (read by the YAML library as UTF-16).
func notText(data []byte) (line int, why string) {
	if bytes.HasPrefix(data, []byte{0xff, 0xfe}) || bytes.HasPrefix(data, []byte{0xfe, 0xff}) {
		return 0, ""
	}
	line, col := 1, 1
	for i := 0; i < len(data); {
		r, size := utf8.DecodeRune(data[i:])
		switch {
		case r == utf8.RuneError && size <= 1:
			return line, fmt.Sprintf("byte 0x%02x at column %d is not UTF-8", data[i], col)
		case r == '\n':
			line, col = line+1, 0
		case r == '\t' || r == '\r' || r >= 0x20 && r <= 0x7e || r == 0x85 ||
			r >= 0xa0 && r <= 0xd7ff || r >= 0xe000 && r <= 0xfffd || r >= 0x10000:
		default:
			return line, fmt.Sprintf("a control character (U+%04X) at column %d", r, col)
		}
		i += size
		col++
	}
	return 0, ""
}

// emptyFileMsg refuses a file of no bytes (IsEmptyFile).
const emptyFileMsg = "no rules: key (the file is empty)"

// IsEmptyFile reports whether err, from Load or LoadDir, refused a file because it holds
// no bytes at all: most likely one being written in place, truncated and its bytes not
// there yet, which a watcher reads again before it reports it.
func IsEmptyFile(err error) bool {
	var es Errors
	if !errors.As(err, &es) {
		return false
	}
	for _, e := range es {
		if e.Msg == emptyFileMsg {
			return true
		}
	}
	return false
}

// emptyDocument reports whether doc, a YAML document, holds nothing: a `---` with no
// content after it (not even an explicit null, `~` or `null`).
func emptyDocument(doc *yaml.Node) bool {
	if len(doc.Content) == 0 {
		return true
	}
	n := doc.Content[0]
	return len(doc.Content) == 1 && n.Kind == yaml.ScalarNode && n.Tag == "!!null" && n.Value == "" && n.Style == 0
}

func (p *parser) parse(data []byte) []*Rule {
	p.literal = literalUnseen(data)
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		switch {
		case !errors.Is(err, io.EOF):
			p.yamlError(err, data)
		case len(data) == 0:
			p.errorf(nil, "", emptyFileMsg)
		case len(bytes.TrimSpace(data)) == 0:
			p.errorf(nil, "", "no rules: key (the file holds only blank space)")
		default: // a byte-order mark alone
			p.errorf(nil, "", "no rules: key (the file holds no YAML document)")
		}
		return nil
	}
	// A second document is refused, but not an empty one: a file that ends with `---`,
	// as files joined or generated by tools often do, holds one document of rules.
	for {
		var next yaml.Node
		err := dec.Decode(&next)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			p.yamlError(err, data)
			return nil
		}
		if !emptyDocument(&next) {
			p.errorf(&next, "", "a second YAML document; put all rules in one document")
			return nil
		}
	}
	if len(doc.Content) != 1 {
		p.errorf(&doc, "", "no rules: key")
		return nil
	}
	if !p.checkAliases(&doc) {
		return nil
	}
	root := deref(doc.Content[0])
	if isNull(root) {
		p.errorf(root, "", "no rules: key")
		return nil
	}
	// A file that is not a rules file at all (a link pointed at a password file, a salt,
	// /etc/shadow) is refused without quoting a byte of it: the error goes to the log and
	// to validate's output, which other eyes read than the file's (a deployer who may
	// write the rules directory and not read the daemon's secrets). Past this point the
	// file is a mapping with rules: or plans:, and errors quote its values.
	if root.Kind != yaml.MappingNode {
		p.errorf(root, "", "not a rules file: its top level is %s, not a mapping with rules:", kindOf(root))
		return nil
	}
	if !hasKey(root, "rules") && !hasKey(root, "plans") {
		// A key a typo away from rules: is named (a misspelt rules file); any other is not.
		for i := 0; i+1 < len(root.Content); i += 2 {
			if k := deref(root.Content[i]); k.Kind == yaml.ScalarNode && (typo(k.Value, "rules") || typo(k.Value, "plans")) {
				p.errorf(k, "", "unknown field %q (valid: rules, plans)", k.Value)
			}
		}
		p.errorf(root, "", "no rules: key (not a rules file? its other keys are not shown)")
		return nil
	}
	top, _ := p.mapping(root, "", []string{"rules", "plans"})
	if top == nil {
		return nil
	}
	if v := top["plans"]; !isNull(v) {
		p.topPlans(v)
	}
	list, present := top["rules"]
	if !present {
		if p.inDir && top["plans"] != nil {
			return []*Rule{}
		}
		p.errorf(root, "", "no rules: key")
		return nil
	}
	if isNull(list) {
		return []*Rule{} // "rules:" with nothing under it: no rules, nothing limited
	}
	if list.Kind != yaml.SequenceNode {
		p.errorf(list, "rules", "expected a list of rules, got %s", describe(list))
		return nil
	}
	rules := make([]*Rule, 0, len(list.Content))
	names := make(map[string]int) // rule name → line of first use
	for i, item := range list.Content {
		r := p.rule(i, deref(item))
		if r == nil {
			continue
		}
		if first, dup := names[r.Name]; dup {
			p.errorf(item, fmt.Sprintf("rules[%d].name", i), "duplicate rule name %q (first at line %d)", r.Name, first)
			continue
		}
		names[r.Name] = r.Line
		r.Index = len(rules)
		rules = append(rules, r)
	}
	return rules
}

var (
	ruleFields  = []string{"name", "match", "key", "algorithm", "limit", "plans", "shadow", "mode", "on_store_failure", "split", "replaces", "concurrency", "warn_at", "delay", "penalty", "ip_prefix"}
	limitFields = []string{"requests", "per", "burst", "tz"}
)

// rule validates one rule; it returns nil when the rule has any problem (all reported).
func (p *parser) rule(idx int, n *yaml.Node) *Rule {
	field := fmt.Sprintf("rules[%d]", idx)
	before := len(p.errs)
	f, _ := p.mapping(n, field, ruleFields)
	if f == nil {
		return nil
	}
	r := &Rule{File: p.file, Line: n.Line, literal: p.literal}

	if v := f["name"]; isNull(v) {
		p.errorf(n, field+".name", "missing (required)")
	} else if s, ok := p.str(v, field+".name"); ok {
		if msg := checkName(s); msg != "" {
			p.errorf(v, field+".name", "%s", msg)
		}
		r.Name = s
	}

	if v, ok := f["match"]; ok && !isNull(v) {
		r.conds, r.Match = p.match(v, field+".match")
		r.emptyMatch = len(r.conds) == 0 && v.Kind == yaml.MappingNode && len(v.Content) == 0
	} else if ok {
		r.emptyMatch = true // match: with nothing after it (its conditions commented out?)
	}

	if v := f["key"]; isNull(v) {
		p.errorf(n, field+".key", "missing (required): an attribute name, or a list of them")
	} else {
		r.Key = p.key(v, field+".key")
	}

	algOK := true
	if v := f["algorithm"]; !isNull(v) {
		algOK = false
		if s, ok := p.str(v, field+".algorithm"); ok {
			if a, err := localbucket.ParseAlgorithm(s); err != nil {
				p.errorf(v, field+".algorithm", "unknown algorithm %q (valid: token_bucket, sliding_window, fixed_window)", s)
			} else {
				r.Algorithm, algOK = a, true
			}
		}
	}

	limitOK := false
	limitNode := f["limit"]
	if cn := f["concurrency"]; !isNull(cn) {
		// A concurrency rule: its limit is max slots held for lease each (concurrency.go).
		if !isNull(limitNode) {
			p.errorf(limitNode, field+".limit", "a rule has limit or concurrency, not both")
		}
		if v := f["algorithm"]; !isNull(v) {
			p.errorf(v, field+".algorithm", "a concurrency rule counts leases in flight; it has no algorithm")
			algOK = false
		}
		limitNode = cn
		limitOK = p.concurrency(r, cn, field+".concurrency")
	} else if isNull(limitNode) {
		p.errorf(n, field+".limit", "missing (required): e.g. { requests: 10, per: 1m }")
		limitNode = nil
	} else if limitNode.Kind == yaml.ScalarNode && limitNode.ShortTag() == "!!str" && limitNode.Value == "unlimited" {
		r.Unlimited = true
		limitNode = nil
	} else if limitNode.Kind == yaml.ScalarNode && limitNode.ShortTag() == "!!str" && limitNode.Value == "deny" {
		r.Deny = true // rejects every request it matches (extensions.go)
		limitNode = nil
	} else {
		var burstNode *yaml.Node
		limitOK, burstNode = p.limit(r, limitNode, field+".limit")
		if r.Calendar != localbucket.NoCalendar {
			if !isNull(f["algorithm"]) && r.Algorithm != localbucket.FixedWindow {
				p.errorf(f["algorithm"], field+".algorithm", "per: %s is a calendar window, counted by fixed_window (algorithm is %s; leave it out)", r.Calendar, r.Algorithm)
				limitOK = false
			}
			r.Algorithm = localbucket.FixedWindow
			if r.TZ == nil {
				r.TZ = time.UTC
			}
		}
		if burstNode != nil && algOK && r.Algorithm != localbucket.TokenBucket {
			p.errorf(burstNode, field+".limit.burst", "only token_bucket has a burst (algorithm is %s)", r.Algorithm)
			limitOK = false
		}
	}
	if limitOK && algOK {
		var lim localbucket.Limit
		var err error
		limField := field + ".limit"
		switch {
		case r.Concurrency:
			// max slots, each held for a lease: the lease store reads its requests and
			// window, never a rate, so it is built as a window. As a token bucket, a max
			// above about 143,000,000 a second of lease (4,294,967,295 for the default
			// 30s) was refused as a rate "too high to keep", named rules[i].limit.
			limField = field + ".concurrency.max"
			lim, err = localbucket.NewLimit(localbucket.FixedWindow, r.Requests, r.Per, 0)
		case r.Calendar != localbucket.NoCalendar:
			lim, err = localbucket.NewCalendarLimit(r.Requests, r.Calendar, r.TZ)
		default:
			lim, err = localbucket.NewLimit(r.Algorithm, r.Requests, r.Per, r.Burst)
		}
		if err != nil {
			p.errorf(limitNode, limField, "%v", err)
			limitOK = false
		}
		r.limit = lim
	}

	if v := f["plans"]; !isNull(v) {
		if r.Unlimited || r.Deny {
			p.errorf(v, field+".plans", "a rule whose limit is unlimited or deny has no plans")
		} else {
			r.plans = p.plans(r, v, field+".plans", limitOK && algOK)
		}
	}
	if v := f["replaces"]; !isNull(v) {
		p.replaces(r, v, field+".replaces")
	}

	if v := f["shadow"]; !isNull(v) {
		if v.Kind != yaml.ScalarNode || v.ShortTag() != "!!bool" || v.Decode(&r.Shadow) != nil {
			p.errorf(v, field+".shadow", "expected true or false, got %s", describe(v))
		}
	}
	if v := f["mode"]; !isNull(v) {
		if s, ok := p.str(v, field+".mode"); ok {
			m, err := ParseMode(s)
			if err != nil {
				p.errorf(v, field+".mode", "%v", err)
			}
			r.Mode = m
		}
	}
	if v := f["on_store_failure"]; !isNull(v) {
		if s, ok := p.str(v, field+".on_store_failure"); ok {
			fp, err := ParseFailurePolicy(s)
			if err != nil {
				p.errorf(v, field+".on_store_failure", "%v", err)
			}
			r.OnStoreFailure = fp
		}
	}

	if v := f["split"]; !isNull(v) {
		if v.Kind == yaml.ScalarNode && v.ShortTag() == "!!str" && v.Value == "auto" {
			r.SplitAuto = true
		} else if n, ok := p.count(v, field+".split", ` (a number of daemons, or auto)`); ok {
			if n > 1<<16 {
				p.errorf(v, field+".split", "%d daemons is too many (at most 65536)", n)
			}
			r.Split = uint32(min(n, 1<<16))
		}
		if r.Unlimited || r.Deny {
			p.errorf(v, field+".split", "a rule whose limit is unlimited or deny cannot be split")
		}
		switch r.Mode {
		case ModeDefault:
			r.Mode = ModeLocal // a split limit is a local one
		case ModeLocal:
		default:
			p.errorf(v, field+".split", "split divides a local limit among daemons; mode %s shares one budget already (use mode local, or drop split)", r.Mode)
		}
	}

	p.policies(r, f, field)

	if v := f["ip_prefix"]; !isNull(v) {
		r.IPPrefix = p.ipPrefix(v, field+".ip_prefix", r.Key)
	}

	if len(p.errs) > before {
		return nil
	}
	r.setKeyLits()
	return r
}

// limit reads requests, per and burst into r; ok when all three are valid. burst is the
// burst's node when one was written.
func (p *parser) limit(r *Rule, n *yaml.Node, field string) (ok bool, burst *yaml.Node) {
	f, ok := p.mapping(n, field, limitFields)
	if f == nil {
		return false, nil
	}
	if v := f["requests"]; isNull(v) {
		p.errorf(n, field+".requests", "missing (required): how many requests per window")
		ok = false
	} else {
		var rok bool
		r.Requests, rok = p.count(v, field+".requests", "")
		ok = ok && rok
	}
	if v := f["per"]; isNull(v) {
		p.errorf(n, field+".per", "missing (required): the window, e.g. 1s, 1m, 1h, 1d")
		ok = false
	} else if s, sok := p.str(v, field+".per"); !sok {
		ok = false
	} else if c, isCal := localbucket.ParseCalendar(s); isCal {
		r.Calendar = c
		r.Per = c.Nominal()
	} else if d, msg := parsePer(s); msg != "" {
		p.errorf(v, field+".per", "%s", msg)
		ok = false
	} else {
		r.Per = d
	}
	if v := f["tz"]; !isNull(v) {
		if s, sok := p.str(v, field+".tz"); !sok {
			ok = false
		} else if r.Calendar == localbucket.NoCalendar {
			p.errorf(v, field+".tz", "a time zone applies to per: day, week or month (per is a duration here)")
			ok = false
		} else if loc, msg := loadZone(s); msg != "" {
			p.errorf(v, field+".tz", "%s", msg)
			ok = false
		} else {
			r.TZ = loc
		}
	}
	if v := f["burst"]; !isNull(v) {
		b, bok := p.count(v, field+".burst", " (leave burst out for burst = requests)")
		r.Burst = b
		ok = ok && bok
		burst = v
	}
	return ok, burst
}

// plans reads the plan table. build says whether the rule's limit is valid, so that plan
// limits can be derived from it.
func (p *parser) plans(r *Rule, n *yaml.Node, field string, build bool) map[string]*planLimit {
	pairs, ok := p.pairs(n, field)
	if !ok {
		return nil
	}
	out := make(map[string]*planLimit, len(pairs))
	for _, kv := range pairs {
		pf := field + "." + kv.key
		if kv.key == "" {
			p.errorf(kv.keyNode, field, "a plan name must not be empty")
			continue
		}
		if kv.key == "*" {
			p.errorf(kv.keyNode, field, starPlan)
			continue
		}
		v := kv.val
		if v.Kind == yaml.ScalarNode && v.ShortTag() == "!!str" {
			if v.Value != "unlimited" {
				p.errorf(v, pf, "expected a number of requests or unlimited, got %s", describe(v))
				continue
			}
			out[kv.key] = &planLimit{unlimited: true}
			continue
		}
		reqs, ok := p.count(v, pf, " (or unlimited)")
		if !ok || !build {
			continue
		}
		burst, ok := scaleBurst(r.Burst, reqs, r.Requests)
		if !ok {
			p.errorf(v, pf, "burst %d scaled to %d requests is too large", r.Burst, reqs)
			continue
		}
		lim, err := r.limit.WithRequests(reqs, burst) // the rule's window and calendar
		if err != nil {
			p.errorf(v, pf, "%v", err)
			continue
		}
		out[kv.key] = &planLimit{limit: lim}
	}
	return out
}

// scaleBurst keeps a written burst's ratio to requests for a plan's requests: ⌈burst ×
// planReqs / reqs⌉, at least 1. A burst of 0 (not written) stays 0, meaning = requests.
func scaleBurst(burst, planReqs, reqs uint64) (uint64, bool) {
	if burst == 0 {
		return 0, true
	}
	hi, lo := bits.Mul64(burst, planReqs)
	if hi >= reqs {
		return 0, false
	}
	q, rem := bits.Div64(hi, lo, reqs)
	if rem != 0 {
		if q == ^uint64(0) {
			return 0, false
		}
		q++
	}
	return max(q, 1), true
}

// match compiles the match conditions: exact ones first (cheaper), then path. written
// is the conditions as the file wrote them, in its order.
func (p *parser) match(n *yaml.Node, field string) (conds []cond, written []MatchCond) {
	pairs, ok := p.pairs(n, field)
	if !ok {
		return nil, nil
	}
	var exact, path []cond
	for _, kv := range pairs {
		cf := field + "." + kv.key
		if msg := checkAttr(kv.key); msg != "" {
			p.errorf(kv.keyNode, field, "%s", msg)
			continue
		}
		c := newCond(kv.key)
		if kv.val.Kind == yaml.MappingNode {
			c.ops = p.condOps(kv.val, cf)
			c.compile()
			exact = append(exact, c)
			if c.ops != nil {
				written = append(written, MatchCond{Attr: kv.key, Glob: c.ops.globText, Not: c.ops.not, NotGlob: c.ops.notGlobText})
			}
			continue
		}
		w := MatchCond{Attr: kv.key}
		p.eachString(kv.val, cf, func(s string, at *yaml.Node, sf string) {
			w.Values = append(w.Values, s)
			if kv.key != PathAttribute {
				c.values = append(c.values, s)
				c.words = append(c.words, newWord16(s))
				return
			}
			g, err := compileGlob(s)
			if err != nil {
				p.errorf(at, sf, "%q: %v", s, err)
				return
			}
			c.globs = append(c.globs, g)
		})
		c.compile()
		written = append(written, w)
		if kv.key == PathAttribute {
			path = append(path, c)
		} else {
			exact = append(exact, c)
		}
	}
	// Test the cheapest conditions first (their order does not change what matches): a
	// path listing only literal paths is a length and a string compare, exact values a
	// lookup and compares, globs a walk.
	if len(path) == 1 && allLiteral(path[0].globs) {
		return append(path, exact...), written
	}
	return append(exact, path...), written
}

// allLiteral reports whether every glob is a literal path.
func allLiteral(globs []glob) bool {
	for i := range globs {
		if !globs[i].literal {
			return false
		}
	}
	return true
}

// key reads the rule's key: one attribute name or a non-empty list of distinct ones.
func (p *parser) key(n *yaml.Node, field string) []string {
	var out []string
	p.eachString(n, field, func(s string, at *yaml.Node, sf string) {
		if msg := checkAttr(s); msg != "" {
			p.errorf(at, sf, "%s", msg)
			return
		}
		if slices.Contains(out, s) {
			p.errorf(at, sf, "attribute %q listed twice", s)
			return
		}
		out = append(out, s)
	})
	return out
}

// eachString reads a string or a non-empty list of strings, calling each for every one with
// its node and field.
func (p *parser) eachString(n *yaml.Node, field string, each func(s string, at *yaml.Node, field string)) {
	if n.Kind != yaml.SequenceNode {
		if s, ok := p.str(n, field); ok {
			each(s, n, field)
		}
		return
	}
	if len(n.Content) == 0 {
		p.errorf(n, field, "empty list; give at least one value")
		return
	}
	for i, item := range n.Content {
		item = deref(item)
		sf := fmt.Sprintf("%s[%d]", field, i)
		if s, ok := p.str(item, sf); ok {
			each(s, item, sf)
		}
	}
}

type pair struct {
	key          string
	keyNode, val *yaml.Node
}

// pairs checks that n is a mapping with scalar keys, none given twice, and returns its
// entries in order, with aliases resolved.
func (p *parser) pairs(n *yaml.Node, field string) ([]pair, bool) {
	if n.Kind != yaml.MappingNode {
		p.errorf(n, field, "expected a mapping, got %s", describe(n))
		return nil, false
	}
	out := make([]pair, 0, len(n.Content)/2)
	seen := make(map[string]int, len(n.Content)/2) // key → index in out
	ok := true
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := deref(n.Content[i]), deref(n.Content[i+1])
		if k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge" {
			p.errorf(k, field, "merge keys (<<) are not supported; write the fields out")
			ok = false
			continue
		}
		if k.Kind != yaml.ScalarNode || k.ShortTag() == "!!null" {
			p.errorf(k, field, "keys must be plain names, got %s", describe(k))
			ok = false
			continue
		}
		if j, dup := seen[k.Value]; dup {
			p.errorf(k, field, "%q given twice (first at line %d)", k.Value, out[j].keyNode.Line)
			ok = false
			continue
		}
		seen[k.Value] = len(out)
		out = append(out, pair{key: k.Value, keyNode: k, val: v})
	}
	return out, ok
}

// mapping is pairs for a mapping whose keys must be among valid; it returns the values of
// the valid keys (nil when n is not a mapping), and ok when there was no problem.
func (p *parser) mapping(n *yaml.Node, field string, valid []string) (map[string]*yaml.Node, bool) {
	pairs, ok := p.pairs(n, field)
	if pairs == nil && !ok {
		return nil, false
	}
	out := make(map[string]*yaml.Node, len(pairs))
	for _, kv := range pairs {
		if !slices.Contains(valid, kv.key) {
			p.errorf(kv.keyNode, field, "unknown field %q (valid: %s)", kv.key, strings.Join(valid, ", "))
			ok = false
			continue
		}
		out[kv.key] = kv.val
	}
	return out, ok
}

// str reads a scalar as the text written; numbers are accepted as text (match: {user: 42}).
func (p *parser) str(n *yaml.Node, field string) (string, bool) {
	if n.Kind == yaml.ScalarNode {
		switch n.ShortTag() {
		case "!!str", "!!int", "!!float":
			return n.Value, true
		}
	}
	p.errorf(n, field, "expected a string, got %s", describe(n))
	return "", false
}

// count reads a whole number >= 1; hint is appended to the "at least 1" message.
func (p *parser) count(n *yaml.Node, field, hint string) (uint64, bool) {
	if n.Kind == yaml.ScalarNode && (n.ShortTag() == "!!int" || n.ShortTag() == "!!float") && leadingZero.MatchString(n.Value) {
		p.leadingZero(n, field, hint)
		return 0, false
	}
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!float" && digits.MatchString(n.Value) {
		p.errorf(n, field, "%s is too large", n.Value) // YAML makes integers past 2^64 floats
		return 0, false
	}
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" {
		p.errorf(n, field, "expected a whole number, got %s", describe(n))
		return 0, false
	}
	if strings.HasPrefix(n.Value, "-") {
		p.errorf(n, field, "must be at least 1, got %s%s", n.Value, hint)
		return 0, false
	}
	var v uint64
	if err := n.Decode(&v); err != nil {
		p.errorf(n, field, "%s is too large", n.Value)
		return 0, false
	}
	if v == 0 {
		p.errorf(n, field, "must be at least 1, got 0%s", hint)
		return 0, false
	}
	return v, true
}

// leadingZero refuses a count written with a leading zero. YAML reads a plain 010 as
// octal: 8, not the 10 written; taken as it came, a limit of "010" per hour admitted 8.
// One with a digit past 7 (0900, 08) is no octal: YAML reads it as a float, which was
// refused as "too large"; and 00 is 0, below any count.
func (p *parser) leadingZero(n *yaml.Node, field, hint string) {
	meant := strings.TrimLeft(strings.ReplaceAll(strings.TrimPrefix(n.Value, "+"), "_", ""), "0")
	var octal uint64
	switch {
	case meant == "":
		p.errorf(n, field, "must be at least 1, got %s%s", n.Value, hint)
	case n.ShortTag() == "!!int" && n.Decode(&octal) == nil:
		p.errorf(n, field, "%s has a leading zero, which YAML reads as octal (%d): write %s, or 0o%s for %d", n.Value, octal, meant, meant, octal)
	default:
		p.errorf(n, field, "%s has a leading zero: write %s", n.Value, meant)
	}
}

// parsePer parses a window: a Go duration ("1m30s"), optionally preceded by whole days
// ("1d", "2d12h"). msg is empty on success.
func parsePer(s string) (d time.Duration, msg string) {
	bad := fmt.Sprintf("%q is not a duration (use e.g. 60s, 1m, 1h, 1d)", s)
	rest := s
	if i := strings.IndexByte(s, 'd'); i >= 0 {
		days, err := strconv.ParseUint(s[:i], 10, 64)
		if err != nil {
			return 0, bad
		}
		const maxDays = uint64(1<<63-1) / uint64(24*time.Hour)
		if days > maxDays {
			return 0, fmt.Sprintf("%q is too long", s)
		}
		d = time.Duration(days) * 24 * time.Hour
		rest = s[i+1:]
		if rest == "" {
			return checkPer(s, d)
		}
		if rest[0] == '-' || rest[0] == '+' {
			return 0, bad
		}
	}
	r, err := time.ParseDuration(rest)
	if err != nil {
		return 0, bad
	}
	if d > 0 && r > time.Duration(1<<63-1)-d {
		return 0, fmt.Sprintf("%q is too long", s)
	}
	return checkPer(s, d+r)
}

// FormatPer writes a duration as a rules file does: whole days as "Nd", then hours,
// minutes and seconds without the zero ones ("1m", not "1m0s"; "1d12h", not "36h0m0s";
// "1m40s"); a part of a second as Go writes it. parsePer reads it back to d.
func FormatPer(d time.Duration) string {
	if d <= 0 || d%time.Second != 0 {
		return d.String()
	}
	var b []byte
	for _, u := range [...]struct {
		unit time.Duration
		name byte
	}{{24 * time.Hour, 'd'}, {time.Hour, 'h'}, {time.Minute, 'm'}, {time.Second, 's'}} {
		if n := d / u.unit; n > 0 {
			b = strconv.AppendInt(b, int64(n), 10)
			b = append(b, u.name)
			d -= n * u.unit
		}
	}
	return string(b)
}

func checkPer(s string, d time.Duration) (time.Duration, string) {
	if d < time.Millisecond {
		return 0, fmt.Sprintf("%q is too short: at least 1ms", s)
	}
	return d, ""
}

var digits = regexp.MustCompile(`^[0-9_]+$`)

// leadingZero matches a plain integer written with a leading zero (010, +07), which YAML
// reads as octal.
var leadingZero = regexp.MustCompile(`^\+?0[0-9_]+$`)

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

const maxNameLen = 64

func checkName(s string) string {
	if len(s) > maxNameLen {
		return fmt.Sprintf("%q is too long (%d bytes; at most %d)", s, len(s), maxNameLen)
	}
	if !nameRE.MatchString(s) {
		return fmt.Sprintf("%q is not a valid rule name (a letter or digit, then letters, digits, _ . -)", s)
	}
	return ""
}

var attrRE = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)

// checkAttr restricts attribute names to bytes that AppendEscaped keeps, so that client
// keys can write them unescaped.
func checkAttr(s string) string {
	if len(s) > maxNameLen {
		return fmt.Sprintf("attribute name %q is too long (%d bytes; at most %d)", s, len(s), maxNameLen)
	}
	if !attrRE.MatchString(s) {
		return fmt.Sprintf("%q is not a valid attribute name (letters, digits, _ . -)", s)
	}
	return ""
}

// maxAliasNodes and maxAliasBytes bound what aliases add to a file: how many more nodes,
// and bytes of scalar text, it would hold with every alias written out in full. The
// parser follows aliases itself (deref), so the YAML library's guard against excessive
// aliasing, which applies only when it decodes into Go values, does not protect it, and
// the work aliases cause grows with the square of the file: 3,000 rules each saying
// plans: *p, for a map of 3,000 plans anchored once, made a 274 KB file cost 17 s and
// 1.8 GB; a 1 MB attribute name aliased 3,000 times in a key list, 41 s and 4.5 GB (an
// error quotes the name each time). A file without aliases adds nothing; a plans map of
// 20 entries shared by 1,000 rules adds about 41,000 nodes and 200 KB.
const (
	maxAliasNodes = 1_000_000
	maxAliasBytes = 16 << 20
)

// expansion is what a node stands for once its aliases are written out.
type expansion struct{ nodes, bytes int }

// checkAliases refuses a document whose aliases expand past maxAliasNodes or
// maxAliasBytes, and one with an alias inside the node it names (&a [*a], which no rules
// file needs), before the parser follows any of them. It walks each node once: the
// expansion of a node an alias names is remembered.
func (p *parser) checkAliases(doc *yaml.Node) bool {
	walking := expansion{-1, -1} // in sizes while the node's children are walked
	failed := expansion{-2, -2}  // returned once the file is refused
	sizes := map[*yaml.Node]expansion{}
	var added expansion
	var size func(n *yaml.Node) expansion
	size = func(n *yaml.Node) expansion {
		if n.Kind == yaml.AliasNode && n.Alias != nil {
			e, seen := sizes[n.Alias]
			if !seen {
				e = size(n.Alias) // not reached in a parsed file: an anchor comes first
			}
			switch {
			case e == failed:
				return failed
			case e == walking:
				p.errorf(n, "", "alias *%s is inside the value it names; write that value out", n.Value)
				return failed
			}
			added.nodes += e.nodes
			added.bytes += e.bytes
			switch {
			case added.nodes > maxAliasNodes:
				p.errorf(n, "", "aliases expand this file by more than %d nodes (*%s here repeats %d); write fewer aliases, or define shared plans once in the top-level plans:, which apply to every rule", maxAliasNodes, n.Value, e.nodes)
				return failed
			case added.bytes > maxAliasBytes:
				p.errorf(n, "", "aliases expand this file by more than %d bytes of text (*%s here repeats %d); write fewer aliases", maxAliasBytes, n.Value, e.bytes)
				return failed
			}
			return e
		}
		if n.Anchor != "" {
			sizes[n] = walking
		}
		total := expansion{1, len(n.Value)}
		for _, c := range n.Content {
			e := size(c)
			if e == failed {
				return failed
			}
			total.nodes += e.nodes
			total.bytes += e.bytes
		}
		if n.Anchor != "" {
			sizes[n] = total
		}
		return total
	}
	return size(doc) != failed
}

// deref follows aliases (*anchor) to the node they name.
func deref(n *yaml.Node) *yaml.Node {
	for i := 0; n != nil && n.Kind == yaml.AliasNode && n.Alias != nil && i < 100; i++ {
		n = n.Alias
	}
	return n
}

// isNull reports whether a value is absent or null ("key:" with nothing after it).
func isNull(n *yaml.Node) bool {
	return n == nil || (n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null")
}

// describe names a node's type for errors: `a string "abc"`, `a list`.
// typo reports whether s is within two edits (insertions, deletions, substitutions,
// or one swap of neighbours) of word, case aside: "ruels", "Rules", "rule".
func typo(s, word string) bool {
	s = strings.ToLower(s)
	if len(s) > len(word)+2 || len(s)+2 < len(word) {
		return false
	}
	// Optimal string alignment distance, rows of len(word)+1.
	prev2, prev, cur := make([]int, len(word)+1), make([]int, len(word)+1), make([]int, len(word)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(s); i++ {
		cur[0] = i
		for j := 1; j <= len(word); j++ {
			c := 1
			if s[i-1] == word[j-1] {
				c = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+c)
			if i > 1 && j > 1 && s[i-1] == word[j-2] && s[i-2] == word[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(word)] <= 2
}

// kindOf is describe without the value: what kind of node n is.
func kindOf(n *yaml.Node) string {
	if n.Kind == yaml.ScalarNode {
		switch n.ShortTag() {
		case "!!str":
			return "a string"
		case "!!int":
			return "an integer"
		case "!!float":
			return "a number"
		case "!!bool":
			return "a boolean"
		}
		return "a tagged value" // the tag is the file's text
	}
	return describe(n)
}

// hasKey reports whether the mapping n has the plain key k.
func hasKey(n *yaml.Node, k string) bool {
	for i := 0; i+1 < len(n.Content); i += 2 {
		if c := deref(n.Content[i]); c.Kind == yaml.ScalarNode && c.Value == k {
			return true
		}
	}
	return false
}

func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.AliasNode:
		return "an alias"
	case yaml.ScalarNode:
		v := n.Value
		if len(v) > 40 {
			v = v[:40] + "..."
		}
		switch n.ShortTag() {
		case "!!str":
			return "a string " + quote(v)
		case "!!int":
			return "an integer " + v
		case "!!float":
			return "a number " + v
		case "!!bool":
			return "a boolean " + v
		case "!!null":
			return "null"
		default:
			return "a " + n.ShortTag() + " value " + quote(v)
		}
	}
	return "nothing"
}

func quote(s string) string { return strconv.Quote(s) }
