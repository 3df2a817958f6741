// Package limiter is the decision engine: for one request it matches the rules, derives
// each rule's client key, validates the inline limits, applies every check to its store
// all-or-nothing and chooses the deciding rule.
//
// A Limiter is safe for concurrent use. Its rules are swapped atomically (SetRules), so a
// check sees either the old rule set or the new one, never a mix. Callers bring their own
// Decision, which holds the scratch space a check needs; reusing one Decision per
// connection makes Check allocation-free once the keys exist. Most callers want New, then
// WithHybrid and WithGlobal when the daemon has Redis, then Check.
//
// # One shape for a check
//
// Check turns a request into a slice of uniform operations (op, in store.go), one per
// matching rule or inline limit: the limit, the client key, the cost, whether it is a
// shadow, the store that decides it, and its failure policy; then it applies them and
// reports one Result per op. What an op takes from its rule and the limiter's
// configuration alone (the store, the key's shape, shadow, a limit no plan or split
// chooses, the failure policy) is derived once per rule set and configuration (compiled,
// in compiled.go), so a check only matches, builds keys and fills in the ops. Each mode
// is one store behind the small interface store
// (store.go):
//
//   - take: decide the store's ops at now, all-or-nothing (or fail: the store cannot
//     decide now);
//   - giveBack: return what take took, when a later store rejects the request;
//   - skip: report without taking, when an earlier store rejected; a store that asks
//     Redis nothing then marks its results unasked (Result.Unasked: allowed, figures
//     not read).
//
// apply walks the stores in a fixed order, cheapest to give back first (hybrid
// allowances in memory, then the global mode's Redis scripts, then the local buckets,
// which commit only when everything else passed). When a store fails, one step
// (Decision.fallBack) applies every affected op's failure policy: open allows, closed
// refuses, local reroutes the op to the local store; the op and the decision are marked
// degraded. Each store's adapter is its own file (store_local.go, store_hybrid.go,
// store_global.go) and is the only code calling that store's package, so a change in a
// store's API changes one file. An adapter keeps its API's own batch types in the
// Decision (scratchOf), so no store costs an allocation per check.
//
// # Extending it
//
// Every new kind of limit adds a store or an algorithm, never another list in Decision:
//
//   - Concurrency leases ("at most N in flight") are the lease store (store_lease.go,
//     leases.go): its take acquires one slot in each concurrency op all-or-nothing, as
//     one lease whose id goes in Decision.Lease, and its giveBack frees it; releasing,
//     renewing and freeing a closed connection's leases are operations on the store
//     (Limiter.Leases), not paths through Check. In global mode the slots are in Redis
//     (store_lease_global.go; taken by sync/scripts/global.lua, in the global store's
//     script call when the check has global rate rules too, so one call per hash slot
//     decides both; released, renewed and queried by sync/scripts/lease.lua): a store
//     before the local lease store, so that on_store_failure local reroutes a
//     concurrency op there; its token
//     carries the rules and clients any daemon needs to release it (Limiter.LeaseToken,
//     ReleaseLease, RenewLease, ReleaseOwner cover both kinds).
//   - Escalating bans (a rule's penalty): a pre-check in Decide before any store (a
//     banned op refuses the request and every store only reports), and raised after
//     apply by the rule's refusals. Where the ban lives is the op's banScope: this
//     daemon's table (bans.go) for a local rule, Redis for a hybrid or global one
//     (bans_shared.go, rlsync.Bans): read at once for global, known within one sync
//     interval for hybrid. One pre-check, two tables; no list in Decision. A ban ends
//     no earlier than the rule would admit the refusal that started it (banEnd, ban.lua's
//     admit_ms), and a cost-0 check's refusal starts none.
//   - Calendar windows (per day/week/month in a time zone): localbucket.NewCalendarLimit,
//     a fixed window whose bounds come from the zone. In global mode the adapter names
//     the window's start in the key (store_global.go, calendarKey); hybrid-mode rules
//     with a calendar window or a delay are routed to the global store (infoOf),
//     since the hybrid sync can express neither.
//   - Delay ("let it through after d instead of refusing"): localbucket.Limit.WithDelay
//     fills Result.Delay (global.lua's algorithm 4 in global mode); Decide takes the
//     longest. The stores and their order stay.
//   - Warnings (warn_at): computed in Decide from each allowed result's remaining.
//
// A new store gets a storeID before storeLocal (the failure policy "local" reroutes to
// the local store, which therefore runs last), an adapter file, and a mapping from its
// mode in storeOf.
//
// # Redis keys
//
// A Redis-backed op's key is the daemon's prefix (SetRedisPrefix; default
// rlsync.DefaultPrefix, "rl:"), then the rule name, then the fingerprint of the rule's
// algorithm and window (AppendFingerprint), then the client between braces, the Redis
// Cluster hash tag: rl:per-user~sw1h:{user=alice}. The fingerprint is what resets a
// rule's Redis state (and hybrid allowances) when a reload changes its algorithm or
// window: its clients move to fresh keys and the old ones expire by their TTL; a reload
// that changes only the limit keeps the key and the count. Every store that keys Redis
// state by rule calls AppendFingerprint, and only the braces make a hash tag: prefix,
// name and fingerprint never contain '{', '}' or ':'. Inline limits use
// rl:~inline/<algorithm>/<limit>/<window_ms>/<burst>:{<key>} (every parameter is in the
// key already). Local keys have no prefix and no fingerprint: the local store resets a
// state written under another kind itself. A global concurrency rule's key has the same
// shape without the fingerprint (rl:exports:{user=alice}: any daemon rebuilds it from a
// lease token) and holds a sorted set of lease parts ("<lease id>:<part>", scored by
// expiry in ms on Redis's clock).
// A calendar window's key names the window's start (Unix seconds) after the rule and its
// fingerprint: rl:monthly~cmonth.1a2b3c4d@1767236400:{user=alice}; a penalty rule's
// shared bans are rl:login@ban:{ip=1.2.3.4} (no fingerprint: a ban is of the client under any
// window of the rule, rlsync.BanIdentity), indexed in the sorted set rl:~bans.
// Rule names have no '@' or '~' and do not start with '~', so none of these is a rule
// key under any prefix, and each keeps its client's hash tag (same slot).
package limiter
