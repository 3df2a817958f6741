package sync

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	gosync "sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// scriptCalls returns how many EVAL and EVALSHA calls b's masters have served.
func scriptCalls(t *testing.T, b globalBackend) int64 {
	t.Helper()
	return int64(evalCalls(t, b.rdb))
}

// A request with a rate rule and a lease on one client (one hash slot) is ONE script
// call, on a standalone Redis (one call, and grouped by slot) and a 3-master Cluster, and
// all-or-nothing both ways: a full lease takes nothing of the rate rule, a refused rate
// rule holds no slot. The slot is lease.lua's (released, renewed there) with its TTL.
func TestCheckRateAndLeaseOneCall(t *testing.T) {
	ctx := context.Background()
	for _, b := range globalBackends(t) {
		t.Run(b.name, func(t *testing.T) {
			g := b.g
			rateKey := "rl:rate:{user=" + b.name + "}"
			slotKey := "rl:slots:{user=" + b.name + "}"
			if Slot(rateKey) != Slot(slotKey) {
				t.Fatal("the test needs one hash slot")
			}
			lim := globalLimit(t, localbucket.TokenBucket, 2, time.Hour, 2)
			var lo LeaseOp
			check := func(id string, cost uint64) (bool, []GlobalOp) {
				t.Helper()
				lo = LeaseOp{Key: slotKey, Part: 0, Max: 1, Lease: time.Minute, Take: true}
				ops := []GlobalOp{{Key: rateKey, Limit: lim, Cost: cost}, LeaseCheck(id, &lo)}
				ok, err := g.Check(ctx, ops)
				if err != nil {
					t.Fatal(err)
				}
				return ok, ops
			}
			rateLeft := func() uint64 {
				t.Helper()
				ops := []GlobalOp{{Key: rateKey, Limit: lim}}
				if _, err := g.Check(ctx, ops); err != nil {
					t.Fatal(err)
				}
				return ops[0].Result.Remaining
			}
			rateLeft() // loads the script on the key's node: no NOSCRIPT below

			before := scriptCalls(t, b)
			ok, ops := check("A", 1)
			if n := scriptCalls(t, b) - before; n != 1 {
				t.Fatalf("a rate rule and a lease on one client made %d script calls, want 1", n)
			}
			if !ok || !lo.Allowed || lo.Remaining != 0 || ops[1].Result.Limit != 1 || ops[0].Result.Remaining != 1 {
				t.Fatalf("first: %v rate %+v lease %+v", ok, ops[0].Result, lo)
			}
			if n := b.rdb.ZCard(ctx, slotKey).Val(); n != 1 {
				t.Fatalf("the lease holds %d members, want 1", n)
			}
			if ttl := b.rdb.PTTL(ctx, slotKey).Val(); ttl <= time.Minute || ttl > time.Minute+LeaseGrace {
				t.Fatalf("lease key TTL %v, want the lease plus the grace", ttl)
			}

			// The lease is full: the rate rule's take is not made.
			ok, ops = check("B", 1)
			if ok || lo.Allowed || lo.RetryAfter <= 0 || lo.RetryAfter > time.Second || !ops[0].Result.Allowed {
				t.Fatalf("full lease: %v rate %+v lease %+v", ok, ops[0].Result, lo)
			}
			if ops[0].Result.Remaining != 1 || rateLeft() != 1 {
				t.Fatal("a request refused by its lease consumed its rate rule")
			}

			// The slot is lease.lua's: released there, it is free again.
			if freed, err := g.Release(ctx, "A", []LeasePart{{Key: slotKey, Part: 0}}); err != nil || !freed {
				t.Fatalf("release: %v %v", freed, err)
			}
			ok, _ = check("C", 1) // the rate rule's last unit
			if !ok || rateLeft() != 0 {
				t.Fatal("C")
			}
			if renewed, in, err := g.Renew(ctx, "C", []LeasePart{{Key: slotKey, Part: 0, Lease: 2 * time.Minute}}); err != nil || !renewed || in != 2*time.Minute {
				t.Fatalf("renew: %v %v %v", renewed, in, err)
			}
			if freed, _ := g.Release(ctx, "C", []LeasePart{{Key: slotKey, Part: 0}}); !freed {
				t.Fatal("release of C")
			}

			// The rate rule refuses: no slot is held, and the lease reports its free slot.
			ok, ops = check("D", 1)
			if ok || ops[0].Result.Allowed || !lo.Allowed || lo.Remaining != 1 {
				t.Fatalf("rate refused: %v rate %+v lease %+v", ok, ops[0].Result, lo)
			}
			if n := b.rdb.ZCard(ctx, slotKey).Val(); n != 0 {
				t.Fatalf("a request refused by its rate rule holds %d slots", n)
			}
		})
	}
}

