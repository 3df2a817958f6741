package sync

import (
	"context"
	"errors"
	"fmt"
	gosync "sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

func TestBreaker(t *testing.T) {
	// An open breaker waits an eighth of the cool-down (100 ms) for its first probe, twice
	// that after a failed one: far past a loaded machine's pause between two of the
	// checks below that expect a refusal (a 50 ms cool-down gave 6 and 12 ms).
	b := NewBreaker(3, 800*time.Millisecond)
	for i := 0; i < 2; i++ {
		b.Failure()
		if !b.Allow() || b.Open() {
			t.Fatalf("open after %d failures", i+1)
		}
	}
	b.Success() // a success resets the streak
	for i := 0; i < 3; i++ {
		b.Failure()
	}
	if !b.Open() || b.Allow() || b.Opened() != 1 {
		t.Fatal("not open after 3 consecutive failures")
	}
	time.Sleep(150 * time.Millisecond)
	if !b.Allow() {
		t.Fatal("no probe after the cool-down")
	}
	if b.Allow() {
		t.Fatal("a second probe while the first is out")
	}
	b.Failure() // the probe failed: another cool-down
	if b.Allow() {
		t.Fatal("allowed right after a failed probe")
	}
	time.Sleep(250 * time.Millisecond)
	if !b.Allow() {
		t.Fatal("no probe after the second cool-down")
	}
	b.Success()
	if b.Open() || !b.Allow() {
		t.Fatal("not closed after a successful probe")
	}
	var nilB *Breaker
	if !nilB.Allow() || nilB.Open() {
		t.Fatal("a nil breaker must allow everything")
	}
}

// A frozen Redis: global checks fail within their deadline, the breaker opens after
// three, and then no check waits at all; thawed, the next probe closes it.
func TestGlobalBreakerFrozenRedis(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	// The open breaker's first probe comes after an eighth of the cool-down: 500 ms, far
	// past a loaded machine's pause between two checks (with a 200 ms cool-down, a pause
	// of 25 ms made the check after the third failure the probe, timing out).
	b := NewBreaker(3, 4*time.Second)
	g := NewGlobal(rdb).WithBreaker(b)
	l := mustLimit(t, localbucket.TokenBucket, 100, time.Minute)
	wait := 20 * time.Millisecond
	check := func() (time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		start := time.Now()
		_, err := g.Check(ctx, []GlobalOp{{Key: "rl:b:{u=1}", Limit: l, Cost: 1}})
		return time.Since(start), err
	}
	// The first check loads the script and dials: given time on a loaded machine (20 ms
	// timed out once in a run beside other packages' tests).
	wait = 2 * time.Second
	if _, err := check(); err != nil {
		t.Fatal(err)
	}
	wait = 20 * time.Millisecond
	srv.Freeze()
	defer srv.Thaw()
	for i := 0; i < 3; i++ {
		el, err := check()
		if err == nil || el > 200*time.Millisecond {
			t.Fatalf("check %d against a frozen Redis: %v after %s", i, err, el)
		}
	}
	// Open: refused at once, not after the client's 1 s timeout on the frozen Redis (the
	// check's own deadline is 2 s now).
	wait = 2 * time.Second
	el, err := check()
	if !errors.Is(err, ErrBreakerOpen) || el > 500*time.Millisecond {
		t.Fatalf("with the breaker open: %v after %s", err, el)
	}
	srv.Thaw()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := check(); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("breaker did not close after Redis came back")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if b.Open() {
		t.Fatal("breaker still open")
	}
}

// An open breaker's first probe comes after an eighth of the cool-down, each failed
// probe doubling the wait up to the cool-down: a store that paused for a moment (a
// cluster's planned failover) costs an eighth of it in failure policies, not all of it.
func TestBreakerBackoff(t *testing.T) {
	b := NewBreaker(1, 800*time.Millisecond)
	b.Failure()
	if !b.Open() || b.wait != 100*time.Millisecond {
		t.Fatalf("opened: wait %v, want 100ms", b.wait)
	}
	time.Sleep(150 * time.Millisecond) // past the first wait, well before the cool-down
	if !b.Allow() {
		t.Fatal("no probe after the first wait")
	}
	for _, want := range []time.Duration{200, 400, 800, 800} {
		b.Failure() // the probe failed
		if b.wait != want*time.Millisecond || b.Allow() {
			t.Fatalf("after a failed probe: wait %v (allowed at once %v), want %v", b.wait, b.Allow(), want*time.Millisecond)
		}
		b.mu.Lock()
		b.until = time.Now() // as if the wait were over
		b.mu.Unlock()
		if !b.Allow() {
			t.Fatal("no probe after the wait")
		}
	}
	b.Success()
	if b.Open() {
		t.Fatal("not closed by a successful probe")
	}
	b.Failure() // opens again: from the first wait
	if b.wait != 100*time.Millisecond {
		t.Fatalf("reopened: wait %v, want 100ms", b.wait)
	}
}

// The failures of calls let through before the breaker opened (a batch in flight, other
// connections' checks) answered once it is open are no failed probes: the first probe
// still comes after an eighth of the cool-down. Before, each doubled the wait, and three
// more such failures pushed the first probe to the whole cool-down.
func TestBreakerFailuresInFlightKeepFirstWait(t *testing.T) {
	b := NewBreaker(3, 800*time.Millisecond)
	for range 3 {
		b.Failure()
	}
	if !b.Open() || b.wait != 100*time.Millisecond {
		t.Fatalf("opened: open %v, wait %v; want open, 100ms", b.Open(), b.wait)
	}
	b.mu.Lock()
	until := b.until
	b.mu.Unlock()
	for range 10 {
		b.Failure() // calls sent before it opened
	}
	b.mu.Lock()
	wait, same := b.wait, b.until.Equal(until)
	b.mu.Unlock()
	if wait != 100*time.Millisecond || !same {
		t.Fatalf("after 10 failures of calls in flight: wait %v (first probe moved: %v); want 100ms, unmoved", wait, !same)
	}
	b.mu.Lock()
	b.until = time.Now() // as if the wait were over
	b.mu.Unlock()
	if ok, probe := b.allow(); !ok || !probe {
		t.Fatal("no probe after the first wait")
	}
	b.Failure() // the probe failed: now the wait doubles
	if b.wait != 200*time.Millisecond {
		t.Fatalf("after a failed probe: wait %v, want 200ms", b.wait)
	}
}

// frozenBreaker starts a real redis-server of its own and a global store on it behind a
// breaker (3 failures, cool-down cool) whose Redis calls time out after timeout; check
// sends one global check of client i that waits at most wait. The script is loaded and a
// connection dialled before it returns, so that freezing the server fails calls, not a
// first dial.
func frozenBreaker(t *testing.T, timeout, cool time.Duration) (*redistest.Server, *Breaker, func(wait time.Duration, i int) error) {
	t.Helper()
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	b := NewBreaker(3, cool)
	g := NewGlobal(rdb).WithBreaker(b)
	l := mustLimit(t, localbucket.TokenBucket, 100, time.Minute)
	check := func(wait time.Duration, i int) error {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		_, err := g.Check(ctx, []GlobalOp{{Key: fmt.Sprintf("rl:b:{u=%d}", i), Limit: l, Cost: 1}})
		return err
	}
	if err := check(2*time.Second, 0); err != nil {
		t.Fatal(err)
	}
	return srv, b, check
}

// A real redis-server frozen under 32 concurrent global checks: they all time out, and
// those answered (failed) after the third failure opened the breaker are no failed
// probes: its first probe is still due an eighth of the cool-down later, so a Redis that
// paused for a moment (a planned failover, CLUSTERDOWN while a replica is promoted) is
// probed again soon. Before, each of them doubled the wait, and the first probe was
// pushed to the whole cool-down.
func TestGlobalBreakerFrozenUnderConcurrentChecks(t *testing.T) {
	srv, b, check := frozenBreaker(t, time.Second, 8*time.Second)
	srv.Freeze()
	defer srv.Thaw()
	var wg gosync.WaitGroup
	var sent atomic.Int32
	for i := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := check(300*time.Millisecond, i); !errors.Is(err, ErrBreakerOpen) {
				sent.Add(1) // it went to Redis (and failed)
			}
		}()
	}
	wg.Wait()
	srv.Thaw()
	b.mu.Lock()
	wait := b.wait
	b.mu.Unlock()
	t.Logf("%d of 32 checks sent to the frozen Redis; the open breaker's wait %s", sent.Load(), wait)
	if !b.Open() || sent.Load() <= 3 {
		t.Fatalf("breaker open %v, %d checks sent; this test needs more than 3 in flight when it opens", b.Open(), sent.Load())
	}
	if wait != time.Second {
		t.Errorf("the open breaker waits %s before its first probe, want an eighth of the cool-down (1s)", wait)
	}
}

