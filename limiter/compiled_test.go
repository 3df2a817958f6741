package limiter

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	"pgregory.net/rapid"
)

// referenceInfo derives, per request as matchRules did before ruleInfo existed, what a
// check of r takes from the limiter's configuration: the reference infoOf is compared
// with.
func referenceInfo(l *Limiter, r *rules.Rule, shadowAll bool) (id storeID, redis, fingerprint, shadow bool, bans banScope, fb rules.FailurePolicy, fallbackSplit bool) {
	if r.Concurrency {
		id = storeLease
		if l.ModeOf(r) == rules.ModeGlobal {
			id = storeGlobalLease
		}
	} else {
		id = storeOf(l.resolve(r.Mode))
	}
	if r.Deny {
		id = storeLocal
	}
	if id == storeHybrid && l.hybridAsGlobal(r) {
		id = storeGlobal
	}
	redis = id == storeHybrid || id == storeGlobal || id == storeGlobalLease
	fingerprint = redis && id != storeGlobalLease
	if redis {
		fb = r.OnStoreFailure
		fallbackSplit = l.hybrid != nil
	}
	shadow = r.Shadow || shadowAll
	if redis && r.Penalty != nil && l.shared != nil {
		bans = bansHybrid
		if id == storeGlobal {
			bans = bansGlobal
		}
	}
	return
}

// compiledRules covers every branch of infoOf: each mode named and not, concurrency in
// each mode, deny, penalty, split (fixed and auto), plans, calendar windows and delay
// (hybrid decided globally), shadow, warn_at and unlimited.
const compiledRules = `
rules:
  - name: plain
    key: ip
    limit: { requests: 5, per: 1s }
  - name: local
    key: ip
    mode: local
    limit: { requests: 5, per: 1s }
  - name: hybrid
    key: ip
    mode: hybrid
    on_store_failure: closed
    limit: { requests: 5, per: 1s }
    penalty: { after: 2, within: 1m, ban: 5s }
  - name: global
    key: ip
    mode: global
    on_store_failure: open
    limit: { requests: 5, per: 1s }
    penalty: { after: 2, within: 1m, ban: 5s }
  - name: daily
    key: user
    mode: hybrid
    limit: { requests: 100, per: day }
  - name: queued
    key: user
    limit: { requests: 2, per: 1s }
    delay: 1s
  - name: pool
    key: user
    concurrency: { max: 2, lease: 1s }
  - name: gpool
    key: user
    mode: global
    concurrency: { max: 2, lease: 1s }
  - name: closed
    key: ip
    limit: deny
  - name: split
    key: user
    limit: { requests: 8, per: 1s }
    split: 2
  - name: plans
    key: user
    limit: { requests: 3, per: 10s }
    plans: { partner: 6, internal: unlimited }
    shadow: true
    warn_at: 0.5
  - name: open
    key: user
    limit: unlimited
`

