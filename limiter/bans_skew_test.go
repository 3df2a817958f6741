package limiter

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestSharedBansClockSkew: three daemons share penalty bans (a rule of 1 per second, so
// that the ban, not the rule's own retry, is what a banned client waits for) on one real Redis (standalone
// and a 3-master Cluster), in global and hybrid mode, their wall clocks 2 minutes behind
// real time, right, and 2 minutes ahead. Refusals counted on two of them reach `after`
// together; the ban (2 s) raised on the one behind, then on the one ahead, is enforced by
// every daemon at once (global) or from its next round (hybrid), for its full length and
// not longer, with the right retry and the right time left in Bans (GET /bans); lifting
// it on another daemon finds it in force and ends it for all. Before, the bans were
// decided on each daemon's clock: a ban raised by the daemon behind had ended 2 minutes
// ago for the others, one raised by the daemon ahead lasted 2 minutes longer for them,
// and Lift on the daemon ahead found no ban in force.
func TestSharedBansClockSkew(t *testing.T) {
	const ban = 2 * time.Second
	// slack is what a daemon's view of Redis's clock may be off by: its offset estimate
	// places Redis's time in the middle of the reply's round trip, so it is off by up to
	// half of it (at most 125 ms once an estimate is known, and unbounded for the first
	// one), and Redis, starved of CPU on a loaded machine, reads its clock late in the
	// round trip. The clocks here are 2 minutes off: a ban decided on a daemon's clock
	// misses by far more.
	const slack = 500 * time.Millisecond
	for _, mode := range []string{"global", "hybrid"} {
		for _, where := range []string{"standalone", "cluster"} {
			t.Run(mode+"/"+where, func(t *testing.T) {
				rdb := redisFor(t, where)
				yaml := fmt.Sprintf(`
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 1s }
    mode: %s
    penalty: { after: 2, within: 1m, ban: %v }
`, mode, ban)
				skews := []time.Duration{-2 * time.Minute, 0, 2 * time.Minute}
				var ls []*Limiter
				for range skews {
					ls = append(ls, sharedLimiter(t, rdb, yaml))
				}
				clock := func(i int) int64 { return time.Now().UnixNano() + int64(skews[i]) }
				round := func(i int) {
					t.Helper()
					if err := ls[i].shared.round(context.Background(), clock(i), true); err != nil {
						t.Fatal(err)
					}
				}
				check := func(i int, client string, cost uint64) Decision {
					t.Helper()
					var d Decision
					if err := ls[i].Check(clock(i), &Input{Attrs: attrs(client), Cost: cost}, &d); err != nil {
						t.Fatal(err)
					}
					if d.Degraded && mode == "global" { // hybrid: a key new here is judged on credit
						t.Fatalf("daemon %d degraded: %+v", i, d.Results)
					}
					return d
				}
				refuse := func(i int, client string) Decision { // one refusal by the rule, on daemon i
					t.Helper()
					for n := 0; ; n++ {
						if n > 50 {
							t.Fatalf("daemon %d never refused %s", i, client)
						}
						if d := check(i, client, 1); !d.Allowed {
							return d
						}
					}
				}
				for i := range ls {
					round(i) // each learns its clock's offset from Redis's
				}
				for _, raiser := range []int{0, 2} { // behind, then ahead
					client := fmt.Sprintf("ip=10.0.0.%d", raiser)
					key := "rl:login:{" + client + "}"
					other := 2 - raiser
					// One refusal on the daemon at the other extreme, one on the raiser: the
					// two add up to after.
					if d := refuse(other, client); d.Banned {
						t.Fatalf("daemon %d: %s banned after one refusal", other, client)
					}
					if mode == "hybrid" {
						round(other)
					}
					start := time.Now()
					refuse(raiser, client)
					round(raiser) // hybrid: sums the refusal, and the ban starts; both: indexes it
					for i := range ls {
						round(i)
					}
					// Every daemon enforces it now, for its whole length less the time since it
					// started (after start), and lists it so.
					for i := range ls {
						d := check(i, client, 0)
						if !d.Banned || d.Results[0].RetryAfter > ban+slack || d.Results[0].RetryAfter < ban-time.Since(start)-slack {
							t.Fatalf("ban raised on daemon %d (clock %v), daemon %d (clock %v): banned %v retry %v, want about %v",
								raiser, skews[raiser], i, skews[i], d.Banned, d.Results[0].RetryAfter, ban)
						}
						bans := ls[i].Bans(clock(i))
						if len(bans) != 1 || bans[0].Key != key || bans[0].Left > ban+slack || bans[0].Left < ban-time.Since(start)-slack {
							t.Fatalf("ban raised on daemon %d (clock %v), daemon %d (clock %v) lists %+v, want %s with about %v left",
								raiser, skews[raiser], i, skews[i], bans, key, ban)
						}
					}
					// The accurate daemon enforces it until its end (by its view of Redis's
					// clock), and not for long after.
					for {
						d := check(1, client, 0)
						at := time.Since(start)
						if !d.Banned {
							if at < ban-slack {
								t.Fatalf("ban raised on daemon %d (clock %v): the accurate daemon let it go %v after its start, before its end (%v)",
									raiser, skews[raiser], at, ban)
							}
							t.Logf("ban of %v raised on daemon %d (clock %v): the accurate daemon let it go %v after its start",
								ban, raiser, skews[raiser], at.Round(time.Millisecond))
							break
						}
						if at > ban+10*time.Second {
							t.Fatalf("ban raised on daemon %d (clock %v): the accurate daemon still enforces it %v after its start, a %v ban",
								raiser, skews[raiser], at, ban)
						}
						time.Sleep(20 * time.Millisecond)
					}
				}
				// Lift: raised on the daemon behind, lifted on the one ahead, which finds it
				// in force; then no daemon enforces it.
				const client = "ip=10.0.0.9"
				refuse(2, client)
				if mode == "hybrid" {
					round(2)
				}
				refuse(0, client)
				round(0)
				for i := range ls {
					round(i)
				}
				if d := check(1, client, 0); !d.Banned {
					t.Fatal("the accurate daemon does not enforce the ban to lift")
				}
				if lifted, err := ls[2].LiftBanErr("rl:login:{"+client+"}", clock(2)); err != nil || !lifted {
					t.Fatalf("the daemon ahead lifting the ban raised by the one behind: %v %v, want lifted", lifted, err)
				}
				for i := range ls {
					round(i)
					if d := check(i, client, 0); d.Banned {
						t.Fatalf("daemon %d (clock %v) enforces the lifted ban", i, skews[i])
					}
					if bans := ls[i].Bans(clock(i)); len(bans) != 0 && strings.Contains(bans[0].Key, client) {
						t.Fatalf("daemon %d (clock %v) lists the lifted ban: %+v", i, skews[i], bans)
					}
				}
			})
		}
	}
}
