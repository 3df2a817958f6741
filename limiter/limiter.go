// Package limiter is the decision engine: for one request it matches the rules, derives
// each rule's client key, validates the inline limits, applies every check to the store
// all-or-nothing and chooses the deciding rule.
//
// A Limiter is safe for concurrent use. Its rules are swapped atomically (SetRules), so a
// check sees either the old rule set or the new one, never a mix. Callers bring their own
// Decision, which holds the scratch space a check needs; reusing one Decision per
// connection makes Check allocation-free once the keys exist.
package limiter

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// Limiter decides requests against a rule set, a store of local buckets and, when the
// daemon has Redis, the hybrid mode's allowances.
type Limiter struct {
	rules       atomic.Pointer[rules.Set]
	store       *localbucket.Store
	hybrid      *rlsync.Hybrid
	global      *rlsync.Global
	globalWait  time.Duration
	defaultMode rules.Mode
	shadowAll   atomic.Bool
}

// New returns a Limiter deciding with set on store, every rule in local mode.
func New(set *rules.Set, store *localbucket.Store) *Limiter {
	l := &Limiter{store: store, defaultMode: rules.ModeLocal}
	l.rules.Store(set)
	return l
}

// WithHybrid makes the limiter decide hybrid-mode rules with h, and rules that do not
// name a mode in hybrid mode too: the default when the daemon has Redis. Call it before
// the limiter is used.
func (l *Limiter) WithHybrid(h *rlsync.Hybrid) *Limiter {
	l.hybrid = h
	l.defaultMode = rules.ModeHybrid
	return l
}

// WithGlobal makes the limiter decide global-mode rules with g, waiting at most timeout
// for Redis per check; past it (or on any error) each rule's failure policy decides.
func (l *Limiter) WithGlobal(g *rlsync.Global, timeout time.Duration) *Limiter {
	l.global = g
	l.globalWait = timeout
	return l
}

// splitAmong is how many daemons a split rule's limit is divided among: its own number,
// or for split: auto the live daemons Redis heartbeats count (1 without Redis).
func (l *Limiter) splitAmong(r *rules.Rule) int {
	if !r.SplitAuto {
		return int(r.Split)
	}
	if l.hybrid == nil {
		return 1
	}
	return l.hybrid.Replicas()
}

// resolve turns a rule's mode into the one the limiter can apply: a rule that names none
// takes the default; without the store a mode needs (replay, or a limiter built without
// Redis) it runs locally. serve refuses such rules up front (CheckModes).
func (l *Limiter) resolve(m rules.Mode) rules.Mode {
	if m == rules.ModeDefault {
		m = l.defaultMode
	}
	if m == rules.ModeHybrid && l.hybrid == nil || m == rules.ModeGlobal && l.global == nil {
		return rules.ModeLocal
	}
	return m
}

// SetShadowAll makes every rule a shadow rule (counted and reported, never rejecting)
// while on: the --shadow switch, for dark-launching a whole rule set.
func (l *Limiter) SetShadowAll(on bool) { l.shadowAll.Store(on) }

// ShadowAll reports whether every rule is forced to shadow.
func (l *Limiter) ShadowAll() bool { return l.shadowAll.Load() }

// ModeOf returns the mode the limiter applies to r.
func (l *Limiter) ModeOf(r *rules.Rule) rules.Mode { return l.resolve(r.Mode) }

// RedisPrefix starts every Redis key: the limiter's client key follows it.
const RedisPrefix = "rl:"

// Rules returns the active rule set.
func (l *Limiter) Rules() *rules.Set { return l.rules.Load() }

// SetRules swaps in a new rule set; checks already running finish with the old one.
func (l *Limiter) SetRules(set *rules.Set) { l.rules.Store(set) }

// Store returns the store the limiter decides on.
func (l *Limiter) Store() *localbucket.Store { return l.store }

// CheckModes reports an error for the first rule whose mode needs a store the daemon does
// not have. Without Redis every rule runs in local mode; hybrid and global need one.
func CheckModes(set *rules.Set, haveRedis bool) error {
	if haveRedis {
		return nil
	}
	for _, r := range set.Rules {
		if r.SplitAuto {
			return fmt.Errorf("%s:%d: rule %q: split: auto counts the live daemons through Redis, and this daemon has none; give a number", r.File, r.Line, r.Name)
		}
		if r.Mode == rules.ModeHybrid || r.Mode == rules.ModeGlobal {
			return fmt.Errorf("%s:%d: rule %q: mode %s needs a Redis store, and this daemon has none; use mode local or leave mode out",
				r.File, r.Line, r.Name, r.Mode)
		}
	}
	return nil
}

