package sync

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	gosync "sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// tlsTimeout is the clients' timeout here: long, since no test waits for it to run out,
// and a TLS handshake under -race on a busy machine took more than 2 s (TestTLSPrivateCA
// then saw "context deadline exceeded" where it wants the certificate's error).
const tlsTimeout = 20 * time.Second

// openTLS opens url with the TLS options o (files loaded as the daemon does).
func openTLS(t *testing.T, url string, cluster bool, o TLSOptions) redis.UniversalClient {
	t.Helper()
	files, err := LoadTLS(o)
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{URL: url, Timeout: tlsTimeout, TLS: files}
	if cluster {
		cfg = Config{Cluster: []string{url}, Timeout: tlsTimeout, TLS: files}
	}
	rdb, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// waitPing waits until rdb answers PING, which it must within 10 s.
func waitPing(t *testing.T, rdb redis.UniversalClient) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := rdb.Ping(context.Background()).Err()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no PING answered in 10 s: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A Redis whose certificate a private CA issued: refused without --redis-tls-ca-file,
// with an error that names it; reached with it. Before, rediss:// trusted the system's
// CAs only, and nothing could be given to trust another.
func TestTLSPrivateCA(t *testing.T) {
	t.Parallel()
	ca := redistest.NewCA(t, "private CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca}))
	url := "rediss://" + srv.Addr

	// No TLS options (a nil TLSFiles, as the daemon without --redis-tls-*): the
	// system's CAs.
	for _, cfg := range []Config{{URL: url}, {Cluster: []string{url}}} {
		cfg.Timeout = tlsTimeout
		rdb, err := Open(cfg)
		if err != nil {
			t.Fatal(err)
		}
		err = rdb.Ping(context.Background()).Err()
		rdb.Close()
		if err == nil || !strings.Contains(err.Error(), "unknown authority") || !strings.Contains(err.Error(), "--redis-tls-ca-file") {
			t.Fatalf("%+v, without the CA: %v; want unknown authority, and the flag named", cfg, err)
		}
	}
	rdb := openTLS(t, url, false, TLSOptions{CAFile: ca.CertFile})
	if err := rdb.Set(context.Background(), "k", "v", 0).Err(); err != nil {
		t.Fatalf("with the CA: %v", err)
	}
	// The certificate names 127.0.0.1 and localhost; another name is checked against it.
	rdb = openTLS(t, url, false, TLSOptions{CAFile: ca.CertFile, ServerName: "localhost"})
	waitPing(t, rdb)
	// The error names the flag's value, and does not say the name "can be given" in a
	// flag the operator gave (it did before).
	rdb = openTLS(t, url, false, TLSOptions{CAFile: ca.CertFile, ServerName: "redis.example"})
	if err := rdb.Ping(context.Background()).Err(); err == nil || !strings.Contains(err.Error(), `--redis-tls-server-name is "redis.example"`) ||
		strings.Contains(err.Error(), "can be given in") {
		t.Fatalf("a server name the certificate does not carry: %v", err)
	}
}

// A CA file that holds another CA than the server's is named in the error. Before,
// the error said "a private CA? give its certificate in --redis-tls-ca-file" to an
// operator who had given one: the hint sent them to the flag, not to the file.
func TestTLSWrongCANamesTheFile(t *testing.T) {
	t.Parallel()
	ca := redistest.NewCA(t, "private CA")
	other := redistest.NewCA(t, "another CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca}))
	for _, cluster := range []bool{false, true} {
		err := openTLS(t, "rediss://"+srv.Addr, cluster, TLSOptions{CAFile: other.CertFile}).Ping(context.Background()).Err()
		if err == nil || !strings.Contains(err.Error(), "unknown authority") || !strings.Contains(err.Error(), other.CertFile) ||
			strings.Contains(err.Error(), "give its certificate") {
			t.Fatalf("cluster %v, a CA file of another CA: %v; want unknown authority and the file named", cluster, err)
		}
	}
}

// A Redis that wants a client certificate (tls-auth-clients yes) is reached with
// --redis-tls-cert-file and --redis-tls-key-file, and refuses the daemon without.
func TestTLSClientCertificate(t *testing.T) {
	t.Parallel()
	ca := redistest.NewCA(t, "private CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca, AuthClients: true}), redistest.WithPassword("pw"))
	url := "rediss://:pw@" + srv.Addr
	if err := openTLS(t, url, false, TLSOptions{CAFile: ca.CertFile}).Ping(context.Background()).Err(); err == nil {
		t.Fatal("reached a Redis that wants a client certificate without one")
	}
	cert, key := ca.Issue(t, "client")
	if err := openTLS(t, url, false, TLSOptions{CAFile: ca.CertFile, CertFile: cert, KeyFile: key}).Ping(context.Background()).Err(); err != nil {
		t.Fatalf("with a client certificate: %v", err)
	}
}

// A server certificate with no subject alternative names (its name in its Common Name
// only, as Redis's utils/gen-test-certs.sh makes them) is accepted by no name: the error
// says to reissue it, and does not send the operator to --redis-tls-server-name, which
// cannot help. Before, both the error dialing 127.0.0.1 and the one with the Common Name
// as --redis-tls-server-name said "the name the certificate carries can be given in
// --redis-tls-server-name".
func TestTLSCommonNameOnly(t *testing.T) {
	t.Parallel()
	ca := redistest.NewCA(t, "private CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca, CommonNameOnly: true}))
	for _, name := range []string{"", "redis-server"} {
		rdb := openTLS(t, "rediss://"+srv.Addr, false, TLSOptions{CAFile: ca.CertFile, ServerName: name})
		err := rdb.Ping(context.Background()).Err()
		if err == nil {
			t.Fatalf("server name %q: a certificate without subject alternative names was accepted", name)
		}
		if msg := err.Error(); strings.Contains(msg, "can be given in --redis-tls-server-name") || !strings.Contains(msg, "subject alternative names") {
			t.Errorf("server name %q: %v; want the certificate's missing subject alternative names named, and no --redis-tls-server-name hint", name, err)
		}
	}
}

// A client certificate, and a CA, replaced on disk (cert-manager renewing them) are
// used by the next connection, with no new client; files that changed to something
// unusable are reported once and the previous contents kept.
func TestTLSRotation(t *testing.T) {
	t.Parallel()
	ca := redistest.NewCA(t, "private CA")
	other := redistest.NewCA(t, "another CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca, AuthClients: true}))
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.crt")
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	copyFile(t, other.CertFile, caFile)           // the server's CA not trusted yet
	other.IssueTo(t, "client", certFile, keyFile) // a certificate the server does not take
	var mu gosync.Mutex
	var reported []string
	rdb := openTLS(t, "rediss://"+srv.Addr, false, TLSOptions{CAFile: caFile, CertFile: certFile, KeyFile: keyFile,
		OnReloadError: func(err error) { mu.Lock(); reported = append(reported, err.Error()); mu.Unlock() }})
	ctx := context.Background()
	if err := rdb.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Fatalf("with another CA: %v", err)
	}
	copyFile(t, ca.CertFile, caFile)
	if err := rdb.Ping(ctx).Err(); err == nil {
		t.Fatal("the server took a certificate of a CA it does not trust")
	}
	ca.IssueTo(t, "client", certFile, keyFile)
	waitPing(t, rdb)

	// Half a rotation (a new certificate, the old key) and a CA file emptied: reported,
	// and a new connection still made with what was good.
	ca.IssueTo(t, "client", certFile, filepath.Join(dir, "unused.key"))
	if err := os.WriteFile(caFile, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Command("CLIENT", "KILL", "TYPE", "normal"); err != nil { // the next call dials anew
		t.Fatal(err)
	}
	waitPing(t, rdb)
	mu.Lock()
	defer mu.Unlock()
	if len(reported) != 1 || !strings.Contains(reported[0], "holds no PEM certificate") || !strings.Contains(reported[0], "does not match") {
		t.Fatalf("reported %q; want one report of both files", reported)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to+".tmp", b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(to+".tmp", to); err != nil {
		t.Fatal(err)
	}
}

// A Redis restart leaves the pool's idle TLS connections closed by the server; they are
// dropped and dialed anew before use, as plain ones are. Before, go-redis's pool checked
// only connections that are a socket (a *tls.Conn is not), so each of the 16 answered
// its next call with EOF: 16 of the next 40 PINGs failed, and in the daemon the failures
// opened the breaker after Redis was back (TestE2ERedisTLSRestart).
func TestTLSRestartIdleConns(t *testing.T) {
	t.Parallel()
	ca := redistest.NewCA(t, "private CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca}))
	rdb := openTLS(t, "rediss://"+srv.Addr, false, TLSOptions{CAFile: ca.CertFile})
	ctx := context.Background()
	// 16 calls at once, each holding its connection 200 ms: the pool holds 16.
	var wg gosync.WaitGroup
	for i := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := rdb.BLPop(ctx, 200*time.Millisecond, "none"+strconv.Itoa(i)).Err(); err != nil && err != redis.Nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := rdb.PoolStats().TotalConns; n != 16 {
		t.Fatalf("%d connections in the pool, want 16", n)
	}
	srv.Restart(t)
	failed := 0
	for range 40 {
		if rdb.Ping(ctx).Err() != nil {
			failed++
		}
	}
	if failed > 0 {
		t.Fatalf("%d of 40 PINGs failed after a restart, with Redis up", failed)
	}
}

// A Redis Cluster over TLS, given one seed node: every master it discovers is reached
// over TLS, with the CA and the client certificate.
func TestTLSCluster(t *testing.T) {
	t.Parallel()
	ca := redistest.NewCA(t, "private CA")
	cl := redistest.StartCluster(t, redistest.WithTLS(redistest.TLS{CA: ca, AuthClients: true}))
	cert, key := ca.Issue(t, "client")
	rdb := openTLS(t, "rediss://"+cl.Addrs[0], true, TLSOptions{CAFile: ca.CertFile, CertFile: cert, KeyFile: key})
	ctx := context.Background()
	seen := map[string]bool{}
	for i := 0; len(seen) < len(cl.Addrs); i++ {
		if i == 1000 {
			t.Fatalf("keys reached %d masters of %d", len(seen), len(cl.Addrs))
		}
		k := "k" + strconv.Itoa(i)
		if err := rdb.Set(ctx, k, "v", 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", k, err)
		}
		for _, n := range cl.Nodes {
			if v, _ := n.Command("GET", k); v == "v" {
				seen[n.Addr] = true
			}
		}
	}
}

// TLS options are refused with a redis:// URL (the connection would be in the clear),
// beside skip_verify=true, and with unusable files, at start, naming the file.
func TestTLSOptionsRefused(t *testing.T) {
	ca := redistest.NewCA(t, "private CA")
	cert, key := ca.Issue(t, "client")
	dir := t.TempDir()
	junk := filepath.Join(dir, "junk")
	if err := os.WriteFile(junk, []byte("not PEM\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, otherKey := ca.Issue(t, "other")
	for _, c := range []struct {
		o    TLSOptions
		want string
	}{
		{TLSOptions{CAFile: filepath.Join(dir, "missing")}, "reading the CA file"},
		{TLSOptions{CAFile: junk}, "holds no PEM certificate"},
		{TLSOptions{CertFile: cert}, "needs both"},
		{TLSOptions{KeyFile: key}, "needs both"},
		{TLSOptions{CertFile: cert, KeyFile: otherKey}, "does not match"},
		{TLSOptions{CertFile: key, KeyFile: cert}, key},
	} {
		if _, err := LoadTLS(c.o); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v; want %q", c.o, err, c.want)
		} else if strings.Contains(err.Error(), "PRIVATE KEY-----") {
			t.Errorf("%+v: the error quotes a key: %v", c.o, err)
		}
	}
	files, err := LoadTLS(TLSOptions{CAFile: ca.CertFile})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{URL: "redis://127.0.0.1:1", TLS: files}, "need a rediss:// URL"},
		{Config{Cluster: []string{"127.0.0.1:1,127.0.0.1:2"}, TLS: files}, "need a rediss:// URL"},
		{Config{Cluster: []string{"redis://127.0.0.1:1"}, TLS: files}, "need a rediss:// URL"},
		{Config{URL: "rediss://127.0.0.1:1/?skip_verify=true", TLS: files}, "skip_verify"},
	} {
		if rdb, err := Open(c.cfg); err == nil {
			rdb.Close()
			t.Errorf("%+v: opened", c.cfg)
		} else if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v; want %q", c.cfg, err, c.want)
		}
	}
}
