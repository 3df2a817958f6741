package daemon

import (
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/rules"
)

// TestRuleHeads: a rule's head is made once and found again; a rule whose limit or window
// varies (plans, a split) gets one per variant, up to maxHeadVariants, the oldest but the
// first dropped past that; a rule of a reloaded set at the same index replaces the old one's; an inline
// limit, and a result not named as its rule was first, get none (encoded in full); the
// table grows past its end keeping what it holds; and concurrent readers and writers
// agree (run with -race).
func TestRuleHeads(t *testing.T) {
	var c ruleHeads
	a := &rules.Rule{Name: "a", Index: 0}
	b := &rules.Rule{Name: "b", Index: 0} // the reloaded set's rule at a's index
	far := &rules.Rule{Name: "far", Index: 100}
	res := func(r *rules.Rule, limit uint64, window time.Duration) *limiter.Result {
		return &limiter.Result{Rule: r, Name: r.Name, Limit: limit, Window: window}
	}
	ha := c.get(res(a, 5, time.Second))
	if ha == nil || !ha.Is("a", 5, 1000) || c.get(res(a, 5, time.Second)) != ha {
		t.Fatalf("a's head: %v, then another", ha)
	}
	// Variants by limit and by window, each found again; a's first one still there.
	ha6 := c.get(res(a, 6, time.Second))
	haW := c.get(res(a, 5, time.Minute))
	if ha6 == nil || !ha6.Is("a", 6, 1000) || haW == nil || !haW.Is("a", 5, 60000) {
		t.Fatalf("a's variants: %v %v", ha6, haW)
	}
	if c.get(res(a, 6, time.Second)) != ha6 || c.get(res(a, 5, time.Minute)) != haW || c.get(res(a, 5, time.Second)) != ha {
		t.Fatal("a variant was not found again")
	}
	// Past maxHeadVariants the oldest but the first goes: a new head for it, right still.
	for l := uint64(100); l < 100+maxHeadVariants; l++ {
		if h := c.get(res(a, l, time.Second)); h == nil || !h.Is("a", l, 1000) {
			t.Fatalf("a's variant %d: %v", l, h)
		}
	}
	if c.table().first(res(a, 5, time.Second)) != ha {
		t.Fatal("the first variant is not found at once")
	}
	if h := c.get(res(a, 6, time.Second)); h == ha6 || h == nil || !h.Is("a", 6, 1000) {
		t.Fatalf("the oldest variant after eviction: %v (the evicted one: %v)", h, ha6)
	}
	// A result named otherwise than its rule's first one: not cached.
	if h := c.get(&limiter.Result{Rule: a, Name: "other", Limit: 5, Window: time.Second}); h != nil {
		t.Fatal("a head for a name the cached one does not encode")
	}
	hb := c.get(res(b, 7, time.Second))
	if hb == nil || !hb.Is("b", 7, 1000) || c.get(res(b, 7, time.Second)) != hb {
		t.Fatalf("after the reload, b's head: %v", hb)
	}
	if h := c.get(&limiter.Result{Name: "~inline", Limit: 3, Window: time.Second}); h != nil {
		t.Fatal("an inline limit got a head")
	}
	hf := c.get(res(far, 1, time.Second))
	if hf == nil || !hf.Is("far", 1, 1000) || c.get(res(b, 7, time.Second)) != hb {
		t.Fatal("growing the table lost an entry or made a wrong one")
	}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				r := &rules.Rule{Name: "r", Index: i % 50}
				if h := c.get(res(r, uint64(i%12), time.Duration(i%3+1)*time.Second)); h == nil || !h.Is("r", uint64(i%12), uint64(i%3+1)*1000) {
					t.Errorf("rule %d: head %v", i, h)
					return
				}
			}
		}()
	}
	wg.Wait()
}
