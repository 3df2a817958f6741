package limiter

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"pgregory.net/rapid"
)

// banModelFactor is each of the bans model's rule sets' penalty factor; 0: no penalty.
var banModelFactor = []float64{2, 3, 0}

// banModelRules returns the rule set the bans model reloads to (set, an index of
// banModelFactor): the same limit of 2 per 4s, of the algorithm alg, with a penalty of
// that factor (none for 0); each with a rule of 3 per 4s, without a penalty, on the IP
// every user shares, and a shadow rule of 1 per 4s per user whose penalty bans for 30s: a
// shadow rule's bans never refuse (README), so it must change no answer.
func banModelRules(set int, alg string) string {
	penalty := ""
	if f := banModelFactor[set]; f > 0 {
		penalty = fmt.Sprintf("\n    penalty: { after: 3, within: 20s, ban: 3s, factor: %g, max: 10s }", f)
	}
	return fmt.Sprintf(`
rules:
  - name: r
    key: user
    algorithm: %s
    limit: { requests: 2, per: 4s }%s
  - name: ip
    key: ip
    algorithm: fixed_window
    limit: { requests: 3, per: 4s }
  - name: sh
    key: user
    algorithm: fixed_window
    limit: { requests: 1, per: 4s }
    penalty: { after: 2, within: 20s, ban: 30s }
    shadow: true
`, alg, penalty)
}

// modelBanKey is one key's state in the bans model: its bucket, and its penalty record
// as README's "penalty" paragraph defines it.
type modelBanKey struct {
	st       localbucket.State // the rule's bucket (localbucket's Take decides it)
	within   int64             // start of the current `within` window of refusals
	refusals int               // in it; 0: no window
	bans     int               // bans since the count last decayed
	until    int64             // the current (or last) ban ends; 0: never banned
}