// Across hash slots (a rate rule per user, a lease per tenant), the calls go in one
// pipeline and a refusal gives back what the other slot's call took: the rate take
// (refund.lua) or the lease's member (refund.lua's algorithm 6).
func TestCheckRateAndLeaseAcrossSlots(t *testing.T) {
	ctx := context.Background()
	for _, b := range globalBackends(t)[1:] { // grouped by slot
		t.Run(b.name, func(t *testing.T) {
			g := b.g
			rateKey := "rl:rate:{user=" + b.name + "}"
			slotKey := "rl:slots:{tenant=" + b.name + "}"
			if Slot(rateKey) == Slot(slotKey) {
				t.Fatal("the test needs two hash slots")
			}
			lim := globalLimit(t, localbucket.FixedWindow, 1, hourWindow(), 0)
			var lo LeaseOp
			check := func(id string) (bool, []GlobalOp) {
				t.Helper()
				lo = LeaseOp{Key: slotKey, Part: 0, Max: 1, Lease: time.Minute, Take: true}
				ops := []GlobalOp{{Key: rateKey, Limit: lim, Cost: 1}, LeaseCheck(id, &lo)}
				ok, err := g.Check(ctx, ops)
				if err != nil {
					t.Fatal(err)
				}
				return ok, ops
			}
			// A lease held elsewhere fills the tenant: the rate take is refunded.
			other := LeaseOp{Key: slotKey, Part: 0, Max: 1, Lease: time.Minute, Take: true}
			if ok, err := g.Acquire(ctx, "X", []LeaseOp{other}); err != nil || !ok {
				t.Fatalf("X: %v %v", ok, err)
			}
			if ok, ops := check("A"); ok || !ops[0].Result.Allowed || ops[0].Result.Remaining != 1 || lo.Allowed {
				t.Fatalf("full lease: %v rate %+v lease %+v", ok, ops[0].Result, lo)
			}
			if n, _ := b.rdb.HGet(ctx, rateKey, "n").Int(); n != 0 {
				t.Fatalf("the rate key counts %d after the refund, want 0", n)
			}
			if freed, _ := g.Release(ctx, "X", []LeasePart{{Key: slotKey}}); !freed {
				t.Fatal("release of X")
			}
			if ok, _ := check("B"); !ok {
				t.Fatal("B refused")
			}
			if freed, _ := g.Release(ctx, "B", []LeasePart{{Key: slotKey}}); !freed {
				t.Fatal("release of B")
			}
			// The rate rule refuses now: the lease's member is removed again.
			ok, ops := check("C")
			if ok || ops[0].Result.Allowed || !lo.Allowed || lo.Remaining != 1 {
				t.Fatalf("rate refused: %v rate %+v lease %+v", ok, ops[0].Result, lo)
			}
			if n := b.rdb.ZCard(ctx, slotKey).Val(); n != 0 {
				t.Fatalf("a request refused by its rate rule holds %d slots", n)
			}
		})
	}
}

