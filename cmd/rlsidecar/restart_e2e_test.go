package main

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// stopDaemon sends SIGTERM and waits for a clean exit.
func stopDaemon(t *testing.T, d *daemonProc) {
	t.Helper()
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitExit(t, d)
}

// waitExit waits up to 15 s for d, stopped, to exit 0.
func waitExit(t *testing.T, d *daemonProc) {
	t.Helper()
	select {
	case err := <-d.done:
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, d.stderr.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("daemon did not exit\n%s", d.stderr.String())
	}
}

// A daemon restarted under the same --daemon-id (a fixed name per host) counts in Redis
// every unit each of its runs admitted. Before, every run's sync tokens started at 1, so a key's first sync in the
// new run carried the token the old run had recorded on the key, and the script took it
// for a replay: 40 keys checked once per run, three runs, Redis counted 1 of 3 on each.
//
// Each run admits one unit per key from Redis's allowances (not degraded). A check
// answered degraded was decided by the rule's failure policy (local: a bucket in the
// daemon's memory) and never reaches Redis, so the key is checked again until an answer
// is not. On a loaded machine the daemon's first heartbeat missed its 100 ms
// (max(--redis-timeout, --sync-interval)) now and then, and the keys new to the run that
// came before the next answer from Redis went to the policy: Redis then counted 2 of 3 on
// them, which the test took for lost units (load 12 or more: 11 runs of 60 failed, every
// missing unit a degraded one). --redis-timeout 5s makes that rare; the retry makes it
// harmless.
func TestE2EHybridRestartSameIDCountsOnce(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: per-user
    key: user
    algorithm: fixed_window
    limit: { requests: 1000, per: 1h }
`)
	const keys, runs = 40, 3
	clearOfWindowEnd(t, time.Hour, 60*time.Second) // Redis's counts are the window's
	socket := dir + "/s.sock"
	var logs []string // each run's log, shown if Redis's counts are not the runs'
	id := uint64(0)
	for run := 0; run < runs; run++ {
		d := startDaemonAt(t, socket, "--config", cfg, "--redis", "redis://"+srv.Addr, "--daemon-id", "gw-1", "--redis-timeout", "5s")
		c := dialRaw(t, d.socket)
		degraded := 0 // answers by the failure policy, checked again
		start := time.Now()
		for k := 0; k < keys; k++ {
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
				id++
				r := c.check(id, 1, fmt.Sprint("user=u", k))
				if !r.Allowed {
					t.Fatalf("run %d, user u%d refused: %+v", run, k, r)
				}
				if !r.Degraded {
					break
				}
				degraded++
				if time.Now().After(deadline) {
					t.Fatalf("run %d, user u%d: still decided without Redis after 10 s: %+v\n%s", run, k, r, d.stderr.String())
				}
			}
		}
		took := time.Since(start)
		stopDaemon(t, d) // its last sync settles what it admitted
		logs = append(logs, fmt.Sprintf("run %d: %d keys in %v, %d answers degraded (checked again), stopped %v after; its log:\n%s",
			run, keys, took.Round(time.Millisecond), degraded, (time.Since(start)-took).Round(time.Millisecond), d.stderr.String()))
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	for k := 0; k < keys; k++ {
		key := fmt.Sprintf("rl:per-user~fw1h:{user=u%d}", k)
		if n, err := rdb.HGet(ctx, key, "n").Int(); err != nil || n != runs {
			t.Errorf("%s: Redis counts %d (%v), the runs admitted %d from Redis's allowances", key, n, err, runs)
		}
	}
	if t.Failed() {
		for _, l := range logs {
			t.Log(l)
		}
	}
}

// Blue/green: the old daemon's SIGTERM closes its gateways' connections, but their
// requests holding global leases are still running; the slots stay held in Redis until
// the gateway releases them through the new daemon (or they expire). Before, the old
// daemon freed them as it shut down, and the new one admitted a request past the
// concurrency max while they were still in flight.
func TestE2EGlobalLeasesOutliveDaemonShutdown(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: exports
    key: user
    concurrency: { max: 2, lease: 60s }
    mode: global
`)
	args := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--global-timeout", "2s", "--redis-timeout", "1s"}
	blue := startDaemon(t, append(args, "--daemon-id", "blue")...)
	green := startDaemon(t, append(args, "--daemon-id", "green")...)
	cb, cg := dialRaw(t, blue.socket), dialRaw(t, green.socket)
	var leases []string
	for i := 0; i < 2; i++ {
		r := cb.check(uint64(1+i), 1, "user=ann")
		if !r.Allowed || r.Lease == "" || r.Degraded {
			t.Fatalf("lease %d on blue: %+v", i+1, r)
		}
		leases = append(leases, r.Lease)
	}
	stopDaemon(t, blue) // its drain closes the gateway's connection; the requests run on
	if r := cg.check(3, 1, "user=ann"); r.Allowed || r.Degraded {
		t.Fatalf("green, with blue's 2 requests still in flight: %+v, want refused (max 2)", r)
	}
	// The gateway ends its requests and releases their leases through green.
	for i, l := range leases {
		if r := cg.leaseOp(uint64(4+i), proto.OpRelease, l, 0); !r.Released || r.IsError() {
			t.Fatalf("release %d through green: %+v, want released", i+1, r)
		}
	}
	if r := cg.check(6, 1, "user=ann"); !r.Allowed || r.Degraded {
		t.Fatalf("green after the releases: %+v, want allowed", r)
	}
}

