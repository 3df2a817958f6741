package rlclient

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// The connection model
//
// A Client has Options.Conns slots; each holds at most one live connection. A Check picks
// a slot round-robin, takes its connection (dialing one in a client-owned goroutine if
// there is none, unless the slot is backing off), and sends on it:
//
//   - under the connection's mutex it assigns the next id, encodes the frame into the
//     connection's Encoder and appends its call to the FIFO of pending calls, so id order,
//     FIFO order and byte order agree;
//   - if no other sender is writing, it becomes the flusher and writes everything encoded
//     so far, looping while others add more (group commit: one write for a burst);
//   - it then waits for its call to be completed, its deadline, or its ctx.
//
// One reader goroutine per connection reads frames, pops the oldest pending call, decodes
// the response into it and checks the echoed id. The server answers in request order; a
// mismatch, an undecodable frame, a frame with no pending call, or any read or write error
// breaks the connection: every pending call fails (its caller answers by the Policy), the
// slot forgets the connection, and the next Check on the slot dials again. (A write error
// other than a timeout first lets the reader read what the server answered before: see
// writeFailed.)
//
// A caller that stops waiting marks its call abandoned and leaves it in the FIFO, so the
// next response still lands on the right call; whoever completes an abandoned call (the
// reader or a failing connection) returns it to the pool.
//
// A connection carries at most Client.maxPending calls (abandoned ones included): a call
// takes a place in its room (a semaphore) before it is queued, and the reader gives the
// place back when it pops the call. A Check whose connection is full tries the other
// slots; when every connection it can get is full, it waits for a place on the first of
// them (places are handed over in the order the callers asked, so a newcomer does not
// overtake a waiting Check), until its deadline, and only then answers by the Policy. So
// a burst of concurrent checks larger than the pool holds is answered by the sidecar, not
// by the Policy, as long as it is answered in time; and memory stays bounded: what waits
// is the caller's own goroutine and call, and no connection queues more than maxPending.
//
// Failed dials back off per slot: 10ms doubling up to 1s, with jitter (half to all of
// it). While a slot backs off, Checks that land on it try the other slots and, when all
// back off, answer by the Policy at once without dialing. A connection that broke before
// it ever answered counts as a failed dial (a sidecar that accepts and then drops is not
// hammered either); one that answered resets the backoff.

const (
	backoffMin = 10 * time.Millisecond
	backoffMax = time.Second

	// maxPending bounds the calls in flight (including abandoned ones) on one connection:
	// a Check that finds every connection at it waits for a place, up to its deadline.
	maxPending = 4096

	// maxResponseFrame is the largest response frame the client reads.
	maxResponseFrame = 1 << 20
)

// backoffError is the Cause while a slot backs off after failed connection attempts.
type backoffError struct {
	failures int
	wait     time.Duration
	err      error // the last failure
}

func (e *backoffError) Error() string {
	attempts := "attempts"
	if e.failures == 1 {
		attempts = "attempt"
	}
	return fmt.Sprintf("rlclient: sidecar unreachable: %d failed %s, next in %v: %v", e.failures, attempts, e.wait.Round(time.Millisecond), e.err)
}
func (e *backoffError) Unwrap() []error { return []error{ErrUnreachable, e.err} }

// backoff returns the wait after n consecutive failures: 10ms·2^(n-1), at most 1s, with jitter.
func backoff(n int) time.Duration {
	d := backoffMax
	if n < 8 {
		d = min(backoffMin<<(n-1), backoffMax)
	}
	return d/2 + rand.N(d/2+1)
}

// call states.
const (
	callWaiting   uint32 = iota
	callDone             // completed; the caller receives from done
	callAbandoned        // the caller left; whoever completes it pools it
)

// call is one request in flight. Calls are pooled; the caller owns one until it either
// receives its completion or abandons it.
type call struct {
	id    uint64
	req   proto.Request // the caller's request; its slices keep their capacity in the pool
	resp  proto.Response
	err   error
	state atomic.Uint32
	done  chan struct{} // capacity 1
	timer *time.Timer   // the caller's deadline
	// bodyLen is, for a request near Options.MaxFrame, its frame body's length with id 0
	// (sizeUp); 0 when it fits whatever its id.
	bodyLen int
}

var callPool = sync.Pool{New: func() any {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &call{done: make(chan struct{}, 1), timer: t}
}}

func getCall() *call {
	cl := callPool.Get().(*call)
	cl.state.Store(callWaiting)
	return cl
}

func (cl *call) release() {
	cl.err = nil
	cl.dropRequest()
	callPool.Put(cl)
}

// dropRequest forgets the request once it is encoded, so that a pooled call does not keep
// the caller's strings alive.
func (cl *call) dropRequest() {
	clear(cl.req.Attrs)
	clear(cl.req.Limits)
	cl.req.Attrs, cl.req.Limits = cl.req.Attrs[:0], cl.req.Limits[:0]
	cl.req.Lease, cl.req.LeaseMs = "", 0
}