// TestInfoMatchesReference: the rule data compiled once per set and configuration are
// what the per-request derivation gives, for every rule, with and without Redis (hybrid,
// global, shared bans) and with shadowAll on and off.
func TestInfoMatchesReference(t *testing.T) {
	set := mustRules(t, compiledRules)
	type config struct {
		name                   string
		hybrid, global, shared bool
	}
	for _, cfg := range []config{
		{name: "local"},
		{name: "hybrid", hybrid: true},
		{name: "global", global: true},
		{name: "hybrid+global", hybrid: true, global: true},
		{name: "hybrid+global+shared", hybrid: true, global: true, shared: true},
	} {
		for _, shadowAll := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/shadowAll=%v", cfg.name, shadowAll), func(t *testing.T) {
				l := New(set, localbucket.NewStore(localbucket.Options{}))
				// Stand-ins: infoOf only asks whether a store is there.
				if cfg.hybrid {
					l.hybrid = &hybridStore{}
					l.stores[storeHybrid] = l.hybrid
					l.defaultMode = rules.ModeHybrid
				}
				if cfg.global {
					l.global = &globalLeaseStore{}
					l.stores[storeGlobal] = globalStore{}
					l.stores[storeGlobalLease] = l.global
				}
				if cfg.shared {
					l.shared = &sharedBans{}
				}
				l.SetShadowAll(shadowAll) // recompiles under this configuration
				c := l.active.Load()
				for _, r := range set.Rules {
					in := &c.rules[r.Index]
					if in.rule != r {
						t.Fatalf("%s: compiled for %v", r.Name, in.rule)
					}
					id, redis, fp, shadow, bans, fb, fbSplit := referenceInfo(l, r, shadowAll)
					got := fmt.Sprint(in.store, in.flags&infoRedis != 0, in.flags&infoFingerprint != 0, in.flags&infoShadow != 0, in.bans, in.fb, in.flags&infoFallbackSplit != 0)
					want := fmt.Sprint(id, redis, fp, shadow, bans, fb, fbSplit)
					if r.Deny || !redis {
						// fb is read only for Redis ops.
						got = fmt.Sprint(in.store, in.flags&infoRedis != 0, in.flags&infoFingerprint != 0, in.flags&infoShadow != 0, in.bans, in.flags&infoFallbackSplit != 0)
						want = fmt.Sprint(id, redis, fp, shadow, bans, fbSplit)
					}
					if got != want {
						t.Errorf("%s: store redis fingerprint shadow bans fb fallbackSplit = %s, want %s", r.Name, got, want)
					}
					if (in.flags&infoPenalty != 0) != (r.Penalty != nil) || (in.flags&infoWarn != 0) != (r.WarnAt > 0) || (in.flags&infoDeny != 0) != r.Deny {
						t.Errorf("%s: flags %b", r.Name, in.flags)
					}
					switch lim, unlimited := r.LimitFor("", false); {
					case r.Deny:
						if in.lim != &denyLimit {
							t.Errorf("%s: limit %v, want the deny limit", r.Name, in.lim)
						}
					case r.HasPlans() || r.Split > 0 || r.SplitAuto:
						if in.lim != nil || in.flags&infoUnlimited != 0 {
							t.Errorf("%s: limit %v (flags %b), want it derived per request", r.Name, in.lim, in.flags)
						}
					case unlimited:
						if in.lim != nil || in.flags&infoUnlimited == 0 {
							t.Errorf("%s: limit %v (flags %b), want unlimited", r.Name, in.lim, in.flags)
						}
					default:
						if in.lim != lim {
							t.Errorf("%s: limit %p, want the rule's %p", r.Name, in.lim, lim)
						}
					}
				}
			})
		}
	}
}

