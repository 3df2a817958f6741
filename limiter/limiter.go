package limiter

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// Limiter decides requests against a rule set, with one store per mode: the local
// buckets always, and when the daemon has Redis the hybrid mode's allowances and the
// global mode's scripts.
type Limiter struct {
	active      atomic.Pointer[compiled] // the rule set and what it means here (compiled.go)
	mu          sync.Mutex               // serialises the writers of active
	buckets     *localbucket.Store
	stores      [numStores]store  // by storeID; nil: the daemon lacks that mode
	hybrid      *hybridStore      // also stores[storeHybrid]; counts the live daemons
	leases      *Leases           // also stores[storeLease]
	global      *globalLeaseStore // also stores[storeGlobalLease]; nil without Redis
	prefix      string            // starts every Redis key
	defaultMode rules.Mode
	shadowAll   atomic.Bool
	bans        *bans       // the penalty rules' refusals and bans (bans.go)
	shared      *sharedBans // the same in hybrid and global mode, in Redis; nil: per daemon (bans_shared.go)
}

// New returns a Limiter deciding with set on store, every rule in local mode, its Redis
// keys (once WithHybrid or WithGlobal) under rlsync.DefaultPrefix.
func New(set *rules.Set, store *localbucket.Store) *Limiter {
	l := &Limiter{buckets: store, defaultMode: rules.ModeLocal, prefix: rlsync.DefaultPrefix, bans: newBans()}
	l.stores[storeLocal] = localStore{store}
	l.leases = newLeases()
	l.stores[storeLease] = leaseStore{l.leases}
	l.recompile(set)
	return l
}

// WithHybrid makes the limiter decide hybrid-mode rules with h, and rules that do not
// name a mode in hybrid mode too: the default when the daemon has Redis. Call it before
// the limiter is used.
func (l *Limiter) WithHybrid(h *rlsync.Hybrid) *Limiter {
	h.SetWall(l.buckets) // windows without a view align on wall time, as the local ones
	l.hybrid = &hybridStore{h}
	l.stores[storeHybrid] = l.hybrid
	l.defaultMode = rules.ModeHybrid
	l.recompile(nil)
	return l
}

// WithGlobal makes the limiter decide global-mode rules with g, waiting at most timeout
// for Redis per check; past it (or on any error) each rule's failure policy decides.
// Concurrency rules in global mode (or hybrid) then hold their slots in Redis too
// (store_lease_global.go).
func (l *Limiter) WithGlobal(g *rlsync.Global, timeout time.Duration) *Limiter {
	l.global = &globalLeaseStore{g: g, wait: timeout, ls: l.leases, lim: l}
	l.stores[storeGlobal] = globalStore{g: g, wait: timeout, wall: l.buckets, leases: l.global}
	l.stores[storeGlobalLease] = l.global
	l.recompile(nil)
	return l
}

// SetRedisPrefix makes every Redis key the limiter builds (rule and inline-limit keys in
// hybrid and global mode) start with prefix instead of rlsync.DefaultPrefix. The daemon's
// other keys take the same prefix through rlsync.HybridOptions. It returns the error of
// rlsync.CheckPrefix and changes nothing on a bad prefix. Call it before the limiter is
// used.
func (l *Limiter) SetRedisPrefix(prefix string) error {
	if err := rlsync.CheckPrefix(prefix); err != nil {
		return err
	}
	l.prefix = prefix
	return nil
}

// RedisPrefix returns the prefix of every Redis key the limiter builds.
func (l *Limiter) RedisPrefix() string { return l.prefix }

// splitAmong is how many daemons a split rule's limit is divided among: its own number,
// or for split: auto the live daemons Redis heartbeats count (1 without Redis).
func (l *Limiter) splitAmong(r *rules.Rule) int {
	if !r.SplitAuto {
		return int(r.Split)
	}
	if l.hybrid == nil {
		return 1
	}
	return l.hybrid.replicas()
}

// resolve turns a rule's mode into the one the limiter can apply: a rule that names none
// takes the default; without the store a mode needs (replay, or a limiter built without
// Redis) it runs locally. serve refuses such rules up front (CheckModes).
func (l *Limiter) resolve(m rules.Mode) rules.Mode {
	if m == rules.ModeDefault {
		m = l.defaultMode
	}
	if m == rules.ModeHybrid && l.stores[storeHybrid] == nil || m == rules.ModeGlobal && l.stores[storeGlobal] == nil {
		return rules.ModeLocal
	}
	return m
}

// SetShadowAll makes every rule, and every inline limit a check carries, a shadow
// (counted and reported, never rejecting) while on: the --shadow switch, for
// dark-launching a whole rule set.
func (l *Limiter) SetShadowAll(on bool) {
	l.mu.Lock()
	l.shadowAll.Store(on)
	l.mu.Unlock()
	l.recompile(nil)
}

// ShadowAll reports whether every rule is forced to shadow.
func (l *Limiter) ShadowAll() bool { return l.shadowAll.Load() }

// ModeOf returns the mode the limiter applies to r. A concurrency rule is local or
// global: hybrid (and the hybrid default, when the daemon has Redis) means global for it.
// A hybrid rule with a calendar window or a delay is global too (hybridAsGlobal).
func (l *Limiter) ModeOf(r *rules.Rule) rules.Mode {
	m := l.resolve(r.Mode)
	if r.Concurrency && m == rules.ModeHybrid {
		m = rules.ModeGlobal
	}
	if r.Concurrency && m == rules.ModeGlobal && l.stores[storeGlobalLease] == nil {
		m = rules.ModeLocal
	}
	if m == rules.ModeHybrid && l.hybridAsGlobal(r) {
		return rules.ModeGlobal
	}
	return m
}

// hybridAsGlobal reports whether r, in hybrid mode, is decided by the global store: a
// calendar window or a delay. The hybrid sync aligns a window to multiples of its length
// and grants tokens ahead of use, so it can express neither a window whose bounds come
// from a time zone nor a reservation that waits.
func (l *Limiter) hybridAsGlobal(r *rules.Rule) bool {
	return l.stores[storeGlobal] != nil && (r.Calendar != localbucket.NoCalendar || r.Delay > 0)
}

