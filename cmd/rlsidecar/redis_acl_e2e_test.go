package main

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// leastPrivilegeACL is the Redis ACL of the daemon's user that docs/operations.md gives:
// keys under the default --redis-prefix only, no Pub/Sub channel, and the commands of
// these categories (no admin or dangerous command beyond INFO).
var leastPrivilegeACL = []string{"~rl:*", "resetchannels", "-@all", "+@scripting", "+@read", "+@write", "+@connection", "+time", "+info", "+cluster|slots"}

// The daemon as a Redis user with least privilege, an ACL user named in the URL and its
// password in a file: every kind of rule (rates with shared bans, a calendar window, a
// concurrency rule's lease taken and released, a composite key) decided by Redis, not
// degraded, in hybrid and global mode, standalone and on a 3-master Cluster, and no
// NOPERM in the log: the daemon touches no key outside its prefix and needs no other
// command.
func TestE2ERedisLeastPrivilegeACL(t *testing.T) {
	for _, cluster := range []bool{false, true} {
		for _, mode := range []string{"hybrid", "global"} {
			name := mode
			if cluster {
				name += "-cluster"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				var nodes []*redistest.Server
				var args []string
				if cluster {
					cl := redistest.StartCluster(t)
					nodes, args = cl.Nodes, []string{"--redis-cluster", "redis://limiter@" + cl.Addrs[0]}
				} else {
					srv := redistest.StartStandalone(t)
					nodes, args = []*redistest.Server{srv}, []string{"--redis", "redis://limiter@" + srv.Addr}
				}
				for _, n := range nodes {
					if out, err := n.Command(append([]string{"ACL", "SETUSER", "limiter", "on", ">limiter-pw-3321"}, leastPrivilegeACL...)...); err != nil {
						t.Fatalf("ACL SETUSER: %v %s", err, out)
					}
				}
				dir := shortTempDir(t)
				pw := writeFile(t, dir, "pw", "limiter-pw-3321\n")
				if err := os.Chmod(pw, 0o600); err != nil {
					t.Fatal(err)
				}
				cfg := writeFile(t, dir, "rules.yaml", strings.ReplaceAll(hostileRules, "MODE", mode))
				d := startDaemon(t, append(args, "--config", cfg, "--redis-password-file", pw,
					"--sync-interval", "50ms", "--redis-timeout", "3s", "--global-timeout", "3s")...)
				c := dialRaw(t, d.socket)
				id := uint64(0)
				// Each user's first request admitted by every rule, its second refused
				// (a ban begins: penalty after 1); a lease released.
				for round, want := range []bool{true, false} {
					for u := range 12 {
						id++
						r := c.check(id, 1, "user=u"+strconv.Itoa(u), "tenant=t")
						if r.Allowed != want || r.Degraded {
							t.Fatalf("round %d, user %d: %+v; want allowed %v, decided by Redis\n%s", round, u, r, want, d.stderr.String())
						}
						if want {
							id++
							if rel := c.leaseOp(id, proto.OpRelease, r.Lease, 0); !rel.Released {
								t.Fatalf("release of %q: %+v\n%s", r.Lease, rel, d.stderr.String())
							}
						}
					}
				}
				stopDaemon(t, d)
				// No warning, but the load of the scripts at the start passing its
				// bound (250 ms; go-redis says "i/o timeout" when it passes during a read,
				// the socket's deadline being set from it: seen at load 11 on the
				// Cluster): a loaded machine, not the
				// ACL, which would be a NOPERM (and the checks above send the scripts
				// again, under the ACL).
				logs := d.stderr.String()
				for _, line := range strings.Split(logs, "\n") {
					cut := strings.Contains(line, "loading the scripts into Redis failed") &&
						(strings.Contains(line, `err="context deadline exceeded"`) || strings.Contains(line, `err="i/o timeout"`))
					if strings.Contains(line, "NOPERM") || strings.Contains(line, "level=WARN") && !cut {
						t.Fatalf("a warning with the least-privilege ACL:\n%s", logs)
					}
				}
			})
		}
	}
}
