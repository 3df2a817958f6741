package redistest_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// noMaint keeps go-redis from offering maintenance notifications, which Redis 7.0 does
// not know (it would only log the refusal).
var noMaint = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}

func client(t *testing.T, addr, password string, readTimeout time.Duration) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{
		Addr:                     addr,
		Password:                 password,
		ReadTimeout:              readTimeout,
		MaxRetries:               -1,
		MaintNotificationsConfig: noMaint,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

func TestStandalone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := redistest.StartStandalone(t)
	if !strings.HasPrefix(srv.Addr, "127.0.0.1:") {
		t.Fatalf("Addr = %q, want 127.0.0.1:port", srv.Addr)
	}
	rdb := client(t, srv.Addr, "", 0)
	if err := rdb.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if got, err := rdb.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET k = %q, %v; want v", got, err)
	}
	for param, want := range map[string]string{"save": "", "appendonly": "no"} {
		got, err := rdb.ConfigGet(ctx, param).Result()
		if err != nil || got[param] != want {
			t.Errorf("CONFIG GET %s = %q, %v; want %q", param, got[param], err, want)
		}
	}
}

func TestPassword(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const pw = `s3cret "quoted" \ and spaces`
	srv := redistest.StartStandalone(t, redistest.WithPassword(pw))
	if srv.Password != pw {
		t.Fatalf("Password = %q, want %q", srv.Password, pw)
	}
	if err := client(t, srv.Addr, pw, 0).Ping(ctx).Err(); err != nil {
		t.Fatalf("PING with AUTH: %v", err)
	}
	err := client(t, srv.Addr, "", 0).Ping(ctx).Err()
	if err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Fatalf("PING without AUTH: %v, want NOAUTH", err)
	}
	err = client(t, srv.Addr, "wrong", 0).Ping(ctx).Err()
	if err == nil || !strings.Contains(err.Error(), "WRONGPASS") {
		t.Fatalf("PING with a wrong password: %v, want WRONGPASS", err)
	}
}

func TestStopRestart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := redistest.StartStandalone(t)
	addr := srv.Addr
	rdb := client(t, addr, "", 0)
	if err := rdb.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}

	srv.Stop()
	if err := rdb.Ping(ctx).Err(); err == nil {
		t.Fatal("PING to a stopped server succeeded")
	}
	srv.Stop() // a second Stop is a no-op

	srv.Restart(t)
	if srv.Addr != addr {
		t.Fatalf("Addr after Restart = %q, want %q", srv.Addr, addr)
	}
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after Restart: %v", err)
	}
	// No persistence: the restarted server starts empty.
	if err := rdb.Get(ctx, "k").Err(); !errors.Is(err, redis.Nil) {
		t.Fatalf("GET k after Restart: %v, want redis.Nil", err)
	}
}

func TestFreezeThaw(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := redistest.StartStandalone(t)
	rdb := client(t, srv.Addr, "", 200*time.Millisecond)
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}

	srv.Freeze()
	start := time.Now()
	err := rdb.Ping(ctx).Err()
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("PING to a frozen server: %v, want a timeout", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("PING to a frozen server took %v, want about 200ms", d)
	}

	srv.Thaw()
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after Thaw: %v", err)
	}
}

// TestStopFrozen checks that Cleanup (Stop) does not hang on a server left frozen.
func TestStopFrozen(t *testing.T) {
	t.Parallel()
	srv := redistest.StartStandalone(t)
	srv.Freeze()
	start := time.Now()
	srv.Stop()
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Stop of a frozen server took %v", d)
	}
}

func TestCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	start := time.Now()
	cl := redistest.StartCluster(t)
	t.Logf("cluster of %d nodes ready in %v", len(cl.Nodes), time.Since(start))
	if len(cl.Addrs) != 3 || len(cl.Nodes) != 3 {
		t.Fatalf("got %d addrs, %d nodes; want 3, 3", len(cl.Addrs), len(cl.Nodes))
	}

	rdb := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:                    cl.Addrs,
		MaintNotificationsConfig: noMaint,
	})
	t.Cleanup(func() { rdb.Close() })

	// Keys spread over slots, and so over all three masters.
	keys := []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"}
	masters := map[string]bool{}
	for _, k := range keys {
		if err := rdb.Set(ctx, k, "v-"+k, 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", k, err)
		}
		masters[masterOf(t, rdb, k)] = true
	}
	if len(masters) != 3 {
		t.Errorf("keys landed on %d masters, want 3", len(masters))
	}
	for _, k := range keys {
		if got, err := rdb.Get(ctx, k).Result(); err != nil || got != "v-"+k {
			t.Fatalf("GET %s = %q, %v; want v-%s", k, got, err, k)
		}
	}

	// A hash tag puts both keys in one slot, so a multi-key command works.
	if m1, m2 := masterOf(t, rdb, "{user1}.a"), masterOf(t, rdb, "{user1}.b"); m1 != m2 {
		t.Errorf("{user1}.a on %s, {user1}.b on %s; want one node", m1, m2)
	}
	s1, _ := rdb.ClusterKeySlot(ctx, "{user1}.a").Result()
	s2, _ := rdb.ClusterKeySlot(ctx, "{user1}.b").Result()
	if s1 != s2 {
		t.Errorf("hash-tagged keys in slots %d and %d", s1, s2)
	}
	if err := rdb.MSet(ctx, "{user1}.a", "1", "{user1}.b", "2").Err(); err != nil {
		t.Fatalf("MSET of hash-tagged keys: %v", err)
	}

	// Keys in different slots: go-redis sends the command to one node, which refuses it.
	sa, _ := rdb.ClusterKeySlot(ctx, "a").Result()
	sb, _ := rdb.ClusterKeySlot(ctx, "b").Result()
	if sa == sb {
		t.Fatalf("a and b share slot %d; pick other keys", sa)
	}
	err := rdb.MGet(ctx, "a", "b").Err()
	if err == nil || !strings.Contains(err.Error(), "CROSSSLOT") {
		t.Fatalf("MGET a b: %v, want CROSSSLOT", err)
	}
}

// masterOf returns the address of the master serving key.
func masterOf(t *testing.T, rdb *redis.ClusterClient, key string) string {
	t.Helper()
	ctx := context.Background()
	slot, err := rdb.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		t.Fatalf("CLUSTER KEYSLOT %s: %v", key, err)
	}
	addr, err := redistest.MasterOf(ctx, rdb, slot)
	if err != nil {
		t.Fatalf("the master of %s: %v", key, err)
	}
	return addr
}

// TestRestartWaitsForPort checks that Restart retries while another process holds the
// server's port, as it may for a moment after Stop.
func TestRestartWaitsForPort(t *testing.T) {
	t.Parallel()
	srv := redistest.StartStandalone(t)
	srv.Stop()
	l, err := net.Listen("tcp", srv.Addr)
	if err != nil {
		t.Fatalf("taking the stopped server's port: %v", err)
	}
	release := time.AfterFunc(300*time.Millisecond, func() { l.Close() })
	defer release.Stop()

	srv.Restart(t)
	if err := client(t, srv.Addr, "", 0).Ping(context.Background()).Err(); err != nil {
		t.Fatalf("PING after Restart: %v", err)
	}
}

// WithTLS: a server and a cluster that speak TLS only, with a private CA, and, with
// AuthClients, only to clients that present a certificate it issued.
func TestTLS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ca := redistest.NewCA(t, "test CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca, AuthClients: true}))
	plain := client(t, srv.Addr, "", time.Second)
	if err := plain.Ping(ctx).Err(); err == nil {
		t.Fatal("a plain client reached a TLS-only server")
	}
	cert, key := ca.Issue(t, "client")
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, TLSConfig: ca.ClientConfig(t, cert, key), MaintNotificationsConfig: noMaint})
	defer c.Close()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("a client with a certificate: %v", err)
	}
	noCert := redis.NewClient(&redis.Options{Addr: srv.Addr, TLSConfig: ca.ClientConfig(t, "", ""), MaxRetries: -1, MaintNotificationsConfig: noMaint})
	defer noCert.Close()
	if err := noCert.Ping(ctx).Err(); err == nil {
		t.Fatal("a client without a certificate reached a server that asks for one")
	}

	cl := redistest.StartCluster(t, redistest.WithTLS(redistest.TLS{CA: ca}))
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs, TLSConfig: ca.ClientConfig(t, "", ""), MaintNotificationsConfig: noMaint})
	defer cc.Close()
	for i := range 30 { // keys over every master
		if err := cc.Set(ctx, "k"+strconv.Itoa(i), "v", 0).Err(); err != nil {
			t.Fatalf("cluster over TLS: %v", err)
		}
	}
}
