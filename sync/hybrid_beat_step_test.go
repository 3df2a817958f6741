package sync

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// TestHybridHeartbeatAfterWallStepBack: on a standalone Redis a heartbeat rides on a
// sync's script call, and Run learns when one last rode (rodeAt). That instant was a
// wall clock reading: after the wall clock stepped back (NTP, a VM resumed) it lay in
// the future, the time since it was negative, and no heartbeat was offered or sent until
// the wall clock caught up with it: for as long as the step. After 3 s without one the
// other daemons, and this one, count a daemon less, and its credits grow. Here the state
// a step back of an hour leaves (a ride an hour ahead of the wall clock) is set, and the
// daemon must go on beating: its score in the daemons set must move.
//
// The state is injected: a test cannot step the host's wall clock.
func TestHybridHeartbeatAfterWallStepBack(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	h := NewHybrid(rdb, HybridOptions{Interval: 20 * time.Millisecond, ID: "stepper"})
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.Run(runCtx, "stepper", func() int64 { return time.Now().UnixNano() }, time.Second, func(error) {})
	}()
	// Traffic, so that syncs run and heartbeats ride on them.
	lim := mustLimit(t, localbucket.TokenBucket, 1000, time.Second)
	trafficDone := make(chan struct{})
	defer func() { cancel(); <-done; <-trafficDone }()
	go func() {
		defer close(trafficDone)
		for runCtx.Err() == nil {
			take(h, time.Now().UnixNano(), "rl:step:{u=1}", lim, 1)
			time.Sleep(5 * time.Millisecond)
		}
	}()
	score := func() float64 {
		v, err := rdb.ZScore(ctx, DaemonsKey, "stepper").Result()
		if err != nil {
			return 0
		}
		return v
	}
	deadline := time.Now().Add(30 * time.Second)
	for score() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no first heartbeat in 30 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Wait for a heartbeat that rode on a sync, then move the last ride an hour ahead of
	// the clock Run reads, which is what a step back of the wall clock did. A ride on its
	// way may overwrite it: set it again a few times.
	for h.rodeAt.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no heartbeat rode on a sync in 30 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	for range 5 {
		v := h.rodeAt.Load()
		h.rodeAt.CompareAndSwap(v, v+int64(time.Hour))
		time.Sleep(300 * time.Millisecond)
	}
	// Heartbeats come every second: one must come within a few (a score that vanished,
	// 0, is the daemon no longer counted live).
	first := score()
	deadline = time.Now().Add(10 * time.Second)
	for score() <= first {
		if time.Now().After(deadline) {
			t.Fatalf("no heartbeat in 10 s after the wall clock stepped back (score was %v, now %v: 0 once the other daemons no longer count it)", first, score())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestHybridLeaveOutlastsTheCallTimeout: a stopping daemon's leave of the live-daemons
// set is given max(timeout, leaveSetBudget), not Run's call timeout alone. The syncs'
// client's own timeout is max(--redis-timeout, --sync-interval, --global-timeout), here
// 100 ms; Run's timeout max(--redis-timeout, --sync-interval), here 50 ms. Through a
// link holding each request 60 ms, the leave failed at 50 ms and the stopped daemon
// stayed counted until its last heartbeat was three seconds old.
func TestHybridLeaveOutlastsTheCallTimeout(t *testing.T) {
	ctx := context.Background()
	srv := redistest.StartStandalone(t)
	direct := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { direct.Close() })
	const timeout = 50 * time.Millisecond
	slow, err := Open(Config{URL: "redis://" + slowLink(t, srv.Addr, 60*time.Millisecond), Timeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { slow.Close() })
	h := NewHybrid(slow, HybridOptions{ID: "leaver"})
	if err := direct.ZAdd(ctx, DaemonsKey, redis.Z{Score: float64(time.Now().UnixMilli()), Member: "leaver"}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := h.leaveAtStop("leaver", timeout); err != nil {
		t.Fatalf("leave: %v", err)
	}
	if n := direct.ZCard(ctx, DaemonsKey).Val(); n != 0 {
		t.Fatalf("the live-daemons set counts %d after the leave, want 0", n)
	}
}