// Rules returns the active rule set.
func (l *Limiter) Rules() *rules.Set { return l.active.Load().set }

// SetRules swaps in a new rule set; checks already running finish with the old one.
func (l *Limiter) SetRules(set *rules.Set) {
	l.recompile(set)
	l.bans.forgetUnpenalized(set)
}

// Leases returns the store of the concurrency rules' leases, for releasing and renewing
// them.
func (l *Limiter) Leases() *Leases { return l.leases }

// Store returns the store the limiter decides on.
func (l *Limiter) Store() *localbucket.Store { return l.buckets }

// CheckModes reports an error for the first rule whose mode needs a store the daemon does
// not have. Without Redis every rule runs in local mode; hybrid and global need one.
func CheckModes(set *rules.Set, haveRedis bool) error {
	if haveRedis {
		return nil
	}
	for _, r := range set.Rules {
		if r.SplitAuto {
			return fmt.Errorf("%s:%d: rule %q: split: auto counts the live daemons through Redis, and this daemon has none; give a number", r.File, r.Line, r.Name)
		}
		if r.Mode == rules.ModeHybrid || r.Mode == rules.ModeGlobal {
			return fmt.Errorf("%s:%d: rule %q: mode %s needs a Redis store, and this daemon has none; use mode local or leave mode out",
				r.File, r.Line, r.Name, r.Mode)
		}
	}
	return nil
}

// Inline is a limit carried by the request itself. Zero numeric fields mean absent.
type Inline struct {
	Key       string
	Name      string
	Algorithm string
	Mode      string
	Limit     uint64
	WindowMs  uint64
	Burst     uint64
	// Deny makes the limit refuse every request, as a rule's limit: deny does (no retry
	// can ever pass; the request with it consumes nothing elsewhere, all-or-nothing;
	// nothing is stored; no store is asked), decided here whatever Mode says. It keeps its
	// window: the Result reports Limit and Remaining 0, Window WindowMs, and Reset the
	// time to the end of the current window aligned to the Unix epoch (wall time), as
	// envoyproxy/ratelimit reports an override of requests_per_unit 0. Limit, Burst and
	// Algorithm must be zero. The native protocol cannot set it (its limit 0 is
	// invalid_limit); the Envoy API sets it for such overrides.
	Deny bool
}

// Input is one request: its attributes, its inline limits and its cost.
//
// With Parts, it is several requests decided together, all-or-nothing: Envoy's
// descriptors of one ShouldRateLimit call. The rules are matched against each part's
// attributes and charged the part's cost; a rule that another matched rule replaces (in
// any part) does not apply. Attrs and Cost are then unused; Limits still apply, at Cost.
type Input struct {
	Attrs  []rules.Attr
	Limits []Inline
	Cost   uint64 // 0 asks without consuming
	Parts  []Part
}

// Part is one of an Input's parts. Its inline limits are checked with its cost; when
// NoRules is set, they alone decide it and no rule is matched (an Envoy descriptor's
// limit override).
type Part struct {
	Attrs   []rules.Attr
	Limits  []Inline
	Cost    uint64
	NoRules bool
}

// Result is one matched rule's or inline limit's part of a decision. Durations are in
// nanoseconds.
type Result struct {
	Name       string
	Limit      uint64
	Window     time.Duration
	Remaining  uint64
	Reset      time.Duration
	RetryAfter time.Duration
	Allowed    bool
	Shadow     bool
	// Impossible: the cost exceeds this rule's capacity; no retry can ever pass.
	Impossible bool
	// Degraded: a failure policy decided this check; the store it needs did not answer.
	Degraded bool
	// Warning: the request was allowed and, after it, the rule has used at least its
	// warn_at fraction of its capacity (rules.Rule.WarnThreshold).
	Warning bool
	// Delay is how long the request must be held before it conforms to this rule (a rule
	// with delay); 0 when it passes at once or was refused.
	Delay time.Duration
	// Banned: the key is banned by this rule (its penalty), either already (the check
	// was refused without asking the store) or from this refusal on; RetryAfter is then
	// the ban's remaining time. BanStarted: this refusal started the ban.
	Banned, BanStarted bool
	// Unasked: this rule's store was not asked, because the request was already refused
	// (by a hybrid rule, whose store comes first, a ban or a deny limit) and a Redis
	// round trip is not spent on a refused request: a global rule, or a global
	// concurrency rule that the global rules' call did not decide; or a hybrid rule whose
	// key this daemon does not hold, after such a refusal. It refused nothing, so Allowed
	// is true and RetryAfter 0; Limit and Window are the rule's; Remaining and Reset were
	// not read and are 0 (a statement of nothing: not "none left"). Only on a refused
	// Decision. A rule not asked whose cost is above its capacity is not Unasked: it is
	// reported Impossible, as its store would answer.
	Unasked bool
	// Repeat: an inline limit identical to an earlier one of the request (Decision's
	// dups): this result is a copy of that one's under its own name; it was not decided,
	// nor charged, on its own (metrics count the earlier one only).
	Repeat bool
	// Rule is the rule this result is for; nil for an inline limit.
	Rule *rules.Rule
	// Key is the client key checked; for a hybrid or global check it is the Redis key,
	// prefix included (valid until the next Check with this Decision).
	Key []byte
	// Part is the index in Input.Parts of the part this result is for; 0 without parts.
	Part int
}