// Inline is a limit carried by the request itself. Zero numeric fields mean absent.
type Inline struct {
	Key       string
	Name      string
	Algorithm string
	Mode      string
	Limit     uint64
	WindowMs  uint64
	Burst     uint64
}

// Input is one request: its attributes, its inline limits and its cost.
type Input struct {
	Attrs  []rules.Attr
	Limits []Inline
	Cost   uint64 // 0 asks without consuming
}

// Result is one matched rule's or inline limit's part of a decision. Durations are in
// nanoseconds.
type Result struct {
	Name       string
	Limit      uint64
	Window     time.Duration
	Remaining  uint64
	Reset      time.Duration
	RetryAfter time.Duration
	Allowed    bool
	Shadow     bool
	// Impossible: the cost exceeds this rule's capacity; no retry can ever pass.
	Impossible bool
	// Degraded: a failure policy decided this check; the store it needs did not answer.
	Degraded bool
	// Rule is the rule this result is for; nil for an inline limit.
	Rule *rules.Rule
	// Key is the client key checked (valid until the next Check with this Decision).
	Key []byte
}

// Decision is the answer to one request, and the scratch space that produced it.
// Reuse one per goroutine; the zero value is ready to use.
//
// Example: with rules per-ip (100/s) and per-user (5/min) both matching, and per-user
// having 3 left after this request, Allowed is true and Deciding points at per-user.
type Decision struct {
	Allowed  bool
	Deciding int // index in Results of the deciding rule; -1 when no rule decides
	Degraded bool
	Results  []Result

	ops    []localbucket.Op
	hops   []rlsync.HybridOp
	gops   []rlsync.GlobalOp
	hfb    []fallback    // per hybrid op
	gfb    []fallback    // per global op
	fixed  []fixedResult // results decided by a failure policy alone
	where  []opRef       // per result: where its check is
	keys   []byte
	ends   []int
	limits []localbucket.Limit
}

// opRef says which list holds a result's check, and where.
type opRef struct {
	kind     rules.Mode // ModeLocal, ModeHybrid, ModeGlobal, or ModeDefault for fixed
	idx      int32
	degraded bool // moved here by a failure policy
}

// fixedResult is a check's result decided by a failure policy, with its limit.
type fixedResult struct {
	res localbucket.Result
	lim *localbucket.Limit
}

// fallback is what decides a Redis-backed check when Redis cannot: the rule's policy,
// and for policy local the limit of the local bucket (the rule's limit divided among the
// live daemons last counted).
type fallback struct {
	policy rules.FailurePolicy
	local  *localbucket.Limit
}

// DecidingResult returns the deciding rule's result, or nil when nothing decides.
func (d *Decision) DecidingResult() *Result {
	if d.Deciding < 0 {
		return nil
	}
	return &d.Results[d.Deciding]
}

// InvalidLimitError reports an inline limit the limiter cannot apply.
type InvalidLimitError struct {
	Index  int
	Reason string
}

func (e *InvalidLimitError) Error() string {
	return "limits[" + strconv.Itoa(e.Index) + "]: " + e.Reason
}

// Check decides in at time now (Unix nanoseconds, read once at the edge) and fills d.
// It returns *InvalidLimitError when an inline limit is malformed; then nothing is consumed.
// It is Prepare then Decide.
func (l *Limiter) Check(now int64, in *Input, d *Decision) error {
	if _, err := l.Prepare(in, d); err != nil {
		return err
	}
	l.Decide(now, d)
	return nil
}

