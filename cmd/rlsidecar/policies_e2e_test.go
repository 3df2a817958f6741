package main

import (
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
	for i := 1; i <= 11; i++ {
		id++
		r := c.check(id, 1, "path=/quota", "user=ann")
		want := i >= 8 && i <= 10
		if r.Allowed != (i <= 10) || r.Warning != want || r.Rules[0].Warning != want {
			t.Fatalf("quota request %d: allowed %v warning %v (entry %v), want warning %v", i, r.Allowed, r.Warning, r.Rules[0].Warning, want)
		}
	}
	// nginx's burst example: 1 r/s, 5 may wait; the 7th is refused.
	for i := 1; i <= 7; i++ {
		id++
		r := c.check(id, 1, "path=/queue", "user=ann")
		if i == 7 {
			if r.Allowed || r.DelayMs != 0 || r.RetryAfterMs == 0 || r.RetryAfterMs > 1000 {
				t.Fatalf("queue request 7: allowed %v delay %d retry %d, want refused within 1s", r.Allowed, r.DelayMs, r.RetryAfterMs)
			}
			continue
		}
		// The daemon's clock moves between requests: each wait is within a few ms of
		// (i-1) seconds, never more.
		want := uint64(i-1) * 1000
		if !r.Allowed || r.DelayMs > want || r.DelayMs+50 < want || r.Rules[0].DelayMs != r.DelayMs {
			t.Fatalf("queue request %d: allowed %v delay %d (entry %d), want about %d", i, r.Allowed, r.DelayMs, r.Rules[0].DelayMs, want)
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
