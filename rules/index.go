package rules

import (
	"slices"
	"strings"
)

// index narrows a Set's rules to the few a request can match. It is built once per Set
// (by Parse and LoadDir, so a reload builds it with the new Set and swaps both in one
// step) and never changes afterwards, so any number of goroutines query it at once.
//
// Every rule with conditions is filed under exactly one of them, its primary:
//
//   - path: the rule sits at the end of each of its globs in a tree over path segments
//     (literal segments in a map, "*", patterns such as "*.png", and "**" nodes);
//   - an exact attribute (method, user, plan, any name): the rule sits under each of
//     its values in a map of that attribute's values.
//
// Whichever condition the rule is filed under, a request the rule matches satisfies that
// condition, so a query visiting the tree along the request's path and the maps at the
// request's values meets every rule that can match; each rule met is then checked on its
// other conditions. The primary is the condition fewer other rules share (see
// buildIndex), so a request visits few rules whatever the size of the set. Rules without
// conditions are on the always list.
type index struct {
	always  []int32     // rules without conditions: every request checks them
	attrs   []attrIndex // one per attribute name some rule is filed under
	root    *pathNode   // nil when no rule is filed under its path
	primary []int32     // per rule position: the condition it is filed under, -1 for none
	linear  bool        // a small set, or Index fields not giving positions: scan linearly
}

// attrIndex files rules by the exact values of one attribute.
type attrIndex struct {
	name    string
	byValue map[string][]int32 // value → rule positions, ascending
	cond    cond               // a condition on name (newCond), to find it with findAttr
}

// pathNode is one state of the path tree: the rules whose glob ends here, and the edges
// that consume the next segment. A star node (the "**" child of its parent) also loops
// on itself: it consumes any segment and stays.
type pathNode struct {
	lit map[string]*pathNode // literal segments; nil when there are none or just one
	// oneLit and oneNode are the literal edge when there is just one (most nodes): a
	// string compare instead of a hash.
	oneLit  string
	oneNode *pathNode
	any     *pathNode  // "*": one non-empty segment
	wild    []wildEdge // segments with '*' in them, such as "*.png"
	star    *pathNode  // "**": zero or more segments
	end     []int32    // rules whose glob ends at this node, ascending
	// isStar marks a "**" node: it consumes any segment and stays.
	isStar bool
	// litOnly: not a star node, and every edge is literal.
	litOnly bool
	// wildAt finds a wild edge by pattern while building; nil once built.
	wildAt map[string]int
}

type wildEdge struct {
	pattern string
	node    *pathNode
}

// pathCond finds the path attribute (findAttr).
var pathCond = newCond(PathAttribute)

// minIndexed is the size from which a Set is matched through its index rather than by
// testing each rule (BenchmarkSmallSetRatio measures the two on a 3-rule set).
const minIndexed = 8

// maxStates bounds the path states kept on the stack during a query; a request that
// needs more (a tree with many overlapping "**" and "*" branches) spills to the heap.
const maxStates = 16

// buildIndex files every rule of rules; rules[i].Index must be i (Parse and LoadDir set
// it), else the index says so and queries scan linearly.
//
// Choosing the primary: for each exact condition, its cost is how many rules list one
// of its values for the same attribute; for a path condition, how many rules list one
// of the same glob patterns, or the number of rules when a glob begins with "/**" (the
// tree cannot narrow it at the first segment). The cheapest wins, path on ties: the tree
// separates rules by every literal segment, the value maps by one value.
//
// A set of fewer than minRules rules is scanned linearly: below a handful of rules that
// is cheaper than walking the index.
func buildIndex(rules []*Rule, minRules int) *index {
	ix := &index{}
	if len(rules) < minRules {
		ix.linear = true
		return ix
	}
	for i, r := range rules {
		if r.Index != i {
			ix.linear = true
			return ix
		}
	}
	type av struct{ attr, value string }
	valueCount := map[av]int{}
	globCount := map[string]int{}
	for _, r := range rules {
		for ci := range r.conds {
			c := &r.conds[ci]
			for _, v := range c.values {
				valueCount[av{c.attr, v}]++
			}
			for gi := range c.globs {
				globCount[c.globs[gi].pattern]++
			}
		}
	}
	attrAt := map[string]int{} // attribute name → index in ix.attrs
	ix.primary = make([]int32, len(rules))
	for i, r := range rules {
		ix.primary[i] = -1
		if len(r.conds) == 0 {
			ix.always = append(ix.always, int32(i))
			continue
		}
		best, bestCost := -1, 0
		for ci := range r.conds {
			c := &r.conds[ci]
			if c.ops != nil {
				continue // an operator mapping (glob, not, not_glob) names no value to file under
			}
			cost := 0
			if c.globs != nil {
				for gi := range c.globs {
					if g := &c.globs[gi]; wideGlob(g) {
						cost += len(rules)
					} else {
						cost += globCount[g.pattern]
					}
				}
			} else {
				for _, v := range c.values {
					cost += valueCount[av{c.attr, v}]
				}
			}
			if best < 0 || cost < bestCost || cost == bestCost && c.globs != nil {
				best, bestCost = ci, cost
			}
		}
		if best < 0 {
			ix.always = append(ix.always, int32(i)) // every condition is an operator mapping
			continue
		}
		ix.primary[i] = int32(best)
		c := &r.conds[best]
		if c.globs != nil {
			if ix.root == nil {
				ix.root = &pathNode{}
			}
			for gi := range c.globs {
				ix.root.insert(&c.globs[gi], int32(i))
			}
			continue
		}
		at, ok := attrAt[c.attr]
		if !ok {
			at = len(ix.attrs)
			attrAt[c.attr] = at
			ix.attrs = append(ix.attrs, attrIndex{name: c.attr, byValue: map[string][]int32{}, cond: newCond(c.attr)})
		}
		m := ix.attrs[at].byValue
		for _, v := range c.values {
			m[v] = appendPos(m[v], int32(i))
		}
	}
	if ix.root != nil {
		ix.root.done()
	}
	return ix
}

