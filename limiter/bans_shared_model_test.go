package limiter

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	rlsync "github.com/rlsidecar/rlsidecar/sync"
	"pgregory.net/rapid"
)

// sharedBanModelFactor is each of the shared bans models' rule sets' penalty factor; 0:
// no penalty.
var sharedBanModelFactor = []float64{2, 3, 0}

// sharedBanModelRules returns the rule set (set, an index of sharedBanModelFactor) the
// shared bans models reload between: a rule of 2 per 40ms of the algorithm alg in mode
// (global or hybrid), with a penalty of that factor (none for 0). Its refusals say retry
// in at most 40ms, less than the shortest ban, so a ban's length is the penalty's alone
// (README: a ban lasts at least until the rule would admit the refused request; that
// bound is tested by BanLastsAsLong).
func sharedBanModelRules(set int, alg, mode string) string {
	penalty := ""
	if f := sharedBanModelFactor[set]; f > 0 {
		penalty = fmt.Sprintf("\n    penalty: { after: 3, within: 120ms, ban: 60ms, factor: %g, max: 150ms }", f)
	}
	return fmt.Sprintf(`
rules:
  - name: r
    key: user
    algorithm: %s
    limit: { requests: 2, per: 40ms }
    mode: %s%s
`, alg, mode, penalty)
}

// The penalty and limit of sharedBanModelRules, in ms, and the models' tolerance on
// Redis's clock (the ms truncation of Redis TIME and of ban.lua's arithmetic, 1ms each).
const (
	sharedBanAfter  = 3
	sharedBanWithin = int64(120)
	sharedBanBan    = int64(60)
	sharedBanMax    = int64(150)
	sharedBanLimit  = 2
	sharedBanTol    = int64(2)
)

// sharedBanModelLimiters starts a real Redis and, for each algorithm (algs), two
// limiters (daemons) sharing it and its bans, on sharedBanModelRules' first set in mode.
func sharedBanModelLimiters(t *testing.T, mode string) (algs []string, ls [][2]*Limiter) {
	_, rdb := realRedisServer(t, 10*time.Second)
	algs = []string{"fixed_window", "sliding_window", "token_bucket"}
	ls = make([][2]*Limiter, len(algs))
	for i, alg := range algs {
		for j := range ls[i] {
			b, err := rlsync.NewBans(rdb, rlsync.DefaultPrefix)
			if err != nil {
				t.Fatal(err)
			}
			ls[i][j] = policyLimiter(t, rdb, sharedBanModelRules(0, alg, mode)).WithSharedBans(b, 5*time.Second)
		}
	}
	return algs, ls
}

// span is a moment of Redis's clock (Unix ms) the model knows only to lie in [lo, hi].
type span struct{ lo, hi int64 }

// msSpan is the span of Redis's clock, in ms, between before and after (Unix ns).
func msSpan(before, after int64) span {
	return span{before/int64(time.Millisecond) - sharedBanTol, (after+int64(time.Millisecond)-1)/int64(time.Millisecond) + sharedBanTol}
}

// sharedModelCheck checks user on one of the daemons, at a cost, both drawn, and returns
// them, the decision, the check's start (Unix ns) and the span of Redis's clock its
// script calls lie in.
func sharedModelCheck(rt *rapid.T, daemons [2]*Limiter, user string) (di int, cost uint64, d Decision, before int64, now span) {
	di = rapid.IntRange(0, 1).Draw(rt, "daemon")
	cost = rapid.SampledFrom([]uint64{0, 1, 1, 1, 1, 1, 2, 3}).Draw(rt, "cost")
	before = time.Now().UnixNano()
	if err := daemons[di].Check(before, &Input{Attrs: attrs("user=" + user), Cost: cost}, &d); err != nil {
		rt.Fatal(err)
	}
	return di, cost, d, before, msSpan(before, time.Now().UnixNano())
}

