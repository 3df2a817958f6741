package rlclient

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"sync"
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
			ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			done := make(chan struct{})
			t.Cleanup(func() { close(done); ln.Close(); wg.Wait() })
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					nc, err := ln.AcceptUnix()
					if err != nil {
						return
					}
					wg.Add(1)
					go func() {
						defer wg.Done()
						defer nc.Close()
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
					}()
				}
			}()
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
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	decided := map[string]int{}
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for conns := 0; ; conns++ {
			nc, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			wg.Add(1)
			go func(first bool) {
				defer wg.Done()
				defer nc.Close()
				br := bufio.NewReader(nc)
				enc := proto.NewEncoder()
				for read := 0; ; read++ {
					if first && read == 10 {
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
					if first && read >= 5 {
						continue // read, not decided: the drain's last frames are never these
					}
					mu.Lock()
					decided[attr(&req, "user")]++
					mu.Unlock()
					enc.Reset()
					enc.EncodeCheck(&proto.Response{ID: req.ID, Allowed: true, Rule: attr(&req, "user")})
					if _, err := nc.Write(enc.Bytes()); err != nil {
						return
					}
				}
			}(conns == 0)
		}
	}()
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
	mu.Lock()
	defer mu.Unlock()
	for i := 0; i < n; i++ {
		if k := decided[fmt.Sprint("u", i)]; k != 1 {
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
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	decided := map[string]int{}
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	const draining = 3 // the first connections: the draining sidecar's
	wg.Add(1)
	go func() {
		defer wg.Done()
		for conns := 0; ; conns++ {
			nc, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			wg.Add(1)
			go func(old bool) {
				defer wg.Done()
				defer nc.Close()
				br := bufio.NewReader(nc)
				enc := proto.NewEncoder()
				for {
					body, err := proto.ReadFrame(br, nil, proto.DefaultMaxFrame)
					if err != nil {
						return
					}
					var req proto.Request
					if proto.NewDecoder().DecodeRequest(body, &req) != nil {
						return
					}
					if old {
						// Read after the drain began: not decided, farewell.
						enc.Reset()
						enc.EncodeError(0, proto.CodeShuttingDown, "farewell")
						nc.Write(enc.Bytes())
						nc.CloseWrite()
						io.Copy(io.Discard, br)
						return
					}
					mu.Lock()
					decided[attr(&req, "user")]++
					mu.Unlock()
					enc.Reset()
					enc.EncodeCheck(&proto.Response{ID: req.ID, Allowed: true, Rule: attr(&req, "user")})
					if _, err := nc.Write(enc.Bytes()); err != nil {
						return
					}
				}
			}(conns < draining)
		}
	}()
	c := newClient(t, Options{Socket: path, Conns: draining, Timeout: 2 * time.Second, Policy: FailClosed})
	// The check's first send and its resends go round the pool, each dialing a
	// connection the draining sidecar accepted, until the pool's first slot redials.
	d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil)
	if err != nil || d.Unreachable || d.Rule != "u" {
		t.Fatalf("decided %+v, %v: want the successor's answer", d, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if decided["u"] != 1 {
		t.Errorf("decided %d times", decided["u"])
	}
}

// A sidecar that tells every connection farewell (shutting_down), new ones too: a drain
// whose successor is not up yet, or a stand-in. A check is given back by each farewell,
// but one on a connection that had answered nothing is resent at most once per pooled
// connection, after a pause: before, it redialed in a loop for its whole timeout (over
// 1,000 connections for one check of 300 ms; 9,000 a second from 4 callers).
func TestFarewellOnEveryConnectionDoesNotLoop(t *testing.T) {
	path := socketPath(t)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := 0
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			nc, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			mu.Lock()
			conns++
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer nc.Close()
				br := bufio.NewReader(nc)
				if _, err := proto.ReadFrame(br, nil, proto.DefaultMaxFrame); err != nil {
					return
				}
				enc := proto.NewEncoder()
				enc.EncodeError(0, proto.CodeShuttingDown, "farewell")
				nc.Write(enc.Bytes())
				nc.CloseWrite()
				io.Copy(io.Discard, br)
			}()
		}
	}()
	const pool = 4
	c := newClient(t, Options{Socket: path, Conns: pool, Timeout: 300 * time.Millisecond, Policy: FailClosed})
	d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil)
	if err != nil || !d.Unreachable {
		t.Fatalf("decided %+v, %v: want the Policy", d, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if conns > pool+2 {
		t.Errorf("one check dialed %d connections to a sidecar that says farewell on each: want at most %d", conns, pool+2)
	}
}
