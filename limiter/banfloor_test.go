package limiter

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestBanLastsAsLongAsItsRefusal: a penalty whose ban (20s) is shorter than its rule's
// retry (2 per minute, token bucket: 30s after a refusal) bans for the retry, so that a
// banned answer's retry_after_ms is never shorter than when the rule would admit: a
// client obeying it then passes instead of meeting the rule's refusal, which would count
// toward the next, longer ban. The answer that starts the ban says banned with that same
// time; the next ban's length still grows from the configured one (20s × 2 = 40s, now
// longer than the retry). In local mode, and in global mode on a standalone Redis and a
// 3-master Cluster (ban.lua). The bans are on the injected clock (global: Redis's clock
// moved with it, Bans.Shift), but a global rule's bucket is on Redis's real one: there,
// only the steps while the bucket stays empty (its first 30 s of real time) are taken.
func TestBanLastsAsLongAsItsRefusal(t *testing.T) {
	yaml := loginRule(2, "1m", "MODE", "after: 1, within: 1m, ban: 20s, factor: 2, max: 5m")
	for _, where := range []string{"local", "global standalone", "global cluster"} {
		t.Run(where, func(t *testing.T) {
			var l *Limiter
			if where == "local" {
				l = newLimiter(t, strings.Replace(yaml, "MODE", "local", 1))
			} else {
				l = sharedLimiter(t, redisFor(t, strings.TrimPrefix(where, "global ")), strings.Replace(yaml, "MODE", "global", 1))
			}
			var d Decision
			sec := int64(time.Second)
			check := func(at int64) *Decision {
				t.Helper()
				shiftBans(time.Duration(at*sec), l)
				if err := l.Check(t0+at*sec, &Input{Attrs: attrs("ip=1.1.1.1"), Cost: 1}, &d); err != nil {
					t.Fatal(err)
				}
				if d.Degraded {
					t.Fatalf("at %ds: degraded %+v", at, d.Results)
				}
				return &d
			}
			for i := range 2 {
				if !check(0).Allowed {
					t.Fatalf("request %d refused", i+1)
				}
			}
			steps := []struct {
				at      int64 // seconds after t0
				allowed bool
				banned  bool
				started bool
				retry   time.Duration
			}{
				{0, false, true, true, 30 * time.Second},  // refused (retry 30s): starts a ban of 30s, not 20s
				{1, false, true, false, 29 * time.Second}, // the ban's remaining time: the rule's too
				{25, false, true, false, 5 * time.Second}, // old code: unbanned at 20s, the rule refused and banned again for 40s
				{30, true, false, false, 0},               // ban over, a token back: obeying the advice passes
				{30, false, true, true, 40 * time.Second}, // the second ban: 20s × 2, longer than the retry (30s)
				{69, false, true, false, 1 * time.Second}, // still that ban
				{70, true, false, false, 0},               // over
			}
			if where != "local" {
				steps = steps[:3]
			}
			for _, s := range steps {
				r := check(s.at)
				res := r.Results[0]
				// Redis's clock runs on between the checks: a global retry may be short of
				// the injected one by what has elapsed (well under a second).
				retryOK := res.RetryAfter == s.retry || where != "local" && res.RetryAfter <= s.retry && res.RetryAfter > s.retry-time.Second
				if r.Allowed != s.allowed || r.Banned != s.banned || res.Banned != s.banned || res.BanStarted != s.started || !retryOK {
					t.Fatalf("at %ds: allowed %v banned %v (entry %v) started %v retry %v; want allowed %v banned %v started %v retry %v",
						s.at, r.Allowed, r.Banned, res.Banned, res.BanStarted, res.RetryAfter, s.allowed, s.banned, s.started, s.retry)
				}
			}
		})
	}
}

