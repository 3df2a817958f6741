package limiter

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// clusterRedis starts a real 3-master Redis Cluster and returns a client of it.
func clusterRedis(t *testing.T) redis.UniversalClient {
	t.Helper()
	c := redistest.StartCluster(t)
	rdb, err := rlsync.Open(rlsync.Config{Cluster: c.Addrs, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// policyLimiter returns a limiter whose rules (yaml) run in global mode on rdb, the
// default mode hybrid (so a calendar or delay rule without a mode is routed to global).
// Its hybrid exact syncs wait up to 2 s, as its global checks do, not the daemon's 25 ms
// (as the sync package's tests raise it): on a loaded machine an exact sync can take
// longer, and a test not about the wait saw a degraded answer it does not test (a
// mid-session CI at load 15: TestInlineDuplicateChargedOnce's hybrid case read a
// remaining of 9 where 8 were left). A Redis stopped still fails at once. Its refunds
// wait up to 2 s too, not the daemon's 250 ms: a refund past its wait is sent again in
// the background, and the next check, which the tests read the refund from, may come
// first (a run at load 15 under -race: TestGlobalPoliciesRefunded's third check found
// the refused second one's calendar count and delay still charged).
func policyLimiter(t testing.TB, rdb redis.UniversalClient, yaml string) *Limiter {
	t.Helper()
	return New(mustRules(t, yaml), localbucket.NewStore(localbucket.Options{})).
		WithHybrid(rlsync.NewHybrid(rdb, rlsync.HybridOptions{FetchWait: 2 * time.Second})).
		WithGlobal(rlsync.NewGlobal(rdb).WithRefundTimeout(2*time.Second), 2*time.Second)
}

// TestCalendarGlobalBoundaries is localbucket's calendar table through global mode on a
// real Redis (standalone and a 3-master Cluster), on an injected clock: two limiters
// (two daemons) share each window; reset and retry-after count to its end; the key
// names the window's start, so the next window starts empty; the key expires with it.
func TestCalendarGlobalBoundaries(t *testing.T) {
	tests := []struct {
		name, zone, unit, at, start, end string
	}{
		{"sao paulo gap: the day starts at 01:00", "America/Sao_Paulo", "day", "2018-11-04T12:00:00-02:00", "2018-11-04T01:00:00-02:00", "2018-11-05T00:00:00-02:00"},
		{"sao paulo gap: the day before ends at 01:00", "America/Sao_Paulo", "day", "2018-11-03T23:59:59-03:00", "2018-11-03T00:00:00-03:00", "2018-11-04T01:00:00-02:00"},
		{"sao paulo month of the gap", "America/Sao_Paulo", "month", "2018-11-30T23:00:00-02:00", "2018-11-01T00:00:00-03:00", "2018-12-01T00:00:00-02:00"},
		{"new york spring forward", "America/New_York", "day", "2026-03-08T03:30:00-04:00", "2026-03-08T00:00:00-05:00", "2026-03-09T00:00:00-04:00"},
		{"new york fall back, second 01:30", "America/New_York", "day", "2026-11-01T01:30:00-05:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00"},
		{"lord howe spring", "Australia/Lord_Howe", "day", "2026-10-04T12:00:00+11:00", "2026-10-04T00:00:00+10:30", "2026-10-05T00:00:00+11:00"},
		{"lord howe autumn", "Australia/Lord_Howe", "day", "2026-04-05T01:45:00+10:30", "2026-04-05T00:00:00+11:00", "2026-04-06T00:00:00+10:30"},
		{"havana repeated midnight, second", "America/Havana", "day", "2026-11-01T00:10:00-05:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00"},
		{"leap february", "UTC", "month", "2028-02-29T23:59:59Z", "2028-02-01T00:00:00Z", "2028-03-01T00:00:00Z"},
		{"leap week", "UTC", "week", "2028-02-29T00:00:00Z", "2028-02-28T00:00:00Z", "2028-03-06T00:00:00Z"},
		{"week across a year end", "Europe/Berlin", "week", "2027-01-03T23:59:59+01:00", "2026-12-28T00:00:00+01:00", "2027-01-04T00:00:00+01:00"},
		{"month across a year end", "Asia/Tokyo", "month", "2026-12-31T23:59:59+09:00", "2026-12-01T00:00:00+09:00", "2027-01-01T00:00:00+09:00"},
	}
	parse := func(s string) int64 {
		v, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			t.Fatal(err)
		}
		return v.UnixNano()
	}
	for _, where := range []string{"standalone", "cluster"} {
		t.Run(where, func(t *testing.T) {
			var rdb redis.UniversalClient
			if where == "cluster" {
				rdb = clusterRedis(t)
			} else {
				rdb = realRedis(t)
			}
			for i, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					yaml := fmt.Sprintf("rules:\n  - name: cal%d\n    key: user\n    limit: { requests: 3, per: %s, tz: %s }\n", i, tt.unit, tt.zone)
					l1, l2 := policyLimiter(t, rdb, yaml), policyLimiter(t, rdb, yaml)
					at, start, end := parse(tt.at), parse(tt.start), parse(tt.end)
					check := annChecker(t)
					for k := range 3 {
						r := check([]*Limiter{l1, l2}[k%2], at)
						if !r.Allowed || r.Remaining != uint64(2-k) || r.Reset != time.Duration(end-at) {
							t.Fatalf("take %d: %+v, want allowed, %d left, reset %v", k+1, r, 2-k, time.Duration(end-at))
						}
					}
					if r := check(l2, at); r.Allowed || r.RetryAfter != time.Duration(end-at) {
						t.Fatalf("fourth take (other daemon): %+v, want refused, retry after %v", r, time.Duration(end-at))
					}
					if r := check(l1, end-1); r.Allowed {
						t.Fatal("allowed 1ns before the boundary")
					}
					if r := check(l2, end); !r.Allowed || r.Remaining != 2 {
						t.Fatalf("at the boundary: %+v, want allowed with 2 left", r)
					}
					lim, _ := l1.Rules().Rules[0].LimitFor("", false)
					key := fmt.Sprintf("rl:cal%d%s@%d:{user=ann}", i, AppendFingerprint(nil, lim), start/int64(time.Second))
					ttl, err := rdb.PTTL(context.Background(), key).Result()
					// PEXPIRE'd to the window's end + 60s (the clock skew it tolerates:
					// TestCalendarGlobalSkewedDaemons); real time has passed since (a
					// loaded machine: allow 10s).
					if err != nil || ttl <= time.Duration(end-at)+50*time.Second || ttl > time.Duration(end-at)+time.Minute {
						t.Fatalf("key %s: TTL %v (%v), want the window's end (%v) + 60s", key, ttl, err, time.Duration(end-at))
					}
				})
			}
		})
	}
}