// Decision is the answer to one request, and the scratch space that produced it.
// Reuse one per goroutine; the zero value is ready to use.
//
// Example: with rules per-ip (100/s) and per-user (5/min) both matching, and per-user
// having 3 left after this request, Allowed is true and Deciding points at per-user.
type Decision struct {
	Allowed  bool
	Deciding int // index in Results of the deciding rule; -1 when no rule decides
	Degraded bool
	// Warning: allowed, and some non-shadow result warns (Result.Warning).
	Warning bool
	// Delay is how long the caller must hold an allowed request before forwarding it:
	// the longest Delay of the non-shadow results; 0 when refused.
	Delay time.Duration
	// Banned: refused, and the deciding result is Banned.
	Banned  bool
	Results []Result
	// Lease is the id of the lease an allowed check took, holding a slot in each
	// concurrency rule it matched (Leases.Token makes its token); 0 when it took none.
	Lease uint64
	// globalLease is the global lease an allowed check took, holding a slot in each
	// global concurrency rule it matched (Limiter.LeaseToken makes the client's token
	// from it and Lease); nil when it took none.
	globalLease *globalLease
	// Owner is set by the caller before Decide: the connection a lease taken belongs to,
	// so that Leases.ReleaseOwner frees it when that closes. 0: no owner.
	Owner uint64
	// Queued, when set by the caller before Decide, is called once the check's global
	// script call is queued for Redis, where the calls of one key go in the order they
	// are queued (rlsync.WithQueued): the daemon lets the next pipelined check of the key
	// go then. Not called for a check that is not queued so (none, or several calls).
	Queued func()
	// Unlimited lists, in order, the parts (0 without Input.Parts) that matched a rule
	// unlimited for them: such a rule gives no Result.
	Unlimited []int

	ops     []op                // one per result: the check's operations
	routed  uint8               // a bit per store (1<<storeID) some op was routed to
	skipped uint8               // a bit per store apply skipped (an earlier one rejected)
	keys    []byte              // every op's key, back to back
	limits  []localbucket.Limit // the inline limits, parsed (with Redis, then room for their shares)
	// live is the live daemons counted when Prepare built the ops: an inline limit in
	// Redis falls back to its share of them (fallBack).
	live    int
	scratch [numStores]any // each store's own batch types (scratchOf)
	// local is the local store's batch: built by Prepare beside the ops (localReady), in
	// op order, rebuilt by the local store when a failure policy has rerouted ops to it
	// since.
	local      native[localbucket.Op]
	localReady bool
	// flags is the union of the ops' flags (op.flags): infoPenalty, some op's rule has
	// a penalty (bans to check before taking); infoDeny, infoWarn. Decide skips what no
	// op needs.
	flags uint16
	// general makes Decide take its general path for every check: the local batch
	// gathered again, every store asked in turn, bans always checked. Tests set it to
	// compare the fast paths with it.
	general bool
	// matched holds the rules matching the request, from the rule set's index.
	matched  []*rules.Rule
	replaced []bool // by rule index: replaced by a matched rule (only when the set has replaces)
	// noWait: DecideInline is deciding; a hybrid key that would wait on Redis sets
	// wouldWait instead, and nothing is taken.
	noWait, wouldWait bool
	// dups is the inline limits of Input.Limits identical to an earlier one there (the
	// same counter: addInline), in request order: given no op (one limit, charged once), and
	// reported by Decide as a copy of the earlier one's result (expandDups).
	dups []inlineDup
}

// inlineDup is an inline limit decided by an earlier identical one: at is its index in
// the final Results, of the earlier one's (both as Decide reports them), name its own.
type inlineDup struct {
	at, of int
	name   string
}

// DecidingResult returns the deciding rule's result, or nil when nothing decides.
func (d *Decision) DecidingResult() *Result {
	if d.Deciding < 0 {
		return nil
	}
	return &d.Results[d.Deciding]
}

// InvalidLimitError reports an inline limit the limiter cannot apply.
type InvalidLimitError struct {
	Index  int
	Reason string
}

func (e *InvalidLimitError) Error() string {
	return "limits[" + strconv.Itoa(e.Index) + "]: " + e.Reason
}

// Check decides in at time now (Unix nanoseconds, read once at the edge) and fills d.
// It returns *InvalidLimitError when an inline limit is malformed; then nothing is consumed.
// It is Prepare then Decide: gather one op per matching rule and inline limit (its key,
// limit, cost, store and failure policy), then apply them all-or-nothing across the
// stores and report each op as a Result.
func (l *Limiter) Check(now int64, in *Input, d *Decision) error {
	if _, err := l.Prepare(in, d); err != nil {
		return err
	}
	l.Decide(now, d)
	return nil
}

// Prepare is the first half of Check: it matches the rules, derives the keys and
// validates the inline limits into d, consuming nothing, and reports whether Decide will
// wait on Redis (a global-mode check), so a caller can decide such a request off its
// fast path. d then refers to in's strings (inline limit names): keep them until Decide.
// It returns *InvalidLimitError when an inline limit is malformed.
func (l *Limiter) Prepare(in *Input, d *Decision) (waits bool, err error) {
	c := l.active.Load()
	set := c.set
	d.Allowed = true
	d.Deciding = -1
	d.Degraded = false
	d.Lease = 0
	d.globalLease = nil
	d.Warning = false
	d.Delay = 0
	d.Banned = false
	d.Results = d.Results[:0]
	d.ops = d.ops[:0]
	d.routed, d.skipped = 0, 0
	d.keys = d.keys[:0]
	d.localReady, d.flags = false, 0
	d.local.ops, d.local.at = d.local.ops[:0], d.local.at[:0]
	d.dups = d.dups[:0]

	if set.AnyReplaces() {
		d.findReplaced(set, in)
	} else {
		d.replaced = d.replaced[:0]
	}
	d.Unlimited = d.Unlimited[:0]
	nparts := max(len(in.Parts), 1)
	for p := range nparts {
		attrs, cost, noRules := in.Attrs, in.Cost, false
		if len(in.Parts) > 0 {
			pt := &in.Parts[p]
			attrs, cost, noRules = pt.Attrs, pt.Cost, pt.NoRules
		}
		if !noRules {
			l.matchRules(d, c, attrs, cost, p)
		}
	}

	ninline := len(in.Limits)
	for p := range in.Parts {
		ninline += len(in.Parts[p].Limits)
	}
	if ninline > 0 {
		// With Redis, a second half: each inline limit's share for a local fallback
		// (addInline). Sized once: ops point into it.
		nl := ninline
		if l.hybrid != nil {
			nl *= 2
			d.live = l.hybrid.replicas()
		}
		if cap(d.limits) < nl {
			d.limits = make([]localbucket.Limit, nl)
		}
		d.limits = d.limits[:nl]
		n := 0
		first := len(d.ops) // the first inline limit's op
		for i := range in.Limits {
			if err := l.addInline(d, n, i, &in.Limits[i], in.Cost, 0, first); err != nil {
				return false, err
			}
			n++
		}
		for p := range in.Parts {
			pt := &in.Parts[p]
			for i := range pt.Limits {
				// No dedupe (-1): identical descriptors of one Envoy call are charged once
				// each, as envoyproxy/ratelimit charges them.
				if err := l.addInline(d, n, n, &pt.Limits[i], pt.Cost, p, -1); err != nil {
					return false, err
				}
				n++
			}
		}
	}
	if len(d.ops) == 0 {
		return false, nil
	}

	d.localReady = !d.general
	return d.routed&(1<<storeGlobal|1<<storeGlobalLease) != 0, nil
}