// TestBansAgainstAModel runs random checks (costs 0 to 3 against a capacity of 2),
// lifts (the admin endpoint's DELETE), sweeps, reloads (changing the factor, removing
// the penalty, putting it back) and steps of the clock against a local penalty rule (a
// fixed window, sliding window or token bucket) and a model: the rule decided by
// localbucket's Take (TestTakeProperties checks it alone), the penalty as README states
// it: a key the rule refuses `after` times within `within` (a fixed window started by
// its first refusal; cost-0 checks and costs above the capacity not counted) is banned
// for ban × factor^n (n: its earlier bans since the count decayed, at most max), the
// count decaying after max without a ban; a ban lasts at least until the rule would
// admit the refused request; while banned every check is refused with the ban's
// remaining time and takes nothing; a reload that removes the penalty ends and forgets
// the bans. Every answer's allowed, banned and retry_after, and the listing of bans,
// must be the model's.
func TestBansAgainstAModel(t *testing.T) {
	const (
		after   = 3
		within  = int64(20 * time.Second)
		ban     = int64(3 * time.Second)
		maxBan  = int64(10 * time.Second)
		window  = int64(4 * time.Second)
		limit   = 2 // the rule's requests per window, its capacity
		ipLimit = 3
	)
	rapid.Check(t, func(rt *rapid.T) {
		alg := rapid.SampledFrom([]localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow, localbucket.TokenBucket}).Draw(rt, "algorithm")
		algName := map[localbucket.Algorithm]string{localbucket.FixedWindow: "fixed_window", localbucket.SlidingWindow: "sliding_window", localbucket.TokenBucket: "token_bucket"}[alg]
		rlim, err := localbucket.NewLimit(alg, limit, time.Duration(window), 0)
		if err != nil {
			rt.Fatal(err)
		}
		rules := func(set int) string { return banModelRules(set, algName) }
		set := 0
		l := newLimiter(t, rules(set))
		keys := map[string]*modelBanKey{}
		var ipStart, ipCount int64 // the ip rule's window
		now := t0
		banFor := func(n int) int64 {
			d := float64(ban)
			for range n {
				d *= banModelFactor[set]
			}
			return min(int64(d), maxBan)
		}
		for step := rapid.IntRange(1, 80).Draw(rt, "steps"); step > 0; step-- {
			switch rapid.IntRange(0, 8).Draw(rt, "op") {
			case 0, 1, 2, 3: // check
				user := rapid.SampledFrom([]string{"ann", "bob"}).Draw(rt, "user")
				cost := rapid.SampledFrom([]uint64{0, 1, 1, 1, 2, 3}).Draw(rt, "cost")
				k := keys[user]
				if k == nil {
					k = &modelBanKey{}
					keys[user] = k
				}
				var wantAllowed, wantBanned, wantStarted, ipAllowed bool
				var wantRetry, ipRetry int64
				start := now - now%window
				if ipStart != start {
					ipStart, ipCount = start, 0
				}
				if ipAllowed = int64(max(cost, 1)) <= ipLimit-ipCount; !ipAllowed && cost <= ipLimit {
					ipRetry = start + window - now
				}
				next, res := rlim.Take(k.st, now, cost)
				switch {
				case banModelFactor[set] != 0 && k.until > now:
					wantBanned, wantRetry = true, k.until-now
				case res.Impossible:
					// never passes: not counted
				case res.Allowed:
					wantAllowed = true
					if ipAllowed { // all or nothing
						k.st = next
						ipCount += int64(cost)
					}
				default:
					wantRetry = res.RetryAfter
					if banModelFactor[set] == 0 || cost == 0 {
						break
					}
					if k.refusals == 0 || now-k.within >= within {
						k.within, k.refusals = now, 0
					}
					k.refusals++
					if k.refusals < after {
						break
					}
					if k.bans > 0 && now-k.until >= maxBan {
						k.bans = 0
					}
					k.until = max(now+banFor(k.bans), now+wantRetry)
					k.bans++
					k.refusals = 0
					wantBanned, wantStarted, wantRetry = true, true, k.until-now
				}
				var d Decision
				if err := l.Check(now, &Input{Attrs: attrs("user="+user, "ip=1.2.3.4"), Cost: cost}, &d); err != nil {
					rt.Fatal(err)
				}
				r, ip := d.Results[0], d.Results[1]
				if !wantBanned && (ip.Allowed != ipAllowed || int64(ip.RetryAfter) != ipRetry) {
					rt.Fatalf("check of %s cost %d at +%v (rules %d): ip rule allowed %v retry %v, model %v %v",
						user, cost, time.Duration(now-t0), set, ip.Allowed, ip.RetryAfter, ipAllowed, time.Duration(ipRetry))
				}
				// The answer is banned when r decides it: the ip rule does not refuse for
				// longer (PROTOCOL.md: the deciding rule; ties to the first, r). While r
				// bans, the ip rule's figures may or may not have been read: its own.
				ipLonger := !ip.Allowed && (ip.Impossible || ip.RetryAfter > r.RetryAfter)
				if len(d.Results) != 3 || d.Deciding == 2 {
					rt.Fatalf("%d results, deciding %d: the shadow rule decides", len(d.Results), d.Deciding)
				}
				if d.Allowed != (wantAllowed && ipAllowed) || r.Allowed != wantAllowed || d.Banned != (wantBanned && !ipLonger) || r.Banned != wantBanned || r.BanStarted != wantStarted || int64(r.RetryAfter) != wantRetry {
					rt.Fatalf("check of %s cost %d at +%v (rules %d): allowed %v banned %v started %v retry %v, model %v %v %v %v",
						user, cost, time.Duration(now-t0), set, d.Allowed, d.Banned, r.BanStarted, r.RetryAfter,
						wantAllowed, wantBanned, wantStarted, time.Duration(wantRetry))
				}
			case 4:
				l.Sweep(now)
			case 5: // reload
				set = rapid.IntRange(0, len(banModelFactor)-1).Draw(rt, "rules")
				l.SetRules(mustRules(t, rules(set)))
				if banModelFactor[set] == 0 {
					for _, k := range keys {
						k.within, k.refusals, k.bans, k.until = 0, 0, 0, 0
					}
				}
			case 6:
				now += int64(rapid.IntRange(1, 6000).Draw(rt, "ms")) * int64(time.Millisecond)
			case 7:
				now += int64(rapid.IntRange(1, 30).Draw(rt, "s")) * int64(time.Second)
			case 8: // DELETE /bans/r/user=…: ends the ban, forgets the refusals and bans
				user := rapid.SampledFrom([]string{"ann", "bob"}).Draw(rt, "lift")
				want := false
				if k := keys[user]; k != nil {
					want = k.until > now
					k.within, k.refusals, k.bans, k.until = 0, 0, 0, 0
				}
				if got := l.LiftBan("r:{user="+user+"}", now); got != want {
					rt.Fatalf("lift of %s at +%v: %v, model %v", user, time.Duration(now-t0), got, want)
				}
			}
			// The listing: the bans in force, their time left and count.
			listed := map[string]Ban{}
			for _, b := range l.Bans(now) {
				if b.Rule == "r" { // not the shadow rule's
					listed[b.Key] = b
				}
			}
			for user, k := range keys {
				b, ok := listed["r:{user="+user+"}"]
				want := banModelFactor[set] != 0 && k.until > now
				if ok != want || ok && (int64(b.Left) != k.until-now || int(b.Count) != k.bans) {
					rt.Fatalf("at +%v (rules %d) %s listed %v %+v, model banned %v for %v, count %d",
						time.Duration(now-t0), set, user, ok, b, want, time.Duration(k.until-now), k.bans)
				}
				delete(listed, "r:{user="+user+"}")
			}
			if len(listed) != 0 {
				rt.Fatalf("listed %v", listed)
			}
		}
	})
}
