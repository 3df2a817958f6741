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
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// Limiter decides requests against a rule set and a store of buckets.
type Limiter struct {
	rules atomic.Pointer[rules.Set]
	store *localbucket.Store
}

// New returns a Limiter deciding with set on store.
func New(set *rules.Set, store *localbucket.Store) *Limiter {
	l := &Limiter{store: store}
	l.rules.Store(set)
	return l
}

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
	keys   []byte
	ends   []int
	limits []localbucket.Limit
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
func (l *Limiter) Check(now int64, in *Input, d *Decision) error {
	set := l.rules.Load()
	d.Allowed = true
	d.Deciding = -1
	d.Degraded = false
	d.Results = d.Results[:0]
	d.ops = d.ops[:0]
	d.keys = d.keys[:0]
	d.ends = d.ends[:0]

	plan, hasPlan := rules.Lookup(in.Attrs, "plan")
	for _, r := range set.Rules {
		if !r.Matches(in.Attrs) {
			continue
		}
		lim, unlimited := r.LimitFor(plan, hasPlan)
		if unlimited {
			continue
		}
		var ok bool
		start := len(d.keys)
		d.keys, ok = r.AppendKey(d.keys, in.Attrs)
		if !ok {
			d.keys = d.keys[:start]
			continue
		}
		d.ends = append(d.ends, len(d.keys))
		d.ops = append(d.ops, localbucket.Op{Limit: lim, Cost: in.Cost, Shadow: r.Shadow})
		d.Results = append(d.Results, Result{Name: r.Name, Shadow: r.Shadow})
	}

	if len(in.Limits) > 0 {
		if cap(d.limits) < len(in.Limits) {
			d.limits = make([]localbucket.Limit, len(in.Limits))
		}
		d.limits = d.limits[:len(in.Limits)]
		for i := range in.Limits {
			il := &in.Limits[i]
			if err := inlineLimit(i, il, &d.limits[i]); err != nil {
				return err
			}
			d.keys = appendInlineKey(d.keys, il, &d.limits[i])
			d.ends = append(d.ends, len(d.keys))
			name := il.Name
			if name == "" {
				name = il.Key
			}
			d.ops = append(d.ops, localbucket.Op{Limit: &d.limits[i], Cost: in.Cost})
			d.Results = append(d.Results, Result{Name: name})
		}
	}
	if len(d.ops) == 0 {
		return nil
	}

	// Keys were appended to one buffer; slice them only now that it no longer grows.
	start := 0
	for i := range d.ops {
		d.ops[i].Key = d.keys[start:d.ends[i]]
		start = d.ends[i]
	}

	d.Allowed = l.store.Apply(now, d.ops)

	for i := range d.ops {
		res := &d.ops[i].Result
		out := &d.Results[i]
		out.Limit = res.Limit
		out.Window = d.ops[i].Limit.Window()
		out.Remaining = res.Remaining
		out.Reset = time.Duration(res.Reset)
		out.RetryAfter = time.Duration(res.RetryAfter)
		out.Allowed = res.Allowed
		out.Impossible = res.Impossible
	}
	d.Deciding = deciding(d.Allowed, d.Results)
	return nil
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
	switch il.Mode {
	case "", "local":
	case "hybrid", "global":
		return &InvalidLimitError{i, fmt.Sprintf("mode %s needs a Redis store, and this daemon has none; use local or leave mode out", il.Mode)}
	default:
		return &InvalidLimitError{i, fmt.Sprintf("unknown mode %q; use local, hybrid or global", il.Mode)}
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