// wideGlob reports whether g begins with "/**": every path starting with '/' reaches it.
func wideGlob(g *glob) bool {
	return !g.literal && len(g.segs) > 1 && g.segs[1].kind == segDoubleStar
}

// appendPos appends rule position i unless it is already last (a rule listing the same
// value or glob twice).
func appendPos(list []int32, i int32) []int32 {
	if n := len(list); n > 0 && list[n-1] == i {
		return list
	}
	return append(list, i)
}

// insert files rule i at the end of glob g's path through the tree, creating nodes.
func (n *pathNode) insert(g *glob, i int32) {
	if g.literal {
		for s := range strings.SplitSeq(g.pattern, "/") {
			n = n.litChild(s)
		}
		n.end = appendPos(n.end, i)
		return
	}
	for si := range g.segs {
		s := &g.segs[si]
		switch s.kind {
		case segLiteral:
			n = n.litChild(s.text)
		case segAny:
			if n.any == nil {
				n.any = &pathNode{}
			}
			n = n.any
		case segWild:
			if n.wildAt == nil {
				n.wildAt = map[string]int{}
			}
			at, ok := n.wildAt[s.text]
			if !ok {
				at = len(n.wild)
				n.wildAt[s.text] = at
				n.wild = append(n.wild, wildEdge{pattern: s.text, node: &pathNode{}})
			}
			n = n.wild[at].node
		case segDoubleStar:
			if n.star == nil {
				n.star = &pathNode{isStar: true}
			}
			n = n.star
		}
	}
	n.end = appendPos(n.end, i)
}

func (n *pathNode) litChild(s string) *pathNode {
	if n.lit == nil {
		n.lit = map[string]*pathNode{}
	}
	c := n.lit[s]
	if c == nil {
		c = &pathNode{}
		n.lit[s] = c
	}
	return c
}

// done drops the build-time maps below n and moves a single literal edge out of its map.
func (n *pathNode) done() {
	n.wildAt = nil
	n.litOnly = !n.isStar && n.any == nil && n.wild == nil && n.star == nil
	if len(n.lit) == 1 {
		for s, c := range n.lit {
			n.oneLit, n.oneNode = s, c
		}
		n.lit = nil
		n.oneNode.done()
	}
	for _, c := range n.lit {
		c.done()
	}
	if n.any != nil {
		n.any.done()
	}
	for _, w := range n.wild {
		w.node.done()
	}
	if n.star != nil && n.star != n {
		n.star.done()
	}
}

// addState adds n to the state set states unless it is there, with its "**" child (which
// may match zero segments).
func addState(states []*pathNode, n *pathNode) []*pathNode {
	if !slices.Contains(states, n) {
		states = append(states, n)
	}
	if n.star != nil && !slices.Contains(states, n.star) {
		states = append(states, n.star)
	}
	return states
}

