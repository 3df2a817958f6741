package limiter

import (
	"context"
	"testing"
	"time"
)

// A reload moving a penalty rule between local and a shared mode does not carry its bans
// across (README, "Policies"): the bans /bans lists (Bans) and rlsidecar_banned_keys
// counts (BannedKeys) are those the active rules enforce, the table of the rule's mode.
// Before, a daemon whose rule went from hybrid to local listed and counted the shared
// ban, which no check refused; and back in hybrid, it listed the local ban beside the
// shared one.
func TestBansListedAreTheModes(t *testing.T) {
	l := sharedLimiter(t, realRedis(t), loginRule(1, "1h", "hybrid", "after: 1, within: 1m, ban: 10m"))
	check := ipChecker(t, l, "ip=1.1.1.1")
	round := func() {
		t.Helper()
		if err := l.shared.round(context.Background(), time.Now().UnixNano(), true); err != nil {
			t.Fatal(err)
		}
	}
	listed := func(want string) {
		t.Helper()
		now := time.Now().UnixNano()
		bans, n := l.Bans(now), l.BannedKeys(now)["login"]
		if len(bans) != 1 || bans[0].Key != want || n != 1 {
			t.Fatalf("Bans %+v, BannedKeys %d; want the one ban %s, the one the rule enforces", bans, n, want)
		}
	}
	refuse(t, check, 1)
	round()
	if r := check(); !r.Banned {
		t.Fatalf("hybrid: not banned after its refusal and a round: %+v", r)
	}
	listed("rl:login:{ip=1.1.1.1}")

	l.SetRules(mustRules(t, loginRule(1, "1h", "local", "after: 1, within: 1m, ban: 10m")))
	round()
	if r := check(); r.Banned {
		t.Fatal("local: the shared ban is enforced (the ban tables are the mode's)")
	}
	refuse(t, check, 1) // the local ban
	if r := check(); !r.Banned {
		t.Fatalf("local: not banned: %+v", r)
	}
	listed("login:{ip=1.1.1.1}")

	l.SetRules(mustRules(t, loginRule(1, "1h", "hybrid", "after: 1, within: 1m, ban: 10m")))
	round()
	if r := check(); !r.Banned {
		t.Fatal("hybrid again: the shared ban, still in Redis, is not enforced")
	}
	listed("rl:login:{ip=1.1.1.1}")
}