// Two daemons on one host name with one pid (containers sharing the host's network, each
// daemon pid 1) get different default IDs: under one ID they counted as one daemon and
// each took the other's use of a shared key for its own.
func TestDefaultDaemonIDsDiffer(t *testing.T) {
	a, b := defaultDaemonID("gw-node-3", 1), defaultDaemonID("gw-node-3", 1)
	if a == b {
		t.Fatalf("two daemons on host gw-node-3 as pid 1 both named %q", a)
	}
	for _, id := range []string{a, b} {
		if !strings.HasPrefix(id, "gw-node-3-1-") {
			t.Fatalf("default ID %q does not start with the host and pid", id)
		}
	}
}

// A daemon stopped while Redis is away cannot hand in what it admitted since its last
// sync: its last sync fails, and those units are never counted in Redis. That must show
// in the log whatever else was logged before. Before, the failure went through the same
// one-line-per-10-s limit as the periodic syncs' failures, so a daemon stopped within
// 10 s of the outage's first warning (a restart to "fix" Redis trouble, say) logged
// "stopped" and nothing about the units it dropped.
func TestE2ELastSyncFailureIsLogged(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: per-user
    key: user
    algorithm: fixed_window
    limit: { requests: 1000, per: 1h }
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--sync-interval", "50ms")
	c := dialRaw(t, d.socket)
	for i := range 3 {
		if r := c.check(uint64(i+1), 1, "user=u"); !r.Allowed {
			t.Fatalf("refused: %+v", r)
		}
	}
	time.Sleep(300 * time.Millisecond) // synced: the key holds a grant
	srv.Stop()
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(d.stderr.String(), "redis sync failed") {
		if time.Now().After(deadline) {
			t.Fatalf("no sync failure logged 5s after Redis stopped\n%s", d.stderr.String())
		}
		c.check(9, 1, "user=u")
		time.Sleep(20 * time.Millisecond)
	}
	for i := range 3 { // admitted, pending: the last sync's to hand in
		c.check(uint64(10+i), 1, "user=u")
	}
	stopDaemon(t, d)
	log := d.stderr.String()
	_, after, _ := strings.Cut(log, "msg=draining")
	if !strings.Contains(after, "level=WARN") || !strings.Contains(after, "last sync") {
		t.Fatalf("the last sync failed (Redis stopped) and nothing said so after the drain began:\n%s", log)
	}
}