// complete hands the result (in cl.resp, or err) to the caller, or pools an abandoned call.
// For an abandoned call whose answer took a concurrency lease, it returns that lease:
// nobody else knows of it, and it would hold its slots until it expires.
func (cl *call) complete(err error) (orphan string) {
	cl.err = err
	if cl.state.CompareAndSwap(callWaiting, callDone) {
		cl.done <- struct{}{}
		return ""
	}
	if err == nil {
		orphan = cl.resp.Lease
	}
	cl.release()
	return orphan
}

// wait waits for cl's completion after it was sent. It returns cl when the caller owns it
// and cl.resp holds the answer; otherwise nil and the reason (cl is then released or
// abandoned: the caller must not touch it).
func (cl *call) wait(ctx context.Context) (*call, error) {
	var cause error
	select {
	case <-cl.done:
		cl.timer.Stop()
		return cl.result()
	case <-cl.timer.C:
		cause = errTimeout
	case <-ctx.Done():
		cl.timer.Stop()
		cause = ctxError(ctx)
	}
	if cl.state.CompareAndSwap(callWaiting, callAbandoned) {
		return nil, cause
	}
	<-cl.done // completed meanwhile: take the answer
	return cl.result()
}

func (cl *call) result() (*call, error) {
	if err := cl.err; err != nil {
		if _, ok := err.(*notSent); ok {
			return cl, err // the caller sends it again, or releases it
		}
		cl.release()
		return nil, err
	}
	return cl, nil
}

func ctxError(ctx context.Context) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return errTimeout
	}
	return &unreachable{what: "the caller's context ended", err: ctx.Err()}
}

// roundTrip sends cl.req on a pooled connection and waits for the answer; it takes over
// cl. On success it returns cl, whose resp holds the answer; the caller releases it.
// Otherwise it returns a nil call and ErrClosed, or an error wrapping ErrUnreachable
// (transport, timeout, ctx).
func (c *Client) roundTrip(ctx context.Context, cl *call) (*call, error) {
	fail := func(err error) (*call, error) {
		cl.release()
		return nil, err
	}
	if c.closed.Load() {
		return fail(ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return fail(errExpired)
		}
		return fail(ctxError(ctx))
	}
	now := time.Now()
	wait := c.opts.Timeout
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, dl.Sub(now))
	}
	if wait <= 0 {
		return fail(errExpired)
	}
	if err := c.sizeUp(cl); err != nil {
		return fail(err)
	}
	deadline := now.Add(wait)
	cl.timer.Reset(wait)
	resent := false
	unwritten := 0      // sends whose frame no write delivered (below)
	freshFarewells := 0 // farewells on connections that had answered nothing (below)
	var refusedBy *slot // the slot whose connection the sidecar refused (below)
	var err error
	var cn *conn
send:
	for {
		cn, err = c.pick(ctx, cl, refusedBy)
		if err == nil {
			err = cn.send(cl)
		}
		if err != errWriteFailed {
			break
		}
		// A write on cn failed, and its reader is reading what the sidecar answered
		// before; cn breaks once it has: then pick again (its slot redials).
		select {
		case <-cn.dead:
			if rerr := cn.refusal(); rerr != nil {
				// The sidecar refused cn as it accepted it (too_many_connections), and
				// its reader read that before cl was written on it: paced and bounded
				// as a refusal of cl itself (below), else a sidecar that refuses every
				// connection was redialed once per slot on top of them.
				if freshFarewells >= c.opts.Conns || !pauseBeforeResend(ctx, deadline) {
					err = rerr
					break send
				}
				freshFarewells++
				refusedBy = cn.s
			}
			continue
		case <-cl.timer.C:
			err = errTimeout
		case <-ctx.Done():
			err = ctxError(ctx)
		}
		break
	}
	if err != nil {
		cl.timer.Stop()
		if err == errNoRoom {
			// The full connection it waited on left it unanswered until its deadline,
			// as if it had timed out on it. Else a connection filled with checks a
			// stalled sidecar never answers would never be given up: none is sent on it,
			// so none times out on it, and every check is answered by the Policy until
			// that process ends.
			cn.timedOut()
		}
		return fail(err)
	}
	res, err := cl.wait(ctx)
	if err == errTimeout {
		// Timeout or the caller's earlier deadline: either way cn left the check
		// unanswered. Before, only a wait of the whole Timeout counted, and a gateway
		// giving each check a shorter deadline of its own kept a stalled sidecar's
		// connections, every check answered by the Policy, until that process ended. A
		// deadline too short for a sidecar that answers gives nothing up: its late
		// answers end each quiet spell (timedOut).
		cn.timedOut()
	}
	if ns, ok := err.(*notSent); ok {
		// The sidecar never read it (see notSent): send it again, once, on another
		// connection, within the same deadline; after a failed write, once per pooled
		// connection (below). After a drain's farewell as often as one
		// comes: the pool's other connections may be the draining sidecar's too, each
		// saying farewell in turn, and the sidecar's word is that it read none of them.
		//
		// A farewell on a connection that had answered nothing (fresh) may come from a
		// sidecar that serves no new connection at all (a drain whose successor is not
		// up yet, a stand-in): each check redialed it in a loop, with no pause, for its
		// whole timeout (9,000 connections a second from 4 callers). Such farewells give
		// a check back at most once per pooled connection, each after a pause.
		//
		// A too_many_connections refusal is such a farewell: the sidecar refused the
		// connection as it accepted it (past its --max-conns) and read none of it.
		//
		// A check whose frame no write delivered (a failed write: EPIPE) goes again as
		// often as the pool has connections, whatever else sent it again: each of them may
		// have been closed by the sidecar (--idle-timeout) before its reader saw it, and
		// the resend's write fail in turn. Before, it was sent again once, and a resend that
		// met the pool's second such connection got the Policy ("writing a request: broken
		// pipe"), though the sidecar had read none of it. The sidecar never read it, so it
		// is never counted twice; and the bound (Conns + 1 writes: one per pooled
		// connection, and one more, by then on a connection dialed since a failure) keeps
		// a sidecar that closes every connection from being redialed for the whole
		// timeout.
		again := !resent
		if ns.unwritten {
			unwritten++
			again = unwritten <= c.opts.Conns
		}
		if ns.farewell() {
			if !ns.fresh {
				again = true
			} else if freshFarewells < c.opts.Conns {
				freshFarewells++
				again = pauseBeforeResend(ctx, deadline)
			}
		}
		refusedBy = nil
		if ns.refused() {
			// Sent again on another connection of the pool first: the refused slot's
			// backoff (5 to 10 ms after its first refusal) may have ended with the pause,
			// and its redial, to a sidecar still at --max-conns, be refused again.
			refusedBy = cn.s
		}
		if left := time.Until(deadline); again && left > 0 && ctx.Err() == nil {
			resent = true
			cl.state.Store(callWaiting)
			cl.timer.Reset(left)
			goto send
		}
		cl.release()
		return nil, ns.err
	}
	if res != nil {
		res.dropRequest()
	}
	return res, err
}

