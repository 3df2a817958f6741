package limiter

import (
	"strconv"
	"testing"
)

// Released leases and emptied slots are kept for reuse only up to the live ones plus
// spareKeep: once a peak of leases has passed, the daemon gives their memory back.
// Before, every lease and slot of the peak stayed on the free lists for good: up to
// DefaultMaxLeases of each (about 200 MB) after a burst of slow requests.
func TestLeasesPeakGivesBackSpares(t *testing.T) {
	l := newLimiter(t, leaseRules)
	const peak = 10 * spareKeep
	toks := make([]string, 0, peak)
	for i := range peak {
		ok, tok, _ := checkLease(t, l, t0, exportInput("u"+strconv.Itoa(i)), 0)
		if !ok {
			t.Fatalf("lease %d refused", i)
		}
		toks = append(toks, tok)
	}
	ls := l.Leases()
	// Half released, one at a time: kept while the live ones are more.
	for _, tok := range toks[:peak/2] {
		if !ls.Release(tok, t0) {
			t.Fatalf("release of %s: not released", tok)
		}
	}
	ls.mu.Lock()
	free, spare := len(ls.free), len(ls.spare)
	ls.mu.Unlock()
	if free > peak/2+spareKeep || spare > peak/2+spareKeep {
		t.Fatalf("%d live leases: %d released leases and %d emptied slots kept, want at most %d", peak/2, free, spare, peak/2+spareKeep)
	}
	for _, tok := range toks[peak/2:] {
		ls.Release(tok, t0)
	}
	ls.mu.Lock()
	free, spare = len(ls.free), len(ls.spare)
	freeCap, spareCap := cap(ls.free), cap(ls.spare)
	ls.mu.Unlock()
	if ls.Len() != 0 || free > spareKeep || spare > spareKeep {
		t.Fatalf("every lease released (%d live): %d released leases and %d emptied slots kept, want at most %d of each", ls.Len(), free, spare, spareKeep)
	}
	if freeCap > 4*spareKeep || spareCap > 4*spareKeep {
		t.Fatalf("the free lists kept arrays of %d and %d", freeCap, spareCap)
	}
	// Still reused: a new peak's first leases take the ones kept.
	for i := range spareKeep {
		if ok, _, _ := checkLease(t, l, t0, exportInput("v"+strconv.Itoa(i)), 0); !ok {
			t.Fatalf("lease %d after the peak refused", i)
		}
	}
	ls.mu.Lock()
	free, spare = len(ls.free), len(ls.spare)
	ls.mu.Unlock()
	if free != 0 || spare != 0 {
		t.Fatalf("%d leases taken after the peak: %d released leases and %d emptied slots left unused", spareKeep, free, spare)
	}
}