// A call sent before the breaker opened whose failure comes while the open breaker's
// probe is out (a check with a long deadline, Redis frozen) is not the probe: its
// failure leaves the probe out and the wait as it was, and the probe's own answer
// decides. Before, it was taken for the probe's failure: the wait doubled, and another
// probe could go while the first was still out.
func TestGlobalBreakerOldFailureIsNotTheProbes(t *testing.T) {
	srv, b, check := frozenBreaker(t, 30*time.Second, 800*time.Millisecond) // first wait 100ms
	srv.Freeze()
	defer srv.Thaw()
	old := make(chan error, 1)
	go func() { old <- check(4*time.Second, 1) }() // sent while the breaker is closed
	for i := range 3 {
		if err := check(100*time.Millisecond, 2+i); err == nil || errors.Is(err, ErrBreakerOpen) {
			t.Fatalf("check %d with Redis frozen: %v; want it sent, and failed", i, err)
		}
	}
	if !b.Open() {
		t.Fatal("the breaker did not open after 3 failures")
	}
	probe := make(chan error, 1)
	for {
		b.mu.Lock()
		due := !time.Now().Before(b.until)
		b.mu.Unlock()
		if due {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	go func() { probe <- check(20*time.Second, 9) }()
	for { // the probe out
		b.mu.Lock()
		out := b.probe
		b.mu.Unlock()
		if out {
			break
		}
		select {
		case err := <-probe:
			t.Fatalf("the probe returned %v with Redis frozen", err)
		default:
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := <-old; err == nil || errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("the check sent before the breaker opened: %v; want it failed at its deadline", err)
	}
	b.mu.Lock()
	wait, out := b.wait, b.probe
	b.mu.Unlock()
	if wait != 100*time.Millisecond || !out {
		t.Errorf("after the failure of a check sent before the breaker opened: wait %v, probe out %v; want 100ms, the probe still out", wait, out)
	}
	if err := check(time.Second, 10); !errors.Is(err, ErrBreakerOpen) {
		t.Errorf("a check while the probe is out: %v; want ErrBreakerOpen (one probe at a time)", err)
	}
	srv.Thaw()
	if err := <-probe; err != nil {
		t.Fatalf("the probe, Redis thawed: %v", err)
	}
	if b.Open() {
		t.Error("the breaker is still open after its probe succeeded")
	}
}