// Prepare is the first half of Check: it matches the rules, derives the keys and
// validates the inline limits into d, consuming nothing, and reports whether Decide will
// wait on Redis (a global-mode check), so a caller can decide such a request off its
// fast path. d then refers to in's strings (inline limit names): keep them until Decide.
// It returns *InvalidLimitError when an inline limit is malformed.
func (l *Limiter) Prepare(in *Input, d *Decision) (waits bool, err error) {
	set := l.rules.Load()
	d.Allowed = true
	d.Deciding = -1
	d.Degraded = false
	d.Results = d.Results[:0]
	d.ops = d.ops[:0]
	d.hops = d.hops[:0]
	d.where = d.where[:0]
	d.gops = d.gops[:0]
	d.hfb = d.hfb[:0]
	d.gfb = d.gfb[:0]
	d.fixed = d.fixed[:0]
	d.keys = d.keys[:0]
	d.ends = d.ends[:0]

	plan, hasPlan := rules.Lookup(in.Attrs, "plan")
	shadowAll := l.shadowAll.Load()
	for _, r := range set.Rules {
		if !r.Matches(in.Attrs) {
			continue
		}
		var lim *localbucket.Limit
		var unlimited bool
		if r.Split > 0 || r.SplitAuto {
			lim, unlimited = r.SplitLimitFor(plan, hasPlan, l.splitAmong(r))
		} else {
			lim, unlimited = r.LimitFor(plan, hasPlan)
		}
		if unlimited {
			continue
		}
		mode := l.resolve(r.Mode)
		var ok bool
		start := len(d.keys)
		if mode != rules.ModeLocal {
			d.keys = append(d.keys, RedisPrefix...)
		}
		d.keys, ok = r.AppendKey(d.keys, in.Attrs)
		if !ok {
			d.keys = d.keys[:start]
			continue
		}
		d.ends = append(d.ends, len(d.keys))
		var fb fallback
		if mode != rules.ModeLocal {
			fb = fallback{r.OnStoreFailure, lim}
			if l.hybrid != nil {
				fb.local, _ = r.SplitLimitFor(plan, hasPlan, l.hybrid.Replicas())
			}
		}
		shadow := r.Shadow || shadowAll
		d.add(mode, lim, in.Cost, shadow, fb)
		d.Results = append(d.Results, Result{Name: r.Name, Shadow: shadow, Rule: r})
	}

	if len(in.Limits) > 0 {
		if cap(d.limits) < len(in.Limits) {
			d.limits = make([]localbucket.Limit, len(in.Limits))
		}
		d.limits = d.limits[:len(in.Limits)]
		for i := range in.Limits {
			il := &in.Limits[i]
			mode, err := l.inlineLimit(i, il, &d.limits[i])
			if err != nil {
				return false, err
			}
			if mode != rules.ModeLocal {
				d.keys = append(d.keys, RedisPrefix...)
			}
			d.keys = appendInlineKey(d.keys, il, &d.limits[i])
			d.ends = append(d.ends, len(d.keys))
			name := il.Name
			if name == "" {
				name = il.Key
			}
			d.add(mode, &d.limits[i], in.Cost, false, fallback{rules.FailLocal, &d.limits[i]})
			d.Results = append(d.Results, Result{Name: name})
		}
	}
	if len(d.where) == 0 {
		return false, nil
	}

	// Keys were appended to one buffer; slice them only now that it no longer grows.
	start := 0
	for i, w := range d.where {
		key := d.keys[start:d.ends[i]]
		start = d.ends[i]
		d.Results[i].Key = key
		switch w.kind {
		case rules.ModeLocal:
			d.ops[w.idx].Key = key
		case rules.ModeHybrid:
			d.hops[w.idx].Key = key
		default:
			d.gops[w.idx].Key = string(key) // the global path goes to Redis anyway
		}
	}
	return len(d.gops) > 0, nil
}

// Decide is the second half of Check: it applies the checks Prepare put in d at time now,
// all-or-nothing, and fills in d's results and deciding rule. It waits on Redis (at most
// the global timeout) only when Prepare said so.
func (l *Limiter) Decide(now int64, d *Decision) {
	if len(d.where) == 0 {
		return
	}
	d.Allowed = l.apply(now, d)

	for i, w := range d.where {
		var res *localbucket.Result
		var lim *localbucket.Limit
		switch w.kind {
		case rules.ModeLocal:
			res, lim = &d.ops[w.idx].Result, d.ops[w.idx].Limit
		case rules.ModeHybrid:
			res, lim = &d.hops[w.idx].Result, d.hops[w.idx].Limit
		case rules.ModeGlobal:
			res, lim = &d.gops[w.idx].Result, d.gops[w.idx].Limit
		default:
			res, lim = &d.fixed[w.idx].res, d.fixed[w.idx].lim
		}
		out := &d.Results[i]
		out.Limit = res.Limit
		out.Window = lim.Window()
		out.Remaining = res.Remaining
		out.Reset = time.Duration(res.Reset)
		out.RetryAfter = time.Duration(res.RetryAfter)
		out.Allowed = res.Allowed
		out.Impossible = res.Impossible
		out.Degraded = w.kind == rules.ModeDefault || w.degraded
	}
	d.Deciding = deciding(d.Allowed, d.Results)
}

