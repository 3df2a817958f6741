package main

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// ipPrefixRules limits per /64 (IPv6) and per /24 (IPv4): 2 an hour each.
const ipPrefixRules = `
rules:
  - name: per-net
    key: ip
    ip_prefix: { ipv4: 24, ipv6: 64 }
    limit: { requests: 2, per: 1h }
`

// ipPrefixSteps: two addresses of one network, spelt differently, take its 2 requests;
// a third address of it is refused; another network has its own 2.
var ipPrefixSteps = []struct {
	ip      string
	allowed bool
}{
	{"2001:db8:1:2::1", true},
	{"2001:0DB8:0001:0002:ffff:ffff:ffff:9", true},
	{"2001:db8:1:2::abcd", false},
	{"2001:db8:1:3::1", true},
	{"192.0.2.1", true},
	{"::ffff:192.0.2.200", true},
	{"192.0.2.77", false},
	{"192.0.3.1", true},
}

// The real daemon keys ip by its network in local mode and in the Redis modes (one
// daemon hybrid; two daemons global, taking turns, so the count is Redis's), whose
// state is on the network's key.
func TestE2EIPPrefix(t *testing.T) {
	run := func(t *testing.T, socks []string) {
		var c []*rawConn
		for _, s := range socks {
			c = append(c, dialRaw(t, s))
		}
		for i, st := range ipPrefixSteps {
			r := c[i%len(c)].check(uint64(i+1), 1, "ip="+st.ip)
			if r.Allowed != st.allowed || r.Degraded {
				t.Fatalf("step %d, ip %s: allowed %v (degraded %v), want %v", i, st.ip, r.Allowed, r.Degraded, st.allowed)
			}
		}
	}
	t.Run("local", func(t *testing.T) {
		d := startDaemon(t, "--config", writeFile(t, shortTempDir(t), "rules.yaml", ipPrefixRules))
		run(t, []string{d.socket})
	})
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	for _, mode := range []string{"hybrid", "global"} {
		t.Run(mode, func(t *testing.T) {
			prefix := "ipp-" + mode + ":"
			cfg := writeFile(t, shortTempDir(t), "rules.yaml", ipPrefixRules+"    mode: "+mode+"\n")
			args := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--redis-prefix", prefix,
				"--sync-interval", "50ms", "--global-timeout", "3s", "--redis-timeout", "3s"}
			socks := []string{startDaemon(t, args...).socket}
			if mode == "global" {
				socks = append(socks, startDaemon(t, args...).socket)
			}
			run(t, socks)
			want := []string{
				prefix + "per-net~tb1h:{ip/64=2001:db8:1:2::}", prefix + "per-net~tb1h:{ip/64=2001:db8:1:3::}",
				prefix + "per-net~tb1h:{ip/24=192.0.2.0}", prefix + "per-net~tb1h:{ip/24=192.0.3.0}",
			}
			var keys []string
			for deadline := time.Now().Add(20 * time.Second); ; { // hybrid syncs in the background
				var err error
				keys, err = rdb.Keys(context.Background(), prefix+"per-net*").Result()
				if err != nil {
					t.Fatal(err)
				}
				slices.Sort(keys)
				slices.Sort(want)
				if slices.Equal(keys, want) || time.Now().After(deadline) {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			if !slices.Equal(keys, want) {
				t.Fatalf("Redis keys %q, want %q", keys, want)
			}
		})
	}
}

// A reload whose ip_prefix is invalid is refused, logged with its line and counted, and
// the rules in force stay: the /64 still shares one limit.
func TestE2EIPPrefixBadReload(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", ipPrefixRules)
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	if r := c.check(1, 1, "ip=2001:db8:1:2::1"); !r.Allowed {
		t.Fatalf("first: %+v", r)
	}
	writeFile(t, dir, "rules.yaml", strings.Replace(ipPrefixRules, "ipv6: 64", "ipv6: 640", 1))
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, samples := scrape(t, base); samples[`rlsidecar_config_reloads_total{result="error"}`] >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no reload error counted\n%s", d.stderr.String())
		}
	}
	if log := d.stderr.String(); !strings.Contains(log, "rules.yaml:5: rules[0].ip_prefix.ipv6: 640 is not a prefix length from 0 to 128") {
		t.Fatalf("log does not name the error:\n%s", log)
	}
	if r := c.check(2, 1, "ip=2001:db8:1:2::2"); !r.Allowed {
		t.Fatalf("second of the /64: %+v", r)
	}
	if r := c.check(3, 1, "ip=2001:db8:1:2::3"); r.Allowed {
		t.Fatalf("third of the /64 after the refused reload: %+v; want refused", r)
	}
}

