package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// policiesRedisRules: the policies of issue #15 in the Redis-backed modes. A calendar
// window and a delay without a mode (hybrid by default with Redis) are decided by the
// global scripts.
const policiesRedisRules = `
rules:
  - name: login-global
    match: { path: /g }
    key: ip
    limit: { requests: 1, per: 1h }
    mode: global
    penalty: { after: 2, within: 1m, ban: 10m }
  - name: login-hybrid
    match: { path: /h }
    key: ip
    limit: { requests: 1, per: 1h }
    mode: hybrid
    penalty: { after: 2, within: 1m, ban: 10m }
  - name: daily
    match: { path: /cal }
    key: user
    limit: { requests: 3, per: day, tz: Asia/Kathmandu }
  - name: queue
    match: { path: /q }
    key: user
    limit: { requests: 1, per: 1s }
    delay: 5s
`

// TestE2EPoliciesRedis runs calendar windows, delay and shared bans through two real
// daemons on one Redis, standalone and a 3-master Cluster.
func TestE2EPoliciesRedis(t *testing.T) {
	t.Run("standalone", func(t *testing.T) {
		srv := redistest.StartStandalone(t)
		testPoliciesRedis(t, "--redis", "redis://"+srv.Addr)
	})
	t.Run("cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t)
		testPoliciesRedis(t, "--redis-cluster", strings.Join(cl.Addrs, ","))
	})
}

