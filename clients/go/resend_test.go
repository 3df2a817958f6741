package rlclient

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// A sidecar that answers one check per connection and then stops reading it, as a
// daemon's graceful restart drains a gateway's kept-alive connection (it answers what the
// connection held, then closes): the client's next check on it is written after that, before
// its reader has seen the close. That check never reached the sidecar — its write fails
// (EPIPE: "shut-read"), or the sidecar closes with it unread and the client reads a reset
// with no answer ("reset") — so it is sent again on a new connection within its timeout,
// not answered by the Policy (a 503 under FailClosed, at every restart). Each check here
// meets such a connection but the first.
func TestResendsCheckTheSidecarNeverRead(t *testing.T) {
	for _, mode := range []string{"shut-read", "reset"} {
		t.Run(mode, func(t *testing.T) {
			path := socketPath(t)
			done := make(chan struct{})
			standIn(t, path, func(nc *net.UnixConn, _ int) {
				body, err := proto.ReadFrame(bufio.NewReader(nc), nil, proto.DefaultMaxFrame)
				if err != nil {
					return
				}
				var req proto.Request
				if proto.NewDecoder().DecodeRequest(body, &req) != nil {
					return
				}
				enc := proto.NewEncoder()
				enc.EncodeCheck(&proto.Response{ID: req.ID, Allowed: true, Rule: attr(&req, "user")})
				if _, err := nc.Write(enc.Bytes()); err != nil {
					return
				}
				if mode == "shut-read" {
					nc.CloseRead() // the client's next write fails: EPIPE
					time.Sleep(5 * time.Millisecond)
					return
				}
				// Close once the next check is in, unread: the client reads a reset.
				rc, _ := nc.SyscallConn()
				for {
					select {
					case <-done:
						return
					case <-time.After(time.Millisecond):
					}
					n := 0
					rc.Control(func(fd uintptr) {
						n, _, _ = syscall.Recvfrom(int(fd), make([]byte, 1), syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
					})
					if n > 0 {
						return
					}
				}
			})
			t.Cleanup(func() { close(done) })
			c := newClient(t, Options{Socket: path, Conns: 1, Timeout: time.Second, Policy: FailClosed})
			const n = 50
			policy := 0
			for i := 0; i < n; i++ {
				d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil)
				if err != nil {
					t.Fatal(err)
				}
				if d.Unreachable {
					policy++
					if policy == 1 {
						t.Logf("check %d: %v", i, d.Cause)
					}
				} else if d.Rule != "u" {
					t.Fatalf("check %d: %+v", i, d)
				}
			}
			if policy > 0 {
				t.Errorf("%d of %d checks answered by the Policy", policy, n)
			}
		})
	}
}

// A draining sidecar ends a connection it has read to its end with an error frame of id
// 0, shutting_down, after its last answer: the checks pending on it without an answer
// were not read. Each is sent again on a new connection, not answered by the Policy (a
// 503 under FailClosed for most checks in flight at every restart). The fake sidecar
// answers the first 5 checks of its first connection, reads 5 more without deciding
// them, then says farewell; later connections answer everything. Every one of 40
// concurrent checks is decided, exactly once.
func TestResendsChecksAfterTheDrainsFarewell(t *testing.T) {
	path := socketPath(t)
	decided, _ := drainStandIn(t, path, func(conn, read int) drainAct {
		switch {
		case conn > 0 || read < 5:
			return drainAnswer
		case read < 10:
			return drainSkip // read, not decided: the drain's last frames are never these
		}
		return drainFarewell
	})
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 2 * time.Second, Policy: FailClosed})
	const n = 40
	var cw sync.WaitGroup
	errs := make(chan string, n)
	start := make(chan struct{})
	for i := 0; i < n; i++ {
		cw.Add(1)
		go func(i int) {
			defer cw.Done()
			<-start
			u := fmt.Sprint("u", i)
			d, err := c.Check(context.Background(), map[string]string{"user": u}, nil)
			if err != nil {
				errs <- err.Error()
			} else if d.Unreachable || d.Rule != u {
				errs <- fmt.Sprintf("check %d: %+v", i, d)
			}
		}(i)
	}
	close(start)
	cw.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	for i := 0; i < n; i++ {
		if k := decided(fmt.Sprint("u", i)); k != 1 {
			t.Errorf("u%d decided %d times", i, k)
		}
	}
}