// Decide is the second half of Check: it applies the checks Prepare put in d at time now,
// all-or-nothing, and fills in d's results and deciding rule. It waits on Redis (at most
// the global timeout) only when Prepare said so.
func (l *Limiter) Decide(now int64, d *Decision) {
	if len(d.ops) == 0 {
		return
	}
	ok := true
	if d.flags&(infoPenalty|infoDeny) != 0 || d.general {
		ok = !l.refusedFirst(now, d)
	}
	d.Allowed = l.apply(now, d, ok)
	if d.wouldWait {
		return // DecideInline: nothing taken, nothing recorded
	}

	if d.flags == 0 && !d.Degraded && !d.general && d.Allowed {
		// Allowed, no deny, penalty or warn_at rule, nothing degraded (most checks):
		// only the window and the delay to report, and the deciding rule (deciding's
		// allowed case) found in the same pass.
		best := -1
		for i := range d.ops {
			out := &d.Results[i]
			out.Window = d.ops[i].lim.Window()
			if !out.Allowed {
				out.Delay = 0 // a shadow's refusal: a peek's wait, not a reservation
			} else if !out.Shadow {
				d.Delay = max(d.Delay, out.Delay)
			}
			if !out.Shadow && (best < 0 || out.Remaining < d.Results[best].Remaining) {
				best = i
			}
		}
		d.Deciding = best
		if len(d.dups) != 0 {
			d.expandDups()
		}
		return
	}
	l.report(now, d)
	d.Deciding = deciding(d.Allowed, d.Results)
	if r := d.DecidingResult(); r != nil && !d.Allowed {
		d.Banned = r.Banned
	}
	if len(d.dups) != 0 {
		d.expandDups()
	}
}

// expandDups inserts into Results, at its place, the result of each inline limit that
// repeated an earlier one (Decision.dups): a copy of that one's under its own name.
// Deciding moves with the result it points at (a copy never decides: ties go to the
// first listed). Results then has more entries than the ops.
func (d *Decision) expandDups() {
	n := len(d.Results)
	total := n + len(d.dups)
	d.Results = slices.Grow(d.Results, len(d.dups))[:total]
	// From the end: each result of an op moves up past the copies before it.
	j, k := n-1, len(d.dups)-1
	for f := total - 1; k >= 0 && f >= 0; f-- {
		if f == d.dups[k].at {
			k--
			continue
		}
		d.Results[f] = d.Results[j]
		j--
	}
	for _, u := range d.dups {
		d.Results[u.at] = d.Results[u.of]
		d.Results[u.at].Name, d.Results[u.at].Repeat = u.name, true
	}
	if d.Deciding >= 0 {
		for _, u := range d.dups {
			if u.at <= d.Deciding {
				d.Deciding++
			}
		}
	}
	d.dups = d.dups[:0]
}