// TestCalendarGlobalRetryNotEarly: a global calendar window's retry-after and reset,
// once rounded up to ms as the wire has them, are never before the window's end. The
// daemon sends the script the time left in the window in µs; it rounded it down, so with
// 1 s and 1 ns left the answer said retry after 1000 ms, and a client that waited that
// long was refused again, 1 ns before the end (and, under a penalty, would have had that
// refusal counted toward a ban).
func TestCalendarGlobalRetryNotEarly(t *testing.T) {
	rdb := realRedis(t)
	l := policyLimiter(t, rdb, "rules:\n  - name: calretry\n    key: user\n    limit: { requests: 1, per: day }\n")
	end := time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC).UnixNano()
	now := end - int64(time.Second) - 1 // 1 s and 1 ns before the day ends
	check := annChecker(t)
	if r := check(l, now); !r.Allowed || CeilMs(r.Reset) != 1001 {
		t.Fatalf("first take: %+v, want allowed, reset 1001 ms", r)
	}
	r := check(l, now)
	if r.Allowed || CeilMs(r.RetryAfter) != 1001 {
		t.Fatalf("second take: %+v, want refused, retry after 1001 ms", r)
	}
	if r := check(l, now+int64(CeilMs(r.RetryAfter))*int64(time.Millisecond)); !r.Allowed {
		t.Fatalf("refused again after waiting the retry-after: %+v", r)
	}
}