// On a Redis Cluster, each network's key is in its own hash slot (the hash tag is the
// network): two daemons taking turns in global mode count as one.
func TestE2EIPPrefixCluster(t *testing.T) {
	cl := redistest.StartCluster(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", ipPrefixRules+"    mode: global\n")
	args := []string{"--config", cfg, "--redis-cluster", strings.Join(cl.Addrs, ","), "--global-timeout", "3s", "--redis-timeout", "3s"}
	c := []*rawConn{dialRaw(t, startDaemon(t, args...).socket), dialRaw(t, startDaemon(t, args...).socket)}
	for i, st := range ipPrefixSteps {
		r := c[i%2].check(uint64(i+1), 1, "ip="+st.ip)
		if r.Allowed != st.allowed || r.Degraded {
			t.Fatalf("step %d, ip %s: allowed %v (degraded %v), want %v", i, st.ip, r.Allowed, r.Degraded, st.allowed)
		}
	}
}

// A global concurrency rule with ip_prefix holds one network's leases in Redis: an
// address of the /64 is refused on the other daemon while another holds the slot, and
// the lease, released through that other daemon (its token carries the network's key),
// frees it.
func TestE2EIPPrefixGlobalLeases(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: exports
    key: ip
    ip_prefix: { ipv6: 64 }
    concurrency: { max: 1, lease: 30s }
    mode: global
`)
	args := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--global-timeout", "3s", "--redis-timeout", "3s"}
	c1, c2 := dialRaw(t, startDaemon(t, args...).socket), dialRaw(t, startDaemon(t, args...).socket)
	r := c1.check(1, 1, "ip=2001:db8:1:2::1")
	if !r.Allowed || r.Lease == "" || r.Degraded {
		t.Fatalf("first: %+v", r)
	}
	if r2 := c2.check(2, 1, "ip=2001:db8:1:2:ffff::2"); r2.Allowed || r2.Degraded {
		t.Fatalf("same /64 on the other daemon: %+v; want refused", r2)
	}
	if r2 := c2.check(3, 1, "ip=2001:db8:1:3::1"); !r2.Allowed || r2.Degraded {
		t.Fatalf("another /64: %+v; want allowed", r2)
	}
	if rr := c2.leaseOp(4, proto.OpRelease, r.Lease, 0); !rr.Released || rr.IsError() {
		t.Fatalf("release through the other daemon: %+v", rr)
	}
	if r2 := c2.check(5, 1, "ip=2001:db8:1:2::3"); !r2.Allowed || r2.Degraded {
		t.Fatalf("after the release: %+v; want allowed", r2)
	}
}

// Through the Envoy API, a descriptor entry is an attribute: ip_prefix on
// remote_address keys Envoy's client address by its network.
func TestE2EIPPrefixEnvoy(t *testing.T) {
	f := startEnvoyDaemon(t, `
rules:
  - name: per-net
    match: { domain: edge, descriptor: remote_address }
    key: [domain, remote_address]
    ip_prefix: { attr: remote_address, ipv6: 64 }
    limit: { requests: 2, per: 1h }
`)
	for i, st := range ipPrefixSteps[:4] {
		resp := f.call(t, "edge", 1, desc("remote_address="+st.ip))
		if got := resp.OverallCode == rlsv3.RateLimitResponse_OK; got != st.allowed {
			t.Fatalf("step %d, remote_address %s: %v, want allowed %v", i, st.ip, resp.OverallCode, st.allowed)
		}
	}
}
