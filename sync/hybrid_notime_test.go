package sync

import (
	"context"
	"fmt"
	"io"
	"net"
	gosync "sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// slowLink forwards loopback connections to upstream, holding each chunk a client
// writes for delay before passing it on: a Redis that answers, slowly (a loaded one).
func slowLink(t testing.TB, upstream string, delay time.Duration) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg gosync.WaitGroup
	var mu gosync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", upstream)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, u)
			mu.Unlock()
			wg.Add(2)
			go func() {
				defer wg.Done()
				defer u.Close()
				buf := make([]byte, 64<<10)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						time.Sleep(delay)
						if _, werr := u.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
			go func() {
				defer wg.Done()
				defer c.Close()
				_, _ = io.Copy(c, u)
			}()
		}
	}()
	return ln.Addr().String()
}

// A sync that cannot send all its keys within its budget sends what fits and leaves the
// rest for the next sync: its master answered, so its breaker hears no failure, and
// nothing is lost or counted twice. Before, the pipeline the budget ran out in failed,
// every such sync counted as a failure of Redis, and three of them opened the breaker:
// with a flood of new keys on a loaded Redis, every key of the master was then decided
// by its rule's failure policy (degraded) while Redis answered.
func TestHybridSyncOutOfTimeIsNoFailure(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + slowLink(t, srv.Addr, 50*time.Millisecond), Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	// The scripts loaded and a connection set up (each of its round trips slow) first.
	if err := LoadScripts(context.Background(), rdb); err != nil {
		t.Fatal(err)
	}
	masters := NewMasters(rdb, 3, time.Minute, nil)
	h := NewHybrid(rdb, HybridOptions{Interval: 100 * time.Millisecond, MaxKeys: 100_000, MaxSyncKeys: 100_000, ID: "d1"}).WithMasters(masters)
	lim := mustLimit(t, localbucket.FixedWindow, 100, hourWindow())
	// 24 pipelines of 4 calls of 128 keys: each round trip at least 50 ms.
	const keys = 24 * pipeCalls * callKeys
	now := time.Now().UnixNano()
	for i := range keys {
		if r := take(h, now, fmt.Sprintf("rl:nt:{u=%d}", i), lim, 1); !r.Allowed {
			t.Fatalf("key %d refused: %+v", i, r)
		}
	}
	syncs, cut := 0, 0
	for ; syncs < 50; syncs++ {
		items := h.collect(now, h.maxSync)
		if len(items) == 0 {
			break
		}
		// A budget for about twelve round trips (as Run's: from when the keys are
		// collected). A sync whose first round trip outlives it failed, rightly: with
		// six of 25 ms, a loaded machine made one such round trip (sync 18 of a run, its
		// one pipeline timed out), and its master counted as not answering.
		ctx, cancel := context.WithTimeout(context.Background(), 600*time.Millisecond)
		sent, err := h.settle(ctx, items, false)
		cancel()
		if err != nil {
			// A round trip on a loaded machine slower than twice the slowest before it: its
			// keys are kept for the next sync all the same (checked below).
			t.Logf("sync %d: %v", syncs+1, err)
		}
		if sent < len(items) || err != nil {
			cut++
		}
		if masters.AnyOpen() {
			t.Fatalf("sync %d sent %d of %d keys and opened the breaker: Redis answered every pipeline it was sent", syncs+1, sent, len(items))
		}
		for _, m := range masters.List() {
			if !m.answering() {
				t.Fatalf("sync %d: the master counts as not answering", syncs+1)
			}
		}
	}
	if cut == 0 {
		t.Fatalf("every sync sent all its keys: the link is not slow enough to test a sync cut short")
	}
	if syncs == 50 {
		t.Fatalf("keys still left after 50 syncs (backlog %d)", h.Backlog())
	}
	direct, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()
	ctx := context.Background()
	for i := range keys {
		k := fmt.Sprintf("rl:nt:{u=%d}", i)
		if n, err := direct.HGet(ctx, k, "n").Int(); err != nil || n != 1 {
			t.Fatalf("%s: Redis counts %d (%v), want the 1 unit admitted", k, n, err)
		}
	}
	if d := h.Dropped(); d != 0 {
		t.Fatalf("%d units dropped", d)
	}
	t.Logf("%d keys in %d syncs, %d of them cut short", keys, syncs, cut)
}
