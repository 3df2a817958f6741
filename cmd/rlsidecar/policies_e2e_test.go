package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestE2EPolicies runs warn_at and delay through the real daemon: the answer fields
// on the wire, and their metrics.
func TestE2EPolicies(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: quota
    match: { path: /quota }
    key: user
    algorithm: fixed_window
    limit: { requests: 10, per: 1h }
    warn_at: 0.8
  - name: queue
    match: { path: /queue }
    key: user
    limit: { requests: 1, per: 1s }
    delay: 5s
`)
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	id := uint64(0)
	clearOfWindowEnd(t, time.Hour, 10*time.Second) // quota's 11 requests in one window
	for i := 1; i <= 11; i++ {
		id++
		r := c.check(id, 1, "path=/quota", "user=ann")
		want := i >= 8 && i <= 10
		if r.Allowed != (i <= 10) || r.Warning != want || r.Rules[0].Warning != want {
			t.Fatalf("quota request %d: allowed %v warning %v (entry %v), want warning %v", i, r.Allowed, r.Warning, r.Rules[0].Warning, want)
		}
	}
	// nginx's burst example: 1 r/s, 5 may wait; the 7th is refused.
	start := time.Now() // before the first request
	for i := 1; i <= 7; i++ {
		id++
		r := c.check(id, 1, "path=/queue", "user=ann")
		if i == 7 {
			if r.Allowed || r.DelayMs != 0 || r.RetryAfterMs == 0 || r.RetryAfterMs > 1000 {
				t.Fatalf("queue request 7: allowed %v delay %d retry %d, want refused within 1s", r.Allowed, r.DelayMs, r.RetryAfterMs)
			}
			continue
		}
		// The daemon's clock moves between requests: each wait is (i-1) seconds less
		// the time since the first request, never more, never less (to the ms). That time
		// is measured here, from before the first request to this answer: a loaded
		// machine spreads the requests (a fixed 50 ms allowance was not always enough).
		want := uint64(i-1) * 1000
		since := uint64(time.Since(start).Milliseconds()) + 1
		if !r.Allowed || r.DelayMs > want || r.DelayMs+since < want || r.Rules[0].DelayMs != r.DelayMs {
			t.Fatalf("queue request %d: allowed %v delay %d (entry %d), want %d less at most the %d ms since the first request", i, r.Allowed, r.DelayMs, r.Rules[0].DelayMs, want, since)
		}
	}
	_, samples := scrape(t, base)
	if got := samples[`rlsidecar_warnings_total{rule="quota"}`]; got != 3 {
		t.Errorf("rlsidecar_warnings_total{quota} = %v, want 3", got)
	}
	if got := samples[`rlsidecar_delayed_total{rule="queue"}`]; got != 5 {
		t.Errorf("rlsidecar_delayed_total{queue} = %v, want 5", got)
	}
}

// TestE2ECalendarWindow: a daily quota in a time zone resets at the zone's next local
// midnight; reset_ms and retry_after_ms count to it.
func TestE2ECalendarWindow(t *testing.T) {
	const zone = "Asia/Kathmandu" // +05:45: no hour-aligned window could match it
	loc, err := time.LoadLocation(zone)
	if err != nil {
		t.Fatal(err)
	}
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: daily
    key: user
    limit: { requests: 3, per: day, tz: `+zone+` }
`)
	d := startDaemon(t, "--config", cfg)
	c := dialRaw(t, d.socket)
	nextMidnight := func() time.Time {
		y, m, dd := time.Now().In(loc).Date()
		return time.Date(y, m, dd+1, 0, 0, 0, 0, loc)
	}
	for i := 1; i <= 4; i++ {
		before := time.Until(nextMidnight())
		r := c.check(uint64(i), 1, "user=ann")
		after := time.Until(nextMidnight())
		if r.Allowed != (i <= 3) {
			t.Fatalf("request %d: allowed %v", i, r.Allowed)
		}
		got := time.Duration(r.ResetMs) * time.Millisecond
		if i == 4 {
			got = time.Duration(r.RetryAfterMs) * time.Millisecond
		}
		// after <= true wait <= before; the answer is rounded up to the millisecond.
		if got < after || got > before+time.Millisecond || r.Rules[0].WindowMs != 86_400_000 {
			t.Fatalf("request %d: reset/retry %v, want within [%v, %v]; window_ms %d", i, got, after, before, r.Rules[0].WindowMs)
		}
	}
}