// report completes the results of Decide's ops: windows, bans, deny, warnings, delays.
func (l *Limiter) report(now int64, d *Decision) {
	for i := range d.ops {
		o := &d.ops[i]
		out := &d.Results[i]
		out.Window = o.lim.Window()
		if out.Limit == 0 && o.flags&infoDeny == 0 {
			out.Limit = o.lim.Requests() // an op no store reported (a global one, unasked)
		}
		if out.Unasked && o.bannedUntil == 0 {
			// Its store was not asked (markUnasked): it refused nothing, and its figures
			// were not read. Unless its cost is above its capacity: that never passes,
			// and no store need be asked to say so. Reported so, it decides the refusal
			// (the client must not retry); before, it said allowed, and the client
			// retried when the other rule admitted, to be refused for good then. A
			// concurrency rule takes one slot whatever the cost: never so.
			never := o.cost > o.lim.Capacity() && o.flags&infoDeny == 0 && (out.Rule == nil || !out.Rule.Concurrency)
			*out = Result{Name: out.Name, Limit: out.Limit, Window: out.Window, Allowed: !never, Impossible: never,
				Unasked: !never, Shadow: out.Shadow, Degraded: o.degraded, Rule: out.Rule, Key: out.Key, Part: out.Part}
			continue
		}
		out.Unasked = false // banned: that is what it says
		if o.bannedUntil != 0 {
			out.Allowed, out.Banned, out.Remaining, out.Delay = false, true, 0, 0
			out.Impossible = false // the ban decides: its time, not "never" (reason)
			// The ban's remaining time, as the protocol defines it for a banned answer
			// (even where the rule itself would refuse for longer).
			out.RetryAfter = time.Duration(o.bannedUntil - now)
			out.Reset = max(out.Reset, out.RetryAfter) // not back to full before the ban ends
			if o.bans == bansGlobal {
				l.shared.saw(now, d, i)
			}
		} else if d.countsRefusal(i) {
			// Refused by its rule: not an op whose store a rejection skipped unasked, nor
			// a cost-0 check, which only asks (it stores nothing: no refusal, no ban),
			// unless AskLeases made it ask (an Envoy call's concurrency rule: the
			// client's request, refused),
			// nor a cost above its capacity, which can never pass and says so (its
			// client is told not to retry; a ban would contradict that), nor one decided
			// on the fallback state a full store's new keys share (its refusal says the
			// shared state is spent, by a flood of other keys, not that this client went
			// over its limit: before, every new client was banned after `after` requests).
			// Nor one its failure policy `closed` made, Redis away: that refuses every
			// client, whatever it sent (before, a hybrid daemon counted them and sent them
			// once Redis was back: every client that had sent `after` requests during
			// the outage was banned as it ended).
			// A ban it starts lasts at least until the rule itself would admit the
			// request again (banEnd): never shorter than this refusal's retry.
			var until, admit int64
			var started bool
			if !out.Impossible && out.RetryAfter > 0 {
				admit = now + int64(out.RetryAfter)
			}
			// One request is one refusal of its client: identical descriptors of an
			// Envoy call (a route's and its virtual host's remote_address, say) are
			// charged once each, but refused together they count once, at the first,
			// whose ban lasts until the last of them would pass; the others say what it
			// says. Before, each counted: a single request refused on two of them started
			// a ban of `after: 2`.
			first := true
			for j := range i {
				if bytes.Equal(d.ops[j].key, o.key) && d.countsRefusal(j) {
					if p := &d.Results[j]; p.Banned {
						out.Banned = true
						out.RetryAfter = max(out.RetryAfter, p.RetryAfter)
						out.Reset = max(out.Reset, out.RetryAfter)
					}
					first = false
					break
				}
			}
			for k := i + 1; first && k < len(d.ops); k++ {
				if r := &d.Results[k]; bytes.Equal(d.ops[k].key, o.key) && d.countsRefusal(k) && r.RetryAfter > 0 {
					admit = max(admit, now+int64(r.RetryAfter))
				}
			}
			switch {
			case !first:
			case o.bans == bansLocal:
				until, started = l.bans.refused(o.key, out.Rule, now, admit)
			case !o.degraded || (o.bans == bansHybrid && o.fb.policy != rules.FailClosed): // a global op degraded: Redis is away
				// A global refusal may find a ban another daemon's refusal started since
				// this check read it: banned, not started here (so may a local one).
				until, started = l.shared.refused(now, d, i, out.Rule, admit)
			}
			if until != 0 {
				out.Banned, out.BanStarted = true, started
				out.RetryAfter = max(out.RetryAfter, time.Duration(until-now))
				out.Reset = max(out.Reset, out.RetryAfter)
			}
		}
		out.Degraded = o.degraded
		if o.flags&infoDeny != 0 {
			out.Limit, out.Remaining = 0, 0
			if out.Rule == nil { // a deny inline limit: the rest of its window (Inline.Deny)
				w, t := int64(out.Window), now+l.buckets.WallOffset()
				out.Reset = time.Duration(w - t%w)
			}
		}
		if !d.Allowed || !out.Allowed {
			out.Delay = 0 // a peek's wait, not a reservation
			continue
		}
		if o.flags&infoWarn != 0 {
			c := o.lim.Capacity()
			out.Warning = c-min(out.Remaining, c) >= out.Rule.WarnThreshold(c)
		}
		if !out.Shadow {
			d.Warning = d.Warning || out.Warning
			d.Delay = max(d.Delay, out.Delay)
		}
	}
}

// queuedCtx is the parent context of d's global script calls: carrying d.Queued.
//
// Not for a check of a global penalty rule (shared bans, bansGlobal): its refusal is
// counted in Redis by a second call, after the script's (sharedBans.refused), and a
// ban that count starts must be seen by the next check of the key, which reads it in
// its own script call. So the next pipelined check of the key waits until this one is
// decided, its refusal counted, not only queued. Before, it went once this one's script
// was queued: five checks pipelined past a limit of 1 with `after: 3` could be answered
// banned on the first refusal and not on the third, and a check decided after the ban
// had started was refused unbanned (and counted toward the next ban).
func (d *Decision) queuedCtx() context.Context {
	if d.Queued == nil {
		return context.Background()
	}
	if d.flags&infoPenalty != 0 {
		for i := range d.ops {
			if d.ops[i].bans == bansGlobal {
				return context.Background()
			}
		}
	}
	return rlsync.WithQueued(context.Background(), d.Queued)
}

// DecideInline is Decide for a caller that must not wait on Redis (a connection's loop,
// whose pipelined requests a wait would stall), after a Prepare that said the check does
// not wait (no global rule). It reports false, having taken and recorded nothing, when a
// hybrid key cannot be decided from the local view (it needs an exact sync, or another
// request's sync is in flight): the caller then runs Prepare and Decide again where
// waiting is fine. Otherwise it is Decide, and reports true.
func (l *Limiter) DecideInline(now int64, d *Decision) bool {
	d.noWait = true
	l.Decide(now, d)
	d.noWait = false
	if d.wouldWait {
		d.wouldWait = false
		return false
	}
	return true
}

// countsRefusal reports whether op i's result is a refusal that counts toward its rule's
// penalty: refused by its rule, not an op whose store a rejection skipped unasked, nor a
// cost-0 check (it only asks) unless AskLeases made it ask, nor a cost above capacity,
// nor one decided on the shared fallback state of a full store (see report).
func (d *Decision) countsRefusal(i int) bool {
	o, out := &d.ops[i], &d.Results[i]
	return o.bannedUntil == 0 && o.flags&infoPenalty != 0 && !out.Allowed && (o.cost != 0 || o.asked) &&
		!out.Impossible && !d.unasked(i) && !o.shared
}

