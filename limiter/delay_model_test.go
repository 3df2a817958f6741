package limiter

import (
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"pgregory.net/rapid"
)

// delayModelRules: a token bucket with a delay per user, a fixed window on the IP every
// user shares, and a shadow token bucket with a delay per user.
const delayModelRules = `
rules:
  - name: d
    key: user
    limit: { requests: 2, per: 1s, burst: 1 }
    delay: 2s
  - name: w
    key: ip
    algorithm: fixed_window
    limit: { requests: 4, per: 4s }
  - name: s
    key: user
    limit: { requests: 1, per: 1s, burst: 1 }
    delay: 1s
    shadow: true
`

// TestDelayAgainstAModel runs random checks (costs 0 to 2) and steps of the clock
// against the rules above and a model that decides each rule with localbucket's Take
// (TestTakeDelayProperties checks it alone) and composes them as README and PROTOCOL.md
// say: all or nothing (a request a non-shadow rule refuses reserves nothing, a delay
// included); the answer's delay is the longest of the non-shadow rules', a shadow rule's
// delay is in its entry only; a refused answer carries no delay, in any entry.
func TestDelayAgainstAModel(t *testing.T) {
	mk := func(l localbucket.Limit, err error) localbucket.Limit {
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	dl := mk(localbucket.NewLimit(localbucket.TokenBucket, 2, time.Second, 1))
	dl = dl.WithDelay(2 * time.Second)
	wl := mk(localbucket.NewLimit(localbucket.FixedWindow, 4, 4*time.Second, 0))
	sl := mk(localbucket.NewLimit(localbucket.TokenBucket, 1, time.Second, 1))
	sl = sl.WithDelay(time.Second)
	lims := []*localbucket.Limit{&dl, &wl, &sl}
	shadow := []bool{false, false, true}
	rapid.Check(t, func(rt *rapid.T) {
		l := newLimiter(t, delayModelRules)
		states := map[string]localbucket.State{} // by rule and key
		now := t0
		for step := rapid.IntRange(1, 60).Draw(rt, "steps"); step > 0; step-- {
			if rapid.IntRange(0, 2).Draw(rt, "op") == 0 {
				now += rapid.Int64Range(1, int64(3*time.Second)).Draw(rt, "ns")
				continue
			}
			user := rapid.SampledFrom([]string{"ann", "bob"}).Draw(rt, "user")
			cost := rapid.Uint64Range(0, 2).Draw(rt, "cost")
			keys := []string{"d:" + user, "w", "s:" + user}
			var want [3]localbucket.Result
			var next [3]localbucket.State
			allowed := true
			var delay int64
			for i, lim := range lims {
				next[i], want[i] = lim.Take(states[keys[i]], now, cost)
				if !shadow[i] {
					allowed = allowed && want[i].Allowed
					delay = max(delay, want[i].Delay)
				}
			}
			if allowed {
				for i := range keys {
					states[keys[i]] = next[i]
				}
			} else {
				delay = 0
			}
			var d Decision
			if err := l.Check(now, &Input{Attrs: attrs("user="+user, "ip=1.2.3.4"), Cost: cost}, &d); err != nil {
				rt.Fatal(err)
			}
			if d.Allowed != allowed || int64(d.Delay) != delay || len(d.Results) != 3 {
				rt.Fatalf("%s cost %d at +%v: allowed %v delay %v, model %v %v (rules %+v)",
					user, cost, time.Duration(now-t0), d.Allowed, d.Delay, allowed, time.Duration(delay), want)
			}
			for i, r := range d.Results {
				wantDelay := want[i].Delay
				if !allowed || !want[i].Allowed {
					wantDelay = 0
				}
				if int64(r.Delay) != wantDelay || r.Shadow != shadow[i] {
					rt.Fatalf("%s cost %d at +%v: rule %s delay %v shadow %v, model %v", user, cost,
						time.Duration(now-t0), r.Name, r.Delay, r.Shadow, time.Duration(wantDelay))
				}
				if !want[i].Allowed && (r.Allowed || int64(r.RetryAfter) != want[i].RetryAfter) {
					rt.Fatalf("%s cost %d at +%v: rule %s allowed %v retry %v, model refused, retry %v", user, cost,
						time.Duration(now-t0), r.Name, r.Allowed, r.RetryAfter, time.Duration(want[i].RetryAfter))
				}
				if allowed && want[i].Allowed && (!r.Allowed || r.Remaining != want[i].Remaining) {
					rt.Fatalf("%s cost %d at +%v: rule %s allowed %v remaining %d, model allowed, %d", user, cost,
						time.Duration(now-t0), r.Name, r.Allowed, r.Remaining, want[i].Remaining)
				}
			}
		}
	})
}
