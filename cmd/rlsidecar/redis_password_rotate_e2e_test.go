package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// A Redis password rotated as an operator rotates it: the ACL user's password changed
// in Redis (ACL SETUSER <user> resetpass ><new>), the new one written to the daemon's
// --redis-password-file (by rename), the daemon's connections then closed (a Redis
// restart or failover does that; here CLIENT KILL USER). The daemon's new connections
// authenticate with the file as it is now: its global checks, on_store_failure closed,
// are Redis's again without a restart. Before, the file was read once at start, and
// every connection made after the rotation failed WRONGPASS: every check stayed
// degraded (refused) until the daemon was restarted. A file emptied meanwhile is logged
// and the password before it kept. No password, old or new, shows in the log.
// Standalone and a 3-master Cluster, with an ACL user named in the URL.
func TestE2ERedisPasswordFileRotated(t *testing.T) {
	t.Run("standalone", func(t *testing.T) {
		t.Parallel()
		srv := redistest.StartStandalone(t, redistest.WithPassword("admin-pw-5521"))
		testPasswordRotated(t, []*redistest.Server{srv}, "--redis", "redis://rotor@"+srv.Addr)
	})
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		cl := redistest.StartCluster(t)
		testPasswordRotated(t, cl.Nodes, "--redis-cluster", "redis://rotor@"+cl.Addrs[0])
	})
}

func testPasswordRotated(t *testing.T, nodes []*redistest.Server, redisArgs ...string) {
	const oldPW, newPW = "rotor-old-pw-1187", "rotor-new-pw-9034"
	acl := func(args ...string) {
		t.Helper()
		for _, n := range nodes {
			if out, err := n.Command(args...); err != nil {
				t.Fatalf("%v on %s: %v %s", args, n.Addr, err, out)
			}
		}
	}
	acl("ACL", "SETUSER", "rotor", "on", ">"+oldPW, "~*", "&*", "+@all")
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", tlsRules)
	pw := writeFile(t, dir, "pw", oldPW+"\n")
	if err := os.Chmod(pw, 0o600); err != nil {
		t.Fatal(err)
	}
	// replace writes the password file as an operator should: beside it, then renamed.
	replace := func(content string, mode os.FileMode) {
		t.Helper()
		tmp := filepath.Join(dir, "pw.new")
		if err := os.WriteFile(tmp, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, pw); err != nil {
			t.Fatal(err)
		}
	}
	d := startDaemon(t, append([]string{"--config", cfg, "--redis-password-file", pw,
		"--redis-timeout", "3s", "--global-timeout", "3s", "--sync-interval", "50ms"}, redisArgs...)...)
	c := dialRaw(t, d.socket)
	n := uint64(0)
	// decided reports whether a fresh client's global check is Redis's (not degraded);
	// fresh ips, so that on the Cluster the checks reach more than one master.
	decided := func() bool {
		n++
		return !c.check(n, 1, "ip=10.9."+strconv.Itoa(int(n/250))+"."+strconv.Itoa(int(n%250))).Degraded
	}
	for range 10 {
		if !decided() {
			t.Fatalf("degraded before the rotation\n%s", d.stderr.String())
		}
	}

	acl("ACL", "SETUSER", "rotor", "resetpass", ">"+newPW)
	replace(newPW+"\n", 0o644)
	acl("CLIENT", "KILL", "USER", "rotor")
	waitFor(t, 20*time.Second, "global check decided by Redis after the rotation", decided)
	for range 10 {
		if !decided() {
			t.Fatalf("degraded after the daemon took the new password\n%s", d.stderr.String())
		}
	}

	// The new file every local user can read (as the first one at start): warned of.
	if !strings.Contains(d.stderr.String(), "password file can be read by every local user") {
		t.Fatalf("no warning of the new password file every user can read:\n%s", d.stderr.String())
	}

	// Emptied (a file truncated before it is written again): logged, and new
	// connections keep the password before it.
	replace("", 0o600)
	acl("CLIENT", "KILL", "USER", "rotor")
	waitFor(t, 20*time.Second, "warning of the emptied password file", func() bool {
		decided()
		return strings.Contains(d.stderr.String(), "the password file changed and cannot be used")
	})
	waitFor(t, 20*time.Second, "global check decided by Redis with the file empty", decided)

	stopDaemon(t, d)
	for _, secret := range []string{oldPW, newPW} {
		if strings.Contains(d.stderr.String(), secret) {
			t.Fatalf("a password shows in the log:\n%s", d.stderr.String())
		}
	}
}