// A drain says farewell on each of the pool's connections in turn, and a check sent
// again after the first farewell can land on another connection to the same draining
// sidecar, which then says farewell too: that check was not read either time. It is
// sent again as long as the deadline allows, not answered by the Policy. Before, the
// second farewell gave it the Policy: an audit's restarts under pipelined load (4
// connections, 64 callers) still answered 7 to 10 checks a restart by the Policy, every
// one after a farewell.
func TestResendsAgainAfterASecondFarewell(t *testing.T) {
	path := socketPath(t)
	const draining = 3 // the first connections: the draining sidecar's
	decided, _ := drainStandIn(t, path, func(conn, read int) drainAct {
		switch {
		case conn >= draining:
			return drainAnswer
		case read == 0:
			return drainSkip // read after the drain began: not decided
		}
		return drainFarewell
	})
	c := newClient(t, Options{Socket: path, Conns: draining, Timeout: 2 * time.Second, Policy: FailClosed})
	// The check's first send and its resends go round the pool, each dialing a
	// connection the draining sidecar accepted, until the pool's first slot redials.
	d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil)
	if err != nil || d.Unreachable || d.Rule != "u" {
		t.Fatalf("decided %+v, %v: want the successor's answer", d, err)
	}
	if k := decided("u"); k != 1 {
		t.Errorf("decided %d times", k)
	}
}

// A sidecar that tells every connection farewell (shutting_down), new ones too: a drain
// whose successor is not up yet, or a stand-in. A check is given back by each farewell,
// but one on a connection that had answered nothing is resent at most once per pooled
// connection, after a pause: before, it redialed in a loop for its whole timeout (over
// 1,000 connections for one check of 300 ms; 9,000 a second from 4 callers).
func TestFarewellOnEveryConnectionDoesNotLoop(t *testing.T) {
	path := socketPath(t)
	_, accepted := drainStandIn(t, path, func(conn, read int) drainAct {
		if read == 0 {
			return drainSkip
		}
		return drainFarewell
	})
	const pool = 4
	c := newClient(t, Options{Socket: path, Conns: pool, Timeout: 300 * time.Millisecond, Policy: FailClosed})
	d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil)
	if err != nil || !d.Unreachable {
		t.Fatalf("decided %+v, %v: want the Policy", d, err)
	}
	if conns := accepted(); conns > pool+2 {
		t.Errorf("one check dialed %d connections to a sidecar that says farewell on each: want at most %d", conns, pool+2)
	}
}

// drainAct is what drainStandIn does at a connection's next request.
type drainAct int

const (
	drainAnswer   drainAct = iota // read it and answer it allowed, its rule the user's
	drainSkip                     // read it and leave it undecided (read after the drain began)
	drainFarewell                 // read no more: the drain's farewell (shutting_down, id 0), then linger
)

// drainStandIn serves path as a sidecar in a drain: act(conn, read) says what to do at the
// next request of the conn-th connection accepted (from 0), read of them having been
// read on it. It returns how many times a user's checks were decided, and how many
// connections were accepted.
func drainStandIn(t *testing.T, path string, act func(conn, read int) drainAct) (decided func(user string) int, accepted func() int) {
	t.Helper()
	var mu sync.Mutex
	users := map[string]int{}
	conns := 0
	standIn(t, path, func(nc *net.UnixConn, conn int) {
		mu.Lock()
		conns++
		mu.Unlock()
		br := bufio.NewReader(nc)
		enc := proto.NewEncoder()
		for read := 0; ; read++ {
			a := act(conn, read)
			if a == drainFarewell {
				enc.Reset()
				enc.EncodeError(0, proto.CodeShuttingDown, "farewell")
				nc.Write(enc.Bytes())
				nc.CloseWrite()
				io.Copy(io.Discard, br) // as the daemon lingers
				return
			}
			body, err := proto.ReadFrame(br, nil, proto.DefaultMaxFrame)
			if err != nil {
				return
			}
			var req proto.Request
			if proto.NewDecoder().DecodeRequest(body, &req) != nil {
				return
			}
			if a == drainSkip {
				continue
			}
			mu.Lock()
			users[attr(&req, "user")]++
			mu.Unlock()
			enc.Reset()
			enc.EncodeCheck(&proto.Response{ID: req.ID, Allowed: true, Rule: attr(&req, "user")})
			if _, err := nc.Write(enc.Bytes()); err != nil {
				return
			}
		}
	})
	decided = func(user string) int {
		mu.Lock()
		defer mu.Unlock()
		return users[user]
	}
	accepted = func() int {
		mu.Lock()
		defer mu.Unlock()
		return conns
	}
	return decided, accepted
}

