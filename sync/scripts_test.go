package sync

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// scriptsKnown reports how many of the daemon's scripts c's Redis has cached.
func scriptsKnown(t *testing.T, c *redis.Client) int {
	t.Helper()
	var hashes []string
	for _, src := range scriptSources() {
		h := sha1.Sum([]byte(src))
		hashes = append(hashes, hex.EncodeToString(h[:]))
	}
	known, err := c.ScriptExists(context.Background(), hashes...).Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, k := range known {
		if k {
			n++
		}
	}
	return n
}

// LoadScripts puts every script into the cache of a standalone Redis and of each
// master of a Cluster, so that the first checks after a start need no NOSCRIPT round.
func TestLoadScripts(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	if n := scriptsKnown(t, rdb); n != 0 {
		t.Fatalf("a fresh Redis knows %d scripts", n)
	}
	if err := LoadScripts(context.Background(), rdb); err != nil {
		t.Fatal(err)
	}
	if n, want := scriptsKnown(t, rdb), len(scriptSources()); n != want {
		t.Errorf("standalone: %d of %d scripts cached", n, want)
	}

	cl := redistest.StartCluster(t)
	crdb, err := Open(Config{Cluster: cl.Addrs, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer crdb.Close()
	if err := LoadScripts(context.Background(), crdb); err != nil {
		t.Fatal(err)
	}
	for _, addr := range cl.Addrs {
		node := redis.NewClient(&redis.Options{Addr: addr})
		if role, _ := node.Do(context.Background(), "ROLE").Slice(); len(role) > 0 && role[0] == "master" {
			if n, want := scriptsKnown(t, node), len(scriptSources()); n != want {
				t.Errorf("cluster master %s: %d of %d scripts cached", addr, n, want)
			}
		}
		node.Close()
	}
}

// A master that answers again after its breaker opened may have restarted with an empty
// script cache: ProbeOpen loads the scripts into it before closing the breaker.
func TestGlobalProbeOpenLoadsScripts(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	m := NewMasters(rdb, 1, 50*time.Millisecond, nil)
	if err := m.Refresh(context.Background()); err != nil || len(m.List()) != 1 {
		t.Fatalf("masters %d (%v), want 1", len(m.List()), err)
	}
	g := NewGlobal(rdb).WithAutoPipeline().WithMasters(m)
	m.List()[0].Breaker().Failure()
	if err := rdb.ScriptFlush(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // the first wait: an eighth of the cool-down
	g.ProbeOpen(context.Background(), 200*time.Millisecond)
	if m.List()[0].Breaker().Open() {
		t.Fatal("the breaker is still open after a probe of a Redis that answers")
	}
	if n, want := scriptsKnown(t, rdb), len(scriptSources()); n != want {
		t.Errorf("%d of %d scripts cached after the probe closed the breaker", n, want)
	}
}

// A Redis that requires a password the daemon was not given closes the connection that
// sends it the scripts unauthenticated; LoadScripts says why (NOAUTH), not EOF.
func TestLoadScriptsWithoutPasswordSaysWhy(t *testing.T) {
	srv := redistest.StartStandalone(t, redistest.WithPassword("s3cret"))
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	err := LoadScripts(context.Background(), rdb)
	if err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Fatalf("LoadScripts without the password: %v, want NOAUTH", err)
	}
	rdb = redis.NewClient(&redis.Options{Addr: srv.Addr, Password: "wrong"})
	defer rdb.Close()
	err = LoadScripts(context.Background(), rdb)
	if err == nil || !strings.Contains(err.Error(), "WRONGPASS") {
		t.Fatalf("LoadScripts with a wrong password: %v, want WRONGPASS", err)
	}
}

// On a Cluster, LoadScripts also has go-redis fetch Redis's command table (COMMAND),
// which the cluster client fetches on its first command not sent in a pipeline: the
// first global check decided alone then sends no COMMAND and waits for none.
func TestLoadScriptsClusterFetchesCommandTable(t *testing.T) {
	cl := redistest.StartCluster(t)
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	ctx := context.Background()
	commands := func() int {
		n := 0
		for _, addr := range cl.Addrs {
			node := redis.NewClient(&redis.Options{Addr: addr})
			info, err := node.Info(ctx, "commandstats").Result()
			node.Close()
			if err != nil {
				t.Fatal(err)
			}
			for _, l := range strings.Split(info, "\n") {
				if v, ok := strings.CutPrefix(strings.TrimSpace(l), "cmdstat_command:calls="); ok {
					c, _, _ := strings.Cut(v, ",")
					k, _ := strconv.Atoi(c)
					n += k
				}
			}
		}
		return n
	}
	if err := LoadScripts(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	before := commands()
	g := NewGlobal(rdb)
	ops := []GlobalOp{{Key: "rl:cmdtable:{user=a}", Limit: mustLimit(t, localbucket.FixedWindow, 10, hourWindow()), Cost: 1}}
	if ok, err := g.Check(ctx, ops); err != nil || !ok {
		t.Fatalf("global check: %v, %v", ok, err)
	}
	if after := commands(); after != before {
		t.Fatalf("the first global check sent COMMAND %d times after LoadScripts; want 0 (fetched by LoadScripts)", after-before)
	}
}
