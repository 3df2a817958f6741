// Package rules holds rlsidecar's rule set: the YAML schema, its strict validation (every
// error names the file, line and field), request matching, per-plan limits and the client
// key encoding.
//
// Most callers want [Load] (or [Parse] for bytes already read), then, per request and per
// rule, [Rule.Matches], [Rule.AppendKey] and [Rule.LimitFor]. A [Set] and its rules are
// immutable once built and safe for concurrent use; a reload builds a new Set and swaps it
// in whole. The per-request methods do not allocate.
package rules

import (
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// PlanAttribute is the request attribute whose value selects a rule's plan limit.
const PlanAttribute = "plan"

// PathAttribute is the request attribute that match.path globs are matched against.
const PathAttribute = "path"

// Attr is one request attribute, such as {"method", "POST"} or {"ip", "1.2.3.4"}.
type Attr struct{ Name, Value string }

// Lookup returns the value of the first attribute called name (a linear scan: requests
// carry a handful of attributes). ok is false when there is none; an empty value that is
// present is found.
func Lookup(attrs []Attr, name string) (value string, ok bool) {
	for i := range attrs {
		if attrs[i].Name == name {
			return attrs[i].Value, true
		}
	}
	return "", false
}

// Mode says where a rule's counters live. The zero value, ModeDefault, means the rule did
// not set one and the daemon's default applies.
type Mode uint8

const (
	ModeDefault Mode = iota // not set in the rule: the daemon decides
	ModeLocal               // in-memory buckets only
	ModeHybrid              // local buckets fed by a periodically synced global view
	ModeGlobal              // one atomic store call per check
)

var modeNames = [...]string{ModeDefault: "default", ModeLocal: "local", ModeHybrid: "hybrid", ModeGlobal: "global"}

// String returns the name used in the YAML ("local", "hybrid", "global"), or "default".
func (m Mode) String() string {
	if int(m) < len(modeNames) {
		return modeNames[m]
	}
	return "Mode(" + itoa(uint64(m)) + ")"
}

// ParseMode parses "local", "hybrid" or "global" (the values a rule's mode takes).
func ParseMode(s string) (Mode, error) {
	for m := ModeLocal; m <= ModeGlobal; m++ {
		if modeNames[m] == s {
			return m, nil
		}
	}
	return ModeDefault, &valueError{what: "mode", value: s, valid: "local, hybrid, global"}
}

// FailurePolicy says what a rule does when its store is unreachable. The zero value is
// FailLocal.
type FailurePolicy uint8

const (
	FailLocal  FailurePolicy = iota // fall back to a local bucket (the default)
	FailOpen                        // allow
	FailClosed                      // reject
)

var policyNames = [...]string{FailLocal: "local", FailOpen: "open", FailClosed: "closed"}

// String returns the name used in the YAML: "local", "open" or "closed".
func (p FailurePolicy) String() string {
	if int(p) < len(policyNames) {
		return policyNames[p]
	}
	return "FailurePolicy(" + itoa(uint64(p)) + ")"
}

// ParseFailurePolicy parses "open", "closed" or "local".
func ParseFailurePolicy(s string) (FailurePolicy, error) {
	for p := range policyNames {
		if policyNames[p] == s {
			return FailurePolicy(p), nil
		}
	}
	return FailLocal, &valueError{what: "on_store_failure", value: s, valid: "open, closed, local"}
}

type valueError struct{ what, value, valid string }

func (e *valueError) Error() string {
	return "unknown " + e.what + " " + quote(e.value) + " (valid: " + e.valid + ")"
}

// Rule is one validated rule. Its exported fields say what the file said (Burst is 0 when
// the file gave none); the compiled matchers and limits are unexported. A Rule is
// immutable and safe for concurrent use.
type Rule struct {
	Name string
	// Match is the match conditions as the file wrote them, in its order; nil when the
	// rule has none (it matches every request). Matching uses compiled forms of them.
	Match          []MatchCond
	Key            []string // attribute names, in order
	Algorithm      localbucket.Algorithm
	Requests       uint64
	Per            time.Duration
	Burst          uint64 // as written, 0 if absent
	Shadow         bool   // counted and reported, never rejects
	Mode           Mode   // ModeDefault when the rule does not set one
	OnStoreFailure FailurePolicy
	// Split divides the limit among this many daemons, each enforcing its part locally
	// (the cheap alternative to a shared budget); 0 when not split. SplitAuto takes the
	// number of live daemons from Redis heartbeats instead. Either implies mode local.
	Split     uint32
	SplitAuto bool
	File      string // where the rule was defined
	Line      int
	// Unlimited: limit: unlimited, a rule that matches and limits nothing. Deny: limit:
	// deny, a rule that rejects every request it matches. Neither has a limit, plans or
	// split (see extensions.go).
	Unlimited bool
	Deny      bool
	// Concurrency: concurrency: {max, lease}, a rule limiting the requests in flight
	// rather than their rate (concurrency.go). Requests is then max and Per the lease.
	Concurrency bool
	// Replaces names the rules that do not apply to a check this rule matches;
	// ReplacesIdx are their indexes in the Set.
	Replaces    []string
	ReplacesIdx []int
	replacesAt  []int  // line of each name
	replacesIn  string // the field that lists them (rules[i].replaces), for errors
	// Calendar is per: day, week or month (NoCalendar for a duration): a fixed window
	// whose boundaries are local midnights in TZ (limit.tz, default UTC). Per is then the
	// unit's nominal length (1, 7 or 31 days).
	Calendar localbucket.Calendar
	TZ       *time.Location
	// WarnAt is warn_at: the fraction of its limit (0 < WarnAt <= 1) from which an
	// allowed check is marked as a warning; 0 when the rule has none (policies.go).
	WarnAt float64
	// Delay is delay: how long a token-bucket request may be held instead of refused
	// (its tokens reserved at once); 0 when the rule has none (policies.go).
	Delay time.Duration
	// Penalty is penalty: escalating bans of a key this rule keeps refusing; nil when
	// the rule has none (policies.go).
	Penalty *Penalty
	// Index is the rule's position in its Set, so callers can keep per-rule data in a
	// slice instead of a map.
	Index int

	conds []cond // all must hold
	// emptyMatch: the file wrote match with no condition (null or {}), which matches
	// every request as no match does, but reads as a rule meant to match some (lint.go).
	emptyMatch bool
	// literal is the unseen runes (lint.go) its file holds as themselves: a match value
	// holding one such is warned of; one written as an escape (\u202E) is seen.
	literal map[rune]bool
	keyLits []string // what AppendKey writes before each key value: Name+":{user=", "|ip="
	// keyWords are the shortWord of each key attribute name (set with keyLits): AppendKey
	// finds a name of at most 8 bytes by its length and word.
	keyWords []uint64
	// key1: the key is one attribute, its name key1Len <= 8 bytes long with shortWord
	// key1Word, and key1Lit is keyLits[0] (AppendKey's common case, set with keyLits).
	key1     bool
	key1Len  int
	key1Word uint64
	key1Lit  string
	limit    localbucket.Limit // the default limit
	plans    map[string]*planLimit
	split    atomic.Pointer[splitLimits] // limits divided for the last daemon count asked

	// IPPrefix is ip_prefix: a key attribute whose addresses are keyed by their network;
	// nil when the rule has none (ipprefix.go). Last, so that the fields checks read
	// keep the offsets they had without it.
	IPPrefix *IPPrefix
}

// MatchCond is one match condition as the rules file wrote it: on attribute Attr, either
// Values (the value, or the values of a list, any of which matches; for path, globs) or
// the operator form { glob, not, not_glob } in Glob, Not and NotGlob.
//
// match: { method: [GET, HEAD], tenant: { glob: "acme-*", not: acme-test } } is
// {Attr: "method", Values: [GET HEAD]} then {Attr: "tenant", Glob: [acme-*], Not: [acme-test]}.
type MatchCond struct {
	Attr               string
	Values             []string
	Glob, Not, NotGlob []string
}

// PlanLimit is a rule's limit for one plan: Requests (a concurrency rule's max), or
// Unlimited.
type PlanLimit struct {
	Name      string
	Requests  uint64
	Unlimited bool
}

// Plans returns the rule's plans by name: those it lists itself and those of the file's
// top-level plans that apply to it (a multiplier resolved to a number of requests); nil
// when it has none. It allocates: for reports, not for checks.
func (r *Rule) Plans() []PlanLimit {
	if r.plans == nil {
		return nil
	}
	out := make([]PlanLimit, 0, len(r.plans))
	for name, p := range r.plans {
		pl := PlanLimit{Name: name, Unlimited: p.unlimited}
		if !p.unlimited {
			pl.Requests = p.limit.Requests()
		}
		out = append(out, pl)
	}
	slices.SortFunc(out, func(a, b PlanLimit) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// splitLimits are a rule's limits divided among n daemons.
type splitLimits struct {
	n     uint64
	def   localbucket.Limit
	plans map[string]*localbucket.Limit
}

type planLimit struct {
	unlimited bool
	limit     localbucket.Limit
}

// Matches reports whether every match condition of the rule holds for attrs. A rule
// without conditions matches every request; a condition on an attribute the request
// lacks fails. It does not allocate.
func (r *Rule) Matches(attrs []Attr) bool {
	for i := range r.conds {
		if !r.conds[i].holds(attrs) {
			return false
		}
	}
	return true
}

// Applies reports whether r applies to a request with attrs: its conditions hold and
// every attribute of its key is there. A rule whose key attribute is missing does not
// apply: it neither limits the request nor takes it off the rules it replaces.
func (r *Rule) Applies(attrs []Attr) bool {
	if !r.Matches(attrs) {
		return false
	}
	for _, name := range r.Key {
		if _, ok := Lookup(attrs, name); !ok {
			return false
		}
	}
	return true
}

// matchesExcept is Matches without testing condition skip (the one a matching index
// already established); skip -1 tests them all.
func (r *Rule) matchesExcept(attrs []Attr, skip int) bool {
	for i := range r.conds {
		if i != skip && !r.conds[i].holds(attrs) {
			return false
		}
	}
	return true
}

// LimitFor returns the limit for a request whose plan attribute is plan (hasPlan false when
// the request has none). A plan the rule does not list gets the rule's default limit. For
// an unlimited plan, lim is nil and unlimited is true. The returned Limit lives as long as
// the Set; it is precomputed, never built per call.
//
// With limit {requests: 100, per: 1m, burst: 150} and plans {partner: 1000, internal:
// unlimited}: no plan or plan "free" → 100/min burst 150; "partner" → 1000/min burst 1500;
// "internal" → (nil, true).
func (r *Rule) LimitFor(plan string, hasPlan bool) (lim *localbucket.Limit, unlimited bool) {
	if r.Unlimited {
		return nil, true
	}
	if hasPlan && r.plans != nil {
		if p, ok := r.plans[plan]; ok {
			if p.unlimited {
				return nil, true
			}
			return &p.limit, false
		}
	}
	return &r.limit, false
}

// HasPlans reports whether the rule's limit depends on the request's plan attribute
// (it lists plans); LimitFor and SplitLimitFor ignore the plan otherwise.
func (r *Rule) HasPlans() bool { return r.plans != nil }

// SplitLimitFor is LimitFor divided among n daemons: each enforces ceil(requests/n)
// (and ceil(burst/n)), at least 1, so together they allow about the rule's limit. The
// limits for the last n asked are cached, so a steady daemon count allocates nothing.
func (r *Rule) SplitLimitFor(plan string, hasPlan bool, n int) (lim *localbucket.Limit, unlimited bool) {
	full, unlimited := r.LimitFor(plan, hasPlan)
	if unlimited || n <= 1 {
		return full, unlimited
	}
	sl := r.split.Load()
	if sl == nil || sl.n != uint64(n) {
		sl = r.buildSplit(uint64(n))
		r.split.Store(sl)
	}
	if full == &r.limit {
		return &sl.def, false
	}
	if l := sl.plans[plan]; l != nil {
		return l, false
	}
	return full, false
}

// SplitLimit is l divided among n daemons, as SplitLimitFor divides a rule's: each
// enforces ceil(requests/n) (and ceil(burst/n)), at least 1.
func SplitLimit(l *localbucket.Limit, n uint64) (localbucket.Limit, error) {
	req := max(1, (l.Requests()+n-1)/n)
	var burst uint64
	if l.Algorithm() == localbucket.TokenBucket {
		burst = max(1, (l.Burst()+n-1)/n)
	}
	return l.WithShare(req, burst)
}

func (r *Rule) buildSplit(n uint64) *splitLimits {
	div := func(l *localbucket.Limit) localbucket.Limit {
		d, err := SplitLimit(l, n)
		if err != nil {
			return *l // a part too small to express: keep the whole (cannot happen for valid limits)
		}
		return d
	}
	sl := &splitLimits{n: n, def: div(&r.limit), plans: map[string]*localbucket.Limit{}}
	for name, p := range r.plans {
		if !p.unlimited {
			d := div(&p.limit)
			sl.plans[name] = &d
		}
	}
	return sl
}

// AppendKey appends the rule's client key for attrs to dst:
//
//	<rule name>:{<attr>=<escaped value>[|<attr>=<escaped value>]...}
//
// with the attributes in the order of the rule's key and values escaped by
// [AppendEscaped]. For rule "per-user" with key [user, ip] and attrs user=ann, ip=::1 the
// key is "per-user:{user=ann|ip=::1}". ok is false (and dst is returned unchanged) when a
// key attribute is missing. It does not allocate when dst has room.
func (r *Rule) AppendKey(dst []byte, attrs []Attr) ([]byte, bool) {
	if !r.key1 {
		return r.appendKeyN(dst, attrs)
	}
	// Most rules: one attribute, its name at most 8 bytes long, found by length and
	// word, and its part written by appendPlain's code, here, so that the common case
	// makes no call.
	n, w, i := r.key1Len, r.key1Word, 0
	for ; i < len(attrs); i++ {
		if a := &attrs[i]; len(a.Name) == n && shortWord(a.Name) == w {
			break
		}
	}
	if i == len(attrs) {
		return dst, false
	}
	lit, v := r.key1Lit, attrs[i].Value
	n, m, k := len(lit), len(v), len(dst)
	if n < 8 || n > 16 || m < 4 || m > 16 || cap(dst)-k < n+m+1 {
		return appendPart(dst, lit, v), true
	}
	var v0, v1 uint64
	if m >= 8 {
		v0, v1 = load64(v, 0), load64(v, m-8)
	} else {
		v0 = uint64(load32(v, 0)) | uint64(load32(v, m-4))<<32
		v1 = v0
	}
	if (v0|v1)&msb != 0 || plainWord(v0)&plainWord(v1) != msb { // a byte to escape, or + @ _ ~
		return appendPart(dst, lit, v), true
	}
	// dst[k:k+n+m+1] is in its capacity: stores at offsets checked above.
	dst = dst[:k+n+m+1]
	store64(dst, k, load64(lit, 0))
	store64(dst, k+n-8, load64(lit, n-8))
	k += n
	if m >= 8 {
		store64(dst, k, v0)
		store64(dst, k+m-8, v1)
	} else {
		store32(dst, k, uint32(v0))
		store32(dst, k+m-4, uint32(v0>>32))
	}
	dst[k+m] = '}'
	return dst, true
}

// appendKeyN is AppendKey for a key of several attributes, or of one with a long name.
func (r *Rule) appendKeyN(dst []byte, attrs []Attr) ([]byte, bool) {
	if len(r.Key) == 0 || len(r.keyLits) != len(r.Key) {
		return r.appendKeySlow(dst, attrs)
	}
	n := len(dst)
	for i, lit := range r.keyLits {
		var v string
		var ok bool
		if name := r.Key[i]; len(name) <= 8 && len(r.keyWords) == len(r.Key) {
			v, ok = lookupShort(attrs, len(name), r.keyWords[i])
		} else {
			v, ok = Lookup(attrs, name)
		}
		if !ok {
			return dst[:n], false
		}
		if i > 0 {
			dst = dst[:len(dst)-1] // the '}' appendPart wrote: the key goes on
		}
		dst = appendPart(dst, lit, v)
	}
	return dst, true
}

// appendKeySlow is AppendKey for a rule without key attributes or keyLits, as a rule
// with ip_prefix is.
func (r *Rule) appendKeySlow(dst []byte, attrs []Attr) ([]byte, bool) {
	n := len(dst)
	dst = append(dst, r.Name...)
	dst = append(dst, ":{"...)
	for i, name := range r.Key {
		v, ok := Lookup(attrs, name)
		if !ok {
			return dst[:n], false
		}
		if i > 0 {
			dst = append(dst, '|')
		}
		if p := r.IPPrefix; p != nil && name == p.Attr {
			dst = appendIPPart(dst, p, name, v)
			continue
		}
		dst = append(dst, name...) // attribute names are validated to need no escaping
		dst = append(dst, '=')
		dst = AppendEscaped(dst, v)
	}
	return append(dst, '}'), true
}

// setKeyLits computes keyLits and keyWords from the rule's name and key (parse.go, once
// valid). A rule with ip_prefix has none: its keys are built by appendKeySlow, so that
// the other rules' paths test nothing more.
func (r *Rule) setKeyLits() {
	if r.IPPrefix != nil {
		r.keyLits, r.keyWords, r.key1 = nil, nil, false
		return
	}
	r.keyLits = make([]string, len(r.Key))
	r.keyWords = make([]uint64, len(r.Key))
	for i, name := range r.Key {
		r.keyWords[i] = shortWord(name)
	}
	if r.key1 = len(r.Key) == 1 && len(r.Key[0]) <= 8; r.key1 {
		r.key1Len, r.key1Word = len(r.Key[0]), r.keyWords[0]
	}
	for i, name := range r.Key {
		if i == 0 {
			r.keyLits[i] = r.Name + ":{" + name + "="
		} else {
			r.keyLits[i] = "|" + name + "="
		}
	}
	if r.key1 {
		r.key1Lit = r.keyLits[0]
	}
}

// Set is a whole, validated rules file. Rules keep the file's order.
type Set struct {
	Rules   []*Rule
	Source  string // file name, or "built-in"
	Version string // hex sha256 of the source bytes, first 12 characters

	skipped   Errors                // LoadDir: dangling links skipped, for Warnings
	idx       atomic.Pointer[index] // built with the Set; see AppendMatching
	replacing bool                  // a rule replaces others
}

// newSet returns a Set of rules with its matching index built.
func newSet(rules []*Rule, source, version string) *Set {
	s := &Set{Rules: rules, Source: source, Version: version, replacing: anyReplaces(rules)}
	s.idx.Store(buildIndex(rules, minIndexed))
	return s
}

func itoa(v uint64) string {
	var b [20]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + v%10)
		v /= 10
		if v == 0 {
			break
		}
	}
	return string(b[i:])
}