// TestDelayGlobalNginxBurst is nginx's documented limit_req example (rate=1r/s burst=5,
// no nodelay) in global mode across two limiters on one Redis (standalone and Cluster):
// six requests at once pass with waits of 0, 1, ..., 5 s, whichever daemon they reach;
// the seventh is refused; a refused request reserves nothing.
func TestDelayGlobalNginxBurst(t *testing.T) {
	for _, where := range []string{"standalone", "cluster"} {
		t.Run(where, func(t *testing.T) {
			var rdb redis.UniversalClient
			if where == "cluster" {
				rdb = clusterRedis(t)
			} else {
				rdb = realRedis(t)
			}
			const yaml = "rules:\n  - name: queue\n    key: user\n    limit: { requests: 1, per: 1s }\n    delay: 5s\n    mode: global\n"
			ls := []*Limiter{policyLimiter(t, rdb, yaml), policyLimiter(t, rdb, yaml)}
			var d Decision
			start := time.Now()
			for i := range 7 {
				if err := ls[i%2].Check(time.Now().UnixNano(), &Input{Attrs: attrs("user=ann"), Cost: 1}, &d); err != nil {
					t.Fatal(err)
				}
				if d.Degraded {
					t.Fatalf("request %d degraded", i+1)
				}
				want := time.Duration(i) * time.Second
				if i == 6 {
					if d.Allowed || d.Delay != 0 || d.Results[0].RetryAfter <= 0 || d.Results[0].RetryAfter > time.Second {
						t.Fatalf("request 7: allowed %v delay %v retry %v, want refused within 1s", d.Allowed, d.Delay, d.Results[0].RetryAfter)
					}
					continue
				}
				// Redis's clock moves as real time between requests: each wait is at most
				// i s, less the time since the first request.
				if !d.Allowed || d.Delay > want || d.Delay < want-time.Since(start)-10*time.Millisecond || d.Results[0].Delay != d.Delay {
					t.Fatalf("request %d: allowed %v delay %v, want about %v", i+1, d.Allowed, d.Delay, want)
				}
			}
		})
	}
}

// TestHybridPoliciesDecidedGlobally: in a daemon whose default mode is hybrid, a rule
// with a calendar window or a delay is decided by the global scripts (one key per
// calendar window in Redis at once, no hybrid allowance), and ModeOf says so; a plain
// rule stays hybrid.
func TestHybridPoliciesDecidedGlobally(t *testing.T) {
	rdb := realRedis(t)
	l := policyLimiter(t, rdb, `
rules:
  - name: daily
    key: user
    limit: { requests: 2, per: day, tz: Europe/Paris }
  - name: queue
    key: user
    limit: { requests: 1, per: 1s }
    delay: 2s
    mode: hybrid
  - name: plain
    key: user
    limit: { requests: 100, per: 1h }
`)
	set := l.Rules()
	for i, want := range []string{"global", "global", "hybrid"} {
		if got := l.ModeOf(set.Rules[i]).String(); got != want {
			t.Errorf("rule %s: mode %s, want %s", set.Rules[i].Name, got, want)
		}
	}
	var d Decision
	now := time.Now().UnixNano()
	if err := l.Check(now, &Input{Attrs: attrs("user=zoe"), Cost: 1}, &d); err != nil || !d.Allowed || d.Degraded {
		t.Fatalf("first check: %+v %v", d, err)
	}
	lim, _ := set.Rules[0].LimitFor("", false)
	start, _, _ := lim.CalendarBounds(now)
	key := fmt.Sprintf("rl:daily%s@%d:{user=zoe}", AppendFingerprint(nil, lim), start/int64(time.Second))
	if n, err := rdb.HGet(context.Background(), key, "n").Int(); err != nil || n != 1 {
		t.Fatalf("%s counts %d (%v), want 1 at once (global)", key, n, err)
	}
	if err := l.Check(now, &Input{Attrs: attrs("user=zoe"), Cost: 1}, &d); err != nil || !d.Allowed || d.Delay <= 0 {
		t.Fatalf("second check: allowed %v delay %v (%v), want a delay from the global token bucket", d.Allowed, d.Delay, err)
	}
}

