package main

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/checker"
	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// One master of a 3-master Redis Cluster frozen (SIGSTOP) for 3 s under the daemon, with
// a hybrid and a global rule, both fail-closed, and clients on every master: the
// clients whose keys are on the two healthy masters are answered as usual, none
// degraded; those on the frozen master follow the policy (rejected, degraded) — the
// global ones at once, the hybrid ones once their allowances are stale. After SIGCONT
// every client is answered normally again. Before the breaker per master, one breaker
// per daemon opened on the frozen master's failures and degraded every key.
func TestFaultClusterMasterFrozen(t *testing.T) {
	// Redis's default node timeout: a master frozen for 3 s is not marked failed by the
	// others (which, with no replica, would answer CLUSTERDOWN for every key).
	cl := redistest.StartCluster(t, redistest.WithClusterNodeTimeout(15*time.Second))
	d := startClusterFaultDaemon(t, cl)
	c := dialFault(t, d.socket)

	// Two clients per master: a key's hash tag is its client ({user=…}).
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()
	ctx := context.Background()
	users := map[string][]string{} // by master address
	for i := 0; len(users) < 3 || len(users[cl.Addrs[0]]) < 2 || len(users[cl.Addrs[1]]) < 2 || len(users[cl.Addrs[2]]) < 2; i++ {
		u := fmt.Sprintf("u%d", i)
		m, err := cc.MasterForKey(ctx, "{user="+u+"}")
		if err != nil {
			t.Fatal(err)
		}
		if a := m.Options().Addr; len(users[a]) < 2 {
			users[a] = append(users[a], u)
		}
	}
	for _, us := range users {
		for _, u := range us {
			waitNormal(t, c, 10*time.Second, "path=/h", "user="+u)
			waitNormal(t, c, 10*time.Second, "path=/g", "user="+u)
		}
	}
	// The keys are where the test thinks: on their client's master.
	deadline := time.Now().Add(10 * time.Second)
	for a, us := range users {
		n := redis.NewClient(&redis.Options{Addr: a})
		for _, u := range us {
			for {
				keys, err := n.Keys(ctx, "*{user="+u+"}").Result()
				if err != nil {
					t.Fatal(err)
				}
				if len(keys) >= 2 { // the hybrid and the global rule's
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("user %s: keys %v on %s, want both rules' there", u, keys, a)
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
		n.Close()
	}

	frozenAddr := cl.Addrs[1]
	var frozen *redistest.Server
	for _, n := range cl.Nodes {
		if n.Addr == frozenAddr {
			frozen = n
		}
	}
	const freeze = 3 * time.Second
	frozen.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			frozen.Thaw()
		}
	}()
	type tally struct{ checks, degraded, rejected, lateNormal int }
	var healthy, onFrozen [2]tally // [0] hybrid, [1] global
	var firstBad string
	start := time.Now()
	for time.Since(start) < freeze {
		for a, us := range users {
			for _, u := range us {
				for i, path := range []string{"/h", "/g"} {
					r, took, err := c.Check("path="+path, "user="+u)
					if err != nil {
						t.Fatalf("%s user=%s, %s into the freeze: %v", path, u, time.Since(start), err)
					}
					tl := &healthy[i]
					if a == frozenAddr {
						tl = &onFrozen[i]
					}
					tl.checks++
					if r.Degraded {
						tl.degraded++
					}
					if !r.Allowed {
						tl.rejected++
					}
					if a != frozenAddr && (r.Degraded || !r.Allowed) && firstBad == "" {
						firstBad = fmt.Sprintf("%s user=%s %s into the freeze: allowed %v degraded %v (took %s)", path, u, time.Since(start).Round(time.Millisecond), r.Allowed, r.Degraded, took)
					}
					// Past the hybrid staleness bound (2 s) with a margin, the frozen
					// master's clients are the policy's on both rules.
					if a == frozenAddr && time.Since(start) > 2500*time.Millisecond && (r.Allowed || !r.Degraded) {
						tl.lateNormal++
					}
				}
			}
		}
	}
	frozen.Thaw()
	thawed = true
	backStart := time.Now()
	for _, us := range users {
		for _, u := range us {
			waitNormal(t, c, 10*time.Second, "path=/h", "user="+u)
			waitNormal(t, c, 10*time.Second, "path=/g", "user="+u)
		}
	}
	back := time.Since(backStart)
	for i, rule := range []string{"hybrid", "global"} {
		t.Logf("%s rule, master %s frozen %s: healthy masters' clients %d checks, %d degraded, %d rejected; frozen master's %d checks, %d degraded, %d rejected",
			rule, frozenAddr, freeze, healthy[i].checks, healthy[i].degraded, healthy[i].rejected, onFrozen[i].checks, onFrozen[i].degraded, onFrozen[i].rejected)
	}
	t.Logf("every client normal again %s after SIGCONT", back.Round(time.Millisecond))
	for i, rule := range []string{"hybrid", "global"} {
		if healthy[i].degraded != 0 || healthy[i].rejected != 0 {
			t.Errorf("%s rule: %d of %d checks of the healthy masters' clients degraded, %d rejected; want 0 (first: %s)",
				rule, healthy[i].degraded, healthy[i].checks, healthy[i].rejected, firstBad)
		}
		if onFrozen[i].degraded == 0 || onFrozen[i].lateNormal != 0 {
			t.Errorf("%s rule: the frozen master's clients had %d degraded answers, %d normal ones past 2.5 s; want some, and 0",
				rule, onFrozen[i].degraded, onFrozen[i].lateNormal)
		}
	}
}

// A Redis Cluster master killed under the daemon and its replica promoted: the clients
// whose keys it held are answered by their policy (a global and a hybrid `closed` rule:
// rejected, degraded) until the failover, then normally again within seconds of it, the
// daemon following the new slot map. Before, the daemon's client kept routing them to
// the dead node until go-redis reloaded its slot map on its own, a minute later.
func TestFaultClusterFailover(t *testing.T) {
	cl := redistest.StartCluster(t) // node timeout 2 s: a quick failover
	replica := cl.AddReplica(t, 0)
	d := startClusterFaultDaemon(t, cl)
	c := dialFault(t, d.socket)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()
	ctx := context.Background()
	var user string
	for i := 0; user == ""; i++ {
		u := fmt.Sprintf("u%d", i)
		m, err := cc.MasterForKey(ctx, "{user="+u+"}")
		if err != nil {
			t.Fatal(err)
		}
		if m.Options().Addr == cl.Addrs[0] {
			user = u
		}
	}
	waitNormal(t, c, 10*time.Second, "path=/g", "user="+user)
	waitNormal(t, c, 10*time.Second, "path=/h", "user="+user)

	cl.Nodes[0].Stop()
	killed := time.Now()
	// The replica takes over after the node timeout (2 s) and an election.
	rc := redis.NewClient(&redis.Options{Addr: replica.Addr})
	defer rc.Close()
	promoted := make(chan time.Duration, 1)
	go func() {
		deadline := time.Now().Add(time.Minute)
		for time.Now().Before(deadline) {
			if info, err := rc.Info(ctx, "replication").Result(); err == nil && strings.Contains(info, "role:master") {
				promoted <- time.Since(killed)
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		promoted <- -1
	}()
	back := waitNormal(t, c, 30*time.Second, "path=/g", "user="+user)
	waitNormal(t, c, 10*time.Second, "path=/h", "user="+user)
	p := <-promoted
	t.Logf("master killed: replica promoted %s later, the global rule normal again %s after the kill", p.Round(time.Millisecond), back.Round(time.Millisecond))
	if p < 0 {
		t.Fatal("the replica was not promoted")
	}
	if back-p > 10*time.Second {
		t.Errorf("normal again %s after the promotion, want within 10 s", back-p)
	}
}

// startClusterFaultDaemon starts a daemon on cl with the cluster fault tests' two rules,
// both closed on a store failure: hyb (hybrid, path /h) and glob (global, path /g), a
// million an hour per user. Generous timeouts: a loaded 2-core machine must not time
// out the healthy masters.
func startClusterFaultDaemon(t *testing.T, cl *redistest.Cluster) *daemonProc {
	t.Helper()
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: hyb
    match: { path: /h }
    key: user
    limit: { requests: 1000000, per: 1h }
    on_store_failure: closed
  - name: glob
    match: { path: /g }
    key: user
    limit: { requests: 1000000, per: 1h }
    mode: global
    on_store_failure: closed
`)
	return startDaemon(t, "--config", cfg, "--redis-cluster", strings.Join(cl.Addrs, ","),
		"--sync-interval", "50ms", "--global-timeout", "250ms", "--redis-timeout", "250ms")
}

// startClusterLeaseDaemon starts a daemon on cl with one global concurrency rule,
// inflight (path /l, per user, concurrency as given), closed on a store failure, with the
// timeouts of startClusterFaultDaemon.
func startClusterLeaseDaemon(t *testing.T, cl *redistest.Cluster, concurrency string) *daemonProc {
	t.Helper()
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: inflight
    match: { path: /l }
    key: user
    concurrency: `+concurrency+`
    mode: global
    on_store_failure: closed
`)
	return startDaemon(t, "--config", cfg, "--redis-cluster", strings.Join(cl.Addrs, ","),
		"--sync-interval", "50ms", "--global-timeout", "250ms", "--redis-timeout", "250ms")
}

// A master killed and its replica promoted, under a global concurrency rule: once checks
// take leases on the promoted replica again, releasing them must work too. The releases
// (and renewals, refund retries, bans) go through a client of their own, which no
// breaker watched: go-redis reloads its slot map only on a redirection or once a minute,
// and calls to the dead master get no redirection, so every lease taken in that minute
// answered released: false and stayed held for its whole lease (a rule of 5 in flight:
// its clients refused, not degraded, for a minute after the failover).
func TestFaultClusterFailoverLeaseRelease(t *testing.T) {
	cl := redistest.StartCluster(t) // node timeout 2 s: a quick failover
	cl.AddReplica(t, 0)
	d := startClusterLeaseDaemon(t, cl, "{ max: 100000, lease: 60s }")
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()
	ctx := context.Background()
	var user string
	for i := 0; user == ""; i++ {
		u := fmt.Sprintf("u%d", i)
		m, err := cc.MasterForKey(ctx, "{user="+u+"}")
		if err != nil {
			t.Fatal(err)
		}
		if m.Options().Addr == cl.Addrs[0] {
			user = u
		}
	}
	attrs := []string{"path=/l", "user=" + user}
	// acquireRelease takes a lease on a fresh connection and releases it on another, so
	// that only the release, not a closing connection, can free it.
	acquireRelease := func() (allowed, degraded, released bool) {
		a, b := dialRaw(t, d.socket), dialRaw(t, d.socket)
		r := a.check(1, 1, attrs...)
		if !r.Allowed || r.Lease == "" {
			return false, r.Degraded, false
		}
		return true, r.Degraded, b.leaseOp(2, proto.OpRelease, r.Lease, 0).Released
	}
	if ok, deg, rel := acquireRelease(); !ok || deg || !rel {
		t.Fatalf("before the failover: allowed %v, degraded %v, released %v; want a lease taken and released", ok, deg, rel)
	}

	cl.Nodes[0].Stop()
	killed := time.Now()
	c := dialFault(t, d.socket)
	normal := waitNormal(t, c, 30*time.Second, attrs...)
	c.Close() // frees the leases its checks took
	var failed int
	for {
		ok, deg, rel := acquireRelease()
		if ok && !deg && rel {
			break
		}
		if ok && !deg {
			failed++ // a lease taken on the promoted replica, not released
		}
		if since := time.Since(killed) - normal; since > 10*time.Second {
			t.Fatalf("%s after checks were normal again, a lease taken is still not released (%d taken and not released); want released within 10 s", since.Round(time.Millisecond), failed)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("checks normal %s after the kill; releases normal %s after that (%d leases taken and not released meanwhile)",
		normal.Round(time.Millisecond), (time.Since(killed) - normal).Round(time.Millisecond), failed)
}

// A master killed under steady lease traffic (clients acquiring and releasing a global
// concurrency rule's leases on its slots, on connections they keep): once a check has
// taken a lease on the promoted replica, its release must free it. The daemon reloaded
// the checks' slot map while a breaker was open, but its client for releases only a
// tick (a second) after the checks' map had changed: in that second every release went
// to the dead master, answered released: false, and left its slot held for the whole
// lease (10 minutes here), its client refused, not degraded, meanwhile: 23 of the 23
// leases taken on the promoted replica not released (3 runs of 3; 12 users, 2 in flight
// each: every client locked out) before; 0 of 11,715–17,350 after (4 runs).
func TestFaultClusterFailoverReleasesFollowChecks(t *testing.T) {
	cl := redistest.StartCluster(t) // node timeout 2 s: a quick failover
	replica := cl.AddReplica(t, 0)
	d := startClusterLeaseDaemon(t, cl, "{ max: 2, lease: 10m }")
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()
	var users []string // on the master to be killed
	for i := 0; len(users) < 12; i++ {
		u := fmt.Sprintf("u%d", i)
		if masterOf(t, cc, cl, "{user="+u+"}") == 0 {
			users = append(users, u)
		}
	}
	c := dialFault(t, d.socket)
	for _, u := range users {
		waitNormal(t, c, 10*time.Second, "path=/l", "user="+u)
	}
	c.Close() // frees the leases its checks took

	type result struct{ stuck, taken int }
	var killed atomic.Bool
	var normalAgain atomic.Bool // a lease taken after the kill
	stop := make(chan struct{})
	results := make(chan result, 3)
	for w := range 3 {
		go func() {
			var r result
			defer func() { results <- r }()
			a, err := checker.Dial(d.socket)
			if err != nil {
				t.Error(err)
				return
			}
			defer a.Close()
			b, err := checker.Dial(d.socket)
			if err != nil {
				t.Error(err)
				return
			}
			defer b.Close()
			for i := w; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				after := killed.Load()
				resp, _, err := a.Check("path=/l", "user="+users[i%len(users)])
				if err != nil {
					t.Errorf("check: %v", err)
					return
				}
				if !resp.Allowed || resp.Degraded || resp.Lease == "" {
					continue
				}
				if after {
					normalAgain.Store(true)
					r.taken++
				}
				rel, _, err := b.Release(resp.Lease)
				if err != nil {
					t.Errorf("release: %v", err)
					return
				}
				if after && !rel.Released {
					r.stuck++
				}
			}
		}()
	}
	time.Sleep(200 * time.Millisecond) // leases taken and released on the old master
	cl.Nodes[0].Stop()
	killed.Store(true)
	rc := redis.NewClient(&redis.Options{Addr: replica.Addr})
	defer rc.Close()
	waitFor(t, time.Minute, "the replica promoted", func() bool {
		info, err := rc.Info(context.Background(), "replication").Result()
		return err == nil && strings.Contains(info, "role:master")
	})
	waitFor(t, 30*time.Second, "a lease taken on the promoted replica", normalAgain.Load)
	// Three ticks of the slot maps' refresh (a second each) past the first lease taken.
	time.Sleep(3 * time.Second)
	close(stop)
	var sum result
	for range 3 {
		r := <-results
		sum.stuck += r.stuck
		sum.taken += r.taken
	}
	t.Logf("after the kill: %d leases taken on the promoted replica, %d of them not released", sum.taken, sum.stuck)
	if sum.stuck != 0 {
		t.Errorf("%d leases taken on the promoted replica answered released: false (held for their 10-minute lease); want 0", sum.stuck)
	}
}