// A sidecar at its --max-conns refuses every new connection as it accepts it
// (too_many_connections, id 0), reading none of it. A check refused so is sent again on
// another connection of the pool, but at most once per pooled connection, after a pause:
// it is not redialed in a loop for its whole timeout; then it answers by the Policy,
// with the sidecar's reason.
func TestRefusedEveryConnectionDoesNotLoop(t *testing.T) {
	path := socketPath(t)
	var mu sync.Mutex
	accepted := 0
	standIn(t, path, func(nc *net.UnixConn, _ int) {
		mu.Lock()
		accepted++
		mu.Unlock()
		enc := proto.NewEncoder()
		enc.EncodeError(0, proto.CodeTooManyConnections, "the daemon serves at most 1 connection; close idle ones or raise --max-conns")
		nc.Write(enc.Bytes())
		nc.CloseWrite()
		nc.SetReadDeadline(time.Now().Add(time.Second))
		io.Copy(io.Discard, nc) // as the daemon lingers
	})
	const pool = 4
	c := newClient(t, Options{Socket: path, Conns: pool, Timeout: 300 * time.Millisecond, Policy: FailClosed})
	d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil)
	if err != nil || !d.Unreachable || !strings.Contains(d.Cause.Error(), proto.CodeTooManyConnections) {
		t.Fatalf("decided %+v, %v: want the Policy, for too_many_connections", d, err)
	}
	mu.Lock()
	defer mu.Unlock()
	// Its first send and one per pooled connection: each dials at most one connection,
	// whether the refusal is read before the check is written on it or after. (Before a
	// refusal read first was counted, a pick went on to dial the next slot at once: up to
	// 10 connections here.)
	if accepted > pool+1 {
		t.Errorf("one check dialed %d connections to a sidecar that refuses each: want at most %d", accepted, pool+1)
	}
}

// A sidecar at --idle-timeout shuts a connection's read side and closes it: a check
// written then fails its write (EPIPE, nothing delivered), and the client's reader reads
// the end of the stream. When the reader got there before the writer had recorded its
// failure, the check (and any encoded behind it) failed with the end of stream, as if
// the sidecar might have read it: the Policy, though it was never sent (13 of 1,600
// checks in TestE2EGoClientIdleTimeoutChecksAreNotLost, cmd/rlsidecar). The reader now
// waits for the write under way, and the check is sent again on a new connection. Here
// the hooks order it so: the stand-in's first connection shuts its read side, answers one
// check, and closes once the next check's write has failed; the writer goes on only
// once the reader has read that end.
func TestResendsCheckWhoseWriteFailedAsTheStreamEnded(t *testing.T) {
	path := socketPath(t)
	writeFailed, readFailed := make(chan struct{}), make(chan struct{})
	var wOnce, rOnce sync.Once
	wf := func() {
		wOnce.Do(func() { close(writeFailed) })
		select {
		case <-readFailed:
		case <-time.After(5 * time.Second): // the fixed reader waits for this write
		}
	}
	rf := func(*conn) { rOnce.Do(func() { close(readFailed) }) }
	writeFailedHook.Store(&wf)
	readFailedHook.Store(&rf)
	t.Cleanup(func() { writeFailedHook.Store(nil); readFailedHook.Store(nil) })
	standIn(t, path, func(nc *net.UnixConn, n int) {
		br := bufio.NewReader(nc)
		dec, enc := proto.NewDecoder(), proto.NewEncoder()
		for {
			body, err := proto.ReadFrame(br, nil, proto.DefaultMaxFrame)
			if err != nil {
				return
			}
			var req proto.Request
			if dec.DecodeRequest(body, &req) != nil {
				return
			}
			if n == 0 {
				nc.CloseRead() // before the answer: the client's next write fails (EPIPE)
			}
			enc.Reset()
			enc.EncodeCheck(&proto.Response{ID: req.ID, Allowed: true, Rule: attr(&req, "user")})
			if _, err := nc.Write(enc.Bytes()); err != nil {
				return
			}
			if n == 0 {
				<-writeFailed // then the connection ends: the reader reads EOF
				return
			}
		}
	})
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 10 * time.Second, Policy: FailClosed})
	for i := 0; i < 2; i++ {
		d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil)
		if err != nil || d.Unreachable || !d.Allowed || d.Rule != "u" {
			t.Fatalf("check %d: %+v %v", i, d, err)
		}
	}
}