// TestCompiledFollowsReloads: a limiter whose rule set and shadowAll switch change
// between checks decides each check as a limiter built afresh for the set and switch of
// that moment, sharing the same state (buckets, bans, leases): the compiled rule data
// are never stale.
func TestCompiledFollowsReloads(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		var sets [2]*rules.Set
		for k := range sets {
			picked := rapid.SliceOfNDistinct(rapid.IntRange(0, len(fastPathRules)-1), 1, 5, rapid.ID).Draw(t, fmt.Sprint("rules", k))
			var b strings.Builder
			b.WriteString("rules:\n")
			for _, i := range picked {
				b.WriteString(fastPathRules[i])
			}
			set, err := rules.Parse("fast.yaml", []byte(b.String()))
			if err != nil {
				t.Skip(err) // a rule replacing one not picked
			}
			sets[k] = set
		}
		cur, shadowAll := 0, false
		live := New(sets[0], localbucket.NewStore(localbucket.Options{}))
		refStore := localbucket.NewStore(localbucket.Options{})
		refBans, refLeases := newBans(), newLeases()
		var dl, dr Decision
		now := t0
		for n := rapid.IntRange(1, 40).Draw(t, "n"); n > 0; n-- {
			switch rapid.IntRange(0, 5).Draw(t, "action") {
			case 0:
				cur = 1 - cur
				live.SetRules(sets[cur])
				// A reload ends the bans of rules without a penalty (TestBansOfARemovedPenalty):
				// a change of the shared state, not of the compiled data, made here too.
				refBans.forgetUnpenalized(sets[cur])
			case 1:
				shadowAll = !shadowAll
				live.SetShadowAll(shadowAll)
			}
			now += rapid.Int64Range(0, int64(700*time.Millisecond)).Draw(t, "dt")
			in := Input{Cost: rapid.Uint64Range(0, 3).Draw(t, "cost")}
			in.Attrs = append(in.Attrs,
				rules.Attr{Name: "method", Value: rapid.SampledFrom([]string{"GET", "POST"}).Draw(t, "method")},
				rules.Attr{Name: "path", Value: rapid.SampledFrom([]string{"/v1/events/7/holds", "/login", "/closed", "/pool", "/"}).Draw(t, "path")},
				rules.Attr{Name: "user", Value: rapid.SampledFrom([]string{"ann", "bob"}).Draw(t, "user")},
				rules.Attr{Name: "ip", Value: rapid.SampledFrom([]string{"10.0.0.1", "::1"}).Draw(t, "ip")},
			)
			if plan := rapid.SampledFrom([]string{"", "partner", "internal"}).Draw(t, "plan"); plan != "" {
				in.Attrs = append(in.Attrs, rules.Attr{Name: "plan", Value: plan})
			}
			// The reference: built for this set and switch, on the shared state.
			ref := New(sets[cur], refStore)
			ref.bans, ref.leases = refBans, refLeases
			ref.stores[storeLease] = leaseStore{refLeases}
			ref.shadowAll.Store(shadowAll)
			ref.active.Store(ref.compile(sets[cur], shadowAll)) // not through the setters under test

			el := live.Check(now, &in, &dl)
			er := ref.Check(now, &in, &dr)
			if fmt.Sprint(el) != fmt.Sprint(er) {
				t.Fatalf("errors differ: live %v, reference %v", el, er)
			}
			if got, want := summary(&dl), summary(&dr); got != want {
				t.Fatalf("request %+v at %d (set %d, shadowAll %v):\nlive      %s\nreference %s", in, now, cur, shadowAll, got, want)
			}
		}
	})
}

// A Set assembled by hand, whose rules' Index are not their positions, is decided with
// each rule's data derived per check: the same decision as the parsed set gives.
func TestHandBuiltSet(t *testing.T) {
	parsed := mustRules(t, compiledRules)
	byHand := &rules.Set{Rules: []*rules.Rule{parsed.Rules[9], parsed.Rules[0]}} // split, plain
	a := New(byHand, localbucket.NewStore(localbucket.Options{}))
	b := New(mustRules(t, "rules:\n  - name: split\n    key: user\n    limit: { requests: 8, per: 1s }\n    split: 2\n  - name: plain\n    key: ip\n    limit: { requests: 5, per: 1s }\n"),
		localbucket.NewStore(localbucket.Options{}))
	in := Input{Attrs: attrs("user=ann", "ip=10.0.0.1"), Cost: 1}
	for range 7 {
		var da, db Decision
		if err := a.Check(t0, &in, &da); err != nil {
			t.Fatal(err)
		}
		if err := b.Check(t0, &in, &db); err != nil {
			t.Fatal(err)
		}
		// The rules themselves differ (pointers), their outcome must not.
		for i := range da.Results {
			da.Results[i].Rule, db.Results[i].Rule = nil, nil
		}
		if got, want := summary(&da), summary(&db); got != want {
			t.Fatalf("hand-built set:\n%s\nparsed:\n%s", got, want)
		}
	}
}

// matchRules writes each field of a rule's op in place rather than zeroing it: a field
// added to op must be written there too. This trips when op changes, as a reminder.
func TestOpFieldsWrittenByMatchRules(t *testing.T) {
	var names []string
	ty := reflect.TypeFor[op]()
	for i := range ty.NumField() {
		names = append(names, ty.Field(i).Name)
	}
	want := "key lim cost fb shadow store degraded bans flags bannedUntil shared asked"
	if got := strings.Join(names, " "); got != want {
		t.Fatalf("op's fields are %q, matchRules writes %q: write the new ones there and update this list", got, want)
	}
}
