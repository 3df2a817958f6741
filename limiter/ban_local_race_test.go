package limiter

import (
	"testing"
	"time"
)

// Two checks of one client on one daemon at once (two connections), local mode, a
// penalty of after: 1: both read no ban, both are refused, and the first refusal counted
// starts the ban. The second, counted while that ban is in force, must not count
// (README and ban.lua: refusals while banned do not count): it is answered by the ban in
// force, not a new one. Before, it started a second ban at once: the count went to 2,
// the ban was replaced by one of ban × factor (20s for 10s), and
// rlsidecar_bans_total counted two. The race is run here by counting the second
// refusal (bans.refused) after the first check, as the racing check would.
func TestLocalBanRacingRefusalCountsNone(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: r
    key: user
    limit: { requests: 1, per: 1s }
    penalty: { after: 1, within: 1m, ban: 10s, factor: 2 }
`)
	now := t0
	var d Decision
	for i := range 2 {
		if err := l.Check(now, &Input{Attrs: attrs("user=ann"), Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
		if i == 1 && (d.Allowed || !d.Results[0].BanStarted) {
			t.Fatalf("refusal 1: %+v, want a ban started", d.Results[0])
		}
	}
	bans := l.Bans(now)
	if len(bans) != 1 || bans[0].Count != 1 {
		t.Fatalf("bans %+v, want one, count 1", bans)
	}
	// The racing check's refusal (its answer is the limiter's: banned, started only if
	// bans.refused says so).
	l.bans.refused([]byte(bans[0].Key), l.Rules().Rules[0], now+int64(time.Millisecond), 0)
	if got := l.Bans(now); len(got) != 1 || got[0].Count != 1 || got[0].Left != 10*time.Second {
		t.Fatalf("bans after the racing refusal %+v, want the first: count 1, 10s left", got)
	}
	// The next check is answered by that ban, with its 10s.
	if err := l.Check(now+int64(2*time.Millisecond), &Input{Attrs: attrs("user=ann"), Cost: 1}, &d); err != nil {
		t.Fatal(err)
	}
	if r := d.Results[0]; !r.Banned || r.BanStarted || r.RetryAfter != 10*time.Second-2*time.Millisecond {
		t.Fatalf("the next check: %+v, want banned by the first ban", r)
	}
}