// refusedFirst reports whether the request is refused before any store is asked to
// take: a key of it banned by a penalty rule (checkBans, which marks the banned ops), or
// a non-shadow deny limit (a rule's limit: deny, or Inline.Deny), which refuses whatever
// the stores say. Each store then only reports (skip): no Redis round trip, nor a refund
// that could fail.
func (l *Limiter) refusedFirst(now int64, d *Decision) bool {
	refused := (d.flags&infoPenalty != 0 || d.general) && l.checkBans(now, d)
	if d.flags&infoDeny != 0 {
		for i := range d.ops {
			if o := &d.ops[i]; o.flags&infoDeny != 0 && !o.shadow {
				refused = true
			}
		}
	}
	return refused
}

// checkBans marks the ops whose key a penalty rule has banned at now (op.bannedUntil),
// and reports whether one of them is not a shadow: the request is then refused without
// taking from any store.
func (l *Limiter) checkBans(now int64, d *Decision) bool {
	refused, shared := false, false
	for i := range d.ops {
		o := &d.ops[i]
		if o.bans != bansLocal {
			// Global: checked in the global store's script call (store_global.go).
			shared = shared || o.bans == bansHybrid
			continue
		}
		if o.flags&infoPenalty == 0 {
			continue
		}
		if o.bannedUntil = l.bans.bannedUntil(o.key, now); o.bannedUntil != 0 && !o.shadow {
			refused = true
		}
	}
	if shared {
		l.shared.check(now, d)
		for i := range d.ops {
			if o := &d.ops[i]; o.bans == bansHybrid && o.bannedUntil != 0 && !o.shadow {
				refused = true
			}
		}
	}
	return refused
}

// matchRules adds the checks of the rules of c's set that match attrs (part p of the
// input), skipping the replaced ones and noting the parts an unlimited rule matched.
// What a rule's check takes from the configuration alone was derived when c was built
// (ruleInfo); only the plan's limit, a split among the live daemons and the key are
// derived here.
func (l *Limiter) matchRules(d *Decision, c *compiled, attrs []rules.Attr, cost uint64, p int) {
	// The plan attribute is read once, for the first matched rule that has plans: the
	// limits of a rule without plans do not depend on it.
	var plan string
	var hasPlan, planRead bool
	var tmp ruleInfo
	d.matched = c.set.AppendMatching(d.matched[:0], attrs) // the index: rule-file order
	for _, r := range d.matched {
		if len(d.replaced) > 0 && d.replaced[r.Index] {
			continue
		}
		in := &tmp
		if i := r.Index; uint(i) < uint(len(c.rules)) && c.rules[i].rule == r {
			in = &c.rules[i]
		} else {
			tmp = l.infoOf(r, c.shadowAll) // a Set assembled by hand: derived per check
		}
		lim := in.lim
		if lim == nil {
			unlimited := in.flags&infoUnlimited != 0
			if !unlimited {
				if !planRead && r.HasPlans() {
					plan, hasPlan = rules.Lookup(attrs, rules.PlanAttribute)
					planRead = true
				}
				if r.Split > 0 || r.SplitAuto {
					lim, unlimited = r.SplitLimitFor(plan, hasPlan, l.splitAmong(r))
				} else {
					lim, unlimited = r.LimitFor(plan, hasPlan)
				}
			}
			if unlimited {
				if n := len(d.Unlimited); n == 0 || d.Unlimited[n-1] != p {
					d.Unlimited = append(d.Unlimited, p)
				}
				continue
			}
		}
		var ok bool
		start := len(d.keys)
		redis := in.flags&infoRedis != 0
		if redis {
			d.keys = append(d.keys, l.prefix...)
		}
		d.keys, ok = r.AppendKey(d.keys, attrs)
		if !ok {
			d.keys = d.keys[:start]
			continue
		}
		var fb fallback
		if redis {
			if in.flags&infoFingerprint != 0 {
				// prefix, name, fingerprint, hash tag: a reload changing the rule's
				// algorithm or window moves its clients to fresh keys (see
				// AppendFingerprint). A concurrency rule has neither (its sorted set of
				// leases reads the same under any max or lease duration), and its key is
				// rebuilt from a lease token by any daemon, so it has no fingerprint.
				d.keys = insertFingerprint(d.keys, start+len(l.prefix)+len(r.Name), lim)
			}
			fb = fallback{policy: in.fb, local: lim}
			if in.flags&infoFallbackSplit != 0 {
				fb.local, _ = r.SplitLimitFor(plan, hasPlan, l.hybrid.replicas())
			}
		}
		shadow := in.flags&infoShadow != 0
		cst := cost
		if in.flags&infoDeny != 0 {
			cst = denyCost
		}
		// A key slice stays valid when a later append moves d.keys: its bytes are
		// neither moved nor written again.
		key := d.keys[start:len(d.keys):len(d.keys)]
		o := push(&d.ops) // every field written in place (see op): no op built aside and copied
		o.key, o.lim, o.cost, o.fb = key, lim, cst, fb
		o.shadow, o.store, o.degraded, o.bans = shadow, in.store, false, in.bans
		o.flags, o.bannedUntil, o.shared, o.asked = in.flags&opFlags, 0, false, false
		d.flags |= in.flags & opFlags
		d.routed |= 1 << in.store
		if in.bans == bansGlobal {
			// A global concurrency rule's ban is read by the global store's call, which
			// then takes its lease slots too (store_global.go).
			d.routed |= 1 << storeGlobal
		}
		if in.store == storeLocal {
			addLocal(&d.local, key, lim, cst, shadow, len(d.ops)-1)
		}
		out := push(&d.Results) // zeroed in place, then the fields known now
		*out = Result{}
		out.Name, out.Shadow, out.Rule, out.Part, out.Key = r.Name, shadow, r, p, key
	}
}

// denyLimit and denyCost make a limit: deny rule's check: a cost no limit can hold, so
// it is rejected as impossible (and with it the request, all-or-nothing) without state.
var (
	denyLimit, _ = localbucket.NewLimit(localbucket.TokenBucket, 1, time.Second, 0)
	denyCost     = ^uint64(0)
)