// sharedModelLift lifts key's ban on one of the daemons, drawn, and returns which; the
// lift must find the ban where the model is sure of one, and the model starts afresh.
func sharedModelLift(rt *rapid.T, daemons [2]*Limiter, key string, k *modelSharedBan) int {
	di := rapid.IntRange(0, 1).Draw(rt, "lifter")
	before := time.Now().UnixNano()
	got, err := daemons[di].LiftBanErr(key, before)
	if err != nil {
		rt.Fatal(err)
	}
	now := msSpan(before, time.Now().UnixNano())
	if k.banned && k.u.lo > now.hi && !got {
		rt.Fatalf("lift on daemon %d found no ban (model %+v, now %v)", di, *k, now)
	}
	*k = modelSharedBan{}
	return di
}

// modelSharedBan is one client's ban hash (ban.lua: u, c, w, r) as the model knows it:
// the times as spans, the counts exactly.
type modelSharedBan struct {
	u        span // the current (or last) ban's end; {0, 0}: never banned
	c        int  // bans since the count last decayed
	w        span // start of the current `within` window of refusals
	r        int  // refusals in it
	banned   bool // u is a ban's end (not never banned)
	unknown  bool // an unobservable outcome split the model: lift to start afresh
	sureBans int  // checks that met a ban the model was sure of (coverage)
}