// Concurrent requests, each a rate take and a lease slot on one client, merged by the
// auto-pipeline into global.lua's batch form: exactly max are admitted, the rate rule
// counts exactly the admitted ones (a request refused by its lease consumed nothing),
// and the merged calls are fewer than the requests.
func TestCheckRateAndLeaseBatched(t *testing.T) {
	srv := redistest.StartStandalone(t)
	// Redis is frozen while the requests queue: its client and the checks wait for it.
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ReadTimeout: time.Minute})
	t.Cleanup(func() { rdb.Close() })
	g := NewGlobal(rdb).WithAutoPipeline()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	lim := globalLimit(t, localbucket.FixedWindow, 1000, hourWindow(), 0) // no window ends while its count is taken
	if _, err := g.Check(ctx, []GlobalOp{{Key: "rl:rate:{user=warm}", Limit: lim, Cost: 1}}); err != nil {
		t.Fatal(err) // loads the script: no NOSCRIPT below
	}
	const n, mx = 200, 7
	var admitted, queued atomic.Int64
	qctx := WithQueued(ctx, func() { queued.Add(1) })
	var wg gosync.WaitGroup
	base := evalCalls(t, rdb)
	// The requests queue together, as a busy gateway's do: let go together, on a loaded
	// machine each could still finish before the next began, with nothing to merge (205
	// calls for 200 requests in one run beside other tests, 135 beside four busy loops).
	// So Redis is frozen until every request has queued: the first batch waits for it,
	// and the others for the first.
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			lo := LeaseOp{Key: "rl:slots:{user=z}", Max: mx, Lease: time.Minute, Take: true}
			ops := []GlobalOp{{Key: "rl:rate:{user=z}", Limit: lim, Cost: 1}, LeaseCheck("L"+strconv.Itoa(i), &lo)}
			<-start
			ok, err := g.Check(qctx, ops)
			if err != nil {
				t.Error(err)
				return
			}
			if ok != lo.Allowed || ok != ops[1].Result.Allowed {
				t.Errorf("request %d: allowed %v, lease %+v", i, ok, lo)
			}
			if ok {
				admitted.Add(1)
			}
		})
	}
	srv.Freeze()
	close(start)
	for deadline := time.Now().Add(30 * time.Second); queued.Load() < n && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	srv.Thaw()
	wg.Wait()
	if q := queued.Load(); q != n {
		t.Fatalf("%d of %d requests queued for Redis", q, n)
	}
	calls := evalCalls(t, rdb) - base
	if admitted.Load() != mx {
		t.Fatalf("%d admitted, want %d", admitted.Load(), mx)
	}
	if c, _ := rdb.HGet(ctx, "rl:rate:{user=z}", "n").Int(); c != mx {
		t.Fatalf("the rate rule counts %d, want %d (the admitted ones)", c, mx)
	}
	if z := rdb.ZCard(ctx, "rl:slots:{user=z}").Val(); z != mx {
		t.Fatalf("%d slots held, want %d", z, mx)
	}
	t.Logf("%d requests in %d script calls", n, calls)
	if calls >= n {
		t.Errorf("%d script calls for %d requests: not merged", calls, n)
	}
}

// A lease acquire that timed out after it reached Redis took its slot all the same: the
// request was decided by its failure policy, with no lease to release, and the slot was
// held, by no one and seen by no one, until it expired (found by a lease audit: 1 to 3
// of 5 slots held after a latency blip, a lease of 30 s). Acquire now gives such slots
// back, at once and again a moment later (the acquire may reach Redis after the first
// give-back): here Redis is frozen while the acquire is on its way.
func TestAcquireTimedOutGivesSlotBack(t *testing.T) {
	defer func(d time.Duration) { giveBackDelay = d }(giveBackDelay)
	giveBackDelay = 300 * time.Millisecond
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	g := NewGlobal(rdb).WithRefundTimeout(100 * time.Millisecond)
	defer g.Close() // its give-back worker ends before giveBackDelay is put back
	ctx := context.Background()
	key := "rl:conc:{user=u}"
	lo := LeaseOp{Key: key, Max: 3, Lease: time.Hour, Take: true}
	if ok, err := g.Acquire(ctx, "warm", []LeaseOp{lo}); !ok || err != nil { // loads the script
		t.Fatal(ok, err)
	}
	if ok, err := g.Release(ctx, "warm", []LeasePart{{Key: key}}); !ok || err != nil {
		t.Fatal(ok, err)
	}
	srv.Freeze()
	tctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	lo = LeaseOp{Key: key, Max: 3, Lease: time.Hour, Take: true}
	ok, err := g.Acquire(tctx, "lost", []LeaseOp{lo})
	cancel()
	if ok || err == nil {
		srv.Thaw()
		t.Fatalf("acquire on a frozen server: %v %v, want an error", ok, err)
	}
	time.Sleep(150 * time.Millisecond) // the first give-back times out, frozen too
	srv.Thaw()
	// The acquire runs as Redis thaws; the second give-back removes its slot.
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, err := rdb.ZCard(ctx, key).Result()
		if err == nil && n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d slots held (%v) 5 s after an acquire that timed out: no one holds its lease", n, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A lease release that failed may have run in Redis only when it was written and its
// answer lost: not when the breaker refused it, its context ended before the write
// (go-redis returns the context's error only then), Redis answered an error, or the
// connection was refused. The daemon counts a lease found gone after such a release as
// that release (limiter: globalLease.sentUnsure).
func TestMayHaveRunLeaseRelease(t *testing.T) {
	for _, err := range []error{nil, ErrBreakerOpen, context.DeadlineExceeded, context.Canceled,
		fmt.Errorf("lease release: %w", context.DeadlineExceeded), tryAgainErr{},
		&net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}, &net.OpError{Op: "dial", Err: syscall.ENOENT}, errNotSent} {
		if MayHaveRun(err) {
			t.Errorf("MayHaveRun(%v) = true, want false: not run", err)
		}
	}
	for _, err := range []error{&net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}, io.EOF,
		fmt.Errorf("lease release: %w", io.ErrUnexpectedEOF)} {
		if !MayHaveRun(err) {
			t.Errorf("MayHaveRun(%v) = false, want true: written, its answer lost", err)
		}
	}
}

