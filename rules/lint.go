package rules

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"github.com/rlsidecar/rlsidecar/internal/plural"
)

// Warnings returns the rules of s that can never have an effect, as errors that do not
// stop the Set from loading (`rlsidecar validate` prints them; a Set with warnings serves
// normally). Each names the file and line of the rule. Two kinds:
//
// A rule that never decides (shadowed). Rule B is shadowed by an earlier rule A when
//
//   - their matches are identical: the same attributes, each with the same set of values
//     or path globs (order and repeats aside);
//   - their keys name the same set of attributes;
//   - they have the same algorithm, the same per, the same mode, split and
//     on_store_failure;
//   - neither is shadow (a shadow B is there to be observed, not to reject);
//   - every rule that replaces A replaces B too (where A alone is replaced, B decides),
//     and A replaces every rule B replaces (B exempts the requests it applies to from
//     those, an effect of its own);
//   - and A's limit is at least as tight as B's for every plan: for the default limit and
//     each plan either rule lists, A's requests ≤ B's and A's burst ≤ B's, or B's plan is
//     unlimited (an unlimited plan on A against a limited one on B is not tighter).
//
// Then every request B applies to, A applies to with the same client; both buckets see
// exactly the same admitted requests (a check is all-or-nothing), and A's, refilling no
// faster and holding no more, is never fuller than B's. So B rejects only requests that A
// rejects already: it never changes a decision (exactly so in local and global modes; in
// hybrid mode up to the sync's approximation). Remove B, or loosen A.
//
// A path glob that no request path can match. Every glob matches some string, so this
// looks at what gateways send: a request path, before the query, with each %XX decoded
// once (clients/testdata/paths.json), so that a space or a control character can be in
// it (/my%20files/a arrives as /my files/a) and is not warned of. A glob warns when it
// holds
//
//   - '?' or '#': they start the query and the fragment, which are not part of the path
//     (and a glob has no '?' wildcard); a path holds them only where it sent %3F or %23,
//     and a glob holding them is far more often a query or a fragment written by mistake;
//   - "//", or a segment "." or "..": the path arrives with runs of '/' merged and dot
//     segments resolved;
//   - route-template or regular-expression syntax that a glob takes literally: a segment
//     "{name}" or ":name", a character class "[...]", ".*", a backslash, a segment
//     starting with '^', a pattern ending in '$'.
//
// A method list with GET and without HEAD: net/http, Express, Starlette and Flask answer
// a HEAD with the GET handler (its work done, its body dropped), so HEAD requests run the
// limited handler unlimited. (A path without its trailing-slash form, "/login" beside
// "/login/", is not warned of: net/http, Flask and Starlette answer "/login/" with a 404
// or a redirect to "/login", which is checked; only some servers (Express) run the same
// handler for both. The README says to list both where they do.)
//
// A match with no condition (`match:` followed by nothing, or `match: {}`): it applies the
// rule to every request, as leaving match out does, which is seldom what a file that
// writes match meant: its conditions were commented out, or indented wrongly.
//
// Rules that replace each other in a cycle ("a" replaces "b" and "b" replaces "a", or
// a longer loop; a shadow rule replaces nothing, so it breaks a cycle): a request that
// matches every rule of the cycle is charged to none of them, each being replaced by
// another it matched. One warning per group of rules in cycles with each other (a
// strongly connected component of the replaces graph), at its first rule, naming a
// cycle and the group's other rules.
//
// A --config DIR's rules file that is a symlink to a missing file: skipped by LoadDir, as
// a deleted file is, and said first.
//
// Warnings come in rule-file order (file, then line).
func (s *Set) Warnings() Errors {
	out := slices.Clone(s.skipped) // a directory's dangling links, skipped
	cycles := replacesCycles(s.Rules)
	if len(s.Rules) == 0 {
		// Valid (a file may list none on purpose), but a template that emptied the
		// list turns every limit off: said, not refused.
		out = append(out, &Error{File: s.Source, Field: "rules", Msg: "no rules: every request is allowed, none limited"})
	}
	// replacers maps each rule to the rules (not shadow) that replace it: A, replaced
	// where B is not, leaves B deciding alone on those requests.
	replacers := map[*Rule][]*Rule{}
	for _, r := range s.Rules {
		if !r.Shadow {
			for _, i := range r.ReplacesIdx {
				if i >= 0 && i < len(s.Rules) {
					replacers[s.Rules[i]] = append(replacers[s.Rules[i]], r)
				}
			}
		}
	}
	replacedAlike := func(a, b *Rule) bool {
		for _, r := range replacers[a] {
			if !slices.Contains(r.ReplacesIdx, b.Index) {
				return false
			}
		}
		// What b replaces, a must replace too: where b applies, the rules it replaces
		// are not charged, so b has that effect even when it never rejects, and removing
		// it would put them back in force.
		for _, i := range b.ReplacesIdx {
			if !slices.Contains(a.ReplacesIdx, i) {
				return false
			}
		}
		return true
	}
	type earlier struct{ rules []*Rule }
	bySig := map[string]*earlier{}
	spent, stopped := 0, false // plan limits compared (see shadowBudget)
	for _, r := range s.Rules {
		if e := cycles[r]; e != nil {
			out = append(out, e)
		}
		if r.emptyMatch {
			out = append(out, &Error{File: r.File, Line: r.Line, Field: "rule " + strconv.Quote(r.Name) + " match",
				Msg: "empty: the rule applies to every request (are its conditions commented out?); leave match out to say so"})
		}
		for ci := range r.conds {
			for gi := range r.conds[ci].globs {
				if why := deadGlob(r.conds[ci].globs[gi].pattern); why != "" {
					out = append(out, &Error{File: r.File, Line: r.Line, Field: "rule " + strconv.Quote(r.Name) + " match.path",
						Msg: fmt.Sprintf("%q matches no request path: %s", r.conds[ci].globs[gi].pattern, why)})
				}
			}
		}
		out = append(out, holes(r)...)
		names := attrNames(r)
		if slices.Contains(names, "domain") {
			// Checked over Envoy's API: the names are its descriptors' keys, sent in the
			// case its configuration writes them.
			names = nil
		}
		for _, name := range names {
			if lower := strings.ToLower(name); lower != name && wellKnownAttrs[lower] {
				out = append(out, &Error{File: r.File, Line: r.Line, Field: "rule " + strconv.Quote(r.Name),
					Msg: fmt.Sprintf("attribute %q: names are case-sensitive and the clients send %q, so a rule naming %q never applies", name, lower, name)})
			}
		}
		if r.Split > 1 && !r.Unlimited && !r.Deny && uint64(r.Split) > r.limit.Requests() {
			// Each daemon enforces ⌈requests ÷ split⌉, at least 1: below split, the
			// fleet admits split per window, not requests.
			out = append(out, &Error{File: r.File, Line: r.Line, Field: "rule " + strconv.Quote(r.Name) + " split",
				Msg: fmt.Sprintf("split %d is more than its %s: each daemon enforces at least 1, so %d daemons admit %d per window", r.Split, plural.Count(r.limit.Requests(), "request"), r.Split, r.Split)})
		}
		sig := shadowSignature(r)
		e := bySig[sig]
		if e == nil {
			e = &earlier{}
			bySig[sig] = e
		}
		if !r.Shadow && !stopped {
			for _, a := range e.rules {
				if spent += 1 + len(a.plans) + len(r.plans); spent > shadowBudget {
					stopped = true
					out = append(out, &Error{File: s.Source, Field: "rules",
						Msg: fmt.Sprintf("stopped looking for rules that never decide after comparing %d plan limits, at rule %q: many rules with the same match and key, each with many plans", shadowBudget, r.Name)})
					break
				}
				if atLeastAsTight(a, r) && replacedAlike(a, r) {
					where := "line " + strconv.Itoa(a.Line)
					if a.File != r.File {
						where = a.File + ":" + strconv.Itoa(a.Line)
					}
					out = append(out, &Error{File: r.File, Line: r.Line, Field: "rule " + strconv.Quote(r.Name),
						Msg: fmt.Sprintf("never decides: rule %q (%s) matches the same requests with the same key and a limit at least as tight", a.Name, where)})
					break
				}
			}
			e.rules = append(e.rules, r)
		}
	}
	return out
}