// pauseBeforeResend waits backoffMin before a check that a fresh farewell or a refused
// connection gave back is sent again. It returns false, at once, when the deadline leaves
// no time for that pause, or when ctx ended.
func pauseBeforeResend(ctx context.Context, deadline time.Time) bool {
	if ctx.Err() != nil || time.Until(deadline) <= backoffMin {
		return false
	}
	t := time.NewTimer(backoffMin)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// notSent is the error of a call whose frame the sidecar certainly did not read, on a
// connection that broke (err): its write failed before any byte of it was written (EPIPE:
// a connection the sidecar closed, a graceful restart's drain, before the reader saw the
// close), or it was the last call pending when the connection was reset (ECONNRESET) with
// no byte of an answer come: the sidecar closed it with bytes unread, the end of the
// stream, its frame among them; or the sidecar said it read none of it: a drain's
// farewell (shutting_down), a connection refused as it was accepted
// (too_many_connections), or a frame before it refused as too large (frame_too_large: the
// sidecar reads nothing more). It was not decided, so roundTrip sends it again.
// A release pending on a connection that broke gets it too, read or not: releasing is
// idempotent (see fail).
type notSent struct {
	err error
	// fresh: the farewell came on a connection that had answered nothing (see farewell).
	fresh bool
	// unwritten: no write delivered any byte of its frame (a failed write), rather than
	// the sidecar saying, or a reset showing, that it read none of it: see roundTrip.
	unwritten bool
}

func (e *notSent) Error() string { return e.err.Error() }

// farewell reports whether the sidecar said so itself (a drain's shutting_down, or
// too_many_connections: a connection refused as it was accepted), rather than the client
// inferring it from a failed write or a reset.
func (e *notSent) farewell() bool {
	var pe *proto.Error
	return errors.As(e.err, &pe) && (pe.Code == proto.CodeShuttingDown || pe.Code == proto.CodeTooManyConnections)
}
func (e *notSent) Unwrap() error { return e.err }

// refused reports whether the sidecar refused the connection as it accepted it
// (too_many_connections): it serves no more connections for now.
func (e *notSent) refused() bool { return isRefusal(e.err) }

func isRefusal(err error) bool {
	var pe *proto.Error
	return errors.As(err, &pe) && pe.Code == proto.CodeTooManyConnections
}

// refusal returns why cn broke when the sidecar refused it as it accepted it
// (too_many_connections), else nil.
func (cn *conn) refusal() error {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if cn.broken && isRefusal(cn.err) {
		return cn.err
	}
	return nil
}

// A connection that answers no check for stallFor while checks are pending on it is given
// up and redialed: a sidecar that stopped answering on it (frozen; or an old sidecar
// stopped with SIGSTOP while a new one took the socket, in a blue/green switch) would
// otherwise keep it, every check on it answered by the failure policy, until that
// process ended (systemd's watchdog: 30 s). A shorter stall keeps it (its late answers
// are dropped as they come).
func (c *Client) stallFor() time.Duration { return max(time.Second, 4*c.opts.Timeout) }

// timedOut notes a check that cn left unanswered for the whole Timeout: the first since an
// answer starts cn's quiet spell; one that ends a spell of stallFor gives cn up. The spell
// is timed on the Client's monotonic clock (Client.mono), so that a step of the wall clock
// does not move it: measured in Unix ns, it lasted as long as a step back of the wall
// clock besides, and a stalled connection was kept that much longer (an hour's step: an
// hour's checks decided by the policy).
func (cn *conn) timedOut() {
	now := int64(cn.s.c.mono())
	if cn.heard.Swap(false) {
		cn.quietFrom.Store(now)
		return
	}
	if quiet := time.Duration(now - cn.quietFrom.Load()); quiet >= cn.s.c.stallFor() {
		cn.giveUp(&unreachable{what: fmt.Sprintf("no answer on this connection for %v (the sidecar stalled?): it is given up, the next check redials", quiet.Round(time.Millisecond))})
	}
}

func (c *Client) sizeUp(cl *call) error {
	cl.bodyLen = 0
	if requestBound(&cl.req) <= c.opts.MaxFrame {
		return nil
	}
	req := cl.req
	req.ID = 0
	enc := proto.NewEncoder()
	enc.EncodeRequest(&req)
	n := enc.Len() - proto.HeaderSize
	if n > c.opts.MaxFrame {
		return &RequestTooLargeError{Size: n, Max: c.opts.MaxFrame}
	}
	cl.bodyLen = n
	return nil
}

// requestBound returns at least the length of r's frame body, whatever its id: its
// strings' lengths, plus the most that msgpack headers, field names and integers take.
func requestBound(r *proto.Request) int {
	const (
		hdr  = 5  // the longest map, array or str header
		num  = 9  // the longest uint
		name = 10 // a field name, at most 9 bytes ("window_ms", "algorithm"), in a fixstr
	)
	// id, op, attrs, limits, cost, lease, lease_ms
	n := hdr + 7*name + num + hdr + len(r.Op) + hdr + hdr + num + hdr + len(r.Lease) + num
	for _, a := range r.Attrs {
		n += hdr + len(a.Name) + hdr + len(a.Value)
	}
	for i := range r.Limits {
		l := &r.Limits[i]
		// key, limit, window_ms, burst, algorithm, mode, name
		n += hdr + 7*name + 4*hdr + len(l.Key) + len(l.Algorithm) + len(l.Mode) + len(l.Name) + 3*num
	}
	return n
}

// uintLen is the length of v as a msgpack uint in its shortest form.
func uintLen(v uint64) int {
	switch {
	case v < 1<<7:
		return 1
	case v < 1<<8:
		return 2
	case v < 1<<16:
		return 3
	case v < 1<<32:
		return 5
	}
	return 9
}

// pick returns a connection with room for cl, its place in the room taken. It goes
// round-robin over the slots: one that is backing off, or whose connection is full,
// passes to the next. When every connection it got is full, it waits for a place on the
// first of them until cl's deadline or ctx; if that connection breaks meanwhile, it
// starts over (its slot redials). When the deadline passes first, it returns errNoRoom
// and that connection. A slot last (not nil) comes after every other one.
func (c *Client) pick(ctx context.Context, cl *call, last *slot) (*conn, error) {
	n := len(c.slots)
	start := int(c.next.Add(1) % uint32(n))
	if last != nil {
		start = (last.i + 1) % n
	}
	for {
		var full *conn
		var err error
		for i := 0; i < n; i++ {
			cn, e := c.slots[(start+i)%n].get(ctx, cl)
			if e != nil {
				if _, backingOff := e.(*backoffError); !backingOff {
					return nil, e // closed, or the deadline or ctx ended while dialing
				}
				err = e
				continue
			}
			select {
			case cn.room <- struct{}{}:
				return cn, nil
			default:
				if full == nil {
					full = cn
				}
			}
		}
		if full == nil {
			return nil, err
		}
		select {
		case full.room <- struct{}{}:
			return full, nil
		case <-full.dead:
		case <-cl.timer.C:
			return full, errNoRoom // the connection it waited on, for timedOut
		case <-ctx.Done():
			return nil, ctxError(ctx)
		}
	}
}

// slot holds one connection of the pool, and its dialing and backoff state.
type slot struct {
	c        *Client
	i        int // its index in Client.slots
	mu       sync.Mutex
	cn       *conn         // live connection, or nil
	dialing  *dialAttempt  // the dial in progress, or nil
	failures int           // consecutive failed dials (or connections that never answered)
	retryAt  time.Time     // no dial before this
	backoff  *backoffError // non-nil while failures > 0
	closed   bool
}

// dialAttempt is a slot's dial in progress.
type dialAttempt struct {
	done chan struct{} // closed when it ends
	cn   *conn         // the connection it made, or nil; set before done is closed
}

// get returns the slot's live connection, dialing one if needed and allowed. While a dial
// is in progress it waits for it, up to the call's deadline, and returns the connection
// it made even when that broke meanwhile: the call's send finds it broken, and roundTrip
// picks again, counting a refusal (too_many_connections, read before the call was
// written on it) as the call's own (paced, and bounded per check). Before, the pick went
// on to dial the next slot at once, and a sidecar that refuses every connection was
// dialed more often than once per pooled connection for a check.
func (s *slot) get(ctx context.Context, cl *call) (*conn, error) {
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return nil, ErrClosed
		}
		if cn := s.cn; cn != nil {
			s.mu.Unlock()
			return cn, nil
		}
		if s.dialing == nil {
			if s.backoff != nil && time.Now().Before(s.retryAt) {
				b := s.backoff
				s.mu.Unlock()
				return nil, b
			}
			s.dialing = &dialAttempt{done: make(chan struct{})}
			s.c.wg.Add(1)
			go s.dial(s.dialing)
		}
		a := s.dialing
		s.mu.Unlock()
		select {
		case <-a.done:
			if a.cn != nil {
				return a.cn, nil // live, or broken: see above
			}
		case <-cl.timer.C:
			return nil, errTimeout
		case <-ctx.Done():
			return nil, ctxError(ctx)
		}
	}
}

