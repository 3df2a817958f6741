package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	gosync "sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// tlsRules are a hybrid rule (the default with Redis) and a global one that refuses
// when Redis cannot decide, so that an answer not degraded is one Redis gave.
const tlsRules = `
rules:
  - name: h
    key: user
    limit: { requests: 100, per: 1h }
  - name: g
    key: ip
    mode: global
    limit: { requests: 3, per: 1h }
    on_store_failure: closed
`

// The real daemon on a Redis that speaks TLS only, with a private CA and client
// certificates required (mutual TLS), standalone and a 3-master Cluster given one seed
// node: global checks are decided by Redis (not degraded, shared by two daemons) and
// hybrid syncs reach it; neither the password nor the key shows in the logs.
func TestE2ERedisTLS(t *testing.T) {
	ca := redistest.NewCA(t, "private CA")
	tlsOpt := redistest.WithTLS(redistest.TLS{CA: ca, AuthClients: true})
	t.Run("standalone", func(t *testing.T) {
		t.Parallel()
		srv := redistest.StartStandalone(t, tlsOpt, redistest.WithPassword("tls-pw-8812"))
		testRedisTLS(t, ca, []*redistest.Server{srv}, "tls-pw-8812", "--redis", "rediss://"+srv.Addr)
	})
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		cl := redistest.StartCluster(t, tlsOpt)
		testRedisTLS(t, ca, cl.Nodes, "", "--redis-cluster", "rediss://"+cl.Addrs[0])
	})
}

func testRedisTLS(t *testing.T, ca *redistest.CA, nodes []*redistest.Server, password string, redisArgs ...string) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", tlsRules)
	cert, key := ca.Issue(t, "client")
	if err := os.Chmod(key, 0o600); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"--config", cfg, "--sync-interval", "50ms", "--global-timeout", "3s", "--redis-timeout", "3s",
		"--redis-tls-ca-file", ca.CertFile, "--redis-tls-cert-file", cert, "--redis-tls-key-file", key}, redisArgs...)
	if password != "" {
		pw := writeFile(t, dir, "pw", password+"\n")
		if err := os.Chmod(pw, 0o600); err != nil {
			t.Fatal(err)
		}
		args = append(args, "--redis-password-file", pw)
	}
	d1, d2 := startDaemon(t, args...), startDaemon(t, args...)
	c := [2]*rawConn{dialRaw(t, d1.socket), dialRaw(t, d2.socket)}
	// Global: 3 per ip over both daemons, each answer Redis's. Several ips, so that on
	// the Cluster the keys fall on more than one master.
	for ip := range 6 {
		for i := range 4 {
			r := c[i%2].check(uint64(100*ip+i+1), 1, "ip=10.0.0."+strconv.Itoa(ip))
			if r.Degraded || r.Allowed != (i < 3) {
				t.Fatalf("ip %d, request %d: %+v; want decided by Redis, allowed %v\n%s", ip, i+1, r, i < 3, d1.stderr.String())
			}
		}
	}
	// Hybrid: the syncs write the keys to Redis.
	for i := range 20 {
		if r := c[0].check(uint64(1000+i), 1, "user=u"+strconv.Itoa(i)); !r.Allowed {
			t.Fatalf("hybrid check %d: %+v", i, r)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		hybridKeys := 0
		for _, n := range nodes {
			out, err := n.Command("EVAL", "return #redis.call('KEYS', 'rl:h~*')", "0")
			if err != nil {
				t.Fatal(err)
			}
			k, _ := strconv.Atoi(out)
			hybridKeys += k
		}
		if hybridKeys == 20 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d hybrid keys in Redis, want 20\n%s", hybridKeys, d1.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, d := range []*daemonProc{d1, d2} {
		logs := d.stderr.String()
		if keyPEM, _ := os.ReadFile(key); strings.Contains(logs, "PRIVATE KEY") || strings.Contains(logs, string(keyPEM)) {
			t.Fatalf("the key shows in the log:\n%s", logs)
		}
		if password != "" && strings.Contains(logs, password) {
			t.Fatalf("the password shows in the log:\n%s", logs)
		}
		if strings.Contains(logs, "can be read by") {
			t.Fatalf("a warning of a readable secret file, all 0600:\n%s", logs)
		}
	}
}