// A drain's farewell says the sidecar read nothing from the oldest pending check on. A
// write failing meanwhile (the drain shut the read side) recorded the first frame it did
// not deliver over the farewell's mark: the checks between, written before and never
// read, failed as if read: the Policy. Each is sent again. Here check A is pending, B was
// written after it, C's write fails (EPIPE); the farewell comes as C's write fails, and
// the hooks have the writer note its failure between the reader noting the farewell and
// failing the connection.
func TestFarewellNotOverriddenByAFailedWrite(t *testing.T) {
	path := socketPath(t)
	readTwo, writeFailed, farewell := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var wOnce, fOnce sync.Once
	c := newClient(t, Options{Socket: path, Conns: 1, Timeout: 10 * time.Second, Policy: FailClosed})
	wf := func() {
		wOnce.Do(func() { close(writeFailed) })
		select {
		case <-farewell:
		case <-time.After(5 * time.Second):
		}
	}
	fh := func() {
		fOnce.Do(func() { close(farewell) })
		// Wait for the failed write to be noted (writeFailed sets werr).
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			s := &c.slots[0]
			s.mu.Lock()
			cn := s.cn
			s.mu.Unlock()
			if cn == nil {
				return
			}
			cn.mu.Lock()
			noted := cn.werr != nil
			cn.mu.Unlock()
			if noted {
				return
			}
		}
	}
	writeFailedHook.Store(&wf)
	closedUnreadHook.Store(&fh)
	t.Cleanup(func() { writeFailedHook.Store(nil); closedUnreadHook.Store(nil) })
	standIn(t, path, func(nc *net.UnixConn, n int) {
		br := bufio.NewReader(nc)
		dec, enc := proto.NewDecoder(), proto.NewEncoder()
		for i := 0; ; i++ {
			body, err := proto.ReadFrame(br, nil, proto.DefaultMaxFrame)
			if err != nil {
				return
			}
			var req proto.Request
			if dec.DecodeRequest(body, &req) != nil {
				return
			}
			if n == 0 {
				if i == 0 {
					continue // A: read, not decided
				}
				nc.CloseRead() // after B: C's write fails (EPIPE)
				close(readTwo)
				<-writeFailed
				enc.EncodeError(0, proto.CodeShuttingDown, "farewell")
				nc.Write(enc.Bytes())
				<-farewell
				return
			}
			enc.Reset()
			enc.EncodeCheck(&proto.Response{ID: req.ID, Allowed: true, Rule: attr(&req, "user")})
			if _, err := nc.Write(enc.Bytes()); err != nil {
				return
			}
		}
	})
	t.Cleanup(func() { c.Close() }) // before the stand-in's cleanup waits for its connections
	errs := make(chan string, 3)
	var wg sync.WaitGroup
	check := func(user string) {
		defer wg.Done()
		d, err := c.Check(context.Background(), map[string]string{"user": user}, nil)
		if err != nil || d.Unreachable || d.Rule != user {
			errs <- fmt.Sprintf("%s: %+v %v", user, d, err)
		}
	}
	wg.Add(2)
	go check("A")
	eventually(t, "A sent", func() bool { // A before B on the connection
		s := &c.slots[0]
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.cn == nil {
			return false
		}
		s.cn.mu.Lock()
		defer s.cn.mu.Unlock()
		return s.cn.flushedID >= 1
	})
	go check("B")
	<-readTwo
	wg.Add(1)
	go check("C")
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// A sidecar at --idle-timeout closes an idle connection (its read side shut first), and
// the client's reader reads the end of the stream with nothing pending and no write under
// way. A check sent in the moment before the reader broke the connection was queued on
// it and written (EPIPE: nothing delivered), and breaking the connection gave it the end
// of stream, as if the sidecar might have read it: the Policy, though the sidecar had
// closed before it was written (TestE2EGoClientIdleTimeoutChecksAreNotLost, cmd/rlsidecar:
// "reading a response: EOF", 1 check in 4 of 20 runs under load). No call is queued on a
// connection once its reader has read its end: the check goes on a new connection. Here
// the hooks place the check in that moment: sent once the reader has noted what the
// writes delivered, its write's failure recorded only once the connection is broken.
func TestCheckSentAsTheReaderReadTheEndGoesOnANewConnection(t *testing.T) {
	path := socketPath(t)
	writeFailed := make(chan struct{})
	var dead <-chan struct{}
	var rOnce, wOnce sync.Once
	lateDone := make(chan struct{})
	var late Decision
	var lateErr error
	var c *Client
	re := func(cn *conn) {
		rOnce.Do(func() {
			dead = cn.dead
			go func() {
				defer close(lateDone)
				late, lateErr = c.Check(context.Background(), map[string]string{"user": "late"}, nil)
			}()
			select {
			case <-writeFailed: // the check was queued on cn, and its write failed
			case <-time.After(time.Second): // the fixed client queues nothing on cn
			}
		})
	}
	wf := func() {
		wOnce.Do(func() {
			close(writeFailed)
			select {
			case <-dead: // cn broken, its pending calls failed
			case <-time.After(5 * time.Second):
			}
		})
	}
	standIn(t, path, func(nc *net.UnixConn, n int) {
		br := bufio.NewReader(nc)
		dec, enc := proto.NewDecoder(), proto.NewEncoder()
		for {
			body, err := proto.ReadFrame(br, nil, proto.DefaultMaxFrame)
			if err != nil {
				return
			}
			var req proto.Request
			if dec.DecodeRequest(body, &req) != nil {
				return
			}
			enc.Reset()
			enc.EncodeCheck(&proto.Response{ID: req.ID, Allowed: true, Rule: attr(&req, "user")})
			if _, err := nc.Write(enc.Bytes()); err != nil {
				return
			}
			if n == 0 {
				nc.CloseRead() // idle: its read side shut, then closed
				return
			}
		}
	})
	c = newClient(t, Options{Socket: path, Conns: 1, Timeout: 10 * time.Second, Policy: FailClosed})
	readEndedHook.Store(&re)
	writeFailedHook.Store(&wf)
	t.Cleanup(func() { readEndedHook.Store(nil); writeFailedHook.Store(nil) }) // before c closes
	d, err := c.Check(context.Background(), map[string]string{"user": "first"}, nil)
	if err != nil || d.Unreachable || d.Rule != "first" {
		t.Fatalf("first check: %+v %v", d, err)
	}
	<-lateDone // the reader read the end of the first connection, and the check was sent
	if lateErr != nil || late.Unreachable || !late.Allowed || late.Rule != "late" {
		t.Fatalf("the check sent as the reader read the end: %+v %v (want it answered on a new connection)", late, lateErr)
	}
}