// findReplaced marks in d.replaced the rules that a rule applying to the input replaces:
// one whose conditions hold and whose key attributes are all there. A rule missing its
// key attribute does not apply, so it replaces nothing (before, a client that left out
// the api_key of a per-key rule replacing per-user escaped both). A shadow rule
// replaces nothing: a dry run changes no decision, so the rules it would replace keep
// deciding until it is enforced (before, shipping a narrower rule in shadow with its
// replaces written took the broader limit off the requests it matched).
func (d *Decision) findReplaced(set *rules.Set, in *Input) {
	if cap(d.replaced) < len(set.Rules) {
		d.replaced = make([]bool, len(set.Rules))
	}
	d.replaced = d.replaced[:len(set.Rules)]
	clear(d.replaced)
	nparts := max(len(in.Parts), 1)
	for p := range nparts {
		attrs := in.Attrs
		if len(in.Parts) > 0 {
			if in.Parts[p].NoRules {
				continue
			}
			attrs = in.Parts[p].Attrs
		}
		for _, r := range set.Rules {
			if len(r.ReplacesIdx) > 0 && !r.Shadow && r.Applies(attrs) {
				for _, i := range r.ReplacesIdx {
					d.replaced[i] = true
				}
			}
		}
	}
}

// addInline adds the check of inline limit il (at index i of the error it may return),
// stored at d.limits[n], costing cost, for part p. With first >= 0 (Input.Limits: the
// native protocol), an inline limit identical to an earlier one among the ops from first
// on (the same counter: algorithm, limit, window, burst and key, both local or both in
// Redis) is the same limit listed twice: it gets no op of its own, so it is decided, and
// charged, once (by the earlier one's store), and Decide reports it as a copy of that
// one (Decision.dups).
func (l *Limiter) addInline(d *Decision, n, i int, il *Inline, cost uint64, p, first int) error {
	mode, noStore, err := l.inlineLimit(i, il, &d.limits[n])
	if err != nil {
		return err
	}
	id := storeOf(mode)
	start := len(d.keys)
	if id != storeLocal || noStore {
		// A Redis key; or, on a daemon without Redis, the local key one would fall back
		// on: apart from a local inline limit that is otherwise the same (they do not
		// share state), shared by hybrid and global.
		d.keys = append(d.keys, l.prefix...)
	}
	d.keys = appendInlineKey(d.keys, il, &d.limits[n])
	name := il.Name
	if name == "" {
		name = il.Key
	}
	if !utf8.ValidString(name) {
		// Answers carry it as a msgpack str, which is UTF-8; a request may send any
		// bytes (as bin). The key keeps the bytes; the name shown is made valid.
		name = strings.ToValidUTF8(name, "\uFFFD")
	}
	key := d.keys[start:len(d.keys):len(d.keys)]
	if first >= 0 {
		for j := first; j < len(d.ops); j++ {
			// The same counter: both local, or both in Redis (a hybrid and a global
			// inline limit share its key and state there).
			if (d.ops[j].store == storeLocal) == (id == storeLocal) && string(d.ops[j].key) == string(key) {
				d.keys = d.keys[:start]
				d.dups = append(d.dups, inlineDup{at: len(d.Results) + len(d.dups), of: d.finalIndex(j), name: name})
				return nil
			}
		}
	}
	var flags uint16
	if il.Deny {
		cost, flags = denyCost, infoDeny // decided by the local store, as a deny rule
		d.flags |= infoDeny
	}
	// Without Redis, an inline limit in hybrid or global mode is decided as a rule with
	// on_store_failure: local: from a local bucket of its limit divided among the live
	// daemons (it was the whole limit: N daemons admitted N times it while Redis was away).
	fb := fallback{policy: rules.FailLocal, local: &d.limits[n]}
	if id != storeLocal && l.hybrid != nil {
		// Its share is worked out by fallBack, when needed, into its room.
		fb.local, fb.share = &d.limits[len(d.limits)/2+n], true
	}
	// --shadow (SetShadowAll) makes inline limits shadows too: a dark launch refuses
	// nothing. Before, a check's inline limit still refused under it.
	shadow := l.shadowAll.Load()
	*push(&d.ops) = op{key: key, lim: &d.limits[n], cost: cost, fb: fb, store: id, flags: flags, degraded: noStore, shadow: shadow}
	if noStore {
		d.Degraded = true
	}
	d.routed |= 1 << id
	if id == storeLocal {
		addLocal(&d.local, key, &d.limits[n], cost, shadow, len(d.ops)-1)
	}
	d.Results = append(d.Results, Result{Name: name, Part: p, Key: key, Shadow: shadow})
	return nil
}

// finalIndex returns where the result of op j lands once Decide has inserted the
// copies of the dups recorded so far (expandDups).
func (d *Decision) finalIndex(j int) int {
	f := j
	for _, u := range d.dups {
		if u.at <= f {
			f++
		}
	}
	return f
}

// storeOf returns the store that decides a mode's checks (m as resolve returns it).
func storeOf(m rules.Mode) storeID {
	switch m {
	case rules.ModeHybrid:
		return storeHybrid
	case rules.ModeGlobal:
		return storeGlobal
	}
	return storeLocal
}

// deciding chooses the deciding rule: when allowed, the non-shadow rule with the least
// remaining; when rejected, the rejecting non-shadow rule with the longest retry-after
// (one that can never pass counts as longest). Ties go to the first listed (retries
// compared in whole milliseconds, as answered).
func deciding(allowed bool, results []Result) int {
	best := -1
	for i := range results {
		r := &results[i]
		if r.Shadow {
			continue
		}
		if allowed {
			if best < 0 || r.Remaining < results[best].Remaining {
				best = i
			}
			continue
		}
		if r.Allowed {
			continue
		}
		if best < 0 {
			best = i
			continue
		}
		b := &results[best]
		if b.Impossible {
			continue
		}
		// Compared as the answer gives them, in whole milliseconds: a sliding window's
		// retry a fraction of a millisecond longer than a fixed window's, both answered
		// 893, decided over the first listed.
		if r.Impossible || CeilMs(r.RetryAfter) > CeilMs(b.RetryAfter) {
			best = i
		}
	}
	return best
}

