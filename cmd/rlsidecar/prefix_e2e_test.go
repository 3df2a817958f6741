package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

const prefixRules = `
rules:
  - name: per-user
    key: user
    algorithm: fixed_window
    limit: { requests: 10, per: 1h }
    mode: global
  - name: spread
    match: { path: /split }
    key: ip
    limit: { requests: 10, per: 1h }
    mode: local
    split: auto
  - name: synced
    match: { path: /hybrid }
    key: account
    algorithm: fixed_window
    limit: { requests: 100, per: 1h }
`

// Three real daemons on one real Redis (standalone, then a 3-master Cluster): a1 and a2
// under --redis-prefix a:, b under b:. Daemons under one prefix share budgets and count
// each other; under another they share nothing: b gets its own full budget, and counts
// itself alone for split: auto. Every key lands under its daemon's prefix, none under rl:.
func TestE2ERedisPrefix(t *testing.T) {
	for _, backend := range []string{"standalone", "cluster"} {
		t.Run(backend, func(t *testing.T) {
			var redisArgs []string
			var rdb redis.UniversalClient
			if backend == "standalone" {
				srv := redistest.StartStandalone(t)
				redisArgs = []string{"--redis", "redis://" + srv.Addr}
				rdb = redis.NewClient(&redis.Options{Addr: srv.Addr})
			} else {
				cl := redistest.StartCluster(t)
				redisArgs = []string{"--redis-cluster", strings.Join(cl.Addrs, ",")}
				rdb = redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
			}
			t.Cleanup(func() { rdb.Close() })
			testPrefixes(t, rdb, redisArgs)
		})
	}
}

