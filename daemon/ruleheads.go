package daemon

import (
	"sync/atomic"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// ruleHeads caches, per rule, the constant part of its entry in check answers (a
// proto.RuleHead: name, limit, window_ms), so an answer copies it instead of encoding it.
// Entries are found by rules.Rule.Index and belong to the rule pointer they were made
// for, so a reloaded set's rules replace the old ones' as they are seen (entries past a
// smaller new set's last index stay, about a hundred bytes per rule). Reads take no
// lock; a miss builds the entry (once per rule and set). Safe for concurrent use; the
// zero value is ready.
type ruleHeads struct {
	t atomic.Pointer[[]atomic.Pointer[ruleHead]]
}

type ruleHead struct {
	rule *rules.Rule
	head *proto.RuleHead
}

// get returns the head of r's entry, windowMs being its window in milliseconds, or nil
// when r has none to cache: an inline limit, or a rule whose limit or window varies
// from one answer to the next (then the caller encodes the entry in full).
func (c *ruleHeads) get(r *limiter.Result, windowMs uint64) *proto.RuleHead {
	rule := r.Rule
	if rule == nil {
		return nil
	}
	if t := c.t.Load(); t != nil && rule.Index < len(*t) {
		if e := (*t)[rule.Index].Load(); e != nil && e.rule == rule {
			if e.head.Is(r.Name, r.Limit, windowMs) {
				return e.head
			}
			return nil // this rule's entries vary: not cached
		}
	}
	return c.add(r, windowMs)
}

// add makes r's entry and publishes it, growing the table (doubling, so the copies cost
// O(rules) in all) when r's index is past its end.
func (c *ruleHeads) add(r *limiter.Result, windowMs uint64) *proto.RuleHead {
	e := &ruleHead{rule: r.Rule, head: proto.NewRuleHead(r.Name, r.Limit, windowMs)}
	x := r.Rule.Index
	if x < 0 {
		return e.head
	}
	for {
		old := c.t.Load()
		if old != nil && x < len(*old) {
			(*old)[x].Store(e) // an entry stored in a table being replaced may be lost: made again
			return e.head
		}
		n := 16
		if old != nil {
			n = 2 * len(*old)
		}
		t := make([]atomic.Pointer[ruleHead], max(n, x+1))
		if old != nil {
			for i := range *old {
				t[i].Store((*old)[i].Load())
			}
		}
		t[x].Store(e)
		if c.t.CompareAndSwap(old, &t) {
			return e.head
		}
	}
}