// TestSharedBansGlobalAgainstAModel runs random checks (costs 0 to 3 against a capacity
// of 2) of one client, spread over two daemons (limiters) sharing a real Redis, with
// waits, lifts (either daemon) and reloads (another factor, the penalty removed and put
// back), against README's penalty semantics in global mode: a ban is enforced at once by
// every daemon; the refusal that reaches `after` within `within` (a fixed window started
// by the first refusal; cost 0, cost above the capacity and banned checks not counted)
// starts a ban of ban × factor^c (at most max; c decays to 0 after max without a ban),
// answered banned with that length; while banned every answer is banned, with retry_after
// the ban's remaining time (never early); a lift ends the ban and forgets the count; a
// reload that removes the penalty stops enforcing bans but leaves them in Redis, enforced
// again once the penalty is back.
//
// Clock and tolerances: the bans run on Redis TIME at ms resolution, read inside the
// script calls, and the test runs on the real clock (it cannot step Redis's). Redis runs
// on this host, so its clock is the test's wall clock; a script call's moment is known
// only to lie between the check's start and end, widened by tol (the ms truncation of
// Redis TIME and of ban.lua's arithmetic, 1ms each). Each time the model tracks is such a
// span, and an outcome is asserted only where every moment of the spans gives the same
// one: a check near a boundary (a ban's end, a window's end, the decay's) may go either
// way, and the model follows the answer, asserting it is one of the possible ones (and
// its retry_after within the spans); where the choice is not visible in the answer (a
// refusal counted in the old window or a new one, below `after` either way) the model
// lifts the ban (which deletes the hash) to start afresh. A slow machine thus widens the
// spans and makes more checks ambiguous, never a wrong assertion. The waits are a few
// milliseconds to a few hundred, and each run of the property stops drawing steps after
// ~300ms of real time, to keep the test under ~15s at rapid's default 100 runs (10-14s
// with four copies running at once on two cores).
func TestSharedBansGlobalAgainstAModel(t *testing.T) {
	const after, within, ban, maxBan, limit, tol = sharedBanAfter, sharedBanWithin, sharedBanBan, sharedBanMax, sharedBanLimit, sharedBanTol
	algs, ls := sharedBanModelLimiters(t, "global")
	var runs atomic.Int64
	var sure, ambiguous, resyncs, started, grown, decays atomic.Int64
	rapid.Check(t, func(rt *rapid.T) {
		ai := rapid.IntRange(0, len(algs)-1).Draw(rt, "algorithm")
		daemons := ls[ai]
		rulesOf := func(set int) string { return sharedBanModelRules(set, algs[ai], "global") }
		set := 0
		for _, l := range daemons {
			l.SetRules(mustRules(t, rulesOf(set)))
		}
		user := fmt.Sprintf("u%d", runs.Add(1)) // a client of its own: Redis is shared by the runs
		key := "rl:r:{user=" + user + "}"
		banFor := func(c int) int64 {
			d := float64(ban)
			for range c {
				d *= sharedBanModelFactor[set]
			}
			return min(int64(d), maxBan)
		}
		k := &modelSharedBan{}
		lift := func(l *Limiter) {
			if _, err := l.LiftBanErr(key, time.Now().UnixNano()); err != nil {
				rt.Fatal(err)
			}
			for _, o := range daemons { // as the next rounds (below)
				if err := o.shared.round(context.Background(), time.Now().UnixNano(), true); err != nil {
					rt.Fatal(err)
				}
			}
			*k = modelSharedBan{}
		}
		begin := time.Now()
		for step := rapid.IntRange(1, 80).Draw(rt, "steps"); step > 0 && time.Since(begin) < 300*time.Millisecond; step-- {
			switch rapid.IntRange(0, 10).Draw(rt, "op") {
			case 0, 1, 2, 3, 4, 5: // a check, on either daemon
				di, cost, d, before, now := sharedModelCheck(rt, daemons, user)
				res := d.Results[0]
				retry := res.RetryAfter.Milliseconds()
				where := fmt.Sprintf("%s check cost %d on daemon %d (rules %d, model %+v, now %v)", algs[ai], cost, di, set, *k, now)
				if d.Degraded {
					k.unknown = true // Redis too slow to answer (a loaded machine): start afresh
					break
				}
				if res.Impossible != (cost > limit && !res.Banned) || d.Allowed != res.Allowed || d.Banned != res.Banned {
					rt.Fatalf("%s: allowed %v banned %v impossible %v, decision allowed %v banned %v", where, res.Allowed, res.Banned, res.Impossible, d.Allowed, d.Banned)
				}
				penalty := sharedBanModelFactor[set] != 0
				if !penalty {
					if res.Banned {
						rt.Fatalf("%s: banned without a penalty", where)
					}
					break
				}
				// The ban read by the check's script call.
				sureBanned := k.banned && k.u.lo > now.hi
				sureFree := !k.banned || k.u.hi <= now.lo
				if sureBanned || sureFree {
					sure.Add(1)
				} else {
					ambiguous.Add(1)
				}
				if sureBanned && !res.Banned {
					rt.Fatalf("%s: not banned, allowed %v retry %v", where, res.Allowed, res.RetryAfter)
				}
				if res.Banned && !res.BanStarted {
					if sureFree {
						rt.Fatalf("%s: banned for %v, the model has no ban in force", where, res.RetryAfter)
					}
					// retry_after is the ban's remaining time, by Redis's clock when read:
					// never early (the client retrying at its end meets no ban), nor late.
					if res.Allowed || retry < k.u.lo-now.hi || retry > k.u.hi-now.lo {
						rt.Fatalf("%s: banned, allowed %v, retry %dms, want between %d and %d", where, res.Allowed, retry, k.u.lo-now.hi, k.u.hi-now.lo)
					}
					if sureBanned {
						k.sureBans++
					}
					break
				}
				// Not banned at the check: the rule decides; its refusals of a cost it can
				// pass are counted.
				if res.Allowed || res.Impossible || cost == 0 {
					if res.Banned || res.BanStarted {
						rt.Fatalf("%s: allowed %v impossible %v, banned %v started %v", where, res.Allowed, res.Impossible, res.Banned, res.BanStarted)
					}
					break
				}
				sureReset := k.r == 0 || now.lo-k.w.hi >= within
				sureKept := k.r != 0 && now.hi-k.w.lo < within
				var reset bool
				switch {
				case sureReset:
					reset = true
				case sureKept:
				case k.r+1 >= after: // visible: the ban starts only in the window kept
					reset = !res.BanStarted
				default:
					reset = true // either; not visible: lift after this check
					k.unknown = true
				}
				if reset {
					k.w, k.r = now, 0
				}
				k.r++
				if k.r < after {
					if res.Banned || res.BanStarted {
						rt.Fatalf("%s: refusal %d of %d banned %v started %v", where, k.r, after, res.Banned, res.BanStarted)
					}
					break
				}
				// This refusal starts a ban, of banFor(c) or, c having decayed, of ban.
				c := k.c
				sureDecay := c > 0 && k.banned && now.lo-k.u.hi >= maxBan
				sureNoDecay := c == 0 || now.hi-k.u.lo < maxBan
				switch {
				case sureDecay:
					c = 0
				case sureNoDecay:
				case retry == banFor(0):
					c = 0
				}
				if c == 0 && k.c > 0 {
					decays.Add(1)
				}
				if !res.Banned || !res.BanStarted || res.Allowed || retry != banFor(c) {
					rt.Fatalf("%s: refusal %d of %d: allowed %v banned %v started %v retry %dms, want a ban of %dms started",
						where, k.r, after, res.Allowed, res.Banned, res.BanStarted, retry, banFor(c))
				}
				started.Add(1)
				if c > 0 {
					grown.Add(1)
				}
				k.c, k.r, k.banned = c+1, 0, true
				k.u = span{now.lo + retry, now.hi + retry}
				// The daemon that started it lists it, with its count, and its time left
				// on the daemon's clock: by the offset to Redis's it measured, which may be
				// off by half the round trip of the call it measured it by, which may be an
				// earlier call than this check (a lift, a round). Redis runs on this host,
				// so the true offset is 0 and the measured one is its error.
				off, _ := daemons[di].shared.b.Offset()
				offMs := (max(off, -off) + int64(time.Millisecond) - 1) / int64(time.Millisecond)
				var found bool
				for _, b := range daemons[di].Bans(time.Now().UnixNano()) {
					if b.Key == key {
						found = true
						if most := retry + now.hi - now.lo + offMs; int(b.Count) != k.c || b.Left > time.Duration(most)*time.Millisecond {
							rt.Fatalf("%s: listed %+v, want count %d and at most %dms left", where, b, k.c, most)
						}
					}
				}
				if !found && time.Now().UnixNano() < before+int64(retry-tol)*int64(time.Millisecond) {
					rt.Fatalf("%s: the ban it started is not listed", where)
				}
			case 6: // wait a while
				ms := rapid.SampledFrom([]int{1, 5, 20, 45}).Draw(rt, "wait")
				time.Sleep(time.Duration(ms) * time.Millisecond)
			case 7, 8: // wait for the ban to end, or for the count to decay
				if !k.banned {
					break
				}
				more := rapid.SampledFrom([]int64{0, 0, 0, maxBan - 2*tol, maxBan + 2*tol}).Draw(rt, "decay")
				time.Sleep(time.Until(time.UnixMilli(k.u.hi + more + 1)))
			case 9: // lift, on either daemon: the ban ends and its count is forgotten
				if sharedBanModelFactor[set] == 0 {
					break // no penalty: the limiter has no shared ban of r to lift
				}
				di := sharedModelLift(rt, daemons, key, k)
				// Lifted: the next check of either daemon finds no ban (its script call
				// reads the ban key). The other daemon's listing drops it at its next
				// round, within one sync interval: run that round here, as RunSharedBans
				// would (until then a ban it starts is listed as the lifted one, the
				// longer: sharedBans.learn keeps the later end).
				if err := daemons[1-di].shared.round(context.Background(), time.Now().UnixNano(), true); err != nil {
					rt.Fatal(err)
				}
			case 10: // reload both daemons
				set = rapid.IntRange(0, len(sharedBanModelFactor)-1).Draw(rt, "rules")
				for _, l := range daemons {
					l.SetRules(mustRules(t, rulesOf(set)))
				}
			}
			if k.unknown {
				resyncs.Add(1)
				if sharedBanModelFactor[set] == 0 {
					set = 0
					for _, l := range daemons {
						l.SetRules(mustRules(t, rulesOf(set)))
					}
				}
				lift(daemons[0])
			}
		}
	})
	t.Logf("checks: ban read sure %d, near a boundary %d; bans started %d (longer than the first %d, after a decay %d); model restarts %d",
		sure.Load(), ambiguous.Load(), started.Load(), grown.Load(), decays.Load(), resyncs.Load())
}