// replacesCycles finds the groups of rules that replace each other in a cycle (the
// strongly connected components of more than one rule of the graph whose edges are the
// replaces of the rules that are not shadow), and returns a warning for each, by its
// first rule in all (rule-file order).
func replacesCycles(all []*Rule) map[*Rule]*Error {
	const maxNamed = 8 // rule names a warning lists, of a cycle and of the others
	edges := func(r *Rule) []int {
		if r.Shadow {
			return nil // a shadow rule replaces nothing (limiter: findReplaced)
		}
		return r.ReplacesIdx
	}
	if !slices.ContainsFunc(all, func(r *Rule) bool { return len(edges(r)) > 0 }) {
		return nil
	}
	// Tarjan's algorithm, iterative: a chain of 50,000 rules each replacing the next
	// recurses no deeper than a loop.
	n := len(all)
	index, low := make([]int, n), make([]int, n)
	onStack := make([]bool, n)
	for i := range index {
		index[i] = -1
	}
	var comps [][]int
	next := 0
	type frame struct{ v, e int }
	var calls []frame
	var sccStack []int
	for root := range all {
		if index[root] >= 0 || len(edges(all[root])) == 0 {
			continue
		}
		calls = append(calls[:0], frame{root, 0})
		index[root], low[root] = next, next
		next++
		sccStack = append(sccStack, root)
		onStack[root] = true
		for len(calls) > 0 {
			f := &calls[len(calls)-1]
			es := edges(all[f.v])
			if f.e < len(es) {
				w := es[f.e]
				f.e++
				if index[w] < 0 {
					index[w], low[w] = next, next
					next++
					sccStack = append(sccStack, w)
					onStack[w] = true
					calls = append(calls, frame{w, 0})
				} else if onStack[w] {
					low[f.v] = min(low[f.v], index[w])
				}
				continue
			}
			v := f.v
			calls = calls[:len(calls)-1]
			if len(calls) > 0 {
				u := calls[len(calls)-1].v
				low[u] = min(low[u], low[v])
			}
			if low[v] == index[v] {
				var comp []int
				for {
					w := sccStack[len(sccStack)-1]
					sccStack = sccStack[:len(sccStack)-1]
					onStack[w] = false
					comp = append(comp, w)
					if w == v {
						break
					}
				}
				if len(comp) > 1 {
					comps = append(comps, comp)
				}
			}
		}
	}
	out := map[*Rule]*Error{}
	for _, comp := range comps {
		slices.Sort(comp)
		first := all[comp[0]]
		// The shortest cycle through first, within comp (breadth first).
		in := map[int]bool{}
		for _, i := range comp {
			in[i] = true
		}
		prev := map[int]int{}
		queue := []int{comp[0]}
		found := false
		for len(queue) > 0 && !found {
			v := queue[0]
			queue = queue[1:]
			for _, w := range edges(all[v]) {
				if !in[w] {
					continue
				}
				if w == comp[0] {
					prev[w], found = v, true
					break
				}
				if _, seen := prev[w]; !seen {
					prev[w] = v
					queue = append(queue, w)
				}
			}
		}
		cycle := []int{comp[0]}
		for v := prev[comp[0]]; v != comp[0]; v = prev[v] {
			cycle = append(cycle, v)
		}
		slices.Reverse(cycle[1:])
		var b strings.Builder
		fmt.Fprintf(&b, "rules replace each other in a cycle: %q replaces", first.Name)
		for i, v := range cycle[1:] {
			if i == maxNamed {
				fmt.Fprintf(&b, ", and so on through %d more rules", len(cycle)-1-maxNamed)
				break
			}
			if i > 0 {
				b.WriteString(", which replaces")
			}
			fmt.Fprintf(&b, " %q", all[v].Name)
		}
		fmt.Fprintf(&b, ", which replaces %q", first.Name)
		var others []string
		inCycle := map[int]bool{}
		for _, v := range cycle {
			inCycle[v] = true
		}
		for _, v := range comp {
			if !inCycle[v] {
				others = append(others, strconv.Quote(all[v].Name))
			}
		}
		if len(others) > maxNamed {
			others = append(others[:maxNamed], fmt.Sprintf("%d more", len(others)-maxNamed))
		}
		if len(others) > 0 {
			fmt.Fprintf(&b, " (and rules %s are in cycles with them)", strings.Join(others, ", "))
		}
		b.WriteString(": a request that matches all of them is limited by none, each being replaced by another")
		out[first] = &Error{File: first.File, Line: first.Line, Field: "rule " + strconv.Quote(first.Name) + " replaces", Msg: b.String()}
	}
	return out
}