// TestGlobalPoliciesRefunded: on a 3-master Cluster, a request whose calendar window and
// delayed bucket (one client's slot) pass but whose other rule (another slot) refuses is
// refunded: the calendar count and the bucket's reservation are given back, so the next
// request sees them untouched. Nothing admitted is lost or counted twice.
func TestGlobalPoliciesRefunded(t *testing.T) {
	rdb := clusterRedis(t)
	l := policyLimiter(t, rdb, `
rules:
  - name: daily
    key: user
    limit: { requests: 5, per: day }
    mode: global
  - name: queue
    key: user
    limit: { requests: 1, per: 1m }
    delay: 10m
    mode: global
  - name: per-ip
    match: { path: /capped }
    key: ip
    limit: { requests: 1, per: 1h }
    mode: global
`)
	if rlsync.Slot("rl:daily:{user=ann}") == rlsync.Slot("rl:per-ip:{ip=9.9.9.9}") {
		t.Fatal("pick keys on two slots")
	}
	var d Decision
	check := func(path string) *Decision {
		t.Helper()
		if err := l.Check(time.Now().UnixNano(), &Input{Attrs: attrs("user=ann", "ip=9.9.9.9", "path="+path), Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
		if d.Degraded {
			t.Fatalf("degraded: %+v", d.Results)
		}
		return &d
	}
	if r := check("/capped"); !r.Allowed || r.Results[0].Remaining != 4 || r.Delay != 0 {
		t.Fatalf("first: allowed %v daily remaining %d delay %v", r.Allowed, r.Results[0].Remaining, r.Delay)
	}
	// per-ip refuses: daily and queue (another slot) passed and are refunded.
	if r := check("/capped"); r.Allowed || r.Results[0].Remaining != 4 || r.Delay != 0 {
		t.Fatalf("second: allowed %v daily remaining %d delay %v, want refused with daily refunded", r.Allowed, r.Results[0].Remaining, r.Delay)
	}
	// Without per-ip: daily has 4 left before this one, and queue's one reservation is the
	// first request's, so this one waits about a minute, not two.
	r := check("/free")
	if !r.Allowed || r.Results[0].Remaining != 3 || r.Delay > time.Minute || r.Delay < 50*time.Second {
		t.Fatalf("third: allowed %v daily remaining %d delay %v, want 3 left and a wait of about 1m", r.Allowed, r.Results[0].Remaining, r.Delay)
	}
}

// An inline limit in hybrid or global mode that Redis does not answer for is decided as
// a rule with on_store_failure: local: from a local bucket of its limit divided among
// the live daemons. It got the whole limit: with 6 daemons live, each admitted all 12
// of an inline 12 an hour while a master was frozen (found by a cluster audit), where
// a rule of the same limit admitted 2.
func TestInlineFallbackSharesTheLimit(t *testing.T) {
	// Nothing listens there: every call fails at once.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1, DialerRetryTimeout: time.Millisecond})
	t.Cleanup(func() { rdb.Close() })
	h := rlsync.NewHybrid(rdb, rlsync.HybridOptions{})
	l := New(mustRules(t, `
rules:
  - name: r
    key: user
    limit: { requests: 12, per: 1h }
    mode: global
    on_store_failure: local
`), localbucket.NewStore(localbucket.Options{})).WithHybrid(h).WithGlobal(rlsync.NewGlobal(rdb), time.Second)
	h.SetReplicas(4)
	for _, mode := range []string{"global", "hybrid"} {
		var d Decision
		var admitted int
		for range 15 {
			in := &Input{Cost: 1, Limits: []Inline{{Key: "tenant-" + mode, Limit: 12, WindowMs: 3_600_000, Mode: mode}}}
			if err := l.Check(time.Now().UnixNano(), in, &d); err != nil {
				t.Fatal(err)
			}
			if d.Allowed && d.Degraded { // (a hybrid key's first unit may pass on credit)
				admitted++
			}
		}
		if admitted != 3 {
			t.Errorf("%s inline limit of 12, Redis away, 4 daemons live: this one admitted %d by its fallback, want 3 (its share)", mode, admitted)
		}
		if mode == "hybrid" {
			continue
		}
		// A global rule of the same limit: the same share.
		admitted = 0
		for range 15 {
			if err := l.Check(time.Now().UnixNano(), &Input{Attrs: attrs("user=u-" + mode), Cost: 1}, &d); err != nil {
				t.Fatal(err)
			}
			if d.Allowed {
				admitted++
			}
		}
		if admitted != 3 {
			t.Errorf("%s: the rule admitted %d, want 3", mode, admitted)
		}
	}
}

// annChecker returns a check of one request of user=ann through a limiter at a time
// given, which fails the test unless Redis decided it on one rule, and returns that
// rule's result (valid until the next check).
func annChecker(t *testing.T) func(l *Limiter, now int64) *Result {
	var d Decision
	return func(l *Limiter, now int64) *Result {
		t.Helper()
		if err := l.Check(now, &Input{Attrs: attrs("user=ann"), Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
		if d.Degraded || len(d.Results) != 1 {
			t.Fatalf("degraded or no result: %+v", d)
		}
		return &d.Results[0]
	}
}