// TestSharedBansHybridAgainstAModel is TestSharedBansGlobalAgainstAModel's model in
// hybrid mode, where README bounds a ban by one sync interval: each daemon's refusals
// wait for its next round (sharedBans.round, run here as RunSharedBans would at each
// interval), which adds them to Redis at once (ban.lua's n: a batch that reaches `after`
// starts the ban, its excess not counted) and then reads the bans in force; a check is
// banned by what its daemon learned at its last round; a lift ends the ban in Redis and
// on the lifting daemon, and on the other at its next round. The clock's tolerances are
// the global test's, plus, for a banned answer's retry_after, the time the round that
// measured the daemon's offset to Redis's clock took. Where the model cannot tell an
// outcome at a round (near a window's, a ban's or the decay's boundary), it starts
// afresh: every daemon's round, a lift, the rounds again.
func TestSharedBansHybridAgainstAModel(t *testing.T) {
	const after, within, ban, maxBan, limit, tol = sharedBanAfter, sharedBanWithin, sharedBanBan, sharedBanMax, sharedBanLimit, sharedBanTol
	algs, ls := sharedBanModelLimiters(t, "hybrid")
	banFor := func(c int) int64 {
		d := float64(ban)
		for range c {
			d *= 2
		}
		return min(int64(d), maxBan)
	}
	type known struct {
		u      span // the ban's end; banned false: none known
		banned bool
		off    int64 // how far off the daemon's measured offset to Redis's clock may be, ms
	}
	var runs, started, bannedSure, restarts atomic.Int64
	rapid.Check(t, func(rt *rapid.T) {
		ai := rapid.IntRange(0, len(algs)-1).Draw(rt, "algorithm")
		daemons := ls[ai]
		user := fmt.Sprintf("h%d", runs.Add(1))
		key := "rl:r:{user=" + user + "}"
		k := &modelSharedBan{}
		var pending [2]int
		// admit is, per daemon, when the rule would admit the pending refusals again (the
		// latest): a ban they start lasts at least until then (README: in hybrid mode the
		// bound is the latest of the batch). A hybrid rule's refusal may say retry later
		// than its window (its allowance from Redis spent), so unlike the global test's,
		// this bound is met.
		var admit [2]span
		var kn [2]known
		// round runs daemon i's round: its pending refusals added to Redis, then the bans
		// in force read. It reports false where the model cannot tell the outcome.
		round := func(i int) bool {
			before := time.Now().UnixNano()
			if err := daemons[i].shared.round(context.Background(), before, true); err != nil {
				rt.Fatal(err)
			}
			now := msSpan(before, time.Now().UnixNano())
			sure := true
			if n := pending[i]; n > 0 {
				pending[i] = 0
				adm := admit[i]
				admit[i] = span{}
				switch {
				case k.banned && k.u.lo > now.hi: // in force: not counted
				case k.banned && k.u.hi > now.lo:
					sure = false
				default:
					switch {
					case k.r == 0 || now.lo-k.w.hi >= within:
						k.w, k.r = now, 0
					case now.hi-k.w.lo < within:
					default:
						sure = false
					}
					k.r += n
					if sure && k.r >= after {
						switch {
						case k.c > 0 && now.lo-k.u.hi >= maxBan:
							k.c = 0
						case k.c == 0 || now.hi-k.u.lo < maxBan:
						default:
							sure = false
						}
						d := banFor(k.c)
						k.u, k.banned, k.r = span{max(now.lo+d, adm.lo), max(now.hi+d, adm.hi)}, true, 0
						k.c++
						started.Add(1)
					}
				}
			}
			if !sure {
				return false
			}
			kn[i] = known{u: k.u, banned: k.banned, off: now.hi - now.lo}
			if k.banned && k.u.lo > now.hi+tol { // surely in force: listed, with its count
				var found bool
				for _, b := range daemons[i].Bans(time.Now().UnixNano()) {
					if b.Key == key {
						found = int(b.Count) == k.c
					}
				}
				if !found {
					rt.Fatalf("daemon %d after its round lists %+v, want %s with count %d (model %+v)", i, daemons[i].Bans(time.Now().UnixNano()), key, k.c, *k)
				}
			}
			return true
		}
		restart := func() {
			restarts.Add(1)
			round(0)
			round(1)
			if _, err := daemons[0].LiftBanErr(key, time.Now().UnixNano()); err != nil {
				rt.Fatal(err)
			}
			*k = modelSharedBan{}
			round(0)
			round(1)
		}
		restart() // the daemons' earlier runs' state (their known bans of other clients) aside
		restarts.Add(-1)
		begin := time.Now()
		for step := rapid.IntRange(1, 80).Draw(rt, "steps"); step > 0 && time.Since(begin) < 300*time.Millisecond; step-- {
			switch rapid.IntRange(0, 9).Draw(rt, "op") {
			case 0, 1, 2, 3, 4:
				di, cost, d, _, now := sharedModelCheck(rt, daemons, user)
				res := d.Results[0]
				retry := res.RetryAfter.Milliseconds()
				kd := kn[di]
				where := fmt.Sprintf("%s check cost %d on daemon %d (model %+v, knows %+v, now %v)", algs[ai], cost, di, *k, kd, now)
				if res.BanStarted {
					rt.Fatalf("%s: a hybrid answer says it started a ban", where)
				}
				sureBanned := kd.banned && kd.u.lo > now.hi+kd.off
				sureFree := !kd.banned || kd.u.hi+kd.off <= now.lo
				if sureBanned && !res.Banned || sureFree && res.Banned {
					rt.Fatalf("%s: banned %v allowed %v retry %v", where, res.Banned, res.Allowed, res.RetryAfter)
				}
				if res.Banned {
					if sureBanned {
						bannedSure.Add(1)
					}
					if res.Allowed || retry < kd.u.lo-now.hi-kd.off || retry > kd.u.hi-now.lo+kd.off {
						rt.Fatalf("%s: banned, allowed %v, retry %dms, want between %d and %d", where, res.Allowed, retry, kd.u.lo-now.hi-kd.off, kd.u.hi-now.lo+kd.off)
					}
					break
				}
				if res.Impossible != (cost > limit) {
					rt.Fatalf("%s: impossible %v", where, res.Impossible)
				}
				if !res.Allowed && !res.Impossible && cost != 0 {
					pending[di]++
					admit[di] = span{max(admit[di].lo, now.lo+retry), max(admit[di].hi, now.hi+retry+1)}
				}
			case 5, 6: // daemon i's sync interval ends
				if !round(rapid.IntRange(0, 1).Draw(rt, "round")) {
					restart()
				}
			case 7:
				ms := rapid.SampledFrom([]int{1, 5, 20, 45}).Draw(rt, "wait")
				time.Sleep(time.Duration(ms) * time.Millisecond)
			case 8:
				if k.banned {
					more := rapid.SampledFrom([]int64{0, 0, maxBan + 2*tol}).Draw(rt, "decay")
					time.Sleep(time.Until(time.UnixMilli(k.u.hi + more + 1)))
				}
			case 9: // lift on daemon i: gone from Redis and from i; the other learns at its round
				di := sharedModelLift(rt, daemons, key, k)
				kn[di] = known{}
			}
		}
	})
	t.Logf("bans started %d, checks banned for sure %d, model restarts %d", started.Load(), bannedSure.Load(), restarts.Load())
}