// wellKnownAttrs are the attributes the clients' defaults and the protocol name, in the
// case they are sent.
var wellKnownAttrs = map[string]bool{"method": true, "path": true, "user": true, "api_key": true, "ip": true, "plan": true}

// attrNames returns the attributes r's match and key name, each once.
func attrNames(r *Rule) []string {
	var names []string
	for ci := range r.conds {
		names = append(names, r.conds[ci].attr)
	}
	names = append(names, r.Key...)
	slices.Sort(names)
	return slices.Compact(names)
}

// shadowBudget bounds the plan limits Warnings compares looking for rules that never
// decide: each rule is compared with every earlier one of its match and key, plan by
// plan, which 1,000 such rules with 1,000 plans each (a 90 KB file) made 36 s of a
// reload, under its lock. A warning is advice; the rules load whatever it finds.
const shadowBudget = 2_000_000

// shadowSignature is equal for two rules exactly when all but their limits and names
// agree in the sense of Warnings.
func shadowSignature(r *Rule) string {
	var b strings.Builder
	conds := make([]string, 0, len(r.conds))
	for ci := range r.conds {
		c := &r.conds[ci]
		var vals []string
		vals = append(vals, c.values...)
		for gi := range c.globs {
			vals = append(vals, c.globs[gi].pattern)
		}
		slices.Sort(vals)
		vals = slices.Compact(vals)
		var cb strings.Builder
		cb.WriteString(strconv.Quote(c.attr))
		for _, v := range vals {
			cb.WriteByte(' ')
			cb.WriteString(strconv.Quote(v))
		}
		if o := c.ops; o != nil {
			// The mapping form's operators, each a set: {glob: "ab*"} and {glob: "a*"}
			// match different requests (they looked alike here, the attribute alone).
			for _, op := range []struct {
				name string
				vals []string
			}{{"glob", o.globText}, {"not", o.not}, {"not_glob", o.notGlobText}} {
				vs := slices.Compact(slices.Sorted(slices.Values(op.vals)))
				cb.WriteString(" " + op.name + ":")
				for _, v := range vs {
					cb.WriteByte(' ')
					cb.WriteString(strconv.Quote(v))
				}
			}
		}
		conds = append(conds, cb.String())
	}
	slices.Sort(conds)
	for _, c := range conds {
		b.WriteString(c)
		b.WriteByte(';')
	}
	key := slices.Clone(r.Key)
	slices.Sort(key)
	fmt.Fprintf(&b, "|%q|%d|%d|%d|%d|%d|%v|%v", key, r.Algorithm, r.limit.Window(), r.Mode, r.OnStoreFailure, r.Split, r.SplitAuto, r.Concurrency)
	// A calendar's zone changes its windows; a policy is an effect of its own.
	fmt.Fprintf(&b, "|%d|%v|%d|%v|%p", r.Calendar, r.TZ, r.Delay, r.WarnAt, r.Penalty)
	if p := r.IPPrefix; p != nil {
		fmt.Fprintf(&b, "|%q/%d/%d", p.Attr, p.IPv4, p.IPv6) // keys of other clients
	}
	return b.String()
}