// add appends one check to the list its mode decides it with.
func (d *Decision) add(mode rules.Mode, lim *localbucket.Limit, cost uint64, shadow bool, fb fallback) {
	switch mode {
	case rules.ModeHybrid:
		d.where = append(d.where, opRef{kind: mode, idx: int32(len(d.hops))})
		d.hops = append(d.hops, rlsync.HybridOp{Limit: lim, Cost: cost, Shadow: shadow})
		d.hfb = append(d.hfb, fb)
	case rules.ModeGlobal:
		d.where = append(d.where, opRef{kind: mode, idx: int32(len(d.gops))})
		d.gops = append(d.gops, rlsync.GlobalOp{Limit: lim, Cost: cost, Shadow: shadow})
		d.gfb = append(d.gfb, fb)
	default:
		d.where = append(d.where, opRef{kind: rules.ModeLocal, idx: int32(len(d.ops))})
		d.ops = append(d.ops, localbucket.Op{Limit: lim, Cost: cost, Shadow: shadow})
	}
}

// apply decides the request's checks all-or-nothing across the three modes, cheapest to
// give back first: hybrid allowances (given back locally), then the exact global checks
// (one Redis round trip; given back with a refund script), then the local buckets, which
// commit only when everything passed. A check that rejects leaves the later ones only
// reporting (the local buckets through Reject), and gives back what earlier ones took.
func (l *Limiter) apply(now int64, d *Decision) bool {
	if len(d.hops) == 0 && len(d.gops) == 0 {
		return l.store.Apply(now, d.ops)
	}
	ok := true
	if len(d.hops) > 0 && !l.hybrid.Healthy(now) {
		// Redis has not answered for a while: the allowances are stale. Each rule's
		// failure policy decides instead, and the decision says so.
		for i := range d.hops {
			op := &d.hops[i]
			ok = d.unavailable(rules.ModeHybrid, i, op.Key, op.Limit, op.Cost, op.Shadow, d.hfb[i]) && ok
		}
		d.hops = d.hops[:0]
	}
	if len(d.hops) > 0 {
		ok = l.hybrid.Take(now, d.hops)
	}
	globalTook := false
	if ok && len(d.gops) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), l.globalWait)
		gok, err := l.global.Check(ctx, d.gops)
		cancel()
		if err != nil {
			gok = true
			for i := range d.gops {
				op := &d.gops[i]
				gok = d.unavailable(rules.ModeGlobal, i, []byte(op.Key), op.Limit, op.Cost, op.Shadow, d.gfb[i]) && gok
			}
			d.gops = d.gops[:0]
		} else {
			globalTook = gok
		}
		if !gok {
			ok = false
			if len(d.hops) > 0 {
				l.hybrid.Undo(d.hops)
			}
		}
	}
	if !ok {
		if len(d.ops) > 0 {
			l.store.Reject(now, d.ops)
		}
		return false
	}
	if len(d.ops) == 0 || l.store.Apply(now, d.ops) {
		return true
	}
	if len(d.hops) > 0 {
		l.hybrid.Undo(d.hops)
	}
	if globalTook {
		// Undo bounds itself (not by globalWait: the decision is made, only capacity is
		// at stake). A failed refund leaves capacity used until it refills.
		_ = l.global.Undo(context.Background(), d.gops)
	}
	return false
}

// unavailable decides the check at index i of the kind's list without the store it
// needs, by its failure policy: open allows, closed rejects (retry in a second), local
// moves it to a local bucket holding the rule's limit divided among the live daemons.
// It points the check's result at its new place and marks the decision degraded; it
// reports whether the check may pass so far.
func (d *Decision) unavailable(kind rules.Mode, i int, key []byte, lim *localbucket.Limit, cost uint64, shadow bool, fb fallback) bool {
	d.Degraded = true
	var to opRef
	ok := true
	switch fb.policy {
	case rules.FailOpen:
		to = opRef{kind: rules.ModeDefault, idx: int32(len(d.fixed))}
		d.fixed = append(d.fixed, fixedResult{localbucket.Result{Allowed: true, Limit: lim.Requests(), Remaining: lim.Capacity()}, lim})
	case rules.FailClosed:
		to = opRef{kind: rules.ModeDefault, idx: int32(len(d.fixed))}
		d.fixed = append(d.fixed, fixedResult{localbucket.Result{Limit: lim.Requests(), RetryAfter: int64(time.Second)}, lim})
		ok = shadow
	default:
		local := fb.local
		if local == nil {
			local = lim
		}
		to = opRef{kind: rules.ModeLocal, idx: int32(len(d.ops))}
		d.ops = append(d.ops, localbucket.Op{Key: key, Limit: local, Cost: cost, Shadow: shadow})
	}
	to.degraded = true
	for w := range d.where {
		if d.where[w].kind == kind && d.where[w].idx == int32(i) {
			d.where[w] = to
		}
	}
	return ok
}

