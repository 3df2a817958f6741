package rules

// Three small additions to the rules language, made for rules converted from
// envoyproxy/ratelimit configurations (rlsidecar import-envoy) and usable by any rule.
// They are kept apart here so that the matching core stays as it was:
//
//   - match operators: a condition may be a mapping instead of a value or list,
//     { glob: [...], not: [...], not_glob: [...] }, where a glob's '*' matches any run of
//     bytes (Envoy's wildcard values; unlike path globs it crosses '/'), not lists values
//     the attribute must not have and not_glob patterns it must not match. All given
//     parts must hold, and the attribute must be present.
//   - limit: unlimited, a rule that matches and limits nothing (Envoy's unlimited), and
//     limit: deny, a rule that rejects every request it matches, no retry ever passing
//     (Envoy's requests_per_unit: 0, a block list).
//   - replaces: [rule names]: when a check matches this rule, the rules it names do not
//     apply to that check (Envoy's replaces).

import (
	"cmp"
	"fmt"
	"strings"

	"go.yaml.in/yaml/v3"
)

// wildcard is a value pattern whose '*' matches any run of bytes, possibly empty:
// "value*", "/api/*/action", "*.png". Without '*' it matches the value itself.
type wildcard struct {
	parts []string // the pattern split at '*'
}

func compileWildcard(s string) wildcard { return wildcard{parts: strings.Split(s, "*")} }

// match reports whether v matches; it does not allocate.
func (w *wildcard) match(v string) bool {
	p := w.parts
	if len(p) == 1 {
		return v == p[0]
	}
	if !strings.HasPrefix(v, p[0]) {
		return false
	}
	v = v[len(p[0]):]
	last := p[len(p)-1]
	for _, mid := range p[1 : len(p)-1] {
		i := strings.Index(v, mid)
		if i < 0 {
			return false
		}
		v = v[i+len(mid):]
	}
	return strings.HasSuffix(v, last)
}

// condOps are a condition's operators (the mapping form); nil for plain values.
type condOps struct {
	globs    []wildcard
	not      []string
	notGlobs []wildcard
	// globText and notGlobText are the patterns as written (Rule.Match).
	globText, notGlobText []string
}

// matches reports whether v satisfies every operator.
func (o *condOps) matches(v string) bool {
	if len(o.globs) > 0 {
		ok := false
		for i := range o.globs {
			if o.globs[i].match(v) {
				ok = true
				break
			}
		}
		if !ok {
			return false
		}
	}
	for _, n := range o.not {
		if v == n {
			return false
		}
	}
	for i := range o.notGlobs {
		if o.notGlobs[i].match(v) {
			return false
		}
	}
	return true
}

var opFields = []string{"glob", "not", "not_glob"}

// condOps reads the mapping form of a match condition.
func (p *parser) condOps(n *yaml.Node, field string) *condOps {
	f, _ := p.mapping(n, field, opFields)
	if f == nil {
		return nil
	}
	ops := &condOps{}
	if v := f["glob"]; !isNull(v) {
		p.eachString(v, field+".glob", func(s string, _ *yaml.Node, _ string) {
			ops.globs = append(ops.globs, compileWildcard(s))
			ops.globText = append(ops.globText, s)
		})
	}
	if v := f["not"]; !isNull(v) {
		p.eachString(v, field+".not", func(s string, _ *yaml.Node, _ string) { ops.not = append(ops.not, s) })
	}
	if v := f["not_glob"]; !isNull(v) {
		p.eachString(v, field+".not_glob", func(s string, _ *yaml.Node, _ string) {
			ops.notGlobs = append(ops.notGlobs, compileWildcard(s))
			ops.notGlobText = append(ops.notGlobText, s)
		})
	}
	if len(ops.globs)+len(ops.not)+len(ops.notGlobs) == 0 {
		p.errorf(n, field, "an operator mapping needs at least one of glob, not, not_glob")
	}
	return ops
}

// replaces reads a rule's replaces list: rule names, resolved once the whole set is known.
func (p *parser) replaces(r *Rule, n *yaml.Node, field string) {
	r.replacesIn = field
	p.eachString(n, field, func(s string, at *yaml.Node, sf string) {
		r.Replaces = append(r.Replaces, s)
		r.replacesAt = append(r.replacesAt, at.Line)
	})
}

// resolveReplaces checks that every name a rule replaces is another rule of the set, and
// records the indexes. It returns the problems found.
func resolveReplaces(all []*Rule) Errors {
	var errs Errors
	byName := make(map[string]*Rule, len(all))
	for _, r := range all {
		byName[r.Name] = r
	}
	for _, r := range all {
		r.ReplacesIdx = r.ReplacesIdx[:0]
		for i, name := range r.Replaces {
			field := fmt.Sprintf("%s[%d]", cmp.Or(r.replacesIn, "replaces"), i)
			o := byName[name]
			switch {
			case o == nil:
				errs = append(errs, &Error{File: r.File, Line: r.replacesAt[i], Field: field,
					Msg: fmt.Sprintf("rule %q replaces %q, which no rule is called", r.Name, name)})
			case o == r:
				errs = append(errs, &Error{File: r.File, Line: r.replacesAt[i], Field: field,
					Msg: fmt.Sprintf("rule %q replaces itself", r.Name)})
			default:
				r.ReplacesIdx = append(r.ReplacesIdx, o.Index)
			}
		}
	}
	return errs
}

// AnyReplaces reports whether a rule of the set replaces others, so that a checker can
// skip looking for replaced rules when none does.
func (s *Set) AnyReplaces() bool { return s.replacing }

func anyReplaces(all []*Rule) bool {
	for _, r := range all {
		if len(r.ReplacesIdx) > 0 {
			return true
		}
	}
	return false
}