// atLeastAsTight reports whether a's limit is at least as tight as b's for the default
// and every plan either lists.
func atLeastAsTight(a, b *Rule) bool {
	tighter := func(plan string, hasPlan bool) bool {
		la, ua := a.LimitFor(plan, hasPlan)
		lb, ub := b.LimitFor(plan, hasPlan)
		switch {
		case ub:
			return true // b never applies to this plan
		case ua:
			return false
		}
		return la.Requests() <= lb.Requests() && la.Burst() <= lb.Burst()
	}
	if !tighter("", false) {
		return false
	}
	for name := range a.plans {
		if !tighter(name, true) {
			return false
		}
	}
	for name := range b.plans {
		if !tighter(name, true) {
			return false
		}
	}
	return true
}

// deadGlob says why no request path can match pattern, or "" when one can.
func deadGlob(pattern string) string {
	for i := 0; i < len(pattern); i++ {
		switch c := pattern[i]; {
		case c == '?':
			return "'?' starts the query string, which is not part of the path (for any characters within a segment, use *)"
		case c == '#':
			return "'#' starts the fragment, which clients never send"
		case c == '\\':
			return "a backslash looks like a regular expression; globs have * (within a segment) and ** (any depth)"
		}
	}
	// The path arrives normalized (clients/testdata/paths.json): runs of '/' merged into
	// one, '.' and '..' segments removed.
	if strings.Contains(pattern, "//") {
		return "\"//\": a request path arrives with runs of '/' merged into one"
	}
	for seg := range strings.SplitSeq(pattern, "/") {
		if seg == "." || seg == ".." {
			return "segment " + strconv.Quote(seg) + ": a request path arrives with its '.' and '..' segments resolved"
		}
	}
	if strings.Contains(pattern, ".*") {
		return "\".*\" looks like a regular expression; globs have * (within a segment) and ** (any depth)"
	}
	if strings.HasSuffix(pattern, "$") && len(pattern) > 1 {
		return "a trailing '$' looks like a regular expression anchor; a glob always matches the whole path"
	}
	for seg := range strings.SplitSeq(pattern, "/") {
		switch {
		case strings.HasPrefix(seg, "{") && strings.HasSuffix(seg, "}") && len(seg) > 2:
			return "segment " + strconv.Quote(seg) + " looks like a route template; use * for one segment"
		case len(seg) > 1 && seg[0] == ':' && isIdent(seg[1:]):
			return "segment " + strconv.Quote(seg) + " looks like a route parameter; use * for one segment"
		case strings.HasPrefix(seg, "^"):
			return "a leading '^' looks like a regular expression anchor; a glob always matches the whole path"
		case strings.Contains(seg, "[") && strings.Contains(seg, "]"):
			return "segment " + strconv.Quote(seg) + " looks like a character class; globs have none (use *)"
		}
	}
	return ""
}

