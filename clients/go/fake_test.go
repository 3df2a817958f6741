package rlclient

import (
	"bufio"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// fakeSidecar serves the rlsidecar protocol on a Unix socket with scripted answers. Like
// the real daemon, it answers in order, and writes all the answers to the requests it has
// already buffered in one write: maxBatch is then the most requests it found pipelined.
type fakeSidecar struct {
	path string
	ln   *net.UnixListener

	// answer fills resp (ID preset to the request's) for a check, release or renew (by
	// req.Op: the fields of that answer); setting resp.Err makes
	// it an error response. It runs on the connection's goroutine, so it may block.
	answer func(req *proto.Request, resp *proto.Response)
	delay  atomic.Int64 // nanoseconds to sleep before each answer

	requests atomic.Int64 // requests read
	maxBatch atomic.Int64

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// socketPath returns a short path for a Unix socket (paths are limited to ~100 bytes).
func socketPath(t testing.TB) string {
	dir, err := os.MkdirTemp("", "rlc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "s.sock")
}

// echoUser answers every check as allowed, with the value of attrs["user"] as the rule.
func echoUser(req *proto.Request, resp *proto.Response) {
	user := attr(req, "user")
	resp.Allowed = true
	resp.Rule = user
	resp.Limit = 10
	resp.Remaining = 9
	resp.ResetMs = 6000
	resp.Rules = append(resp.Rules, proto.RuleResult{Name: user, Limit: 10, WindowMs: 60000, Remaining: 9, ResetMs: 6000, Allowed: true})
}

func attr(req *proto.Request, name string) string {
	for _, a := range req.Attrs {
		if a.Name == name {
			return a.Value
		}
	}
	return ""
}

// startFake serves on path until stop (or the test's end).
func startFake(t testing.TB, path string, answer func(*proto.Request, *proto.Response)) *fakeSidecar {
	t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	if answer == nil {
		answer = echoUser
	}
	f := &fakeSidecar{path: path, ln: ln, answer: answer, conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go f.accept()
	t.Cleanup(f.stop)
	return f
}

func (f *fakeSidecar) accept() {
	defer f.wg.Done()
	for {
		nc, err := f.ln.Accept()
		if err != nil {
			return
		}
		f.mu.Lock()
		if f.conns == nil { // stopped
			f.mu.Unlock()
			nc.Close()
			return
		}
		f.conns[nc] = struct{}{}
		f.wg.Add(1)
		f.mu.Unlock()
		go f.serve(nc)
	}
}

func (f *fakeSidecar) serve(nc net.Conn) {
	defer f.wg.Done()
	defer func() {
		f.mu.Lock()
		delete(f.conns, nc)
		f.mu.Unlock()
		nc.Close()
	}()
	br := bufio.NewReader(nc)
	dec := proto.NewDecoder()
	enc := proto.NewEncoder()
	var req proto.Request
	var resp proto.Response
	var buf []byte
	batch := int64(0)
	for {
		body, err := proto.ReadFrame(br, buf, proto.DefaultMaxFrame)
		if err != nil {
			return
		}
		buf = body
		f.requests.Add(1)
		if d := f.delay.Load(); d > 0 {
			time.Sleep(time.Duration(d))
		}
		if err := dec.DecodeRequest(body, &req); err != nil {
			var pe *proto.Error
			errors.As(err, &pe)
			enc.EncodeError(req.ID, pe.Code, pe.Message)
		} else {
			switch req.Op {
			case proto.OpPing:
				enc.EncodePing(req.ID, "fake-1.0")
			case proto.OpCheck, proto.OpRelease, proto.OpRenew:
				resp.Reset()
				resp.ID = req.ID
				f.answer(&req, &resp)
				switch {
				case resp.IsError():
					enc.EncodeError(resp.ID, resp.Err.Code, resp.Err.Message)
				case req.Op == proto.OpRelease:
					enc.EncodeRelease(resp.ID, resp.Released)
				case req.Op == proto.OpRenew:
					enc.EncodeRenew(resp.ID, resp.Renewed, resp.ExpiresMs)
				default:
					enc.EncodeCheck(&resp)
				}
			default:
				enc.EncodeError(req.ID, proto.CodeUnknownOp, "unknown op")
			}
		}
		batch++
		if br.Buffered() == 0 {
			if batch > f.maxBatch.Load() {
				f.maxBatch.Store(batch)
			}
			batch = 0
			if _, err := nc.Write(enc.Bytes()); err != nil {
				return
			}
			enc.Reset()
		}
	}
}

// dropConns closes every open connection; the listener stays.
func (f *fakeSidecar) dropConns() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for nc := range f.conns {
		nc.Close()
	}
}

// stop closes the listener (removing the socket file) and every connection, and waits.
func (f *fakeSidecar) stop() {
	f.ln.Close()
	f.mu.Lock()
	for nc := range f.conns {
		nc.Close()
	}
	f.conns = nil
	f.mu.Unlock()
	f.wg.Wait()
}

// standIn listens on path and serves each connection accepted with handle, in a
// goroutine of its own, n counting the connections from 0; handle's connection is closed
// when it returns. At the test's end the listener is closed and every handle waited for
// (cleanups a test registers after calling standIn run before).
func standIn(t *testing.T, path string, handle func(nc *net.UnixConn, n int)) {
	t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 0; ; n++ {
			nc, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer nc.Close()
				handle(nc, n)
			}()
		}
	}()
}
