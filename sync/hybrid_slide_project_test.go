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
