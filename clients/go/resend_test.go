package rlclient

import (
	"bufio"
	"context"
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