// busyAfterFirstCall is a Redis client on a pool of one connection whose second call
// (a refused check's refund, after the check's pipeline) finds that connection taken,
// by a call to the frozen server, until its context ends: a refund that could not be
// written.
type busyAfterFirstCall struct {
	*redis.Client
	srv   *redistest.Server
	n     *atomic.Int32
	taken chan struct{}
}

func (c busyAfterFirstCall) block() {
	if c.n.Add(1) != 2 {
		return
	}
	c.srv.Freeze()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		close(c.taken)
		_ = c.Client.Ping(ctx).Err() // holds the only connection while frozen
	}()
	<-c.taken
	time.Sleep(20 * time.Millisecond) // the ping is on the connection
}

func (c busyAfterFirstCall) Pipeline() redis.Pipeliner {
	c.block()
	return c.Client.Pipeline()
}

func (c busyAfterFirstCall) Process(ctx context.Context, cmd redis.Cmder) error {
	c.block()
	return c.Client.Process(ctx, cmd)
}

// A check with two concurrency rules on two hash slots, one full: the other's slot,
// taken in its own call, is given back by the refund. A refund that could not be sent
// (no connection to be had before its timeout: a Redis frozen a moment) left that slot
// held by no one until its lease ran out (an hour here); counted in RefundErrors, no
// more. Its lease slots now go to the background give-back, as an unanswered acquire's
// do: removing a member is safe whether the refund ran or not.
func TestRefundNotSentGivesLeaseSlotBack(t *testing.T) {
	defer func(d time.Duration) { giveBackDelay = d }(giveBackDelay)
	giveBackDelay = 200 * time.Millisecond
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true, MaxRetries: -1, PoolSize: 1})
	t.Cleanup(func() { rdb.Close() })
	ctx := context.Background()
	free, full := "rl:conc_a:{user=a}", "rl:conc_z:{user=z}"
	warm := NewGlobal(rdb)
	if ok, err := warm.Acquire(ctx, "holder", []LeaseOp{{Key: full, Max: 1, Lease: time.Hour, Take: true}}); !ok || err != nil {
		t.Fatal(ok, err)
	}
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	g := (&Global{rdb: busyAfterFirstCall{rdb, srv, new(atomic.Int32), make(chan struct{})}, bySlot: true}).WithRefundTimeout(100 * time.Millisecond)
	defer g.Close()
	ok, err := g.Acquire(ctx, "refused", []LeaseOp{
		{Key: free, Part: 0, Max: 10, Lease: time.Hour, Take: true},
		{Key: full, Part: 1, Max: 1, Lease: time.Hour, Take: true},
	})
	if ok || err != nil {
		t.Fatalf("Acquire: %v %v, want refused (full)", ok, err)
	}
	if g.RefundErrors() == 0 {
		t.Fatal("the refund was sent: the test does not test anything")
	}
	srv.Thaw()
	thawed = true
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, err := rdb.ZCard(ctx, free).Result()
		if err == nil && n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d slots of %s held (%v) 10 s after a refused acquire whose refund was not sent: no one holds its lease", n, free, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