// A check whose write failed (EPIPE: the sidecar read none of it) goes again on another
// connection of the pool, at most Conns + 1 writes in all (conn.go). A broken connection
// puts its slot in backoff, but a slow dial outlasts a first backoff, and without that
// count a sidecar failing every write was redialed for the check's whole timeout. Here
// the stand-in shuts the read side of every connection it accepts and closes it once the
// client's write has failed: each check (on a fresh client) gets the Policy within that
// bound, at once.
func TestWriteFailingOnEveryConnectionIsSentAtMostConnsPlusOneTimes(t *testing.T) {
	for _, pool := range []int{1, 2, 4} {
		t.Run(fmt.Sprint("conns=", pool), func(t *testing.T) {
			path := socketPath(t)
			shut, writeFailed := make(chan struct{}, 64), make(chan struct{}, 64)
			standIn(t, path, func(nc *net.UnixConn, n int) {
				nc.CloseRead() // the client's write to it fails
				shut <- struct{}{}
				select { // then it ends, as a sidecar's drain or idle cut ends it
				case <-writeFailed:
				case <-time.After(10 * time.Second):
				}
			})
			var failed atomic.Int64
			wf := func() { failed.Add(1); writeFailed <- struct{}{} }
			writeFailedHook.Store(&wf)
			// A client writes as soon as it has connected, before the stand-in has
			// accepted the connection: each dial waits for its connection's shut read
			// side, and then longer than a first backoff (5 to 10 ms), as a dial on a
			// busy machine may: the slot that failed first is free again by the time
			// the others have, and only the count of failed writes ends the resends.
			dialed := func() {
				select {
				case <-shut:
				case <-time.After(10 * time.Second):
				}
				time.Sleep(2 * backoffMin)
			}
			dialedHook.Store(&dialed)
			t.Cleanup(func() { writeFailedHook.Store(nil); dialedHook.Store(nil) })
			const timeout = 20 * time.Second
			for i := 0; i < 3; i++ {
				c := newClient(t, Options{Socket: path, Conns: pool, Timeout: timeout, Policy: FailClosed})
				failed.Store(0)
				start := time.Now()
				d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil)
				took := time.Since(start)
				if err != nil || !d.Unreachable || d.Allowed {
					t.Fatalf("check %d: %+v, %v: want the Policy (FailClosed)", i, d, err)
				}
				if got := failed.Load(); got < 1 || got > int64(pool+1) {
					t.Errorf("check %d: %d failed writes, want 1 to Conns + 1 = %d (%v)", i, got, pool+1, d.Cause)
				}
				if took > timeout/2 {
					t.Errorf("check %d took %v: redialed for its timeout (%v)", i, took, timeout)
				}
				c.Close()
			}
		})
	}
}
