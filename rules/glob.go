package rules

import (
	"errors"
	"strings"
)

// A glob is a compiled match.path pattern. Patterns start with '/' and are split into
// '/'-separated segments:
//
//   - a segment "*" matches exactly one non-empty segment: /v1/*/holds matches
//     /v1/e1/holds but not /v1//holds or /v1/a/b/holds;
//   - a '*' inside a segment matches any run of bytes other than '/', possibly empty:
//     /files/*.png matches /files/a.png and /files/.png;
//   - a segment "**" matches any number of whole segments, including none: /v1/** matches
//     /v1, /v1/ and /v1/a/b;
//   - every other byte matches itself. A trailing slash is significant: /a matches /a and
//     not /a/.
//
// Matching walks the path by index and does not allocate.
type glob struct {
	pattern string
	literal bool // no '*': compare whole strings
	segs    []segment
	// parts is the pattern without "**" as runs of literal text (slashes included) and
	// single-segment wildcards, matched left to right in one pass (matchParts); nil when
	// the pattern has a "**".
	parts []globPart
	// pre and suf are parts' literal first and last parts ("" when a wildcard ends it),
	// tested first, where a mismatch is cheapest; mid are the parts between them.
	pre, suf string
	mid      []globPart
	// preW and sufW are pre and suf compiled for comparing by words (word16), and lit
	// the pattern when it is literal; all set by compileGlob.
	preW, sufW, lit word16
	// anyMid: the pattern is pre, one "*" segment, suf, with pre (not empty) and suf
	// at most 16 bytes long (match compares them by words, without matchParts).
	anyMid bool
	// head is the pattern without its "**" when that is its last segment and its only
	// "**" (and something precedes it): a path matches when its first headSegs segments
	// match head. nil otherwise.
	head     *glob
	headSegs int
}

// globPart is a run of literal text, or (wild set) one segment matching a wildcard
// segment: "*" (any non-empty segment) or a pattern such as "*.png".
type globPart struct {
	text string // the literal run, or the wildcard segment's pattern
	wild bool
	any  bool // wild and the pattern is "*"
}

type segKind uint8

const (
	segLiteral    segKind = iota // the segment text itself
	segAny                       // "*": one non-empty segment
	segWild                      // text with '*' in it
	segDoubleStar                // "**": zero or more segments
)

type segment struct {
	kind segKind
	text string
}

func compileGlob(pattern string) (glob, error) {
	if !strings.HasPrefix(pattern, "/") {
		return glob{}, errors.New("must start with /")
	}
	g := glob{pattern: pattern}
	if strings.IndexByte(pattern, '*') < 0 {
		g.literal = true
		g.lit = newWord16(pattern)
		return g, nil
	}
	for s := range strings.SplitSeq(pattern, "/") {
		switch {
		case s == "**":
			if n := len(g.segs); n > 0 && g.segs[n-1].kind == segDoubleStar {
				continue // /a/**/**/b is /a/**/b
			}
			g.segs = append(g.segs, segment{kind: segDoubleStar})
		case strings.Contains(s, "**"):
			return glob{}, errors.New("** must be a whole segment (e.g. /v1/**)")
		case s == "*":
			g.segs = append(g.segs, segment{kind: segAny})
		case strings.IndexByte(s, '*') >= 0:
			g.segs = append(g.segs, segment{kind: segWild, text: s})
		default:
			g.segs = append(g.segs, segment{kind: segLiteral, text: s})
		}
	}
	if n := len(g.segs); n > 2 && g.segs[n-1].kind == segDoubleStar {
		// A trailing "**" only (the common /v1/**): the segments before it are matched
		// as a glob of their own (head) against as many leading segments of the path,
		// whatever follows.
		var b strings.Builder
		only := true
		for i, sg := range g.segs[:n-1] {
			if i > 0 {
				b.WriteByte('/')
			}
			switch sg.kind {
			case segDoubleStar:
				only = false
			case segAny:
				b.WriteByte('*')
			default:
				b.WriteString(sg.text)
			}
		}
		if only {
			head, err := compileGlob(b.String())
			if err != nil {
				return glob{}, err
			}
			g.head, g.headSegs = &head, n-1
		}
	}
	g.parts = compileParts(g.segs)
	if mid := g.parts; mid != nil {
		if !mid[0].wild {
			g.pre, mid = mid[0].text, mid[1:]
		}
		if n := len(mid); n > 0 && !mid[n-1].wild {
			g.suf, mid = mid[n-1].text, mid[:n-1]
		}
		g.mid = mid
	}
	g.preW, g.sufW = newWord16(g.pre), newWord16(g.suf)
	g.anyMid = len(g.mid) == 1 && g.mid[0].any && g.pre != "" && len(g.pre) <= 16 && len(g.suf) <= 16
	return g, nil
}

