package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	gosync "sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// Concurrency leases under reloads and closing connections, on the real daemon: six
// clients pipeline checks that take a global and a local lease, release some, leave the
// rest to their connection's close, or close with their checks in flight, while 39
// rewrites of the rules file (each followed by SIGHUP) move the rules between global
// and local mode, rename one and change max and lease. Every release of a lease taken
// is answered released, whatever the rules in force by then; once every connection has
// closed, rlsidecar_inflight is 0 for every rule and no sorted set in Redis holds a live
// slot. Before, a release of a global lease whose rule a reload had since made local,
// or renamed, was answered false and freed nothing (129 of about 2,000 in a run); its
// slot stayed held until its connection closed, or for its 60 s lease.
func TestE2ELeasesUnderReloadsAndCloses(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	variants := []string{
		"  - name: jobs\n    match: { path: /job }\n    key: user\n    concurrency: { max: 40, lease: 60s }\n    mode: global\n  - name: here\n    match: { path: /job }\n    key: user\n    concurrency: { max: 40, lease: 60s }\n    mode: local\n",
		"  - name: jobs\n    match: { path: /job }\n    key: user\n    concurrency: { max: 40, lease: 60s }\n    mode: local\n  - name: here\n    match: { path: /job }\n    key: user\n    concurrency: { max: 30, lease: 60s }\n    mode: global\n",
		"  - name: jobs2\n    match: { path: /job }\n    key: user\n    concurrency: { max: 40, lease: 60s }\n    mode: global\n",
		"  - name: jobs\n    match: { path: /job }\n    key: user\n    concurrency: { max: 20, lease: 30s }\n    mode: global\n  - name: here\n    match: { path: /job }\n    key: user\n    concurrency: { max: 40, lease: 60s }\n    mode: local\n",
	}
	rulesFor := func(i int) string {
		return "rules:\n" + variants[i%len(variants)] + "  - name: rate\n    key: user\n    limit: { requests: 1000000, per: 1h }\n"
	}
	cfg := writeFile(t, dir, "rules.yaml", rulesFor(0))
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--admin", "127.0.0.1:0", "--sync-interval", "20ms", "--global-timeout", "2s")
	base := "http://" + adminAddr(t, d)

	stop := make(chan struct{})
	var wg gosync.WaitGroup
	var mu gosync.Mutex
	var errs []string
	for c := 0; c < 6; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := 0; ; round++ {
				select {
				case <-stop:
					return
				default:
				}
				conn := dialRaw(t, d.socket)
				enc := proto.NewEncoder()
				for i := 0; i < 8; i++ {
					enc.EncodeRequest(&proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
						{Name: "user", Value: fmt.Sprint("u", c%3)}, {Name: "path", Value: "/job"}}})
				}
				conn.write(enc.Bytes())
				if round%3 == 0 {
					conn.c.Close() // gone with its checks in flight
					continue
				}
				var toks []string
				for i := 0; i < 8; i++ {
					r := conn.recv()
					if r.IsError() {
						mu.Lock()
						errs = append(errs, fmt.Sprint(r.Err))
						mu.Unlock()
					}
					if r.Lease != "" {
						toks = append(toks, r.Lease)
					}
				}
				time.Sleep(time.Millisecond)
				enc.Reset()
				n := 0
				for i, tok := range toks {
					if round%3 == 2 && i%2 == 1 {
						continue // left to the close
					}
					enc.EncodeRequest(&proto.Request{ID: uint64(100 + i), Op: proto.OpRelease, Lease: tok})
					n++
				}
				if n > 0 {
					conn.write(enc.Bytes())
					for range n {
						if r := conn.recv(); !r.Released {
							mu.Lock()
							errs = append(errs, fmt.Sprintf("release %d not released", r.ID))
							mu.Unlock()
						}
					}
				}
				conn.c.Close()
			}
		}()
	}
	for i := 1; i < 40; i++ {
		if err := os.WriteFile(cfg, []byte(rulesFor(i)), 0o644); err != nil {
			t.Fatal(err)
		}
		d.cmd.Process.Signal(syscall.SIGHUP)
		time.Sleep(25 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	// The watcher reloads too: two writes close together may be one reload.
	if n := strings.Count(d.stderr.String(), "rules reloaded"); n < 20 {
		t.Errorf("%d reloads, want most of 39\n%s", n, d.stderr.String())
	}
	if len(errs) > 0 {
		t.Errorf("%d wrong answers, the first: %v", len(errs), errs[:min(3, len(errs))])
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, s := scrape(t, base)
		left := 0.0
		var desc []string
		for k, v := range s {
			if strings.HasPrefix(k, "rlsidecar_inflight{") && v != 0 {
				left += v
				desc = append(desc, fmt.Sprint(k, "=", v))
			}
		}
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("in flight after every connection closed: %v", desc)
		}
		time.Sleep(100 * time.Millisecond)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	keys, _ := rdb.Keys(context.Background(), "rl:*").Result()
	for _, k := range keys {
		if typ := rdb.Type(context.Background(), k).Val(); typ == "zset" {
			if n := rdb.ZCount(context.Background(), k, fmt.Sprint(time.Now().UnixMilli()), "+inf").Val(); n != 0 {
				t.Errorf("%s holds %d live slots after every connection closed", k, n)
			}
		}
	}
	sigterm(t, d, 10*time.Second)
}
