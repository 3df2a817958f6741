package limiter

import (
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// compiled is the active rule set with, per rule, what matchRules derives from the rule
// and the limiter's configuration alone (not from a request): the store, whether the key
// goes to Redis, shadow, the limit when no plan or split chooses it, the failure policy,
// where its bans live. It is built whenever either changes (SetRules, SetShadowAll,
// WithHybrid, WithGlobal, WithSharedBans) and swapped in whole, so a check reads one
// consistent pair of set and configuration; it is never modified afterwards.
//
// What depends on the moment, not on the configuration (the live daemons a split: auto
// rule divides among, the hybrid fallback's divided limit), is still read per request.
type compiled struct {
	set       *rules.Set
	shadowAll bool
	rules     []ruleInfo // by Rule.Index
}

// ruleInfo is one rule's part of compiled.
type ruleInfo struct {
	rule *rules.Rule // the rule it was derived from (matchRules verifies it: hand-built sets)
	// lim is the rule's limit when it does not depend on the request (no plans, no split,
	// not unlimited); nil: matchRules derives it per request.
	lim   *localbucket.Limit
	fb    rules.FailurePolicy
	store storeID
	bans  banScope
	// flags: infoRedis (the key is a Redis key, prefix first), infoFingerprint (and
	// carries the limit's fingerprint), infoShadow, infoDeny, infoPenalty, infoWarn,
	// infoFallbackSplit (the fallback's local limit is the rule's divided among the live
	// daemons: read per request), infoUnlimited (limits nothing, whatever the plan).
	flags uint16
}

const (
	infoRedis uint16 = 1 << iota
	infoFingerprint
	infoShadow
	infoDeny
	infoPenalty
	infoWarn
	infoFallbackSplit
	infoUnlimited
)

// opFlags are the ruleInfo flags an op carries into Decide (op.flags).
const opFlags = infoDeny | infoPenalty | infoWarn

// compile derives set's compiled form under the limiter's current configuration.
func (l *Limiter) compile(set *rules.Set, shadowAll bool) *compiled {
	c := &compiled{set: set, shadowAll: shadowAll, rules: make([]ruleInfo, len(set.Rules))}
	for i, r := range set.Rules {
		if r.Index == i {
			c.rules[i] = l.infoOf(r, shadowAll)
		}
	}
	return c
}

// infoOf derives r's ruleInfo: the one place that maps a rule and the configuration to
// a store, a key shape and a policy.
func (l *Limiter) infoOf(r *rules.Rule, shadowAll bool) ruleInfo {
	in := ruleInfo{rule: r, fb: r.OnStoreFailure}
	var id storeID
	if r.Concurrency {
		id = storeLease // per daemon, or in Redis (global mode)
		if l.ModeOf(r) == rules.ModeGlobal {
			id = storeGlobalLease
		}
	} else {
		id = storeOf(l.resolve(r.Mode))
	}
	if r.Deny {
		id = storeLocal // decided here: no store is asked
		in.flags |= infoDeny
		in.lim = &denyLimit
	}
	if id == storeHybrid && l.hybridAsGlobal(r) {
		id = storeGlobal
	}
	in.store = id
	redis := id == storeHybrid || id == storeGlobal || id == storeGlobalLease
	if redis {
		in.flags |= infoRedis
		if id != storeGlobalLease {
			in.flags |= infoFingerprint
		}
		if l.hybrid != nil {
			in.flags |= infoFallbackSplit
		}
	}
	if r.Shadow || shadowAll {
		in.flags |= infoShadow
	}
	if r.Penalty != nil {
		in.flags |= infoPenalty
		if redis && l.shared != nil {
			in.bans = bansHybrid
			if id == storeGlobal || id == storeGlobalLease {
				// A global concurrency rule's ban is read in the global store's call
				// with its lease slots (store_global.go), as a global rate rule's.
				in.bans = bansGlobal
			}
		}
	}
	if r.WarnAt > 0 {
		in.flags |= infoWarn
	}
	if !r.Deny && !r.HasPlans() && r.Split == 0 && !r.SplitAuto {
		lim, unlimited := r.LimitFor("", false)
		if unlimited {
			in.flags |= infoUnlimited
		} else {
			in.lim = lim
		}
	}
	return in
}

// recompile rebuilds the compiled set after a change of set or configuration. Writers
// are serialised, so two changes at once cannot leave a compiled form built from the
// older of them.
func (l *Limiter) recompile(set *rules.Set) {
	l.mu.Lock()
	defer l.mu.Unlock()
	old := l.active.Load()
	if set == nil {
		set = old.set
	}
	c := l.compile(set, l.shadowAll.Load())
	if old != nil && l.hybrid != nil {
		// Before the swap: no check of the new set may spend a view from before.
		if names := hybridAgain(old, c); names != nil {
			l.hybrid.forgetViews(l.prefix, names)
		}
	}
	l.active.Store(c)
}

// hybridAgain returns the names of the rules that c decides in hybrid mode and old
// decided in another (global: mode global, or a delay; local), whose hybrid views on
// this daemon are older than what it decided of their keys meanwhile
// (rlsync.Hybrid.ForgetRuleViews).
func hybridAgain(old, c *compiled) map[string]struct{} {
	var other map[string]struct{} // old's rules in another mode
	for i := range old.rules {
		if o := &old.rules[i]; o.rule != nil && o.store != storeHybrid {
			if other == nil {
				other = map[string]struct{}{}
			}
			other[o.rule.Name] = struct{}{}
		}
	}
	var names map[string]struct{}
	for i := range c.rules {
		if in := &c.rules[i]; in.rule != nil && in.store == storeHybrid {
			if _, ok := other[in.rule.Name]; ok {
				if names == nil {
					names = map[string]struct{}{}
				}
				names[in.rule.Name] = struct{}{}
			}
		}
	}
	return names
}
