package daemon

import (
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/rules"
)

// TestRuleHeads: a rule's head is made once and found again; a rule of a reloaded set
// at the same index replaces the old one's; a rule whose limit varies, and an inline
// limit, get none (their entries are encoded in full); the table grows past its end
// keeping what it holds; and concurrent readers and writers agree (run with -race).
func TestRuleHeads(t *testing.T) {
	var c ruleHeads
	a := &rules.Rule{Name: "a", Index: 0}
	b := &rules.Rule{Name: "b", Index: 0} // the reloaded set's rule at a's index
	far := &rules.Rule{Name: "far", Index: 100}
	res := func(r *rules.Rule, limit uint64) *limiter.Result {
		return &limiter.Result{Rule: r, Name: r.Name, Limit: limit, Window: time.Second}
	}
	ha := c.get(res(a, 5), 1000)
	if ha == nil || !ha.Is("a", 5, 1000) || c.get(res(a, 5), 1000) != ha {
		t.Fatalf("a's head: %v, then another", ha)
	}
	if h := c.get(res(a, 6), 1000); h != nil {
		t.Fatal("a head for a limit the cached one does not encode")
	}
	hb := c.get(res(b, 7), 1000)
	if hb == nil || !hb.Is("b", 7, 1000) || c.get(res(b, 7), 1000) != hb {
		t.Fatalf("after the reload, b's head: %v", hb)
	}
	if h := c.get(&limiter.Result{Name: "~inline", Limit: 3, Window: time.Second}, 1000); h != nil {
		t.Fatal("an inline limit got a head")
	}
	hf := c.get(res(far, 1), 1000)
	if hf == nil || !hf.Is("far", 1, 1000) || c.get(res(b, 7), 1000) != hb {
		t.Fatal("growing the table lost an entry or made a wrong one")
	}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				r := &rules.Rule{Name: "r", Index: i % 50}
				if h := c.get(res(r, uint64(i)), 1000); h == nil || !h.Is("r", uint64(i), 1000) {
					t.Errorf("rule %d: head %v", i, h)
					return
				}
			}
		}()
	}
	wg.Wait()
}