// deciding chooses the deciding rule: when allowed, the non-shadow rule with the least
// remaining; when rejected, the rejecting non-shadow rule with the longest retry-after
// (one that can never pass counts as longest). Ties go to the first listed.
func deciding(allowed bool, results []Result) int {
	best := -1
	for i := range results {
		r := &results[i]
		if r.Shadow {
			continue
		}
		if allowed {
			if best < 0 || r.Remaining < results[best].Remaining {
				best = i
			}
			continue
		}
		if r.Allowed {
			continue
		}
		if best < 0 {
			best = i
			continue
		}
		b := &results[best]
		if b.Impossible {
			continue
		}
		if r.Impossible || r.RetryAfter > b.RetryAfter {
			best = i
		}
	}
	return best
}

func (l *Limiter) inlineLimit(i int, il *Inline, out *localbucket.Limit) (rules.Mode, error) {
	mode, err := l.inlineMode(i, il)
	if err != nil {
		return mode, err
	}
	return mode, inlineLimit(i, il, out)
}

func (l *Limiter) inlineMode(i int, il *Inline) (rules.Mode, error) {
	switch il.Mode {
	case "":
		return l.defaultMode, nil
	case "local":
		return rules.ModeLocal, nil
	case "hybrid":
		if l.hybrid != nil {
			return rules.ModeHybrid, nil
		}
		return 0, &InvalidLimitError{i, "mode hybrid needs a Redis store, and this daemon has none; use local or leave mode out"}
	case "global":
		if l.global != nil {
			return rules.ModeGlobal, nil
		}
		return 0, &InvalidLimitError{i, "mode global needs a Redis store, and this daemon has none; use local or leave mode out"}
	}
	return 0, &InvalidLimitError{i, fmt.Sprintf("unknown mode %q; use local, hybrid or global", il.Mode)}
}

func inlineLimit(i int, il *Inline, out *localbucket.Limit) error {
	if il.Key == "" {
		return &InvalidLimitError{i, `"key" is required and must not be empty`}
	}
	if il.Limit == 0 {
		return &InvalidLimitError{i, `"limit" must be at least 1`}
	}
	if il.WindowMs == 0 {
		return &InvalidLimitError{i, `"window_ms" must be at least 1`}
	}
	alg := localbucket.TokenBucket
	if il.Algorithm != "" {
		a, err := localbucket.ParseAlgorithm(il.Algorithm)
		if err != nil {
			return &InvalidLimitError{i, err.Error()}
		}
		alg = a
	}
	if il.WindowMs > uint64(366*24*time.Hour/time.Millisecond) {
		return &InvalidLimitError{i, `"window_ms" must be at most 366 days`}
	}
	lim, err := localbucket.NewLimit(alg, il.Limit, time.Duration(il.WindowMs)*time.Millisecond, il.Burst)
	if err != nil {
		return &InvalidLimitError{i, err.Error()}
	}
	*out = lim
	return nil
}

// appendInlineKey writes ~inline/<algorithm>/<limit>/<window_ms>/<burst>:{<escaped key>}.
// Two inline limits share state only when they agree on key and every parameter.
func appendInlineKey(dst []byte, il *Inline, lim *localbucket.Limit) []byte {
	dst = append(dst, "~inline/"...)
	dst = append(dst, lim.Algorithm().String()...)
	dst = append(dst, '/')
	dst = strconv.AppendUint(dst, il.Limit, 10)
	dst = append(dst, '/')
	dst = strconv.AppendUint(dst, il.WindowMs, 10)
	dst = append(dst, '/')
	dst = strconv.AppendUint(dst, lim.Burst(), 10)
	dst = append(dst, ":{"...)
	dst = rules.AppendEscaped(dst, il.Key)
	return append(dst, '}')
}

// Sweep drops the state of keys that carry no information any more (full buckets,
// windows that have passed), so memory follows the active keys. Call it periodically.
func (l *Limiter) Sweep(now int64) int { return l.store.Sweep(now) }