// dial connects the slot and starts the connection's reader. It runs in its own goroutine
// so that it finishes (and its result serves later checks) even when the check that
// started it has given up waiting.
func (s *slot) dial(a *dialAttempt) {
	defer s.c.wg.Done()
	nc, err := s.c.dialer.DialContext(s.c.ctx, "unix", s.c.opts.Socket)
	if f := dialedHook.Load(); f != nil && err == nil {
		(*f)()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer close(a.done)
	s.dialing = nil
	if s.closed {
		if err == nil {
			nc.Close()
		}
		return
	}
	if err != nil {
		s.failed(err)
		return
	}
	cn := &conn{s: s, nc: nc, enc: proto.NewEncoder(), spare: proto.NewEncoder(),
		room: make(chan struct{}, s.c.maxPending), dead: make(chan struct{})}
	cn.wrote.L = &cn.mu
	s.cn, a.cn = cn, cn
	s.c.wg.Add(1)
	go cn.readLoop()
}

// failed records a failed attempt and starts the backoff. s.mu is held.
func (s *slot) failed(err error) {
	s.failures++
	wait := backoff(s.failures)
	s.retryAt = time.Now().Add(wait)
	s.backoff = &backoffError{failures: s.failures, wait: wait, err: err}
}

// detach forgets a broken connection. s.mu is not held.
func (s *slot) detach(cn *conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cn != cn {
		return
	}
	s.cn = nil
	if cn.served.Load() {
		s.failures, s.backoff = 0, nil
	} else {
		s.failed(cn.err)
	}
}

func (s *slot) close() {
	s.mu.Lock()
	s.closed = true
	cn := s.cn
	s.cn = nil
	s.mu.Unlock()
	if cn != nil {
		cn.fail(ErrClosed)
	}
}

// conn is one pipelined connection to the sidecar.
type conn struct {
	s      *slot
	nc     net.Conn
	served atomic.Bool // a response arrived: the sidecar is really there
	// heard: an answer arrived since the last check that timed out; quietFrom: when the
	// connection's quiet spell began, on Client.mono (timedOut): its first check, or the
	// first check since an answer that timed out.
	heard     atomic.Bool
	quietFrom atomic.Int64
	// room holds one element per call in flight (abandoned ones included), at most
	// Client.maxPending: a sender puts one in before queuing, the reader takes one out
	// when it pops a call.
	room chan struct{}
	dead chan struct{} // closed when the connection breaks

	mu       sync.Mutex
	enc      *proto.Encoder // frames not yet written
	spare    *proto.Encoder // the buffer the flusher is writing
	flushing bool
	nextID   uint64
	// flushedID is the id of the last call whose frame was handed to a write; unsentFrom,
	// when not 0, the first id whose frame no write delivered (its write failed: see
	// notSent). resetLast: the connection was reset with no byte of an answer come.
	// unwrittenFrom, when not 0, is the first id from which no write delivered any
	// frame (notSent.unwritten); unsentFrom is at most it.
	flushedID     uint64
	unsentFrom    uint64
	unwrittenFrom uint64
	resetLast     bool
	// writing: a write is under way, from outside mu; wrote is signaled when it ends and
	// what it delivered is recorded (unsentFrom, werr). A reader whose read failed waits
	// for it (see readLoop).
	writing bool
	wrote   sync.Cond
	fresh   bool // a farewell came before any answer (notSent.fresh)
	pending queue
	broken  bool
	err     error // why it broke
	// werr is the write error of a connection about to break: its reader reads what the
	// sidecar answered before (see writeFailed); no request is sent on it any more.
	werr error
	// closeDead closes dead once (a retired connection closes it before it breaks).
	deadOnce sync.Once
	// Under Client.leaseMu (leaseconn.go): the leases taken on it and not yet released,
	// when the last of them expires, and, once retired, the timer that closes it then.
	leases    int
	holdUntil time.Time
	expiry    *time.Timer
	retiredAt bool // given up for a stall while holding leases (under mu)
}

func (cn *conn) closeDead() { cn.deadOnce.Do(func() { close(cn.dead) }) }

// errWriteFailed is send's error on a connection whose write failed and which is about
// to break: the caller waits for it to break and tries again.
var errWriteFailed = errors.New("rlclient: the connection's write failed")

// send assigns cl.req an id, queues cl and makes sure the frame gets written; the caller
// has taken a place in cn.room. A request that its id would make longer than
// Options.MaxFrame is not sent (its place is given back). A write error breaks the
// connection, which completes cl; so once cl is queued, send returns nil.
//
// A write can block only when the sidecar has stopped reading and the socket buffer is
// full. Its deadline is Options.Timeout from the start of the write, not the flusher's
// own deadline: a caller with little time left must not break the connection for all.
// So the flusher's Check can take up to Timeout longer than its own deadline, and only
// when the sidecar has stalled; the connection then breaks.
func (cn *conn) send(cl *call) error {
	cn.mu.Lock()
	if cn.broken || cn.werr != nil {
		// cn broke (or its write failed) after pick took it: cl was not sent; the caller
		// waits for cn to break and picks again (its slot redials).
		cn.mu.Unlock()
		return errWriteFailed
	}
	if cl.bodyLen > 0 {
		if n := cl.bodyLen - 1 + uintLen(cn.nextID+1); n > cn.s.c.opts.MaxFrame {
			cn.mu.Unlock()
			<-cn.room
			return &RequestTooLargeError{Size: n, Max: cn.s.c.opts.MaxFrame}
		}
	}
	cn.nextID++
	if cn.nextID == 1 {
		// Quiet from its first check on, until an answer (timedOut). Before, from its
		// dial: a connection dialed for a check that stopped waiting (its ctx, or a dial
		// longer than its Timeout) and left idle over stallFor was given up at the first
		// check that timed out on it, though the sidecar answered; the checks pending on
		// it got the Policy.
		cn.quietFrom.Store(int64(cn.s.c.mono()))
	}
	cl.id = cn.nextID
	cl.req.ID = cl.id
	cn.enc.EncodeRequest(&cl.req)
	cn.pending.push(cl)
	if cn.flushing {
		cn.mu.Unlock()
		return nil
	}
	cn.flushing = true
	for cn.enc.Len() > 0 {
		buf := cn.enc
		first, last := cn.flushedID+1, cn.nextID
		cn.flushedID = last
		cn.enc, cn.spare = cn.spare, buf
		cn.writing = true
		cn.mu.Unlock()
		n := 0
		err := cn.nc.SetWriteDeadline(time.Now().Add(cn.s.c.opts.Timeout))
		if err == nil {
			n, err = cn.nc.Write(buf.Bytes())
		}
		var rest []byte // the unwritten end of the frame the write stopped in
		if err != nil && n > 0 {
			rest = frameRest(buf.Bytes(), n)
		}
		buf.Reset()
		if err != nil {
			if f := writeFailedHook.Load(); f != nil {
				(*f)()
			}
			// No frame from first on reached the sidecar when nothing of this write did;
			// else none after last (the frames encoded meanwhile are never written).
			unsent := first
			if n > 0 {
				unsent = last + 1
			}
			cn.mu.Lock()
			// The earliest mark stands: a farewell noted meanwhile may say the sidecar
			// read none from an earlier call on. Before, this one replaced it, and the
			// calls between failed as if read: the Policy.
			if cn.unsentFrom == 0 || unsent < cn.unsentFrom {
				cn.unsentFrom = unsent
			}
			if cn.unwrittenFrom == 0 || unsent < cn.unwrittenFrom {
				cn.unwrittenFrom = unsent
			}
			cn.mu.Unlock()
			cn.writeFailed(&unreachable{what: "writing a request", err: err}, rest)
			cn.mu.Lock()
			cn.writing = false
			cn.wrote.Broadcast()
			cn.mu.Unlock()
			return nil
		}
		cn.mu.Lock()
		cn.writing = false
		cn.wrote.Broadcast()
	}
	cn.flushing = false
	cn.mu.Unlock()
	return nil
}

// writeFailedHook and readFailedHook, when set (tests), run as a write of request frames
// has failed (before what it delivered is recorded) and as the reader's read fails.
// dialedHook, when set (tests), runs as a dial has connected, before anything is written.
// closedUnreadHook, when set (tests), runs as the sidecar's last word has been noted
// (closedUnread), before the calls it was not read are failed. readEndedHook, when set
// (tests), runs as the reader whose read failed has noted what the writes delivered,
// before it breaks the connection.
var writeFailedHook, closedUnreadHook, dialedHook atomic.Pointer[func()]
var readFailedHook, readEndedHook atomic.Pointer[func(*conn)]

// readLoop hands each response to the oldest pending call until the connection breaks.
func (cn *conn) readLoop() {
	defer cn.s.c.wg.Done()
	br := bufio.NewReaderSize(cn.nc, 16<<10)
	dec := proto.NewDecoder()
	var buf []byte
	for {
		// Reset with no byte of an answer read: the sidecar closed with bytes unread, the
		// last pending call's among them (notSent).
		_, err := br.Peek(1)
		reset := err != nil && errors.Is(err, syscall.ECONNRESET)
		var body []byte
		if err == nil {
			body, err = proto.ReadFrame(br, buf, maxResponseFrame)
		}
		if err != nil {
			if f := readFailedHook.Load(); f != nil {
				(*f)(cn)
			}
			cn.mu.Lock()
			// A write under way ends at once on a connection the sidecar closed (EPIPE:
			// nothing of it was delivered) or within Options.Timeout: wait for it, so
			// that what it delivered is known. Before, an end of stream read as the
			// write was failing (a sidecar at --idle-timeout shuts its read side and
			// closes as a check is written) failed its checks, and those encoded
			// behind them, which the sidecar never read, as undecided: the Policy.
			for cn.writing {
				cn.wrote.Wait()
			}
			// No call is queued on cn from now on: send sees werr, and its caller waits
			// for cn to break and picks again. Before, a check sent in the moment between
			// this and fail (cn not yet broken) was queued and written, and fail gave it
			// the end of stream, as if the sidecar might have read it: the Policy, though
			// the sidecar had closed before it was written (a sidecar at --idle-timeout:
			// TestE2EGoClientIdleTimeoutChecksAreNotLost, cmd/rlsidecar, failed 4 of 20
			// runs so, "reading a response: EOF", as in a CI run).
			if cn.werr == nil {
				cn.werr = &unreachable{what: "reading a response", err: err}
			}
			werr := cn.werr
			cn.resetLast = reset
			cn.mu.Unlock()
			if f := readEndedHook.Load(); f != nil {
				(*f)(cn)
			}
			cn.fail(werr)
			return
		}
		buf = body
		cn.mu.Lock()
		cl := cn.pending.pop()
		if cl == nil {
			// No call is queued on cn from now on: send sees werr, and its caller picks
			// again (roundTrip). Before, a call queued between this pop and fail got
			// this frame's error, and the Policy, though the sidecar never read it (a
			// refusal, too_many_connections, read before the check was written).
			err := unsolicited(dec, body)
			cn.werr = err
			cn.mu.Unlock()
			cn.fail(err)
			return
		}
		cn.mu.Unlock()
		<-cn.room // cl's place: the next caller waiting for room takes it
		if err := dec.DecodeResponse(body, &cl.resp); err != nil {
			err = &unreachable{what: "undecodable response", err: err}
			cl.complete(err)
			cn.fail(err)
			return
		}
		r := &cl.resp
		if r.ID != cl.id && (!r.IsError() || r.ID != 0) {
			err := &unreachable{what: fmt.Sprintf("response id %d where %d was due", r.ID, cl.id)}
			cl.complete(err)
			cn.fail(err)
			return
		}
		switch r.Err.Code {
		case proto.CodeTooManyConnections:
			// The sidecar refused this connection as it accepted it (past its --max-conns)
			// and closes it, reading none of it: this call and every one after it were
			// not read, not decided. Each goes again on another connection of the pool
			// (notSent), as after a fresh farewell: at most once per pooled connection,
			// after a pause (roundTrip). Its slot backs off (served stays false): it
			// answered nothing. Before, each got the Policy though another connection of
			// the pool was served.
			cn.closedUnread(cl, closedBySidecar(r), true)
			return
		case proto.CodeShuttingDown:
			// The drain's last word (or a connection it accepted and does not serve):
			// this call and every one after it on the connection were not read, not
			// decided. Each is sent again, once, on another connection (notSent), to
			// the sidecar's successor: not answered by the Policy at every restart.
			// The sidecar answered: its slot redials at once (no backoff), to the
			// successor.
			// fresh: it had answered nothing before (see roundTrip: such farewells
			// are paced and bounded).
			cn.closedUnread(cl, closedBySidecar(r), !cn.served.Swap(true))
			return
		}
		cn.served.Store(true)
		if !cn.heard.Load() {
			cn.heard.Store(true)
		}
		if r.Err.Code == proto.CodeFrameTooLarge {
			// The sidecar closes the connection after this answer: detach it before the
			// caller can send its next check on it. It answered from the frame's header
			// and reads nothing more of the connection: every call pending after cl was
			// not read, not decided, and is sent again on a new connection (notSent).
			// Before, each got the Policy: one oversized request refused the concurrent
			// checks pipelined behind it.
			cn.mu.Lock()
			if cn.unsentFrom == 0 || cn.unsentFrom > cl.id+1 {
				cn.unsentFrom = cl.id + 1
			}
			cn.mu.Unlock()
			cn.fail(&unreachable{what: "the sidecar closed the connection after an oversized request"})
			cl.complete(nil)
			return
		}
		if lease := r.Lease; lease != "" && !r.IsError() {
			// Tracked before the caller can release it (leaseconn.go).
			cn.s.c.trackLease(cn, lease, leaseWindow(r.Rules))
		}
		if lease := cl.complete(nil); lease != "" {
			cn.s.c.releaseOrphan(lease)
		}
	}
}

// releaseOrphan releases, in a goroutine of its own, the lease of an answer that came after
// its caller stopped waiting (a timeout, a canceled ctx): the caller decided by its Policy
// without the slot, so nothing else would free it before it expires. Without this, a
// sidecar slowed past the callers' timeout would leave each late admission's slots held
// for a whole lease, refusing requests that fit.
func (c *Client) releaseOrphan(lease string) {
	// No request runs under it: a connection retired for a stall need not stay open for it
	// (closing frees it as the release does), whether or not the release is answered.
	// Before, it was tracked until its release was answered, and a retired connection
	// stayed open for it, for a whole lease when that release failed.
	c.leaseEnded(lease)
	if c.closed.Load() {
		return // Close closes the connections, which frees their leases
	}
	c.wg.Add(1) // the reader calling this is counted: Close cannot be waiting on zero
	go func() {
		defer c.wg.Done()
		ctx, cancel := context.WithTimeout(c.ctx, c.opts.Timeout)
		defer cancel()
		c.Release(ctx, lease) // released or not (the lease may have ended meanwhile), or unreachable: it then expires
	}()
}

// closedBySidecar is the error of the calls on a connection the sidecar closes with the
// error r (too_many_connections, shutting_down, or any with no request pending): no
// fault of the requests.
func closedBySidecar(r *proto.Response) error {
	return &unreachable{what: "the sidecar closed the connection", err: &proto.Error{Code: r.Err.Code, Message: r.Err.Message}}
}

// unsolicited describes a frame that arrived with no request pending.
func unsolicited(dec *proto.Decoder, body []byte) error {
	var r proto.Response
	if dec.DecodeResponse(body, &r) == nil && r.IsError() {
		return closedBySidecar(&r)
	}
	return &unreachable{what: "response without a pending request"}
}

// writeFailed handles the failed write of a request frame. A sidecar that refuses a
// request from its header (a frame over its --max-frame: frame_too_large, then it closes)
// fails the write of the rest (EPIPE, ECONNRESET), though its answer is already in the
// receive queue: breaking the connection at once would answer that request by the Policy,
// not with its 431. So the reader is left to read what came (it breaks the connection, with
// err, at the end of it), within Options.Timeout; meanwhile nothing more is sent on it.
// A write that timed out (the sidecar stopped reading) breaks the connection at once,
// or retires it when it holds leases (rest: see retire).
func (cn *conn) writeFailed(err *unreachable, rest []byte) {
	var ne net.Error
	if errors.As(err.err, &ne) && ne.Timeout() {
		if !cn.retire(err, rest) {
			cn.fail(err)
		}
		return
	}
	cn.mu.Lock()
	if cn.broken || cn.werr != nil {
		cn.mu.Unlock()
		return
	}
	cn.werr = err
	cn.mu.Unlock()
	if cn.nc.SetReadDeadline(time.Now().Add(cn.s.c.opts.Timeout)) != nil {
		cn.fail(err)
	}
}

// closedUnread ends cn on err, the sidecar's last word, which says it read none of cl nor
// of the calls after it: they are sent again on another connection (notSent; fresh: cn
// had answered nothing before, see roundTrip).
func (cn *conn) closedUnread(cl *call, err error, fresh bool) {
	cn.mu.Lock()
	cn.unsentFrom = cl.id
	cn.fresh = fresh
	cn.mu.Unlock()
	if f := closedUnreadHook.Load(); f != nil {
		(*f)()
	}
	cl.complete(&notSent{err: err, fresh: fresh})
	cn.fail(err)
}

// fail breaks the connection once: it closes the socket, fails every pending call with
// err and detaches the connection from its slot.
func (cn *conn) fail(err error) {
	cn.mu.Lock()
	if cn.broken {
		cn.mu.Unlock()
		return
	}
	cn.broken = true
	cn.err = err
	pending := cn.pending.drain()
	unsentFrom, unwrittenFrom, resetLast, fresh := cn.unsentFrom, cn.unwrittenFrom, cn.resetLast, cn.fresh
	cn.mu.Unlock()
	cn.nc.Close()
	cn.forgetRetired()
	cn.s.detach(cn) // first, so that the failed callers' next checks redial
	cn.closeDead()  // and the callers waiting for room on it try again
	for i, cl := range pending {
		if (unsentFrom != 0 && cl.id >= unsentFrom) || (resetLast && i == len(pending)-1) {
			cl.complete(&notSent{err: err, fresh: fresh, unwritten: unwrittenFrom != 0 && cl.id >= unwrittenFrom})
		} else if cl.req.Op == proto.OpRelease {
			// The sidecar may have read it, but a release is idempotent: sent again, to
			// the sidecar's successor when this one died (SIGKILL), it frees a global
			// lease's slots in Redis, or answers false. Failed, its slots stayed held
			// for the whole lease with no request running.
			cl.complete(&notSent{err: err})
		} else {
			cl.complete(err)
		}
	}
}

// queue is a FIFO ring of pending calls.
type queue struct {
	buf     []*call
	head, n int
}

func (q *queue) push(cl *call) {
	if q.n == len(q.buf) {
		nb := make([]*call, max(16, 2*len(q.buf)))
		for i := 0; i < q.n; i++ {
			nb[i] = q.buf[(q.head+i)%len(q.buf)]
		}
		q.buf, q.head = nb, 0
	}
	q.buf[(q.head+q.n)%len(q.buf)] = cl
	q.n++
}

func (q *queue) pop() *call {
	if q.n == 0 {
		return nil
	}
	cl := q.buf[q.head]
	q.buf[q.head] = nil
	q.head = (q.head + 1) % len(q.buf)
	q.n--
	return cl
}

func (q *queue) drain() []*call {
	out := make([]*call, 0, q.n)
	for cl := q.pop(); cl != nil; cl = q.pop() {
		out = append(out, cl)
	}
	return out
}