func isIdent(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return s != ""
}

// holes returns r's warnings for the requests its match leaves out that the same handler
// serves (see Warnings): a GET without HEAD (only the list form is looked at; an operator
// mapping, not: POST, says what it means), and a method written in lower case (get), in
// a list or after not:, which a request with the method GET does not match.
func holes(r *Rule) Errors {
	var out Errors
	field := "rule " + strconv.Quote(r.Name) + " match."
	for _, m := range r.Match {
		for _, v := range slices.Concat(m.Values, m.Glob, m.Not, m.NotGlob) {
			if c, ok := unseen(v, r.literal); ok {
				out = append(out, &Error{File: r.File, Line: r.Line, Field: field + m.Attr,
					Msg: fmt.Sprintf("%q holds %U, a character the file does not show as what it matches (a right-to-left override shows the text after it reversed; a block scalar, | or >, ends its value with a line feed); if it is meant, write it as an escape in a double-quoted string (\"\\u%04X\")", v, c, c)})
			}
		}
		switch m.Attr {
		case "method":
			if slices.Contains(m.Values, "GET") && !slices.Contains(m.Values, "HEAD") {
				out = append(out, &Error{File: r.File, Line: r.Line, Field: field + "method",
					Msg: "GET without HEAD: net/http, Express, Starlette and Flask run the GET handler for a HEAD request, which this rule does not match; list both (method: [GET, HEAD])"})
			}
			for _, v := range slices.Concat(m.Values, m.Not) {
				if v != strings.ToUpper(v) {
					out = append(out, &Error{File: r.File, Line: r.Line, Field: field + "method",
						Msg: fmt.Sprintf("%q: methods are case-sensitive (RFC 9110) and the clients send them as the request has them; this matches only a request whose method is %q, which servers do not take for %s: write %s", v, v, strings.ToUpper(v), strings.ToUpper(v))})
				}
			}
		}
	}
	return out
}

// unseen returns the first rune of v that a reader of the rules file does not see as
// what it matches: a tab, line feed or carriage return (a value from a YAML block
// scalar, `|` or `>`, ends with one), or, where the file holds it as itself (literal), a
// control character (C0, DEL, C1) or an invisible formatting one (zero-width spaces and
// joiners, the bidirectional marks, embeddings, overrides and isolates, the byte-order
// mark), which can make a value read as another (CVE-2021-42574, "Trojan Source").
func unseen(v string, literal map[rune]bool) (rune, bool) {
	for _, c := range v {
		if c == '\t' || c == '\n' || c == '\r' || literal[c] {
			return c, true
		}
	}
	return 0, false
}

// hidden reports whether c is a control or an invisible formatting character (unseen).
func hidden(c rune) bool {
	return unicode.IsControl(c) ||
		c >= 0x200B && c <= 0x200F || // zero-width space, joiners; left-to-right, right-to-left marks
		c >= 0x202A && c <= 0x202E || // embeddings and overrides
		c >= 0x2060 && c <= 0x2069 || // word joiner, invisible operators, isolates
		c == 0x061C || c == 0xFEFF
}

// literalUnseen returns the hidden runes that data holds as themselves, other than tab,
// line feed and carriage return (the file's own whitespace) and a byte-order mark that
// starts it; nil when none.
func literalUnseen(data []byte) map[rune]bool {
	var out map[rune]bool
	for i, c := range string(data) {
		if c == '\t' || c == '\n' || c == '\r' || c == 0xFEFF && i == 0 || !hidden(c) {
			continue
		}
		if out == nil {
			out = map[rune]bool{}
		}
		out[c] = true
	}
	return out
}