func testPrefixes(t *testing.T, rdb redis.UniversalClient, redisArgs []string) {
	ctx := context.Background()
	clearOfWindowEnd(t, time.Hour, 30*time.Second) // budgets and Redis's counts are the window's
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", prefixRules)
	names := []string{"a1", "b", "a2"}
	prefix := map[string]string{"a1": "a:", "a2": "a:", "b": "b:"}
	ds := map[string]*daemonProc{}
	cs := map[string]*rawConn{}
	for _, n := range names {
		args := append([]string{"--config", cfg, "--sync-interval", "50ms", "--global-timeout", "500ms",
			"--daemon-id", n, "--redis-prefix", prefix[n]}, redisArgs...)
		ds[n] = startDaemon(t, args...)
		cs[n] = dialRaw(t, ds[n].socket)
	}
	var id uint64
	check := func(n string, cost uint64, attrs ...string) *proto.Response {
		id++
		r := cs[n].check(id, cost, attrs...)
		if r.Degraded || r.Err.Code != "" {
			t.Fatalf("%s: %+v\n%s", n, r, ds[n].stderr.String())
		}
		return r
	}
	splitLimit := func(n string) uint64 {
		r := check(n, 0, "path=/split", "ip=probe")
		if len(r.Rules) != 1 || r.Rules[0].Name != "spread" {
			t.Fatalf("%s: %+v", n, r)
		}
		return r.Rules[0].Limit
	}

	// split: auto: a1 and a2 count two daemons and get 5 each; b counts itself.
	deadline := time.Now().Add(10 * time.Second)
	for splitLimit("a1") != 5 || splitLimit("a2") != 5 {
		if time.Now().After(deadline) {
			t.Fatalf("a1 and a2 never counted each other: split limits %d, %d", splitLimit("a1"), splitLimit("a2"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Each prefix's live-daemons set counts its own daemons (b's first heartbeat may
	// come after a1 and a2 have counted each other: a fresh-clone CI run read 0).
	for key, want := range map[string]int64{"a:daemons": 2, "b:daemons": 1} {
		for got := rdb.ZCard(ctx, key).Val(); got != want; got = rdb.ZCard(ctx, key).Val() {
			if time.Now().After(deadline) {
				t.Fatalf("ZCARD %s = %d, want %d", key, got, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if got := splitLimit("b"); got != 10 {
		t.Fatalf("b's split limit %d: it counted daemons of another prefix", got)
	}
	admitted := map[string]int{}
	for i := 0; i < 12; i++ {
		for _, n := range names {
			if check(n, 1, "path=/split", "ip=s").Allowed {
				admitted[n]++
			}
		}
	}
	if admitted["a1"] != 5 || admitted["a2"] != 5 || admitted["b"] != 10 {
		t.Fatalf("split: auto admitted %v, want a1 5, a2 5, b 10", admitted)
	}

	// Budgets (global mode, exact): a1 and a2 share user=x's 10; b has its own 10.
	clear(admitted)
	for i := 0; i < 15; i++ {
		for _, n := range names {
			if check(n, 1, "user=x").Allowed {
				admitted[n]++
			}
		}
	}
	if admitted["a1"]+admitted["a2"] != 10 || admitted["b"] != 10 {
		t.Fatalf("global budgets admitted %v, want a1+a2 10 and b 10", admitted)
	}

	// Hybrid keys and their sync records go under the prefix too; after SIGTERM every
	// admitted request is counted there.
	for _, n := range names {
		if !check(n, 1, "path=/hybrid", "account=h").Allowed {
			t.Fatalf("%s: the first hybrid request was refused", n)
		}
	}
	for _, n := range names {
		ds[n].cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, n := range names {
		select {
		case err := <-ds[n].done:
			if err != nil {
				t.Fatalf("%s exit: %v\n%s", n, err, ds[n].stderr.String())
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s did not exit", n)
		}
	}
	for key, want := range map[string]int{"a:synced~fw1h:{account=h}": 2, "b:synced~fw1h:{account=h}": 1} {
		if got, err := rdb.HGet(ctx, key, "n").Int(); err != nil || got != want {
			t.Errorf("%s counts %d (%v), want %d", key, got, err, want)
		}
	}
	var mu sync.Mutex // ForEachMaster calls scan for every master at once
	var stray []string
	scan := func(ctx context.Context, c *redis.Client) error {
		for _, p := range []string{"rl:*", "*daemons*"} {
			keys, err := c.Keys(ctx, p).Result()
			if err != nil {
				return err
			}
			mu.Lock()
			stray = append(stray, keys...)
			mu.Unlock()
		}
		return nil
	}
	var err error
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, scan)
	case *redis.Client:
		err = scan(ctx, c)
	}
	if err != nil {
		t.Fatal(err)
	}
	// On a Cluster the live-daemons set has two copies on other masters, named after it
	// (a:daemons:{N}); nothing may be under rl: or another deployment's prefix, and no
	// live-daemons set of a daemon that stopped.
	slices.Sort(stray)
	var sets []string
	for _, k := range stray {
		base, _, _ := strings.Cut(k, ":{")
		if base != "a:daemons" && base != "b:daemons" {
			t.Fatalf("keys under rl: or named daemons: %v, want only a:daemons and b:daemons (and their cluster copies)", stray)
		}
		if !slices.Contains(sets, base) {
			sets = append(sets, base)
		}
	}
	// The sets were a:daemons and b:daemons while the daemons ran (ZCARD above); each
	// daemon left its set as it stopped, so none is left.
	if len(sets) != 0 {
		var logs strings.Builder
		for _, n := range names {
			fmt.Fprintf(&logs, "--- %s:\n%s", n, ds[n].stderr.String())
		}
		t.Fatalf("live-daemon sets %v after every daemon stopped cleanly, want none (each leaves its set)\n%s", sets, logs.String())
	}
}

// serve refuses a bad --redis-prefix before it listens or touches Redis.
func TestServeRefusesBadRedisPrefix(t *testing.T) {
	for _, tc := range []struct{ prefix, msg string }{
		{"", "must not be empty"},
		{"tenant", "must end with ':'"},
		{"{t}:", "'{' or '}'"},
		{strings.Repeat("x", 70) + ":", "at most 64"},
	} {
		_, errOut, code := runInProcess("serve", "--socket", shortTempDir(t)+"/s.sock", "--redis", "redis://127.0.0.1:1",
			"--redis-prefix="+tc.prefix)
		if code != exitUsage || !strings.Contains(errOut, "--redis-prefix") || !strings.Contains(errOut, tc.msg) {
			t.Errorf("prefix %q: code %d, stderr %q", tc.prefix, code, errOut)
		}
	}
}