func testPoliciesRedis(t *testing.T, redisArgs ...string) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", policiesRedisRules)
	const interval = 50 * time.Millisecond
	// A generous global timeout: the machine may be loaded, and a degraded answer would
	// test the failure policy, not the policies.
	args := append([]string{"--config", cfg, "--admin", "127.0.0.1:0", "--sync-interval", interval.String(), "--global-timeout", "3s", "--redis-timeout", "3s"}, redisArgs...)
	d1, d2 := startDaemon(t, args...), startDaemon(t, args...)
	c := [2]*rawConn{dialRaw(t, d1.socket), dialRaw(t, d2.socket)}
	id := uint64(0)
	check := func(t *testing.T, k int, attrs ...string) *responseView {
		t.Helper()
		id++
		r := c[k].check(id, 1, attrs...)
		if r.Degraded {
			t.Fatalf("degraded with Redis up: %+v", r)
		}
		return &responseView{r.Allowed, r.Banned, r.DelayMs, r.ResetMs, r.RetryAfterMs}
	}

	t.Run("calendar", func(t *testing.T) {
		loc, err := time.LoadLocation("Asia/Kathmandu")
		if err != nil {
			t.Fatal(err)
		}
		nextMidnight := func() time.Time {
			y, m, dd := time.Now().In(loc).Date()
			return time.Date(y, m, dd+1, 0, 0, 0, 0, loc)
		}
		for i := 1; i <= 4; i++ { // alternating daemons: one window for both
			before := time.Until(nextMidnight())
			r := check(t, i%2, "path=/cal", "user=ann")
			after := time.Until(nextMidnight())
			if r.allowed != (i <= 3) {
				t.Fatalf("request %d: allowed %v", i, r.allowed)
			}
			got := time.Duration(r.resetMs) * time.Millisecond
			if i == 4 {
				got = time.Duration(r.retryMs) * time.Millisecond
			}
			if got < after || got > before+time.Millisecond {
				t.Fatalf("request %d: reset/retry %v, want within [%v, %v] (the next Kathmandu midnight)", i, got, after, before)
			}
		}
	})

	t.Run("delay: nginx's burst example over two daemons", func(t *testing.T) {
		start := time.Now()
		for i := 1; i <= 7; i++ {
			r := check(t, i%2, "path=/q", "user=ann")
			if i == 7 {
				if r.allowed || r.delayMs != 0 || r.retryMs == 0 || r.retryMs > 1000 {
					t.Fatalf("request 7: allowed %v delay %d retry %d, want refused within 1s", r.allowed, r.delayMs, r.retryMs)
				}
				continue
			}
			// Redis's clock moves as real time: the wait is (i-1) s less the time since
			// the first request, rounded up to the ms.
			want := uint64(i-1) * 1000
			if !r.allowed || r.delayMs > want || r.delayMs+uint64(time.Since(start).Milliseconds())+10 < want {
				t.Fatalf("request %d: allowed %v delay %d ms, want about %d", i, r.allowed, r.delayMs, want)
			}
		}
	})

	t.Run("global bans: at once on the other daemon", func(t *testing.T) {
		if r := check(t, 0, "path=/g", "ip=1.1.1.1"); !r.allowed {
			t.Fatal("first request refused")
		}
		if r := check(t, 0, "path=/g", "ip=1.1.1.1"); r.allowed || r.banned {
			t.Fatalf("refusal 1: allowed %v banned %v", r.allowed, r.banned)
		}
		if r := check(t, 1, "path=/g", "ip=1.1.1.1"); r.allowed || !r.banned {
			t.Fatalf("refusal 2 on daemon 2: banned %v, want the ban to start", r.banned)
		}
		if r := check(t, 0, "path=/g", "ip=1.1.1.1"); !r.banned {
			t.Fatalf("daemon 1 right after: banned %v, want banned at once", r.banned)
		}
	})

	t.Run("hybrid bans: within a sync interval", func(t *testing.T) {
		for k := range 2 { // one refusal on each daemon: two in all
			for i := 0; ; i++ {
				if i > 100 {
					t.Fatalf("daemon %d never refused", k+1)
				}
				r := check(t, k, "path=/h", "ip=2.2.2.2")
				if r.banned {
					t.Fatal("banned before two refusals")
				}
				if !r.allowed {
					break
				}
				time.Sleep(interval)
			}
		}
		// Each daemon sums its refusal at its next interval; the one that reaches `after`
		// starts the ban, and each learns it at its next read: a few intervals at most.
		start := time.Now()
		for k := range 2 {
			for !check(t, k, "path=/h", "ip=2.2.2.2").banned {
				if time.Since(start) > 5*time.Second {
					t.Fatalf("daemon %d not banned after %v", k+1, time.Since(start))
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
		t.Logf("both daemons enforce the hybrid ban %v after the second refusal (sync interval %v)", time.Since(start), interval)
	})

	t.Run("/bans and DELETE", func(t *testing.T) {
		base1, base2 := "http://"+adminAddr(t, d1), "http://"+adminAddr(t, d2)
		var bans []struct {
			Rule   string `json:"rule"`
			Client string `json:"client"`
			Count  uint32 `json:"count"`
			LeftMs int64  `json:"left_ms"`
		}
		code, body := httpGet(t, base2+"/bans")
		if err := json.Unmarshal([]byte(body), &bans); code != 200 || err != nil || len(bans) != 2 {
			t.Fatalf("daemon 2 /bans: %d %s (%v), want both shared bans", code, body, err)
		}
		if strings.Contains(body, "1.1.1.1") || bans[0].Rule != "login-global" || bans[1].Rule != "login-hybrid" || bans[0].LeftMs < 590_000 {
			t.Fatalf("daemon 2 /bans: %s", body)
		}
		req, _ := http.NewRequest(http.MethodDelete, base2+"/bans/login-global/ip=1.1.1.1", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("DELETE on daemon 2: %d, want 204", resp.StatusCode)
		}
		if r := check(t, 0, "path=/g", "ip=1.1.1.1"); r.banned {
			t.Fatal("daemon 1 still enforces the global ban daemon 2 lifted")
		}
		// Daemon 2 started the global ban; one of the two started the hybrid one (the one
		// whose batch of refusals reached after); daemon 1 knows the hybrid one.
		s1, s2 := scrapeSamples(t, base1), scrapeSamples(t, base2)
		if got := s2[`rlsidecar_bans_total{rule="login-global"}`]; got != 1 {
			t.Errorf("daemon 2: rlsidecar_bans_total{login-global} = %v, want 1", got)
		}
		if got := s1[`rlsidecar_bans_total{rule="login-hybrid"}`] + s2[`rlsidecar_bans_total{rule="login-hybrid"}`]; got != 1 {
			t.Errorf("rlsidecar_bans_total{login-hybrid} on both daemons = %v, want 1", got)
		}
		if _, samples := scrape(t, base1); samples[`rlsidecar_banned_keys{rule="login-hybrid"}`] != 1 {
			_, list := httpGet(t, base1+"/bans")
			t.Errorf("daemon 1: rlsidecar_banned_keys{login-hybrid} = %v, want 1 (/bans: %s)", samples[`rlsidecar_banned_keys{rule="login-hybrid"}`], list)
		}
	})
}

// responseView is the part of an answer these tests read.
type responseView struct {
	allowed, banned           bool
	delayMs, resetMs, retryMs uint64
}

// TestE2ESharedBanGrowth: through two real daemons in global mode, bans grow ban,
// ban×factor, ban×factor² up to max and decay after max without one, on the daemons'
// real clocks (short durations). Each ban starts on the refusal that reaches `after`,
// whichever daemon takes it, whose answer carries the whole ban as retry_after_ms. (At
// a ban of 300 ms and a max of 1,200 ms, a loaded machine took longer than the max to
// earn the third ban, and the count had decayed: a ban of 300 ms, want 1,200; the
// durations are twice that now.)
func TestE2ESharedBanGrowth(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 50ms }
    mode: global
    penalty: { after: 2, within: 1m, ban: 600ms, factor: 2, max: 2400ms }
`)
	args := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--global-timeout", "3s", "--redis-timeout", "3s"}
	c := [2]*rawConn{dialRaw(t, startDaemon(t, args...).socket), dialRaw(t, startDaemon(t, args...).socket)}
	id := uint64(0)
	// earn sends requests, alternating daemons, until one is banned; it returns that
	// answer's retry_after_ms.
	earn := func() uint64 {
		t.Helper()
		for i := 0; i < 200; i++ {
			id++
			r := c[i%2].check(id, 1, "ip=1.1.1.1")
			if r.Degraded {
				t.Fatalf("degraded: %+v", r)
			}
			if r.Banned {
				return r.RetryAfterMs
			}
		}
		t.Fatal("never banned")
		return 0
	}
	for _, want := range []uint64{600, 1200, 2400, 2400} {
		got := earn()
		// The starting refusal carries the whole ban, rounded up to the ms.
		if got != want && got != want+1 {
			t.Fatalf("ban of %d ms, want %d", got, want)
		}
		time.Sleep(time.Duration(got) * time.Millisecond)
	}
	time.Sleep(2600 * time.Millisecond) // max (2400ms) without a ban: the count decays
	if got := earn(); got != 600 && got != 601 {
		t.Fatalf("after the decay: a ban of %d ms, want 600 again", got)
	}
}

func scrapeSamples(t *testing.T, base string) map[string]float64 {
	t.Helper()
	_, samples := scrape(t, base)
	return samples
}

// TestE2EBanLastsAsLongAsItsRefusal: through the real daemon in global mode on a real
// Redis, a penalty whose ban (300ms) is shorter than its rule's retry (1 per 3s) bans for
// the retry: the answers while banned say the rule's time, not the ban's, and a client
// that waits what they say passes, instead of meeting the rule's refusal (which would
// count toward a longer ban).
func TestE2EBanLastsAsLongAsItsRefusal(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 3s }
    mode: global
    penalty: { after: 1, within: 1m, ban: 300ms, factor: 2, max: 10s }
`)
	c := dialRaw(t, startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--global-timeout", "3s", "--redis-timeout", "3s").socket)
	id := uint64(0)
	check := func() (allowed, banned bool, retryMs uint64) {
		t.Helper()
		id++
		r := c.check(id, 1, "ip=1.1.1.1")
		if r.Degraded {
			t.Fatalf("degraded: %+v", r)
		}
		return r.Allowed, r.Banned, r.RetryAfterMs
	}
	if ok, _, _ := check(); !ok {
		t.Fatal("first request refused")
	}
	// The refusal starts the ban, and says so, with the rule's retry (about 3 s: just
	// under, or a millisecond over, rounded up from Redis's microseconds).
	start := time.Now()
	ok, banned, retry := check()
	if ok || !banned || retry < 2000 || retry > 3002 {
		t.Fatalf("refusal: allowed %v banned %v retry %d ms, want banned for the rule's retry (about 3000)", ok, banned, retry)
	}
	// Banned for as long: the old code said the ban's 300 ms here.
	ok, banned, retry2 := check()
	if elapsed := uint64(time.Since(start).Milliseconds()); ok || !banned || retry2+elapsed+1 < retry || retry2 > retry+1 {
		t.Fatalf("banned answer %d ms after: allowed %v banned %v retry %d ms, want what the refusal said less the time since (%d ms)",
			elapsed, ok, banned, retry2, retry)
	}
	// Obeying it passes.
	time.Sleep(time.Duration(retry2) * time.Millisecond)
	if ok, banned, retry := check(); !ok {
		t.Fatalf("after waiting retry_after_ms: refused (banned %v, retry %d ms)", banned, retry)
	}
}