// CeilMs rounds a duration up to whole milliseconds, as the answers give durations, so
// a client that waits retry_after_ms is never early.
func CeilMs(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	return (uint64(d) + uint64(time.Millisecond) - 1) / uint64(time.Millisecond) // unsigned: no overflow near the longest duration, and a cheaper division
}

// inlineLimit validates il into out and returns the mode it is decided in; noStore: it
// asked for hybrid or global of a daemon without Redis (inlineMode).
func (l *Limiter) inlineLimit(i int, il *Inline, out *localbucket.Limit) (mode rules.Mode, noStore bool, err error) {
	if il.Deny {
		return rules.ModeLocal, false, denyInline(i, il, out)
	}
	if mode, noStore, err = l.inlineMode(i, il); err != nil {
		return mode, noStore, err
	}
	return mode, noStore, inlineLimit(i, il, out)
}

// inlineMode returns the mode inline limit il is decided in. A daemon without Redis
// decides one in hybrid or global mode locally (noStore), and its answer says degraded,
// as a daemon whose Redis does not answer does: a client cannot know whether the daemon
// it asks has a Redis, and its request is not malformed.
func (l *Limiter) inlineMode(i int, il *Inline) (mode rules.Mode, noStore bool, err error) {
	switch il.Mode {
	case "":
		return l.defaultMode, false, nil
	case "local":
		return rules.ModeLocal, false, nil
	case "hybrid":
		if l.stores[storeHybrid] != nil {
			return rules.ModeHybrid, false, nil
		}
		return rules.ModeLocal, true, nil
	case "global":
		if l.stores[storeGlobal] != nil {
			return rules.ModeGlobal, false, nil
		}
		return rules.ModeLocal, true, nil
	}
	return 0, false, &InvalidLimitError{i, fmt.Sprintf("unknown mode %s; use local, hybrid or global", proto.Quote(il.Mode))}
}

func inlineLimit(i int, il *Inline, out *localbucket.Limit) error {
	if il.Key == "" {
		return &InvalidLimitError{i, `"key" is required and must not be empty`}
	}
	if il.Limit == 0 {
		return &InvalidLimitError{i, `"limit" must be at least 1`}
	}
	if il.WindowMs == 0 {
		return &InvalidLimitError{i, `"window_ms" must be at least 1`}
	}
	alg := localbucket.TokenBucket
	if il.Algorithm != "" {
		a, err := localbucket.ParseAlgorithm(il.Algorithm)
		if err != nil {
			return &InvalidLimitError{i, err.Error()}
		}
		alg = a
	}
	if il.WindowMs > uint64(366*24*time.Hour/time.Millisecond) {
		return &InvalidLimitError{i, `"window_ms" must be at most 366 days`}
	}
	burst := il.Burst
	if alg != localbucket.TokenBucket && burst == il.Limit {
		burst = 0 // a window holds its limit: a client that always sends burst says so
	}
	lim, err := localbucket.NewLimit(alg, il.Limit, time.Duration(il.WindowMs)*time.Millisecond, burst)
	if err != nil {
		return &InvalidLimitError{i, err.Error()}
	}
	*out = lim
	return nil
}

// denyInline checks a deny inline limit and sets out to a fixed window of 1 per its
// window: what its Result reports the window of (and its reset from), never what
// decides it (its cost, denyCost, exceeds any limit).
func denyInline(i int, il *Inline, out *localbucket.Limit) error {
	switch {
	case il.Key == "":
		return &InvalidLimitError{i, `"key" is required and must not be empty`}
	case il.Limit != 0 || il.Burst != 0 || il.Algorithm != "":
		return &InvalidLimitError{i, "a deny limit takes no limit, burst or algorithm"}
	case il.WindowMs == 0:
		return &InvalidLimitError{i, `"window_ms" must be at least 1`}
	case il.WindowMs > uint64(366*24*time.Hour/time.Millisecond):
		return &InvalidLimitError{i, `"window_ms" must be at most 366 days`}
	}
	lim, err := localbucket.NewLimit(localbucket.FixedWindow, 1, time.Duration(il.WindowMs)*time.Millisecond, 0)
	if err != nil {
		return &InvalidLimitError{i, err.Error()}
	}
	*out = lim
	return nil
}

// appendInlineKey writes ~inline/<algorithm>/<limit>/<window_ms>/<burst>:{<escaped key>}
// (<algorithm> is "deny" for Inline.Deny).
// Two inline limits share state only when they agree on key and every parameter.
func appendInlineKey(dst []byte, il *Inline, lim *localbucket.Limit) []byte {
	dst = append(dst, "~inline/"...)
	if il.Deny {
		dst = append(dst, "deny"...) // no state is kept for it; its key stays apart anyway
	} else {
		dst = append(dst, lim.Algorithm().String()...)
	}
	dst = append(dst, '/')
	dst = strconv.AppendUint(dst, il.Limit, 10)
	dst = append(dst, '/')
	dst = strconv.AppendUint(dst, il.WindowMs, 10)
	dst = append(dst, '/')
	dst = strconv.AppendUint(dst, lim.Burst(), 10)
	dst = append(dst, ":{"...)
	dst = rules.AppendEscaped(dst, il.Key)
	return append(dst, '}')
}

// Sweep drops the state of keys that carry no information any more (full buckets,
// windows that have passed), so memory follows the active keys. Call it periodically.
// It also frees the concurrency leases that ran out (Leases.Sweep) and the bans that ended.
func (l *Limiter) Sweep(now int64) int {
	n := l.buckets.Sweep(now) + l.leases.Sweep(now) + l.bans.sweep(now, l.Rules())
	if l.global != nil {
		n += l.global.sweep(now)
	}
	return n
}