// TestE2EBans: a penalty rule bans a key through the real daemon; the answer says
// banned, /bans lists it (client hashed as in the metrics), the metrics count it, and
// DELETE /bans/{rule}/{client} lifts it.
func TestE2EBans(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: login
    key: ip
    limit: { requests: 2, per: 1h }
    penalty: { after: 3, within: 1m, ban: 10m, factor: 2, max: 1h }
`)
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	for i := 1; i <= 5; i++ {
		r := c.check(uint64(i), 1, "ip=1.1.1.1")
		if r.Allowed != (i <= 2) || r.Banned != (i == 5) {
			t.Fatalf("request %d: allowed %v banned %v", i, r.Allowed, r.Banned)
		}
	}
	r := c.check(6, 1, "ip=1.1.1.1")
	// The ban (10m) lasts as long as the refusal that started it: the rule (2 per hour)
	// admits again only in 30m.
	if r.Allowed || !r.Banned || !r.Rules[0].Banned || r.RetryAfterMs < 1_799_000 || r.RetryAfterMs > 1_800_000 {
		t.Fatalf("banned check: allowed %v banned %v retry %d, want banned with about 30m left (the rule's retry)", r.Allowed, r.Banned, r.RetryAfterMs)
	}
	if r := c.check(7, 1, "ip=2.2.2.2"); !r.Allowed || r.Banned {
		t.Fatal("another key is banned")
	}
	code, body := httpGet(t, base+"/bans")
	var bans []struct {
		Rule, Client string
		LeftMs       int64 `json:"left_ms"`
		Count        int
	}
	if err := json.Unmarshal([]byte(body), &bans); code != 200 || err != nil || len(bans) != 1 {
		t.Fatalf("/bans: %d %s (%v)", code, body, err)
	}
	if b := bans[0]; b.Rule != "login" || !strings.HasPrefix(b.Client, "h:") || strings.Contains(body, "1.1.1.1") || b.Count != 1 || b.LeftMs < 1_790_000 {
		t.Fatalf("/bans: %s, want login's ban of a hashed client, never the raw key", body)
	}
	_, samples := scrape(t, base)
	if samples[`rlsidecar_bans_total{rule="login"}`] != 1 || samples[`rlsidecar_banned_keys{rule="login"}`] != 1 {
		t.Fatalf("bans_total %v banned_keys %v, want 1 and 1", samples[`rlsidecar_bans_total{rule="login"}`], samples[`rlsidecar_banned_keys{rule="login"}`])
	}
	del := func(path string) int {
		req, _ := http.NewRequest(http.MethodDelete, base+path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := del("/bans/login/ip=9.9.9.9"); code != http.StatusNotFound {
		t.Fatalf("lifting an absent ban: %d, want 404", code)
	}
	if code := del("/bans/login/" + bans[0].Client); code != http.StatusNoContent {
		t.Fatalf("lifting the ban by its hashed name: %d, want 204", code)
	}
	if r := c.check(8, 1, "ip=1.1.1.1"); r.Banned || r.Allowed {
		t.Fatalf("after the lift: banned %v allowed %v, want refused by the limit only", r.Banned, r.Allowed)
	}
	if _, body := httpGet(t, base+"/bans"); strings.TrimSpace(body) != "[]" {
		t.Fatalf("/bans after the lift: %s", body)
	}
}
