package limiter

import (
	"fmt"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// leaseModelRules are two local concurrency rules of different leases on one key, the
// second matching one path only: a check of /long takes a lease of two parts.
const leaseModelRules = `
rules:
  - name: short
    key: user
    concurrency: { max: 2, lease: 1s }
  - name: long
    key: user
    match: { path: /long }
    concurrency: { max: 1, lease: 3s }
`

// modelPart is a slot a lease holds in the model: its rule, key and expiry.
type modelPart struct {
	rule, user string
	expires    int64
	freed      bool
}

type modelLease struct {
	token string
	owner uint64
	parts []*modelPart
}

// TestLeasesAgainstAModel runs random checks, renewals (by each rule's lease or a given
// one), releases, connection closes, sweeps and steps of the clock against the local
// leases, and a model that holds each lease's parts with their expiries: a slot is held
// while a part not freed has not expired (expires > now). Every answer must be the
// model's: a check allowed when each of its rules has a slot free, a renewal renewed when
// every part is held (and then each part extended), a release released when any part is
// held, an owner holding a lease when a part of one of its leases is held. It found a renewal of a lease run out answered renewed: true.
func TestLeasesAgainstAModel(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		l := newLimiter(t, leaseModelRules)
		max := map[string]int{"short": 2, "long": 1}
		dur := map[string]int64{"short": int64(time.Second), "long": int64(3 * time.Second)}
		var leases []*modelLease
		now := t0
		held := func(rule, user string) int {
			n := 0
			for _, ml := range leases {
				for _, p := range ml.parts {
					if p.rule == rule && p.user == user && !p.freed && p.expires > now {
						n++
					}
				}
			}
			return n
		}
		for step := rapid.IntRange(1, 60).Draw(rt, "steps"); step > 0; step-- {
			switch rapid.IntRange(0, 7).Draw(rt, "op") {
			case 0, 1: // check
				user := rapid.SampledFrom([]string{"ann", "bob"}).Draw(rt, "user")
				long := rapid.Bool().Draw(rt, "long")
				owner := uint64(rapid.IntRange(1, 3).Draw(rt, "owner"))
				in := &Input{Attrs: attrs("user=" + user), Cost: 1}
				rules := []string{"short"}
				if long {
					in = &Input{Attrs: attrs("user="+user, "path=/long"), Cost: 1}
					rules = append(rules, "long")
				}
				want := true
				for _, r := range rules {
					if held(r, user) >= max[r] {
						want = false
					}
				}
				d := Decision{Owner: owner}
				if err := l.Check(now, in, &d); err != nil {
					rt.Fatal(err)
				}
				if d.Allowed != want {
					rt.Fatalf("check of %s (rules %v) at +%v: allowed %v, model %v", user, rules, time.Duration(now-t0), d.Allowed, want)
				}
				if d.Allowed {
					ml := &modelLease{token: l.Leases().Token(d.Lease), owner: owner}
					for _, r := range rules {
						ml.parts = append(ml.parts, &modelPart{rule: r, user: user, expires: now + dur[r]})
					}
					leases = append(leases, ml)
				}
			case 2: // renew
				if len(leases) == 0 {
					continue
				}
				ml := rapid.SampledFrom(leases).Draw(rt, "lease")
				ms := rapid.SampledFrom([]int64{0, 500, 2000}).Draw(rt, "lease_ms")
				want := true
				for _, p := range ml.parts {
					if p.freed || p.expires <= now {
						want = false
					}
				}
				renewed, in := l.RenewLease(ml.token, time.Duration(ms)*time.Millisecond, now)
				if renewed != want {
					rt.Fatalf("renew (lease_ms %d) at +%v of %s: renewed %v, model %v", ms, time.Duration(now-t0), describe(ml, now), renewed, want)
				}
				if renewed {
					first := int64(-1)
					for _, p := range ml.parts {
						p.expires = now + dur[p.rule]
						if ms > 0 {
							p.expires = now + ms*int64(time.Millisecond)
						}
						if first < 0 || p.expires-now < first {
							first = p.expires - now
						}
					}
					if int64(in) != first {
						rt.Fatalf("renewed for %v, model %v", in, time.Duration(first))
					}
				}
			case 3: // release
				if len(leases) == 0 {
					continue
				}
				ml := rapid.SampledFrom(leases).Draw(rt, "lease")
				want := false
				for _, p := range ml.parts {
					if !p.freed && p.expires > now {
						want = true
					}
					p.freed = true
				}
				if got := l.ReleaseLease(ml.token, now); got != want {
					rt.Fatalf("release at +%v of %s: released %v, model %v", time.Duration(now-t0), describe(ml, now), got, want)
				}
			case 4: // a connection closes
				owner := uint64(rapid.IntRange(1, 3).Draw(rt, "closed"))
				l.ReleaseOwner(owner, now)
				for _, ml := range leases {
					if ml.owner == owner {
						for _, p := range ml.parts {
							p.freed = true
						}
					}
				}
			case 5:
				l.Sweep(now)
			case 6:
				now += int64(rapid.IntRange(1, 2500).Draw(rt, "ms")) * int64(time.Millisecond)
			case 7: // does an owner hold a lease (a connection's idle close asks)
				owner := uint64(rapid.IntRange(1, 3).Draw(rt, "holder"))
				want := false
				for _, ml := range leases {
					for _, p := range ml.parts {
						want = want || ml.owner == owner && !p.freed && p.expires > now
					}
				}
				if got := l.Leases().Holds(owner, now); got != want {
					rt.Fatalf("owner %d holds a lease at +%v: %v, model %v", owner, time.Duration(now-t0), got, want)
				}
			}
		}
	})
}

func describe(ml *modelLease, now int64) string {
	s := "lease"
	for _, p := range ml.parts {
		s += fmt.Sprintf(" [%s/%s expires in %v freed %v]", p.rule, p.user, time.Duration(p.expires-now), p.freed)
	}
	return s
}
