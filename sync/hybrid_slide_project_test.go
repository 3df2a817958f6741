package sync

import (
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A sliding window's view projects the previous window's share as it falls, as the
// exact mode counts it: 5 per 3 s, 3 counted in the previous window, the view taken
// 0.3 s into this one (3 left); 1.2 s later the share is 1, so 4 are left. Before, the
// view stood still at 3 until the next sync: a cost of 4 was refused (retry 1 ms) and
// questions said 3 (a cross-mode audit).
func TestHybridSlidingViewProjectsFallingShare(t *testing.T) {
	lim := mustLimit(t, localbucket.SlidingWindow, 5, 3*time.Second)
	const synced = int64(1_000 * time.Second)
	e := &hentry{lim: lim, view: 3, synced: synced}
	e.setTimes(3, int64(300*time.Millisecond/time.Microsecond), 0) // p = 3, 0.3 s gone
	for _, c := range []struct {
		after time.Duration
		want  float64
	}{
		{0, 3},                       // floor(3 × 2.7/3) = 2 counted: 3 left
		{1200 * time.Millisecond, 4}, // floor(3 × 1.5/3) = 1
		{2300 * time.Millisecond, 5}, // floor(3 × 0.4/3) = 0
		{4 * time.Second, 5},         // the next window
	} {
		if got := project(e, synced+int64(c.after)); got != c.want {
			t.Errorf("%v after the view: %v left, want %v", c.after, got, c.want)
		}
	}
}

// A check works a sliding window view's slide out once (slideAt) for its projection, its
// resets and its retry. A relimit in the same check (the same key under another plan's
// limit, a later op of the batch) moves the view, and the slide with it: the slide worked
// out before it is worked out again for the new limit, not read as it was.
func TestHybridSlideAtFollowsARelimit(t *testing.T) {
	a := mustLimit(t, localbucket.SlidingWindow, 10, 3*time.Second)
	b := mustLimit(t, localbucket.SlidingWindow, 20, 3*time.Second)
	const synced = int64(1_000 * time.Second)
	e := &hentry{lim: a, view: 4, synced: synced}
	e.setTimes(3, int64(300*time.Millisecond/time.Microsecond), 0) // p = 3, 0.3 s gone
	sv := e.slideAt()
	if sv.lim != a || sv.s.q != 10-4-2 { // floor(3 × 2.7/3) = 2 of the previous window
		t.Fatalf("slideAt under %v: %+v", a, sv)
	}
	e.relimit(b, 2)
	if e.view != 14 {
		t.Fatalf("the view is %v after the raise, want 14", e.view)
	}
	if got, want := *sv.of(e), e.slideAt(); got != want {
		t.Fatalf("the slide after a relimit is %+v, want %+v (worked out again)", got, want)
	}
	if got := sv.s.q; got != 20-14-2 {
		t.Fatalf("the current window's count is %v after a relimit, want 4", got)
	}
}