// A Redis out of reach across a daemon's stop (a failover, a restart with persistence, a
// network blip longer than the sync's timeout) costs nothing admitted if it is back
// within the last sync's budget: the last sync is tried again until Redis answers.
// Before, its one try was cut at the sync client's timeout (here 50 ms) and every unit
// admitted since the last sync that reached Redis was lost, as with a SIGKILL. The link
// is cut cleanly, as in TestFaultOutageDeltasReachRedisOnce (a command reaches Redis
// whole with its reply, or not at all).
func TestE2ELastSyncOutlastsARedisBlip(t *testing.T) {
	srv := redistest.StartStandalone(t)
	proxy := startToxiproxy(t, srv.Addr)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: orders
    key: user
    algorithm: fixed_window
    limit: { requests: 1000000000, per: 366d }
`)
	// Syncs every second, not every 50 ms: the checks after the link is cut must come
	// before the daemon's breaker opens (3 failed calls), and at 50 ms that was within
	// about 150 ms of the cut; at load 7.5 and 17 a -race run had check 10, and check 20,
	// degraded (the breaker open: the policy decides, rightly).
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+proxy.Listen, "--sync-interval", "1s")
	c := dialRaw(t, d.socket)
	admitted := 0
	check := func(id uint64) {
		if r := c.check(id, 1, "user=shopper"); !r.Allowed || r.Degraded {
			t.Fatalf("check %d: %+v\n%s", id, r, d.stderr.String())
		}
		admitted++
	}
	// Five units admitted with Redis up. The key's first check waits for its exact sync,
	// which a loaded machine can make outlive its wait (the sync client's 50 ms): that
	// check is then degraded, its unit the local fallback's, never in Redis, and not
	// counted here.
	id := uint64(0)
	for deadline := time.Now().Add(10 * time.Second); admitted < 5; {
		id++
		r := c.check(id, 1, "user=shopper")
		switch {
		case !r.Allowed:
			t.Fatalf("check %d: %+v", id, r)
		case !r.Degraded:
			admitted++
		case time.Now().After(deadline):
			t.Fatalf("still degraded 10 s after the start, Redis up: %+v", r)
		}
	}
	// Synced: Redis counts the five, and the key holds a grant.
	for deadline := time.Now().Add(10 * time.Second); redisCount(t, srv.Addr, "rl:orders~fw366d:{user=shopper}") != admitted; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("Redis counts %d 10 s after the checks, want %d", redisCount(t, srv.Addr, "rl:orders~fw366d:{user=shopper}"), admitted)
		}
	}
	addToxic(t, proxy, "blackhole", "timeout", "upstream", `{"timeout":0}`)
	proxy.Stop()
	removeToxic(t, proxy, "blackhole")
	for i := range 20 { // admitted on the grant, pending: the last sync's to hand in
		check(uint64(10 + i))
	}
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if err := proxy.Start(); err != nil {
		t.Fatalf("restarting toxiproxy on %s: %v", proxy.Listen, err)
	}
	start := time.Now()
	waitExit(t, d)
	t.Logf("exit %s after Redis was back", time.Since(start).Round(time.Millisecond))
	if got := redisCount(t, srv.Addr, "rl:orders~fw366d:{user=shopper}"); got != admitted {
		t.Fatalf("Redis counts %d after a stop across a 0.5 s outage, the client was told %d were admitted\n%s", got, admitted, d.stderr.String())
	}
}

// The refusals a hybrid penalty rule counted since the last round of sharing them are
// sent once more at stop; when Redis is away, that failure is logged at warn whatever
// was logged before (the refusals, and the bans they start, never reach the other
// daemons). Before, the last round's error was dropped without a word.
func TestE2ELastBanRoundFailureIsLogged(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 1h }
    penalty: { after: 100, within: 1h, ban: 1m }
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--sync-interval", "50ms")
	c := dialRaw(t, d.socket)
	if r := c.check(1, 1, "ip=10.0.0.9"); !r.Allowed {
		t.Fatalf("first check refused: %+v", r)
	}
	// Refused from the daemon's view of the key, with Redis up: until a sync has brought
	// that view, a check past the limit waits on Redis, and with Redis stopped the policy
	// decides it, counting no refusal (a sleep of 300 ms for the sync was not always
	// enough on a loaded machine: nothing was left for the last round to send).
	for id, deadline := uint64(2), time.Now().Add(10*time.Second); ; id++ {
		if r := c.check(id, 1, "ip=10.0.0.9"); !r.Allowed && !r.Degraded {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no check refused from the daemon's view within 10 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	srv.Stop()
	refused := 0
	for i := range 5 { // refused: counted here, for the last round to send
		if r := c.check(uint64(100+i), 1, "ip=10.0.0.9"); !r.Allowed && !r.Degraded {
			refused++
		}
	}
	if refused == 0 {
		t.Fatal("with Redis stopped, no check was refused from the daemon's view: nothing for the last round to send")
	}
	stopDaemon(t, d)
	log := d.stderr.String()
	_, after, _ := strings.Cut(log, "msg=draining")
	if !strings.Contains(after, "sharing the penalty bans before stopping failed") {
		t.Fatalf("the last round of sharing bans failed (Redis stopped) and nothing said so:\n%s", log)
	}
}

// A daemon started under a --daemon-id another live daemon uses says so at start. Two
// live daemons under one ID each take the other's syncs of a key for their own and admit
// past the limit (docs/reliability.md), and a blue/green pair on one host that both read
// RLSIDECAR_DAEMON_ID from /etc/default/rlsidecar is such a pair: before, nothing said
// so (two daemons under one ID alternating on a key of 100 per hour admitted 104; under
// two IDs, 100). A daemon whose predecessor under the ID left the live-daemons set
// (SIGTERM) says nothing, and neither does one under an ID of its own.
func TestE2EDaemonIDInUseWarned(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: per-user
    key: user
    limit: { requests: 100, per: 1h }
`)
	args := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--redis-timeout", "5s"}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	// live waits until the live-daemons set holds id (the daemon's first heartbeat).
	live := func(id string) {
		t.Helper()
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if err := rdb.ZScore(context.Background(), "rl:daemons", id).Err(); err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("no heartbeat of %s in 15 s", id)
			}
		}
	}
	const warning = "another live daemon uses this daemon id"
	blue := startDaemon(t, append(args, "--daemon-id", "gw-1")...)
	// Logs are read once each daemon has exited: all of its stderr is in then. A daemon
	// asks for its ID's heartbeat at its start within 250 ms (serve.go), which a loaded
	// machine can exceed, and then says nothing: green is started up to three times, each
	// once blue's heartbeat is in the set again (green's SIGTERM took the ID out of it).
	// A daemon that never says so fails all three.
	var green *daemonProc
	for try := 1; ; try++ {
		live("gw-1")
		green = startDaemon(t, append(args, "--daemon-id", "gw-1")...)
		stopDaemon(t, green)
		if strings.Contains(green.stderr.String(), warning) && strings.Contains(green.stderr.String(), "daemon_id=gw-1") {
			break
		}
		if try == 3 {
			t.Fatalf("a daemon started under the ID of a live one does not say so (3 starts):\n%s", green.stderr.String())
		}
		t.Logf("start %d under the ID of a live one said nothing; starting it again", try)
	}
	live("gw-1")
	other := startDaemon(t, append(args, "--daemon-id", "gw-2")...)
	stopDaemon(t, other)
	stopDaemon(t, blue) // leaves the live-daemons set
	for name, d := range map[string]*daemonProc{"the first under gw-1": blue, "the one under gw-2": other} {
		if strings.Contains(d.stderr.String(), warning) {
			t.Errorf("%s warns of its ID in use:\n%s", name, d.stderr.String())
		}
	}
	next := startDaemon(t, append(args, "--daemon-id", "gw-1")...)
	stopDaemon(t, next)
	if strings.Contains(next.stderr.String(), warning) {
		t.Errorf("a daemon started under the ID of one stopped with SIGTERM warns of it in use:\n%s", next.stderr.String())
	}
}