// matchPath appends to dst the end lists of every node path reaches, as a set of states
// advanced one segment at a time (so overlapping "**" branches cost states, never
// backtracking). It returns how many non-empty lists it appended.
func (ix *index) matchPath(dst []int32, path string) ([]int32, int) {
	var bufA, bufB [maxStates]*pathNode
	cur := addState(bufA[:0], ix.root)
	next := bufB[:0]
	for pos := 0; pos <= len(path) && len(cur) > 0; {
		end := pos
		for end < len(path) && path[end] != '/' {
			end++ // segments are short: a loop beats a call to IndexByte
		}
		seg := path[pos:end]
		pos = end + 1
		if len(cur) == 1 && cur[0].litOnly {
			// The common case, a single state with only literal edges: descend.
			n := cur[0]
			c := n.oneNode
			if c == nil {
				c = n.lit[seg]
			} else if seg != n.oneLit {
				c = nil
			}
			cur = cur[:0]
			if c != nil {
				cur = addState(cur, c)
			}
			continue
		}
		next = next[:0]
		for _, n := range cur {
			if n.isStar {
				next = addState(next, n)
			}
			if n.oneNode != nil {
				if seg == n.oneLit {
					next = addState(next, n.oneNode)
				}
			} else if c := n.lit[seg]; c != nil {
				next = addState(next, c)
			}
			if n.any != nil && seg != "" {
				next = addState(next, n.any)
			}
			for wi := range n.wild {
				if wildMatch(n.wild[wi].pattern, seg) {
					next = addState(next, n.wild[wi].node)
				}
			}
		}
		cur, next = next, cur
	}
	lists := 0
	for _, n := range cur {
		if len(n.end) > 0 {
			dst = append(dst, n.end...)
			lists++
		}
	}
	return dst, lists
}

// AppendMatching appends to dst every rule of s whose match holds for attrs, in the
// rule-file order (the order of s.Rules), and returns the extended slice. It gives the
// same rules as testing Rule.Matches on each rule of s in turn, but visits only the rules
// the Set's index files under the request's path and attribute values, so its cost does
// not grow with the number of rules. It does not allocate when dst has room for the
// matched rules (a Decision's scratch slice, reused, soon has) and the path reaches at
// most 32 rules through at most 16 tree states at a time; beyond that its scratch space
// spills to the heap. It is safe for concurrent use.
//
// A Set built by Parse, Load or LoadDir carries its index; one assembled by hand is
// indexed on first use.
func (s *Set) AppendMatching(dst []*Rule, attrs []Attr) []*Rule {
	ix := s.idx.Load()
	if ix == nil {
		ix = buildIndex(s.Rules, minIndexed)
		s.idx.CompareAndSwap(nil, ix)
	}
	return ix.appendMatching(s.Rules, dst, attrs)
}

func (ix *index) appendMatching(rules []*Rule, dst []*Rule, attrs []Attr) []*Rule {
	if ix.linear {
		for _, r := range rules {
			if r.Matches(attrs) {
				dst = append(dst, r)
			}
		}
		return dst
	}
	start := len(dst)
	sources := 0 // lists that contributed a rule: each is sorted and without repeats
	dst, sources = ix.appendChecked(dst, sources, rules, ix.always, attrs)
	for ai := range ix.attrs {
		a := &ix.attrs[ai]
		if v, ok := a.cond.findAttr(attrs); ok {
			dst, sources = ix.appendChecked(dst, sources, rules, a.byValue[v], attrs)
		}
	}
	if ix.root != nil {
		if path, ok := pathCond.findAttr(attrs); ok {
			var buf [32]int32
			cand, lists := ix.matchPath(buf[:0], path)
			n := sources
			dst, sources = ix.appendChecked(dst, sources, rules, cand, attrs)
			if sources > n && lists > 1 {
				sources++ // several end lists: out of order, maybe with repeats
			}
		}
	}
	if sources <= 1 {
		return dst // one sorted list without repeats
	}
	return sortUnique(dst, start)
}

// appendChecked appends the rules at positions list that match attrs, counting list in
// sources when it gave one. A rule's primary condition is not tested again: the list it
// was found in holds only for requests meeting it.
func (ix *index) appendChecked(dst []*Rule, sources int, rules []*Rule, list []int32, attrs []Attr) ([]*Rule, int) {
	n := len(dst)
	for _, i := range list {
		if r := rules[i]; r.matchesExcept(attrs, int(ix.primary[i])) {
			dst = append(dst, r)
		}
	}
	if len(dst) > n {
		sources++
	}
	return dst, sources
}

// sortUnique sorts dst[start:] by rule position and drops repeats (a rule reached through
// two globs).
func sortUnique(dst []*Rule, start int) []*Rule {
	m := dst[start:]
	sorted := true
	for i := 1; i < len(m); i++ {
		if m[i].Index <= m[i-1].Index {
			sorted = false
			break
		}
	}
	if sorted {
		return dst
	}
	if len(m) <= 16 {
		for i := 1; i < len(m); i++ {
			for j := i; j > 0 && m[j].Index < m[j-1].Index; j-- {
				m[j], m[j-1] = m[j-1], m[j]
			}
		}
	} else {
		slices.SortFunc(m, func(a, b *Rule) int { return a.Index - b.Index })
	}
	out := start
	for i, r := range m {
		if i > 0 && r == m[i-1] {
			continue
		}
		dst[out] = r
		out++
	}
	return dst[:out]
}
