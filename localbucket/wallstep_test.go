package localbucket

import (
	"fmt"
	"testing"
	"time"
)

// TestStoreFixedWindowWallStepBack: the daemon decides on a monotonic clock and aligns
// fixed windows to wall time (SetWallOffset). A wall clock stepped back (NTP, a VM
// resumed) puts a client's window in the future: its count must not be forgotten (no
// fresh window at the step), and it must not refuse the client for as long as the step
// either, only until the end of a window. Before, a client that had used a 10 per 1 s
// window was refused for the whole step: an hour and a second.
func TestStoreFixedWindowWallStepBack(t *testing.T) {
	for _, tc := range []struct {
		name     string
		window   time.Duration
		step     time.Duration
		maxRetry time.Duration // at most
	}{
		{"1s back 1h", time.Second, -time.Hour, time.Second},
		{"1m back 1h", time.Minute, -time.Hour, time.Minute},
		{"1s back 5s", time.Second, -5 * time.Second, time.Second},
		// Back by less than max(a window, 1 s): the count stays in its window (wait at most
		// the step plus a window), so a step of a few ms across an edge forgives nothing.
		{"1s back 2s", time.Second, -2 * time.Second, 2 * time.Second},
		{"1m back 50ms", time.Minute, -50 * time.Millisecond, time.Minute + 50*time.Millisecond},
		{"1s back 1s", time.Second, -time.Second, 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStore(Options{})
			l := mustLimit(t, FixedWindow, 10, tc.window, 0)
			now := base + int64(tc.window) - int64(time.Millisecond) // 1 ms before a window's end
			for i := range 10 {
				if ops := []Op{op("f:{u}", l, 1)}; !s.Apply(now, ops) {
					t.Fatalf("take %d refused: %+v", i+1, ops[0].Result)
				}
			}
			s.SetWallOffset(int64(tc.step))
			now += int64(time.Millisecond)
			ops := []Op{op("f:{u}", l, 1)}
			if s.Apply(now, ops) {
				t.Fatalf("after a wall step of %v: the used window's count was forgotten: %+v", tc.step, ops[0].Result)
			}
			if r := ops[0].Result; r.RetryAfter <= 0 || r.RetryAfter > int64(tc.maxRetry) {
				t.Fatalf("after a wall step of %v: retry after %v, want (0, %v]", tc.step, time.Duration(r.RetryAfter), tc.maxRetry)
			}
			// And it is admitted again once that wait has passed, on the monotonic clock.
			later := now + ops[0].Result.RetryAfter
			if ops := []Op{op("f:{u}", l, 1)}; !s.Apply(later, ops) {
				t.Fatalf("refused after its retry: %+v", ops[0].Result)
			}
		})
	}
}

// TestStoreFixedWindowLateClockRead: a check whose clock was read well before it reached
// the store (the daemon decides a check that waits on Redis at its arrival time, after
// the checks queued before it on its connection) is not a wall clock step: the offset is
// the same. Before, such a read more than max(the window, 1 s) late moved the window's
// state back to its own, earlier window, and the next check on time found a fresh window
// there: a client that had used a 10 per 1 s window was admitted 10 more in it. Every
// path (one op, two, up to four, more; Reject) keeps the window's count.
func TestStoreFixedWindowLateClockRead(t *testing.T) {
	l := mustLimit(t, FixedWindow, 10, time.Second, 0)
	other := mustLimit(t, TokenBucket, 1000, time.Second, 0)
	for _, n := range []int{1, 2, 3, 5} {
		for _, reject := range []bool{false, true} {
			t.Run(fmt.Sprintf("%d ops reject=%v", n, reject), func(t *testing.T) {
				s := NewStore(Options{})
				batch := func() []Op {
					ops := []Op{op("f:{u}", l, 1)}
					for i := 1; i < n; i++ {
						ops = append(ops, op(fmt.Sprintf("o%d:{u}", i), other, 1))
					}
					return ops
				}
				now := base + 3*int64(time.Second) + int64(100*time.Millisecond)
				for i := range 10 {
					if ops := batch(); !s.Apply(now, ops) {
						t.Fatalf("take %d refused: %+v", i+1, ops[0].Result)
					}
				}
				late := now - int64(2500*time.Millisecond) // read 2.5 s before it is applied
				if reject {
					s.Reject(late, batch())
				} else {
					s.Apply(late, batch())
				}
				ops := batch()
				if s.Apply(now+int64(time.Millisecond), ops) {
					t.Fatalf("after a check whose clock read was 2.5 s late: admitted an 11th take in a window of 10: %+v", ops[0].Result)
				}
			})
		}
	}
}

// TestStoreCalendarWallStepBack: a calendar window is a fixed window to a backward step
// of the wall clock (docs/reliability.md): the count is never forgotten, and refuses for
// at most the step plus a window, and never more than two windows (a count whose window
// starts more than a window after the wall time moves to the wall time's window). A
// client at 3 of 3 per day at 23:00 UTC.
func TestStoreCalendarWallStepBack(t *testing.T) {
	const day = 24 * time.Hour
	for _, tc := range []struct {
		step     time.Duration
		maxRetry time.Duration // at most
	}{
		{-time.Hour, 2 * time.Hour},       // the count stays in its day, which ends 2 h away
		{-25 * time.Hour, 26 * time.Hour}, // still in its day: the step plus what is left of it
		{-49 * time.Hour, 2 * time.Hour},  // moved to the wall time's day, which ends 2 h away
		{-30 * 24 * time.Hour, day},       // moved, whatever the step
	} {
		t.Run(tc.step.String(), func(t *testing.T) {
			lv, err := NewCalendarLimit(3, Day, time.UTC)
			if err != nil {
				t.Fatal(err)
			}
			l := &lv
			s := NewStore(Options{})
			now := time.Date(2026, 3, 10, 23, 0, 0, 0, time.UTC).UnixNano()
			for i := range 3 {
				if ops := []Op{op("c:{u}", l, 1)}; !s.Apply(now, ops) {
					t.Fatalf("take %d refused: %+v", i+1, ops[0].Result)
				}
			}
			s.SetWallOffset(int64(tc.step))
			now += int64(time.Millisecond)
			ops := []Op{op("c:{u}", l, 1)}
			if s.Apply(now, ops) {
				t.Fatalf("after a wall step of %v: the day's count was forgotten: %+v", tc.step, ops[0].Result)
			}
			if r := ops[0].Result; r.RetryAfter <= 0 || r.RetryAfter > int64(tc.maxRetry) || r.RetryAfter > int64(2*day) {
				t.Fatalf("after a wall step of %v: retry after %v, want (0, %v]", tc.step, time.Duration(r.RetryAfter), tc.maxRetry)
			}
			later := now + ops[0].Result.RetryAfter
			if ops := []Op{op("c:{u}", l, 1)}; !s.Apply(later, ops) {
				t.Fatalf("refused after its retry: %+v", ops[0].Result)
			}
		})
	}
}