// compileParts joins a pattern's segments into the parts matchParts walks: each
// wildcard segment stands alone, and the literal segments and slashes between them form
// one run. It returns nil when a segment is "**".
func compileParts(segs []segment) []globPart {
	var parts []globPart
	var lit strings.Builder
	for i := range segs {
		s := &segs[i]
		if i > 0 {
			lit.WriteByte('/')
		}
		switch s.kind {
		case segDoubleStar:
			return nil
		case segLiteral:
			lit.WriteString(s.text)
			continue
		}
		if lit.Len() > 0 {
			parts = append(parts, globPart{text: lit.String()})
			lit.Reset()
		}
		parts = append(parts, globPart{text: s.text, wild: true, any: s.kind == segAny})
	}
	if lit.Len() > 0 {
		parts = append(parts, globPart{text: lit.String()})
	}
	return parts
}

// matchParts matches path against a pattern without "**": each literal run must come
// next, each wildcard takes the bytes up to the next '/' (at least one for "*"), and
// the path must end with the last part. The literal runs at both ends are tested first;
// a wildcard is a whole segment, so the run after it starts with '/' and the wildcard
// stops where it would in one pass from the start.
func (g *glob) matchParts(path string) bool {
	if len(path) < len(g.pre)+len(g.suf) || !g.preW.eq(path[:len(g.pre)]) || !g.sufW.eq(path[len(path)-len(g.suf):]) {
		return false
	}
	path = path[len(g.pre) : len(path)-len(g.suf)]
	if len(g.mid) == 1 && g.mid[0].any { // "/v1/events/*/holds": one non-empty segment
		return path != "" && segEnd(path, 0) == len(path)
	}
	pos := 0
	for i := range g.mid {
		pt := &g.mid[i]
		if !pt.wild {
			if len(path)-pos < len(pt.text) || path[pos:pos+len(pt.text)] != pt.text {
				return false
			}
			pos += len(pt.text)
			continue
		}
		end := segEnd(path, pos)
		if pt.any {
			if end == pos {
				return false
			}
		} else if !wildMatch(pt.text, path[pos:end]) {
			return false
		}
		pos = end
	}
	return pos == len(path)
}

// segEnd returns the index of the '/' ending the segment that starts at pos, or len(p).
// Segments are short: a loop beats a call to IndexByte.
func segEnd(p string, pos int) int {
	for pos < len(p) && p[pos] != '/' {
		pos++
	}
	return pos
}

func (s *segment) match(seg string) bool {
	switch s.kind {
	case segLiteral:
		return seg == s.text
	case segAny:
		return seg != ""
	case segWild:
		return wildMatch(s.text, seg)
	}
	return false
}

// matchAnyMid is match for an anyMid glob: pre, one non-empty segment, suf
// ("/v1/events/*/holds"), pre and suf of at most 16 bytes, compared by words (word16).
func (g *glob) matchAnyMid(path string) bool {
	pre, suf := &g.preW, &g.sufW
	np, ns, n := len(pre.s), len(suf.s), len(path)
	if n <= np+ns {
		return false
	}
	if np < 8 {
		if shortWord(path[:np]) != pre.w0 {
			return false
		}
	} else if load64(path, 0) != pre.w0 || load64(path, np-8) != pre.w1 {
		return false
	}
	if ns < 8 {
		if shortWord(path[n-ns:]) != suf.w0 {
			return false
		}
	} else if load64(path, n-ns) != suf.w0 || load64(path, n-8) != suf.w1 {
		return false
	}
	return segEnd(path, np) == n-ns
}

// match reports whether path matches the glob. Segments are the tokens of a classic
// wildcard match, with "**" as the star: on a mismatch the last "**" takes one more
// segment, so the walk is O(len(segs) × segments in path) with no recursion.
func (g *glob) match(path string) bool {
	if g.literal {
		w := &g.lit
		n := len(path)
		switch {
		case n != len(w.s):
			return false
		case n < 8:
			return shortWord(path) == w.w0
		case n <= 16:
			return load64(path, 0) == w.w0 && load64(path, n-8) == w.w1
		}
		return path == w.s
	}
	if g.anyMid {
		return g.matchAnyMid(path)
	}
	if g.parts != nil {
		return g.matchParts(path)
	}
	if g.head != nil {
		// The path's first headSegs segments: up to its headSegs-th '/', or all of it.
		cut, slashes := len(path), 0
		for i := 0; i < len(path); i++ {
			if path[i] == '/' {
				if slashes++; slashes == g.headSegs {
					cut = i
					break
				}
			}
		}
		return g.head.match(path[:cut])
	}
	segs := g.segs
	pi, pos := 0, 0 // pattern segment, byte offset of the current path segment
	starPi, starPos := -1, 0
	for pos <= len(path) {
		if pi < len(segs) && segs[pi].kind == segDoubleStar {
			if pi == len(segs)-1 {
				return true // a trailing ** takes whatever is left
			}
			starPi, starPos = pi, pos
			pi++
			continue
		}
		end := segEnd(path, pos)
		if pi < len(segs) && segs[pi].match(path[pos:end]) {
			pi++
			pos = end + 1
			continue
		}
		if starPi < 0 {
			return false
		}
		starPos = segEnd(path, starPos) + 1
		pi, pos = starPi+1, starPos
	}
	for pi < len(segs) && segs[pi].kind == segDoubleStar {
		pi++
	}
	return pi == len(segs)
}