// TestHybridBanLastsAsLongAsItsRefusal: in hybrid mode a batch of refusals that starts a
// ban (at the next interval) bans until the rule would admit the latest of them again:
// 1 per hour with a 10s ban bans for about an hour, not 10s.
func TestHybridBanLastsAsLongAsItsRefusal(t *testing.T) {
	yaml := loginRule(1, "1h", "hybrid", "after: 1, within: 1m, ban: 10s")
	l := sharedLimiter(t, realRedis(t), yaml)
	var d Decision
	for i := 0; ; i++ {
		if i > 50 {
			t.Fatal("never refused")
		}
		if err := l.Check(time.Now().UnixNano(), &Input{Attrs: attrs("ip=1.1.1.1"), Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
		if !d.Allowed {
			break
		}
	}
	if retry := d.Results[0].RetryAfter; retry < 59*time.Minute {
		t.Fatalf("refused with retry %v, want about 1h", retry)
	}
	if err := l.shared.round(context.Background(), time.Now().UnixNano(), true); err != nil {
		t.Fatal(err)
	}
	if err := l.Check(time.Now().UnixNano(), &Input{Attrs: attrs("ip=1.1.1.1"), Cost: 1}, &d); err != nil {
		t.Fatal(err)
	}
	if !d.Banned || d.Results[0].RetryAfter < 59*time.Minute {
		t.Fatalf("after the round: banned %v retry %v; want a ban of about 1h (the rule's retry), not 10s", d.Banned, d.Results[0].RetryAfter)
	}
	bans := l.Bans(time.Now().UnixNano())
	if len(bans) != 1 || bans[0].Left < 59*time.Minute || bans[0].Count != 1 {
		t.Fatalf("bans %+v, want one of about 1h, count 1", bans)
	}
}

// TestCostZeroEarnsNoBan: a cost-0 check only asks (PROTOCOL.md: nothing is stored), so
// its refusal is no refusal for a penalty: any number of them start no ban, and the
// refusals of real requests still do. While banned, a cost-0 check reads the ban. In
// local mode and in global mode (shared bans, on a real Redis).
func TestCostZeroEarnsNoBan(t *testing.T) {
	yaml := loginRule(1, "1h", "MODE", "after: 2, within: 1h, ban: 10m")
	for _, mode := range []string{"local", "global"} {
		t.Run(mode, func(t *testing.T) {
			check := penaltyChecks(t, yaml, mode)
			if !check(1).Allowed {
				t.Fatal("first request refused")
			}
			for i := range 5 {
				if r := check(0); r.Allowed || r.Banned {
					t.Fatalf("cost-0 check %d: allowed %v banned %v, want refused, not banned", i+1, r.Allowed, r.Banned)
				}
			}
			if r := check(1); r.Allowed || r.Banned {
				t.Fatalf("first refusal of a request: banned %v, want not yet (after: 2)", r.Banned)
			}
			if r := check(1); !r.Banned || !r.Results[0].BanStarted {
				t.Fatalf("second refusal: banned %v started %v, want the ban to start", r.Banned, r.Results[0].BanStarted)
			}
			if r := check(0); !r.Banned || r.Results[0].BanStarted {
				t.Fatalf("cost-0 check while banned: banned %v started %v, want the ban read", r.Banned, r.Results[0].BanStarted)
			}
		})
	}
}

// TestImpossibleCostEarnsNoBan: a request whose cost is above the rule's capacity can
// never pass, and its answer says so (reason cost_exceeds_capacity, retry_after_ms 0:
// do not retry). Its refusals are no rate abuse and start no ban; a ban they started
// (found by an audit) made the next answer say both "never" and "banned for 3 s", and
// showed the rule spent when nothing was. A key banned for real refusals still reads
// the ban, and a banned answer is a ban's, not "never".
func TestImpossibleCostEarnsNoBan(t *testing.T) {
	yaml := loginRule(1, "1h", "MODE", "after: 2, within: 1h, ban: 10m")
	for _, mode := range []string{"local", "global"} {
		t.Run(mode, func(t *testing.T) {
			check := penaltyChecks(t, yaml, mode)
			for i := range 5 {
				r := check(2)
				if res := r.Results[0]; r.Allowed || r.Banned || !res.Impossible || res.RetryAfter != 0 {
					t.Fatalf("cost 2 against a capacity of 1, %d: allowed %v banned %v impossible %v retry %v, want never, not banned", i+1, r.Allowed, r.Banned, res.Impossible, res.RetryAfter)
				}
			}
			if r := check(1); !r.Allowed {
				t.Fatalf("cost 1 after the impossible ones: refused (banned %v), want allowed: nothing was consumed", r.Banned)
			}
			check(1)
			if r := check(1); !r.Banned {
				t.Fatal("second real refusal: not banned")
			}
			if r := check(2); !r.Banned || r.Results[0].Impossible || r.Results[0].RetryAfter < 9*time.Minute {
				t.Fatalf("cost 2 while banned: banned %v impossible %v retry %v, want the ban's answer", r.Banned, r.Results[0].Impossible, r.Results[0].RetryAfter)
			}
		})
	}
}

// penaltyChecks returns a check of ip=1.1.1.1 at cost on a limiter of yaml with MODE
// replaced by mode (local; else shared bans on a real Redis), failing the test on an
// error or a degraded decision.
func penaltyChecks(t *testing.T, yaml, mode string) func(cost uint64) *Decision {
	var l *Limiter
	if mode == "local" {
		l = newLimiter(t, strings.Replace(yaml, "MODE", mode, 1))
	} else {
		l = sharedLimiter(t, realRedis(t), strings.Replace(yaml, "MODE", mode, 1))
	}
	var d Decision
	return func(cost uint64) *Decision {
		t.Helper()
		if err := l.Check(t0, &Input{Attrs: attrs("ip=1.1.1.1"), Cost: cost}, &d); err != nil {
			t.Fatal(err)
		}
		if d.Degraded {
			t.Fatalf("degraded: %+v", d.Results)
		}
		return &d
	}
}