// A daemon (re)started beside others counts the live daemons before its first check: a
// split: auto rule holds ⌈limit ÷ live daemons⌉ on it from the start. Before, the count
// was 1 until its first heartbeat answered, which went on its own goroutine as the
// daemon began serving, and the checks that came first (under socket activation, the
// gateways' connections waiting in the backlog through a restart) had the whole limit:
// a third daemon beside two, 30 checks of one client pipelined as it started, admitted
// 30 of a limit of 30 split three ways.
func TestE2ESplitAutoCountsDaemonsFromTheStart(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: per-user
    key: user
    algorithm: fixed_window
    limit: { requests: 30, per: 1h }
    mode: local
    split: auto
`)
	// A generous Redis timeout: on a loaded machine a heartbeat cut at 100 ms would
	// leave the count at 1, which is what the test looks for.
	args := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--redis-timeout", "5s"}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	startDaemon(t, args...)
	startDaemon(t, args...)
	for deadline := time.Now().Add(15 * time.Second); rdb.ZCard(context.Background(), "rl:daemons").Val() != 2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("two daemons not both in the live-daemons set after 15 s")
		}
	}
	clearOfWindowEnd(t, time.Hour, 60*time.Second) // the 30 checks count in one window
	// The old code lost the race to its heartbeat now and then: six runs, where one
	// losing is enough.
	for run := range 6 {
		d := startDaemon(t, args...)
		c := dialRaw(t, d.socket)
		const checks = 30
		for i := range checks {
			c.send(&proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: fmt.Sprint("fresh-", run)}}})
		}
		admitted := 0
		for range checks {
			if c.recv().Allowed {
				admitted++
			}
		}
		stopDaemon(t, d) // leaves the live-daemons set: the next run is the third again
		if admitted != 10 {
			t.Fatalf("run %d: a daemon started beside two admitted %d of %d checks of one client pipelined at its start, want 10 (⌈30 ÷ 3⌉)\n%s", run, admitted, checks, d.stderr.String())
		}
	}
}
