package main

import (
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// TestE2EBanCountsARequestOnce: through the real daemon's Envoy API, in local, hybrid
// and global mode on a real Redis, one call refused on two identical descriptors (Envoy
// sends one per rate_limits entry: a route's and its virtual host's remote_address give
// two) is one refusal of its client, not two: with `after: 2` it starts no ban, and the
// next refused call does. Before, each descriptor counted, and the first refused request
// banned the client in every mode.
func TestE2EBanCountsARequestOnce(t *testing.T) {
	srv := redistest.StartStandalone(t)
	for _, mode := range []string{"local", "hybrid", "global"} {
		t.Run(mode, func(t *testing.T) {
			f := startEnvoyDaemon(t, strings.ReplaceAll(`
rules:
  - name: per-ip
    match: { domain: edge, descriptor: remote_address }
    key: [domain, remote_address]
    limit: { requests: 2, per: 1h }
    mode: MODE
    penalty: { after: 2, within: 1h, ban: 1h }
`, "MODE", mode), "--admin", "127.0.0.1:0", "--top-labels", "raw", "--redis", "redis://"+srv.Addr,
				"--redis-prefix", "rl"+mode+":", "--sync-interval", "50ms", "--global-timeout", "3s", "--redis-timeout", "3s")
			base := "http://" + adminAddr(t, f.d)
			ip := func(a string) string { return "remote_address=" + a }
			listed := func(client string) bool {
				_, body := httpGet(t, base+"/bans")
				return strings.Contains(body, `"domain=edge|remote_address=`+client+`"`)
			}
			// waitListed waits until client's ban is in /bans: in hybrid mode, until the
			// daemon's round has sent its refusals and read the ban back.
			waitListed := func(client string) {
				t.Helper()
				for deadline := time.Now().Add(10 * time.Second); !listed(client); {
					if time.Now().After(deadline) {
						t.Fatalf("%s never banned", client)
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			for _, c := range []string{"a", "z"} {
				for range 2 {
					if r := f.call(t, "edge", 1, desc(ip(c))); r.OverallCode != ok {
						t.Fatalf("%s within its limit: %v", c, r.OverallCode)
					}
				}
			}
			// One request refused on two identical descriptors.
			if r := f.call(t, "edge", 1, desc(ip("a")), desc(ip("a"))); r.OverallCode != over {
				t.Fatalf("the call past the limit: %v", r.OverallCode)
			}
			// A sentinel client refused twice, in two calls: banned, in hybrid mode by a
			// round that has also sent a's refusals (they were pending before).
			for range 2 {
				f.call(t, "edge", 1, desc(ip("z")))
			}
			waitListed("z")
			if listed("a") {
				_, body := httpGet(t, base+"/bans")
				t.Fatalf("one refused request banned its client (after: 2): %s", body)
			}
			// The next refused call is the second refusal: the ban starts.
			f.call(t, "edge", 1, desc(ip("a")))
			waitListed("a")
		})
	}
}

// TestE2EEnvoyIdenticalDescriptorsRetry: through the real daemon's Envoy API, in local,
// hybrid and global mode on a real Redis, a call of two identical descriptors on an empty
// token bucket (3 per hour) is told to retry when both fit, two units' refill (2,400 s),
// as hybrid mode said. Before, local and global mode said one unit's (1,200 s), and a
// gateway that retried then was refused again (under a penalty, a refusal toward the
// next ban).
func TestE2EEnvoyIdenticalDescriptorsRetry(t *testing.T) {
	srv := redistest.StartStandalone(t)
	for _, mode := range []string{"local", "hybrid", "global"} {
		t.Run(mode, func(t *testing.T) {
			f := startEnvoyDaemon(t, strings.ReplaceAll(`
rules:
  - name: per-ip
    match: { domain: edge, descriptor: remote_address }
    key: [domain, remote_address]
    limit: { requests: 3, per: 1h }
    mode: MODE
`, "MODE", mode), "--redis", "redis://"+srv.Addr, "--redis-prefix", "rlr"+mode+":",
				"--global-timeout", "3s", "--redis-timeout", "3s")
			for range 3 {
				if r := f.call(t, "edge", 1, desc("remote_address=a")); r.OverallCode != ok {
					t.Fatalf("within the limit: %v", r.OverallCode)
				}
			}
			r := f.call(t, "edge", 1, desc("remote_address=a"), desc("remote_address=a"))
			if r.OverallCode != over {
				t.Fatalf("two units on an empty bucket: %v", r.OverallCode)
			}
			if h := headerMap(r)["Retry-After"]; h != "2400" && h != "2399" {
				t.Fatalf("Retry-After %q, want 2400 (two units of 1,200 s)", h)
			}
		})
	}
}