// wildMatch matches s against pattern, where '*' stands for any run of bytes (s holds no
// '/', being one segment).
func wildMatch(pattern, s string) bool {
	pi, si := 0, 0
	starPi, starSi := -1, 0
	for si < len(s) {
		switch {
		case pi < len(pattern) && pattern[pi] == '*':
			starPi, starSi = pi, si
			pi++
		case pi < len(pattern) && pattern[pi] == s[si]:
			pi++
			si++
		case starPi >= 0:
			starSi++
			pi, si = starPi+1, starSi
		default:
			return false
		}
	}
	for pi < len(pattern) && pattern[pi] == '*' {
		pi++
	}
	return pi == len(pattern)
}

// cond is one match condition: the attribute must be present and equal one of values
// (exact) or match one of globs (path).
type cond struct {
	attr   string
	values []string
	globs  []glob
	ops    *condOps // the mapping form (extensions.go); nil otherwise
	// short: attr is at most 8 bytes long and attrW its shortWord: matches finds it by
	// length and word, without a call to compare strings.
	short bool
	attrW uint64
	// words are values compiled for comparing (word16), one per value; nil in a
	// condition assembled by hand, which compares values as strings.
	words []word16
	// kind is the common shape matches tests without its general loops (set by
	// compile; condGeneral in a condition assembled by hand).
	kind condKind
}

type condKind uint8

const (
	condGeneral  condKind = iota
	condOneValue          // one value, no globs: words[0]
	condOneGlob           // one glob and no values: globs[0]
	condLitPath           // one literal glob and no values: globs[0].lit
	condAnyMid            // one glob pre/*/suf (glob.anyMid) and no values
)

// newCond returns a condition on attribute attr, without values yet; compile it once
// they are added.
func newCond(attr string) cond {
	return cond{attr: attr, short: len(attr) <= 8, attrW: shortWord(attr)}
}

// compile sets c.kind from its values and globs.
func (c *cond) compile() {
	switch {
	case c.ops != nil || len(c.words) != len(c.values):
		c.kind = condGeneral
	case len(c.values) == 1 && len(c.globs) == 0:
		c.kind = condOneValue
	case len(c.values) == 0 && len(c.globs) == 1 && c.globs[0].literal:
		c.kind = condLitPath
	case len(c.values) == 0 && len(c.globs) == 1 && c.globs[0].anyMid:
		c.kind = condAnyMid
	case len(c.values) == 0 && len(c.globs) == 1:
		c.kind = condOneGlob
	default:
		c.kind = condGeneral
	}
}

// findAttr is Lookup(attrs, c.attr), by length and word when the name is short.
func (c *cond) findAttr(attrs []Attr) (string, bool) {
	if c.short {
		return lookupShort(attrs, len(c.attr), c.attrW)
	}
	return Lookup(attrs, c.attr)
}

// holds is matches, with the common conditions — a short attribute name and one value,
// one literal path or one pre/*/suf glob — tested here without a call, so that they keep
// everything in registers (matches is called only in tail position, for the others).
func (c *cond) holds(attrs []Attr) bool {
	if !c.short || c.kind < condOneValue || c.kind == condOneGlob {
		return c.matches(attrs)
	}
	var v string
	n, w, i := len(c.attr), c.attrW, 0
	for ; i < len(attrs); i++ {
		if a := &attrs[i]; len(a.Name) == n && shortWord(a.Name) == w {
			v = a.Value
			break
		}
	}
	if i == len(attrs) {
		return false
	}
	var want *word16
	switch c.kind {
	case condOneValue:
		want = &c.words[0]
	case condLitPath:
		want = &c.globs[0].lit
	default: // condAnyMid
		return c.globs[0].matchAnyMid(v)
	}
	switch n := len(v); {
	case n != len(want.s):
		return false
	case n < 8:
		return shortWord(v) == want.w0
	case n <= 16:
		return load64(v, 0) == want.w0 && load64(v, n-8) == want.w1
	}
	return v == want.s // a long value or path
}

// matches reports whether the condition holds for attrs: the general test, for a
// condition of any shape (holds tests the common ones itself and calls matches for the
// others).
func (c *cond) matches(attrs []Attr) bool {
	v, ok := c.findAttr(attrs)
	if !ok {
		return false
	}
	if c.ops != nil {
		return c.ops.matches(v)
	}
	if len(c.words) == len(c.values) {
		for i := range c.words {
			if c.words[i].eq(v) {
				return true
			}
		}
	} else {
		for _, want := range c.values {
			if v == want {
				return true
			}
		}
	}
	for i := range c.globs {
		if c.globs[i].match(v) {
			return true
		}
	}
	return false
}
