package daemon

import (
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// ruleHeads caches, per rule, the constant part of its entry in check answers (a
// proto.RuleHead: name, limit, window_ms), so an answer copies it instead of encoding it.
// A rule's limit and window can vary from one answer to the next (its plans, a split
// limit as daemons come and go), so a rule keeps a head per limit and window seen: the
// first one, found by get inline, and up to maxHeadVariants-1 more, found by a search,
// the oldest of those dropped for a new one past that.
//
// Entries are found by rules.Rule.Index and belong to the rule pointer they were made
// for, so a reloaded set's rules replace the old ones' as they are seen (entries past a
// smaller new set's last index stay, a few hundred bytes per rule). Reads take no lock;
// a miss builds the head (once per rule, limit and window). Safe for concurrent use; the
// zero value is ready.
type ruleHeads struct {
	t atomic.Pointer[headTable]
}

// maxHeadVariants is how many (limit, window) heads a rule keeps.
const maxHeadVariants = 8

// ruleHead is one rule's heads, immutable once published: add replaces it whole.
type ruleHead struct {
	rule  *rules.Rule
	name  string // the answers' name for rule (its Name)
	first headVariant
	more  []headVariant // the other variants, oldest first
}

type headVariant struct {
	key  headKey
	head *proto.RuleHead
}

// headKey is what varies among a rule's entries: its limit and window.
type headKey struct {
	limit  uint64
	window time.Duration
}

// get returns the head of r's entry, or nil when r has none to cache (an inline limit, or
// a result whose name is not its rule's): the caller then encodes the entry in full.
func (c *ruleHeads) get(r *limiter.Result) *proto.RuleHead {
	if h := c.table().first(r); h != nil {
		return h
	}
	return c.find(r)
}

// headTable is the table of rule heads, by rule index. A table replaces the one it
// grows from; each slot is replaced whole (ruleHead is immutable).
type headTable []atomic.Pointer[ruleHead]

// table returns the heads' table as it is now: an answer reads it once for its entries.
func (c *ruleHeads) table() headTable {
	if t := c.t.Load(); t != nil {
		return *t
	}
	return nil
}

// first is get's common case, inlined: the head of r's rule's first variant when r is for
// it and named by the rule's own name string; else nil (then find knows).
func (t headTable) first(r *limiter.Result) *proto.RuleHead {
	rule := r.Rule
	if rule == nil || uint(rule.Index) >= uint(len(t)) {
		return nil
	}
	e := t[rule.Index].Load()
	if e == nil || e.rule != rule || e.first.key != (headKey{r.Limit, r.Window}) ||
		unsafe.StringData(e.name) != unsafe.StringData(r.Name) || len(e.name) != len(r.Name) {
		return nil
	}
	return e.first.head
}

// find is get past first: a search of r's rule's variants, then add.
func (c *ruleHeads) find(r *limiter.Result) *proto.RuleHead {
	if r.Rule == nil || r.Rule.Index < 0 {
		return nil
	}
	if t := c.t.Load(); t != nil && r.Rule.Index < len(*t) {
		if e := (*t)[r.Rule.Index].Load(); e != nil && e.rule == r.Rule {
			if e.name != r.Name {
				return nil // not its rule's name: not cached
			}
			if h := e.variant(r); h != nil {
				return h
			}
		}
	}
	return c.add(r)
}

// variant returns e's head for r's limit and window, nil when it has none.
func (e *ruleHead) variant(r *limiter.Result) *proto.RuleHead {
	k := headKey{r.Limit, r.Window}
	if e.first.key == k {
		return e.first.head
	}
	for i := range e.more {
		if v := &e.more[i]; v.key == k {
			return v.head
		}
	}
	return nil
}

// add makes r's head and publishes it, growing the table (doubling, so the copies cost
// O(rules) in all) when r's index is past its end.
func (c *ruleHeads) add(r *limiter.Result) *proto.RuleHead {
	v := headVariant{key: headKey{r.Limit, r.Window},
		head: proto.NewRuleHead(r.Name, r.Limit, uint64(r.Window/time.Millisecond))}
	x := r.Rule.Index
	for {
		old := c.t.Load()
		if old != nil && x < len(*old) {
			slot := &(*old)[x]
			e := slot.Load()
			next := &ruleHead{rule: r.Rule, name: r.Name, first: v}
			if e != nil && e.rule == r.Rule {
				if e.name != r.Name {
					return nil // not its rule's name: not cached
				}
				if h := e.variant(r); h != nil {
					return h // published meanwhile
				}
				keep := e.more[max(0, len(e.more)-(maxHeadVariants-2)):]
				next.first = e.first
				next.more = append(append(make([]headVariant, 0, len(keep)+1), keep...), v)
			}
			if slot.CompareAndSwap(e, next) {
				// Stored in a table being replaced, it may be lost: made again then.
				return v.head
			}
			continue
		}
		n := 16
		if old != nil {
			n = 2 * len(*old)
		}
		t := make(headTable, max(n, x+1))
		if old != nil {
			for i := range *old {
				t[i].Store((*old)[i].Load())
			}
		}
		c.t.CompareAndSwap(old, &t) // then store into whichever table won
	}
}