// Without --redis-tls-ca-file, a Redis whose certificate a private CA issued is not
// reached, and the log says which flag fixes it; a key file every local user can read
// is warned of; TLS options the daemon cannot use stop it at start with an error naming
// the flag or the file.
func TestE2ERedisTLSRefused(t *testing.T) {
	ca := redistest.NewCA(t, "private CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca}))
	cert, key := ca.Issue(t, "client")
	if err := os.Chmod(key, 0o644); err != nil {
		t.Fatal(err)
	}
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", tlsRules)
	// The scripts' loading at start, then every hybrid sync, fails and says why (the
	// first within --redis-timeout, under any load).
	d := startDaemon(t, "--config", cfg, "--redis", "rediss://"+srv.Addr, "--redis-timeout", "3s", "--sync-interval", "50ms",
		"--redis-tls-cert-file", cert, "--redis-tls-key-file", key)
	for _, want := range []string{"give its certificate in --redis-tls-ca-file", "the --redis-tls-key-file can be read by every local user"} {
		for deadline := time.Now().Add(10 * time.Second); !strings.Contains(d.stderr.String(), want); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("no %q in the log:\n%s", want, d.stderr.String())
			}
		}
	}

	junk := writeFile(t, dir, "junk.pem", "not a certificate\n")
	sock := filepath.Join(dir, "s.sock")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--redis", "redis://" + srv.Addr, "--redis-tls-ca-file", ca.CertFile}, "need a rediss:// URL"},
		{[]string{"--redis-tls-ca-file", ca.CertFile}, "need --redis or --redis-cluster"},
		{[]string{"--redis", "rediss://" + srv.Addr, "--redis-tls-ca-file", junk}, junk + " holds no PEM certificate"},
		{[]string{"--redis", "rediss://" + srv.Addr, "--redis-tls-ca-file", filepath.Join(dir, "none")}, "reading the CA file"},
		{[]string{"--redis", "rediss://" + srv.Addr, "--redis-tls-cert-file", cert}, "needs both --redis-tls-cert-file and --redis-tls-key-file"},
		{[]string{"--redis-cluster", "rediss://" + srv.Addr, "--redis-tls-cert-file", cert, "--redis-tls-key-file", junk}, cert},
	} {
		out, err := runCLI(t, append([]string{"serve", "--admin=", "--socket", sock}, c.args...)...)
		if err == nil || !strings.Contains(out, c.want) {
			t.Errorf("%v: %v\n%s\nwant %q", c.args, err, out, c.want)
		}
	}
}

// A Redis restart, the daemon busy on it over TLS: once Redis answers again, every
// global check is decided by it. Before, the checks' idle TLS connections, which the
// restart had closed, were used as they were (go-redis checks plain ones only), and
// their failures opened the breaker with Redis up: 142,981 of 177,029 answers in the 4 s
// after the restart were degraded (refused: on_store_failure closed), the last 2.1 s in;
// over redis:// none was.
func TestE2ERedisTLSRestart(t *testing.T) {
	ca := redistest.NewCA(t, "private CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca}))
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: g
    key: ip
    mode: global
    limit: { requests: 1000000, per: 1h }
    on_store_failure: closed
`)
	d := startDaemon(t, "--config", cfg, "--redis", "rediss://"+srv.Addr, "--redis-tls-ca-file", ca.CertFile,
		"--redis-timeout", "3s", "--global-timeout", "3s")
	conns := make([]*rawConn, 32)
	for i := range conns {
		conns[i] = dialRaw(t, d.socket)
	}
	// Checks from 32 connections at once, as many Redis connections as they keep busy.
	run := func(conns []*rawConn, round int, until func(i int) bool) (degraded, total int) {
		var wg gosync.WaitGroup
		var mu gosync.Mutex
		for g, c := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; !until(i); i++ {
					r := c.check(uint64(i+1), 1, "ip=10."+strconv.Itoa(round)+"."+strconv.Itoa(g)+"."+strconv.Itoa(i%250))
					mu.Lock()
					total++
					if r.Degraded {
						degraded++
					}
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		return degraded, total
	}
	if degraded, _ := run(conns, 1, func(i int) bool { return i == 200 }); degraded > 0 {
		t.Fatalf("%d answers degraded before the restart\n%s", degraded, d.stderr.String())
	}
	srv.Restart(t)
	end := time.Now().Add(2 * time.Second)
	degraded, total := run(conns[:16], 2, func(int) bool { return time.Now().After(end) })
	if degraded > 0 {
		t.Fatalf("%d of %d answers degraded after the restart, Redis up\n%s", degraded, total, d.stderr.String())
	}
}

// A rediss:// URL with skip_verify=true reaches Redis over TLS without checking its
// certificate (go-redis's option): the daemon serves, and warns at start that the
// connection can be intercepted, naming the flags that check it instead. Before, it
// was taken without a word; the same URL without the option draws no warning.
func TestE2ERedisTLSSkipVerifyWarned(t *testing.T) {
	ca := redistest.NewCA(t, "private CA")
	srv := redistest.StartStandalone(t, redistest.WithTLS(redistest.TLS{CA: ca}))
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", tlsRules)
	const warning = "skip_verify=true checks no server certificate"
	d := startDaemon(t, "--config", cfg, "--redis", "rediss://"+srv.Addr+"/0?skip_verify=true", "--redis-timeout", "3s", "--global-timeout", "3s")
	if r := dialRaw(t, d.socket).check(1, 1, "ip=10.0.0.1"); !r.Allowed || r.Degraded {
		t.Fatalf("%+v: want decided by Redis\n%s", r, d.stderr.String())
	}
	e := startDaemon(t, "--config", cfg, "--redis", "rediss://"+srv.Addr+"/0", "--redis-tls-ca-file", ca.CertFile, "--redis-timeout", "3s", "--global-timeout", "3s")
	if r := dialRaw(t, e.socket).check(1, 1, "ip=10.0.0.2"); !r.Allowed || r.Degraded {
		t.Fatalf("%+v: want decided by Redis\n%s", r, e.stderr.String())
	}
	stopDaemon(t, d)
	stopDaemon(t, e)
	if !strings.Contains(d.stderr.String(), warning) || !strings.Contains(d.stderr.String(), "--redis-tls-ca-file") {
		t.Fatalf("no warning of skip_verify=true:\n%s", d.stderr.String())
	}
	if strings.Contains(e.stderr.String(), warning) {
		t.Fatalf("a warning of skip_verify without it:\n%s", e.stderr.String())
	}
}
