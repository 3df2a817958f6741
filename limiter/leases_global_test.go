package limiter

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"slices"
	"strings"
	gosync "sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

const globalLeaseRules = `
rules:
  - name: exports
    match: { path: "/v1/exports/**" }
    key: user
    concurrency: { max: 3, lease: 10s }
    mode: global
  - name: uploads
    match: { path: "/v1/uploads/**" }
    key: user
    concurrency: { max: 2, lease: 10s }
  - name: here
    match: { path: "/v1/uploads/**" }
    key: user
    concurrency: { max: 5, lease: 10s }
    mode: local
  - name: per-user
    key: user
    limit: { requests: 1000, per: 1h }
    mode: local
`

// globalLimiter returns a limiter on rdb with global mode (and the hybrid default, but
// for a FetchWait a loaded machine's exact sync fits in, not 25 ms), its Redis keys under
// prefix.
func globalLimiter(t *testing.T, rdb redis.UniversalClient, yaml, prefix string) *Limiter {
	t.Helper()
	l := New(mustRules(t, yaml), localbucket.NewStore(localbucket.Options{})).
		WithHybrid(rlsync.NewHybrid(rdb, rlsync.HybridOptions{Prefix: prefix, FetchWait: 5 * time.Second})).
		// A loaded machine is slow, not down: the checks wait 5 s, and so does the refund
		// of what a refused check took in other hash slots. A refund past its bound (250
		// ms by default) leaves the slot to the background give-back, 0.6-0.8 s later with
		// a 1 ms bound; TestGlobalLeasesCluster, which looks at once, failed under load.
		WithGlobal(rlsync.NewGlobal(rdb).WithRefundTimeout(5*time.Second), 5*time.Second)
	if err := l.SetRedisPrefix(prefix); err != nil {
		t.Fatal(err)
	}
	return l
}

func nowNs() int64 { return time.Now().UnixNano() }

// acquire checks in on l for owner and returns the decision's allowed and token.
func acquire(t *testing.T, l *Limiter, in *Input, owner uint64) (bool, string, *Decision) {
	t.Helper()
	d := &Decision{Owner: owner}
	if err := l.Check(nowNs(), in, d); err != nil {
		t.Fatal(err)
	}
	return d.Allowed, l.LeaseToken(d), d
}

// Two daemons on one Redis share a global concurrency rule's slots: 3 in flight per user
// across them, the 4th refused; a lease released through the OTHER daemon frees a slot;
// a second release is false. The hybrid default makes a rule without a mode global too.
func TestGlobalLeasesAcrossDaemons(t *testing.T) {
	rdb := realRedis(t)
	a := globalLimiter(t, rdb, globalLeaseRules, "t1:")
	b := globalLimiter(t, rdb, globalLeaseRules, "t1:")
	in := exportInput("ann")
	var toks []string
	for i, l := range []*Limiter{a, b, a} {
		ok, tok, d := acquire(t, l, in, 0)
		if !ok || !strings.HasPrefix(tok, "g") || d.Results[0].Remaining != uint64(2-i) || d.Results[0].Limit != 3 {
			t.Fatalf("lease %d: allowed %v token %q result %+v", i, ok, tok, d.Results[0])
		}
		toks = append(toks, tok)
	}
	ok, tok, d := acquire(t, b, in, 0)
	if ok || tok != "" || d.Results[0].RetryAfter <= 0 || d.Results[0].RetryAfter > time.Second {
		t.Fatalf("4th: allowed %v token %q retry %v; want refused, no lease, a hint in (0, 1s]", ok, tok, d.Results[0].RetryAfter)
	}
	if !b.ReleaseLease(toks[0], nowNs()) {
		t.Fatal("release through the other daemon: false")
	}
	if b.ReleaseLease(toks[0], nowNs()) || a.ReleaseLease(toks[0], nowNs()) {
		t.Fatal("second release: true")
	}
	if ok, _, _ := acquire(t, b, in, 0); !ok {
		t.Fatal("a slot released through the other daemon is not free")
	}
	if n := rdb.ZCard(context.Background(), "t1:exports:{user=ann}").Val(); n != 3 {
		t.Fatalf("Redis holds %d members under the prefix's key, want 3", n)
	}
	// Renew through the other daemon.
	if ok, in := b.RenewLease(toks[1], time.Minute, nowNs()); !ok || in != time.Minute {
		t.Fatalf("renew through b: %v %v", ok, in)
	}
	if ok, _ := a.RenewLease(toks[0], 0, nowNs()); ok {
		t.Fatal("renewed a released lease")
	}
	// The stats: a acquired two, of which b released one: a still counts both in flight
	// until it learns so (its sweep); b counts the release.
	if s := stats(b, "exports"); s.Released != 1 {
		t.Errorf("b's exports stats %+v, want 1 released", s)
	}

	// The default mode (hybrid) is global for a concurrency rule; a local one beside it
	// joins the same token.
	up := &Input{Attrs: attrs("path=/v1/uploads/x", "user=bo"), Cost: 1}
	ok, tok, _ = acquire(t, a, up, 7)
	if !ok || !strings.Contains(tok, "~g") {
		t.Fatalf("uploads: allowed %v token %q, want a local and a global lease", ok, tok)
	}
	if _, tok2, _ := acquire(t, b, up, 0); tok2 == "" {
		t.Fatal("second upload refused")
	}
	if ok, _, _ := acquire(t, b, up, 0); ok {
		t.Fatal("third upload allowed: uploads (hybrid default) is not global")
	}
	if !b.ReleaseLease(tok, nowNs()) { // b frees the global part; the local part is a's
		t.Fatal("release of the joint token through b: false")
	}
	if a.Leases().Len() != 1 {
		t.Fatalf("a holds %d local leases, want 1 (the joint token's local part)", a.Leases().Len())
	}
	if !a.ReleaseLease(tok, nowNs()) || a.Leases().Len() != 0 {
		t.Fatal("the joint token's local part not released through a")
	}
}

// A connection that closes frees its global leases in Redis (ReleaseOwner).
func TestGlobalLeasesOwnerClose(t *testing.T) {
	rdb := realRedis(t)
	a := globalLimiter(t, rdb, globalLeaseRules, "rl:")
	for range 3 {
		if ok, _, _ := acquire(t, a, exportInput("cy"), 42); !ok {
			t.Fatal("refused")
		}
	}
	if s := stats(a, "exports"); s.InFlight != 3 {
		t.Fatalf("in flight %d, want 3", s.InFlight)
	}
	if n := a.ReleaseOwner(42, nowNs()); n != 3 {
		t.Fatalf("ReleaseOwner freed %d, want 3", n)
	}
	if n := rdb.ZCard(context.Background(), "rl:exports:{user=cy}").Val(); n != 0 {
		t.Fatalf("%d members left after the owner closed", n)
	}
	if s := stats(a, "exports"); s.InFlight != 0 || s.Closed != 3 {
		t.Fatalf("stats %+v, want 0 in flight, 3 closed", s)
	}
}

// A request a local rate rule or a local concurrency rule refuses is refused before
// Redis is asked: the global lease takes no slot, not even for the round trip a
// give-back would take (its entry is unasked); nothing is held in Redis. Before, a local
// concurrency rule was decided only by its take, after the global lease had taken its
// slot, which was given back a round trip later.
func TestGlobalLeaseGivenBack(t *testing.T) {
	rdb := realRedis(t)
	l := globalLimiter(t, rdb, `
rules:
  - name: exports
    key: user
    match: { path: "/x/*" }
    concurrency: { max: 1 }
    mode: global
  - name: rate
    key: user
    match: { path: /x/rate }
    limit: { requests: 1, per: 1h }
    mode: local
  - name: slots
    key: user
    match: { path: "/*/slots" }
    concurrency: { max: 1 }
    mode: local
`, "rl:")
	for _, c := range []struct {
		user, path string
		slots      bool // the local concurrency rule refuses, not the rate rule
	}{{"dee", "/x/rate", false}, {"eve", "/x/slots", true}} {
		in := &Input{Attrs: attrs("user="+c.user, "path="+c.path), Cost: 1}
		if c.slots {
			// The local slot, held by a request the global rule does not match.
			if ok, _, _ := acquire(t, l, &Input{Attrs: attrs("user="+c.user, "path=/y/slots"), Cost: 1}, 1); !ok {
				t.Fatalf("%s: holding the local slot", c.path)
			}
		} else if ok, tok, _ := acquire(t, l, in, 1); !ok || !l.ReleaseLease(tok, nowNs()) {
			t.Fatalf("%s: the rate rule's one unit", c.path) // the global slot released, the unit spent
		}
		ok, tok, d := acquire(t, l, in, 2) // the local rule refuses now
		if ok || tok != "" {
			t.Fatalf("%s: allowed %v token %q", c.path, ok, tok)
		}
		if n := rdb.ZCard(context.Background(), "rl:exports:{user="+c.user+"}").Val(); n != 0 {
			t.Fatalf("%s: a refused request holds %d slots in Redis", c.path, n)
		}
		if r := d.Results[0]; !r.Allowed || !r.Unasked {
			t.Fatalf("%s: exports result %+v, want unasked (Redis not asked for a refused request)", c.path, r)
		}
	}
	if s := stats(l, "exports"); s.InFlight != 0 {
		t.Fatalf("in flight %d after the refusals", s.InFlight)
	}
}

// Forged and garbage tokens release and renew nothing, are never an error, and can
// only address a global concurrency rule's keys.
func TestGlobalLeaseForgedTokens(t *testing.T) {
	rdb := realRedis(t)
	l := globalLimiter(t, rdb, globalLeaseRules, "rl:")
	ok, tok, _ := acquire(t, l, exportInput("eve"), 0)
	if !ok {
		t.Fatal("refused")
	}
	raw, err := base64.RawURLEncoding.DecodeString(tok[1:])
	if err != nil {
		t.Fatal(err)
	}
	enc := func(b []byte) string { return "g" + base64.RawURLEncoding.EncodeToString(b) }
	mutate := func(f func([]byte) []byte) string { return enc(f(append([]byte(nil), raw...))) }
	// A token with the real id naming a rate rule, a local rule, a brace in the client.
	withPart := func(rule, client string) string {
		b := append([]byte(nil), raw[:1+leaseIDBytes]...)
		b = append(b, 1, byte(len(rule)))
		b = append(b, rule...)
		b = append(b, byte(len(client)))
		return enc(append(b, client...))
	}
	for name, forged := range map[string]string{
		"empty":         "",
		"garbage":       "not a lease",
		"g only":        "g",
		"bad base64":    "g!!!!",
		"short":         enc([]byte{1, 2, 3}),
		"version":       mutate(func(b []byte) []byte { b[0] = 9; return b }),
		"v2 unnumbered": mutate(func(b []byte) []byte { b[0] = 2; return b }),
		"other id":      mutate(func(b []byte) []byte { b[1] ^= 0xFF; return b }),
		"zero parts":    mutate(func(b []byte) []byte { b[1+leaseIDBytes] = 0; return b[:2+leaseIDBytes] }),
		"more parts":    mutate(func(b []byte) []byte { b[1+leaseIDBytes] = 2; return b }),
		"trailing":      mutate(func(b []byte) []byte { return append(b, 0) }),
		"truncated":     mutate(func(b []byte) []byte { return b[:len(b)-2] }),
		"rate rule":     withPart("per-user", "user=eve"),
		"local rule":    withPart("here", "user=eve"),
		"unknown rule":  withPart("nope", "user=eve"),
		"brace":         withPart("exports", "user=eve}{x"),
		"empty client":  withPart("exports", ""),
		"local nonce":   "00000000.1",
		"joined junk":   "x~y",
	} {
		if l.ReleaseLease(forged, nowNs()) {
			t.Errorf("%s: released", name)
		}
		if ok, _ := l.RenewLease(forged, 0, nowNs()); ok {
			t.Errorf("%s: renewed", name)
		}
	}
	if n := rdb.ZCard(context.Background(), "rl:exports:{user=eve}").Val(); n != 1 {
		t.Fatalf("%d members after forged releases, want 1", n)
	}
	if !l.ReleaseLease(tok, nowNs()) {
		t.Fatal("the real token no longer releases")
	}
}

// Redis down: a global concurrency rule follows its on_store_failure: open allows,
// degraded, holding no slot; closed refuses; local takes a local lease.
func TestGlobalLeaseRedisDown(t *testing.T) {
	for _, tc := range []struct {
		policy  string
		allowed bool
		local   bool // a local lease taken
	}{{"open", true, false}, {"closed", false, false}, {"local", true, true}} {
		t.Run(tc.policy, func(t *testing.T) {
			l := globalLimiter(t, unreachable(t), `
rules:
  - name: exports
    key: user
    concurrency: { max: 2 }
    mode: global
    on_store_failure: `+tc.policy+"\n", "rl:")
			for i := range 3 {
				ok, tok, d := acquire(t, l, &Input{Attrs: attrs("user=fay"), Cost: 1}, 0)
				want := tc.allowed && (!tc.local || i < 2)
				if ok != want || !d.Degraded {
					t.Fatalf("check %d: allowed %v degraded %v; want %v, degraded", i, ok, d.Degraded, want)
				}
				if (tok != "") != (tc.local && want) || strings.HasPrefix(tok, "g") {
					t.Fatalf("check %d: token %q", i, tok)
				}
			}
		})
	}
}

// 100 goroutines over two daemons against max 10 never see 11 in flight.
func TestGlobalLeasesNeverOverMax(t *testing.T) {
	rdb := realRedis(t)
	yaml := "rules:\n  - name: pool\n    key: svc\n    concurrency: { max: 10, lease: 30s }\n    mode: global\n    on_store_failure: closed\n"
	ls := []*Limiter{globalLimiter(t, rdb, yaml, "rl:"), globalLimiter(t, rdb, yaml, "rl:")}
	var inFlight, peak, admitted atomic.Int64
	var wg gosync.WaitGroup
	for g := range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := ls[g%2]
			in := &Input{Attrs: attrs("svc=pay"), Cost: 1}
			for range 20 {
				d := &Decision{}
				if err := l.Check(nowNs(), in, d); err != nil {
					t.Error(err)
					return
				}
				if !d.Allowed {
					continue
				}
				n := inFlight.Add(1)
				for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
				}
				admitted.Add(1)
				time.Sleep(200 * time.Microsecond)
				inFlight.Add(-1)
				if !ls[(g+1)%2].ReleaseLease(l.LeaseToken(d), nowNs()) { // through the other daemon
					t.Error("release false")
				}
			}
		}()
	}
	wg.Wait()
	if peak.Load() > 10 || peak.Load() < 2 || admitted.Load() < 20 {
		t.Fatalf("peak %d in flight (max 10), %d admitted", peak.Load(), admitted.Load())
	}
	t.Logf("peak %d, admitted %d of 2000", peak.Load(), admitted.Load())
}

// On a 3-master Redis Cluster, a lease whose parts are in different hash slots is taken
// all-or-nothing, and released through another daemon.
func TestGlobalLeasesCluster(t *testing.T) {
	cl := redistest.StartCluster(t)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	t.Cleanup(func() { cc.Close() })
	yaml := `
rules:
  - name: by-user
    key: user
    concurrency: { max: 2 }
    mode: global
  - name: by-tenant
    key: tenant
    concurrency: { max: 1 }
    mode: global
`
	a, b := globalLimiter(t, cc, yaml, "rl:"), globalLimiter(t, cc, yaml, "rl:")
	in := func(u string) *Input { return &Input{Attrs: attrs("user="+u, "tenant=acme"), Cost: 1} }
	if rlsync.Slot("rl:by-user:{user=gil}") == rlsync.Slot("rl:by-tenant:{tenant=acme}") {
		t.Fatal("the test needs two hash slots")
	}
	ok, tok, _ := acquire(t, a, in("gil"), 0)
	if !ok {
		t.Fatal("first refused")
	}
	ok, _, d := acquire(t, b, in("gil"), 0) // by-tenant full: by-user gives its slot back
	if ok || !d.Results[0].Allowed || d.Results[1].Allowed {
		t.Fatalf("second: %v %+v", ok, d.Results)
	}
	ctx := context.Background()
	if n := cc.ZCard(ctx, "rl:by-user:{user=gil}").Val(); n != 1 {
		t.Fatalf("by-user holds %d, want 1 (the refused lease gave its slot back)", n)
	}
	if !b.ReleaseLease(tok, nowNs()) {
		t.Fatal("release through b")
	}
	if n := cc.ZCard(ctx, "rl:by-tenant:{tenant=acme}").Val() + cc.ZCard(ctx, "rl:by-user:{user=gil}").Val(); n != 0 {
		t.Fatalf("%d members left after the release", n)
	}
	if ok, _, _ := acquire(t, b, in("gil"), 0); !ok {
		t.Fatal("refused after the release")
	}
}

// Expiry frees a global slot for everyone, and the acquiring daemon's sweep counts it
// expired (the leak signal); one released through another daemon is not.
func TestGlobalLeaseExpirySweep(t *testing.T) {
	rdb := realRedis(t)
	// The lease is long enough for the refusal and the renewal below to come before it
	// runs out on a loaded machine (each is one Redis round trip after an acquire; 50 ms
	// was not always).
	const lease = 250 * time.Millisecond
	yaml := fmt.Sprintf("rules:\n  - name: short\n    key: user\n    concurrency: { max: 1, lease: %v }\n    mode: global\n", lease)
	a, b := globalLimiter(t, rdb, yaml, "rl:"), globalLimiter(t, rdb, yaml, "rl:")
	in := &Input{Attrs: attrs("user=hal"), Cost: 1}
	if ok, _, _ := acquire(t, a, in, 0); !ok {
		t.Fatal("refused")
	}
	if ok, _, _ := acquire(t, b, in, 0); ok {
		t.Fatal("allowed over max")
	}
	time.Sleep(lease + 50*time.Millisecond)
	ok, tok, _ := acquire(t, b, &Input{Attrs: attrs("user=hal"), Cost: 1}, 0)
	if !ok {
		t.Fatal("an expired lease still holds its slot")
	}
	in2 := &Input{Attrs: attrs("user=ivy"), Cost: 1}
	_, tok2, _ := acquire(t, a, in2, 0)
	if !b.ReleaseLease(tok2, nowNs()) {
		t.Fatal("release of ivy's lease through b")
	}
	// jo's lease, taken on a, renewed through b for a minute: a's sweep keeps it.
	_, tok3, _ := acquire(t, a, &Input{Attrs: attrs("user=jo"), Cost: 1}, 0)
	if ok, _ := b.RenewLease(tok3, time.Minute, nowNs()); !ok {
		t.Fatal("renew of jo's lease through b")
	}
	time.Sleep(lease + 50*time.Millisecond)
	a.Sweep(nowNs() + int64(time.Second))
	if s := stats(a, "short"); s.Expired != 1 || s.InFlight != 1 {
		t.Fatalf("a's stats after its sweep: %+v, want 1 expired (hal), 1 in flight (jo, renewed through b)", s)
	}
	if !a.ReleaseLease(tok3, nowNs()) {
		t.Fatal("jo's renewed lease is not live")
	}
	if s := stats(a, "short"); s.InFlight != 0 || s.Released != 1 {
		t.Fatalf("a's stats after releasing jo: %+v", s)
	}
	_ = tok
}

// A global lease whose token would exceed what a release may carry (client keys of
// kilobytes) is not taken: the rule's on_store_failure decides, degraded.
func TestGlobalLeaseTokenTooLong(t *testing.T) {
	rdb := realRedis(t)
	l := globalLimiter(t, rdb, "rules:\n  - name: c\n    key: user\n    concurrency: { max: 2 }\n    mode: global\n    on_store_failure: closed\n", "rl:")
	// The longest key part a value can make, 4,096 bytes escaped (a value whose escaping
	// is longer is keyed by its digest), fits (it did not at MaxLeaseLen 2,048).
	ok, tok, d := acquire(t, l, &Input{Attrs: attrs("user=" + strings.Repeat("%", 1365) + "a"), Cost: 1}, 0)
	if !ok || len(tok) > proto.MaxLeaseLen || d.Degraded {
		t.Fatalf("user escaped to 4,096 bytes: allowed %v degraded %v token of %d bytes", ok, d.Degraded, len(tok))
	}
	if !l.ReleaseLease(tok, nowNs()) {
		t.Fatal("the long user's lease did not release")
	}
	// Nine such key parts (one rule, nine attributes) do not fit: the closed policy refuses.
	l = globalLimiter(t, rdb, "rules:\n  - name: c\n    key: [a, b, c, d, e, f, g, h, i]\n    concurrency: { max: 2 }\n    mode: global\n    on_store_failure: closed\n", "rl:")
	ok, tok, d = acquire(t, l, &Input{Attrs: attrs(longAttrs("abcdefghi")...), Cost: 1}, 0)
	if ok || tok != "" || !d.Degraded {
		t.Fatalf("nine 4096-byte key parts: allowed %v degraded %v token %d bytes; want refused by the closed policy", ok, d.Degraded, len(tok))
	}
}

// A global rate rule and a global concurrency rule on one request: when the lease is
// refused (full), the rate rule has consumed nothing (one script call decides both, see
// TestGlobalRateAndLeaseOneCall).
func TestGlobalLeaseRefundsGlobalRate(t *testing.T) {
	rdb := realRedis(t)
	l := globalLimiter(t, rdb, `
rules:
  - name: rate
    key: user
    limit: { requests: 10, per: 1h }
    mode: global
  - name: slots
    key: user
    concurrency: { max: 1 }
    mode: global
`, "rl:")
	in := &Input{Attrs: attrs("user=kim"), Cost: 1}
	if ok, _, _ := acquire(t, l, in, 0); !ok {
		t.Fatal("first refused")
	}
	for range 3 {
		if ok, _, d := acquire(t, l, in, 0); ok || d.Results[1].Allowed {
			t.Fatalf("allowed with the slot held: %+v", d.Results)
		}
	}
	_, _, d := acquire(t, l, &Input{Attrs: attrs("user=kim"), Cost: 0}, 0)
	if r := d.Results[0]; r.Remaining != 9 {
		t.Fatalf("rate remaining %d after 1 allowed and 3 lease refusals; want 9 (refunded)", r.Remaining)
	}
}

// LeaseWaits tells the daemon which releases and renews go to Redis (decided off the
// connection's fast path): a token with a global part, on a limiter with global mode;
// never a local token. It allocates nothing.
func TestLeaseWaits(t *testing.T) {
	rdb := realRedis(t)
	g := globalLimiter(t, rdb, globalLeaseRules, "rl:")
	local := New(mustRules(t, globalLeaseRules), localbucket.NewStore(localbucket.Options{}))
	_, global, _ := acquire(t, g, exportInput("dee"), 7)
	if global == "" || global[0] != globalTokenPrefix {
		t.Fatalf("global token %q", global)
	}
	loc := g.leases.Token(1)
	for _, tc := range []struct {
		name  string
		l     *Limiter
		token string
		want  bool
	}{
		{"local token", g, loc, false},
		{"global token", g, global, true},
		{"local and global joined", g, loc + tokenJoin + global, true},
		{"forged global (Redis says no)", g, "gAAAA", true},
		{"empty", g, "", false},
		{"global token, no global mode", local, global, false},
		{"local token, no global mode", local, loc, false},
	} {
		if got := tc.l.LeaseWaits(tc.token); got != tc.want {
			t.Errorf("%s: LeaseWaits(%q) = %v, want %v", tc.name, tc.token, got, tc.want)
		}
	}
	joined := loc + tokenJoin + global
	if n := testing.AllocsPerRun(100, func() { g.LeaseWaits(joined) }); n != 0 {
		t.Errorf("LeaseWaits allocates %v times", n)
	}
}

// A closed connection's global leases that Redis cannot release (frozen) stay tracked,
// ownerless, and in flight: Redis still holds their slots. The sweep then counts them
// expired (the leak signal) once they have run out, as for any lease never released.
func TestGlobalLeasesOwnerCloseRedisFrozen(t *testing.T) {
	srv, rdb := realRedisServer(t, time.Second)
	yaml := "rules:\n  - name: short\n    key: user\n    concurrency: { max: 5, lease: 200ms }\n    mode: global\n"
	a := globalLimiter(t, rdb, yaml, "rl:")
	for range 2 {
		if ok, _, _ := acquire(t, a, &Input{Attrs: attrs("user=kim"), Cost: 1}, 42); !ok {
			t.Fatal("refused")
		}
	}
	srv.Freeze()
	start := time.Now()
	n := a.ReleaseOwner(42, nowNs())
	srv.Thaw()
	if el := time.Since(start); n != 0 || el > 3*time.Second {
		t.Fatalf("ReleaseOwner with Redis frozen freed %d in %v; want 0, bounded", n, el)
	}
	if s := stats(a, "short"); s.InFlight != 2 || s.Closed != 0 {
		t.Fatalf("stats after a release Redis could not make: %+v; want 2 in flight, 0 closed", s)
	}
	time.Sleep(300 * time.Millisecond)
	a.Sweep(nowNs() + int64(time.Second))
	if s := stats(a, "short"); s.InFlight != 0 || s.Expired != 2 {
		t.Fatalf("stats after the sweep: %+v; want 0 in flight, 2 expired", s)
	}
	if a.ReleaseOwner(42, nowNs()) != 0 {
		t.Fatal("the owner still holds leases")
	}
}

// Global leases given up while Redis does not run their release (clients paused: the
// releases time out, their connections close, and Redis drops them unrun), one by its
// holder's release, two by their connection's close: once Redis answers, the sweep
// releases them, long before their lease (an hour) runs out, and counts them released
// and closed. Before, the release answered false and nothing sent it again: the three
// slots stayed held for the hour, in flight, their client refused at max 3.
func TestGlobalLeasesGivenUpWhileRedisAwayReleasedBySweep(t *testing.T) {
	srv, rdb := realRedisServer(t, time.Second)
	yaml := "rules:\n  - name: slots\n    key: user\n    concurrency: { max: 3, lease: 1h }\n    mode: global\n"
	a := globalLimiter(t, rdb, yaml, "rl:")
	in := &Input{Attrs: attrs("user=kim"), Cost: 1}
	var held string
	for i := range 3 {
		owner := uint64(42)
		if i == 2 {
			owner = 43
		}
		ok, token, _ := acquire(t, a, in, owner)
		if !ok {
			t.Fatalf("lease %d refused", i+1)
		}
		held = token
	}
	if ok, _, _ := acquire(t, a, in, 44); ok {
		t.Fatal("a fourth lease past max 3 admitted")
	}
	// Every client but the pausing one waits; those whose call times out close their
	// connection, and Redis drops their command unrun.
	// The releases give up after the client's timeout (1 s) each; the pause outlasts both.
	if out, err := srv.Command("CLIENT", "PAUSE", "6000", "ALL"); err != nil {
		t.Fatalf("CLIENT PAUSE: %q %v", out, err)
	}
	paused := time.Now()
	released := a.ReleaseLease(held, nowNs())
	freed := a.ReleaseOwner(42, nowNs())
	if el := time.Since(paused); el >= 6*time.Second {
		t.Fatalf("the releases took %s, past the pause: this test needs them to give up during it", el)
	}
	for { // the pause over (a PING on a connection of its own is answered)
		if out, err := srv.Command("PING"); err == nil && out == "PONG" {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if released || freed != 0 {
		t.Fatalf("with Redis paused: released %v, the closed connection's leases freed %d; want false, 0", released, freed)
	}
	ctx := context.Background()
	if n, err := rdb.ZCard(ctx, "rl:slots:{user=kim}").Result(); err != nil || n != 3 {
		t.Fatalf("slots held in Redis after the paused releases: %d (%v); want 3 (this test needs them unrun)", n, err)
	}
	a.Sweep(nowNs()) // long before the hour is out
	if n, err := rdb.ZCard(ctx, "rl:slots:{user=kim}").Result(); err != nil || n != 0 {
		t.Errorf("slots held in Redis after a sweep with Redis back: %d (%v); want 0", n, err)
	}
	if s := stats(a, "slots"); s.InFlight != 0 || s.Released != 1 || s.Closed != 2 {
		t.Errorf("stats after the sweep: %+v; want 0 in flight, 1 released, 2 closed", s)
	}
	if ok, _, _ := acquire(t, a, in, 44); !ok {
		t.Error("a lease after the sweep refused: the slots given up are still held")
	}
}

// scriptCalls returns how many EVAL and EVALSHA calls the masters behind rdb have served.
func scriptCalls(t *testing.T, rdb redis.UniversalClient) int64 {
	t.Helper()
	n, err := redistest.ScriptCalls(context.Background(), rdb)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A request matching a global rate rule and a global concurrency rule on one client (one
// hash slot) is decided by ONE script call, on a real redis-server and a real 3-master
// Cluster, all-or-nothing both ways: a full lease consumes nothing of the rate rule, a
// refusing rate rule holds no slot. Its lease is released and renewed as any (through
// another daemon), and its refusals carry the lease's retry hint.
func TestGlobalRateAndLeaseOneCall(t *testing.T) {
	yaml := `
rules:
  - name: rate
    key: user
    limit: { requests: 2, per: 1h }
    mode: global
  - name: slots
    key: user
    concurrency: { max: 1, lease: 1m }
    mode: global
`
	onRealRedises(t, yaml, func(t *testing.T, name string, rdb redis.UniversalClient, a, b *Limiter) {
		ctx := context.Background()
		in := func(cost uint64) *Input { return &Input{Attrs: attrs("user=lu-" + name), Cost: cost} }
		slots := "rl:slots:{user=lu-" + name + "}"
		rateLeft := func() uint64 {
			t.Helper()
			_, _, d := acquire(t, a, in(0), 0) // a peek, holding nothing
			return d.Results[0].Remaining
		}
		if rateLeft() != 2 { // and the script is loaded on the client's node
			t.Fatal("fresh rate rule")
		}
		calls := func(f func()) int64 {
			t.Helper()
			before := scriptCalls(t, rdb)
			f()
			return scriptCalls(t, rdb) - before
		}

		var tok string
		if n := calls(func() {
			var ok bool
			var d *Decision
			ok, tok, d = acquire(t, a, in(1), 0)
			if !ok || tok == "" || d.Degraded || d.Results[1].Remaining != 0 || d.Results[0].Remaining != 1 {
				t.Fatalf("first: allowed %v token %q %+v", ok, tok, d.Results)
			}
		}); n != 1 {
			t.Fatalf("a rate rule and a lease on one client made %d script calls, want 1", n)
		}
		if n := calls(func() {
			ok, tok2, d := acquire(t, b, in(1), 0)
			if ok || tok2 != "" || d.Results[1].Allowed || d.Results[1].RetryAfter <= 0 || d.Results[1].RetryAfter > time.Second {
				t.Fatalf("full lease: allowed %v token %q %+v", ok, tok2, d.Results)
			}
		}); n != 1 {
			t.Fatalf("a refusal made %d script calls, want 1", n)
		}
		if rateLeft() != 1 {
			t.Fatal("a request refused by its lease consumed the rate rule")
		}
		if ok, in := b.RenewLease(tok, 2*time.Minute, nowNs()); !ok || in != 2*time.Minute {
			t.Fatalf("renew through the other daemon: %v %v", ok, in)
		}
		if !b.ReleaseLease(tok, nowNs()) || a.ReleaseLease(tok, nowNs()) {
			t.Fatal("release through the other daemon, then again")
		}
		ok, tok, _ := acquire(t, b, in(1), 0) // the rate rule's last unit
		if !ok || !b.ReleaseLease(tok, nowNs()) || rateLeft() != 0 {
			t.Fatal("second lease")
		}
		ok, tok, d := acquire(t, a, in(1), 0)
		if ok || tok != "" || d.Results[0].Allowed || !d.Results[1].Allowed || d.Results[1].Remaining != 1 {
			t.Fatalf("rate refused: allowed %v token %q %+v; want the free slot reported", ok, tok, d.Results)
		}
		if n := rdb.ZCard(ctx, slots).Val(); n != 0 {
			t.Fatalf("a request refused by its rate rule holds %d slots", n)
		}
		if s := stats(a, "slots"); s.InFlight != 0 { // the refused request tracks no lease
			t.Fatalf("a's stats %+v, want nothing in flight", s)
		}
	})
}

// With Redis down, a check with a global rate rule and a global concurrency rule (one
// script call when Redis is up) follows each rule's own on_store_failure: the call's
// error reaches both, degraded (unless the rate rule's closed policy has refused
// already: the lease is then not asked, as any store after a refusal).
func TestGlobalRateAndLeaseRedisDown(t *testing.T) {
	for _, tc := range []struct {
		rate, slots string
		allowed     bool
		local       bool // a local lease taken
	}{
		{"open", "open", true, false},
		{"open", "local", true, true},
		{"open", "closed", false, false},
		{"closed", "open", false, false},
		{"local", "local", true, true},
	} {
		t.Run(tc.rate+"-"+tc.slots, func(t *testing.T) {
			l := globalLimiter(t, unreachable(t), `
rules:
  - name: rate
    key: user
    limit: { requests: 10, per: 1h }
    mode: global
    on_store_failure: `+tc.rate+`
  - name: slots
    key: user
    concurrency: { max: 2 }
    mode: global
    on_store_failure: `+tc.slots+"\n", "rl:")
			ok, tok, d := acquire(t, l, &Input{Attrs: attrs("user=max"), Cost: 1}, 0)
			// A rate rule that refuses by its policy leaves the lease unasked (skipped).
			slotsAsked := tc.rate != "closed"
			if ok != tc.allowed || !d.Degraded || !d.Results[0].Degraded || d.Results[1].Degraded != slotsAsked {
				t.Fatalf("allowed %v degraded %v %+v; want %v, degraded", ok, d.Degraded, d.Results, tc.allowed)
			}
			if (tok != "") != (tc.local && tc.allowed) || strings.HasPrefix(tok, "g") {
				t.Fatalf("token %q", tok)
			}
			if l.Leases().Len() != 0 && !tc.allowed {
				t.Fatal("a refused check holds a local lease")
			}
		})
	}
}

// A check whose global lease's token would be too long (a client key of kilobytes) with
// a global rate rule beside it: the lease falls to its on_store_failure (closed: the
// check is refused) and the rate rule, taken in the same call, is given back.
func TestGlobalRateAndLeaseTokenTooLong(t *testing.T) {
	rdb := realRedis(t)
	l := globalLimiter(t, rdb, `
rules:
  - name: rate
    key: user
    limit: { requests: 10, per: 1h }
    mode: global
  - name: slots
    key: [user, a, b, c, d, e, f, g, h]
    concurrency: { max: 2 }
    mode: global
    on_store_failure: closed
`, "rl:")
	in := attrs(append(longAttrs("abcdefgh"), "user="+strings.Repeat("u", 4096))...) // 4 KiB of key per attribute
	ok, tok, d := acquire(t, l, &Input{Attrs: in, Cost: 1}, 0)
	if ok || tok != "" || !d.Results[1].Degraded || d.Results[0].Degraded {
		t.Fatalf("allowed %v token %d bytes %+v; want refused by the lease's closed policy", ok, len(tok), d.Results)
	}
	_, _, d = acquire(t, l, &Input{Attrs: in, Cost: 0}, 0)
	if r := d.Results[0].Remaining; r != 10 {
		t.Fatalf("rate remaining %d, want 10 (given back)", r)
	}
}

// A client whose requests a local limit refuses, retrying without pause, holds nothing of
// a small Redis-backed rule meanwhile: another request for the same key, asking it with
// cost 0, is never refused while they run (it was, nearly always, when the Redis stores
// took first and gave back after the local refusal), in either Redis mode.
func TestRefusedLocallyHoldsNothingInRedis(t *testing.T) {
	rdb := realRedis(t)
	for _, mode := range []string{"hybrid", "global"} {
		l := globalLimiter(t, rdb, `
rules:
  - name: small
    key: user
    mode: `+mode+`
    limit: { requests: 1, per: 60s }
`, "rl:"+mode+":")
		spent := Inline{Key: "z", Limit: 1, WindowMs: 3_600_000, Mode: "local"}
		if ok, _, _ := acquire(t, l, &Input{Attrs: attrs("user=other"), Limits: []Inline{spent}, Cost: 1}, 0); !ok {
			t.Fatal("spending the inline limit")
		}
		stop := make(chan struct{})
		var wg gosync.WaitGroup
		wg.Add(1)
		go func() { // the refused client
			defer wg.Done()
			d := &Decision{}
			in := &Input{Attrs: attrs("user=u"), Limits: []Inline{spent}, Cost: 1}
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := l.Check(nowNs(), in, d); err != nil || d.Allowed {
					t.Errorf("%s: the refused client: allowed %v, err %v", mode, d.Allowed, err)
					return
				}
			}
		}()
		asks, refused := asksFor(t, l, &Input{Attrs: attrs("user=u"), Cost: 0}, &Decision{}, 500*time.Millisecond)
		close(stop)
		wg.Wait()
		if refused != 0 {
			t.Errorf("%s: %d of %d asks refused while another request of the key was being refused", mode, refused, asks)
		}
	}
}

// A global lease released (or its connection closed) after it ran out is counted
// expired, the leak signal: a request that outlived its lease. It was counted nowhere
// when the release came before the sweep reached it (found by a lease audit), where a
// local lease released late is counted expired.
func TestGlobalLeaseReleasedLateCountsExpired(t *testing.T) {
	rdb := realRedis(t)
	yaml := "rules:\n  - name: short\n    key: user\n    concurrency: { max: 2, lease: 50ms }\n    mode: global\n"
	a := globalLimiter(t, rdb, yaml, "rl:")
	_, tok, _ := acquire(t, a, &Input{Attrs: attrs("user=kim"), Cost: 1}, 0)
	acquire(t, a, &Input{Attrs: attrs("user=lou"), Cost: 1}, 7) // held by connection 7
	time.Sleep(80 * time.Millisecond)
	if a.ReleaseLease(tok, nowNs()) {
		t.Fatal("a lease that ran out was freed")
	}
	if s := stats(a, "short"); s.Expired != 1 || s.Released != 0 || s.InFlight != 1 {
		t.Fatalf("after a late release: %+v, want 1 expired, 1 in flight", s)
	}
	a.ReleaseOwner(7, nowNs()) // its connection closes after the lease ran out
	if s := stats(a, "short"); s.Expired != 2 || s.Closed != 0 || s.InFlight != 0 {
		t.Fatalf("after a late close: %+v, want 2 expired", s)
	}
}

// A global lease released through another daemon is not counted expired by the daemon
// that took it when its connection closes after the lease's expiry as that daemon knew
// it: the other daemon counted it released, and Redis no longer holds it. Before, the
// close counted every lease it did not free and past that expiry as expired, so one
// lease counted once released and once expired across the fleet, and the leak alert
// (RlsidecarLeasesExpired) fired for a lease released in time. A lease Redis holds
// expired is still counted expired at the close (TestGlobalLeaseReleasedLateCountsExpired).
func TestGlobalLeaseReleasedElsewhereNotExpiredAtClose(t *testing.T) {
	rdb := realRedis(t)
	yaml := "rules:\n  - name: short\n    key: user\n    concurrency: { max: 2, lease: 50ms }\n    mode: global\n"
	a := globalLimiter(t, rdb, yaml, "rel-else:")
	b := globalLimiter(t, rdb, yaml, "rel-else:")
	_, tok, _ := acquire(t, a, &Input{Attrs: attrs("user=kim"), Cost: 1}, 7) // held by a's connection 7
	if !b.ReleaseLease(tok, nowNs()) {
		t.Fatal("release through the other daemon: false")
	}
	time.Sleep(80 * time.Millisecond) // past the lease as a knows it; no sweep has run
	a.ReleaseOwner(7, nowNs())
	if s := stats(a, "short"); s.Expired != 0 || s.Closed != 0 || s.InFlight != 0 {
		t.Fatalf("the daemon that took it, after its connection closed: %+v, want nothing counted", s)
	}
	if s := stats(b, "short"); s.Released != 1 {
		t.Fatalf("the daemon it was released through: %+v, want 1 released", s)
	}
}

// longAttrs returns an attribute named by each letter of names, each valued at 4,096
// bytes kept as they are: the longest key part a value makes.
func longAttrs(names string) []string {
	var out []string
	for _, n := range names {
		out = append(out, string(n)+"="+strings.Repeat(string(n), 4096))
	}
	return out
}

// A request whose cost is above a rate rule's capacity, on a path that also takes a
// global concurrency rule's slot: the rate rule decides (it can never pass), and the
// concurrency rule, which takes one slot whatever the cost and was not asked, reports
// itself allowed, not "cost exceeds capacity" (which it never is). Found by an audit:
// with Redis the concurrency rule said cost_exceeds_capacity and decided the refusal,
// naming the wrong rule and limit to the client; local mode was right.
func TestGlobalLeaseNotImpossibleByCost(t *testing.T) {
	rdb := realRedis(t)
	for _, mode := range []string{"global", "local"} {
		l := globalLimiter(t, rdb, `
rules:
  - name: cr
    match: { path: "/cr" }
    key: user
    concurrency: { max: 3, lease: 10s }
    mode: `+mode+`
  - name: rr
    match: { path: "/cr" }
    key: user
    limit: { requests: 5, per: 10s }
    mode: local
`, "rl:"+mode+"cost:")
		ok, _, d := acquire(t, l, &Input{Attrs: attrs("user=u", "path=/cr"), Cost: 6}, 0)
		if ok {
			t.Fatalf("%s: cost 6 above rr's capacity 5 allowed", mode)
		}
		if dec := d.Results[d.Deciding]; dec.Name != "rr" || !dec.Impossible {
			t.Errorf("%s: deciding %q (impossible %v), want rr, which can never pass cost 6", mode, dec.Name, dec.Impossible)
		}
		for _, r := range d.Results {
			if r.Name == "cr" && (r.Impossible || !r.Allowed) {
				t.Errorf("%s: cr: allowed %v, impossible %v: a concurrency rule takes one slot whatever the cost", mode, r.Allowed, r.Impossible)
			}
		}
	}
}

// A check whose first global concurrency rule is a shadow one that is full holds a slot
// of the second only: its member in Redis is "<id>:1", part 1 of the check's ops. Its
// token must still release and renew it, through any daemon. Before, the token numbered
// its parts by their place among the parts held (0), so the release looked for "<id>:0"
// and answered false, and the slot stayed held until its lease ran out.
func TestGlobalLeaseAfterFullShadowReleases(t *testing.T) {
	rdb := realRedis(t)
	const yaml = `
rules:
  - name: sa
    key: u
    concurrency: { max: 1, lease: 60s }
    shadow: true
    mode: global
  - name: b
    key: v
    concurrency: { max: 5, lease: 60s }
    mode: global
  - name: c
    key: w
    concurrency: { max: 5, lease: 60s }
    mode: global
  - name: sz
    key: z
    concurrency: { max: 1, lease: 60s }
    shadow: true
    mode: global
`
	a := globalLimiter(t, rdb, yaml, "shfull:")
	b := globalLimiter(t, rdb, yaml, "shfull:")
	for _, in := range []*Input{{Attrs: attrs("u=1"), Cost: 1}, {Attrs: attrs("z=1"), Cost: 1}} {
		if ok, tok, _ := acquire(t, a, in, 0); !ok || tok == "" {
			t.Fatalf("filling the shadow rule: allowed %v token %q", ok, tok)
		}
	}
	held := func(key string) int64 { return rdb.ZCard(context.Background(), key).Val() }
	for _, tc := range []struct {
		in      *Input
		version byte // the token's: 1 while its parts are numbered 0, 1, ...
	}{
		{&Input{Attrs: attrs("u=1", "v=1"), Cost: 1}, 2},
		{&Input{Attrs: attrs("u=1", "v=1", "w=1"), Cost: 1}, 2},
		{&Input{Attrs: attrs("v=1", "w=1", "z=1"), Cost: 1}, 1}, // the full shadow last
	} {
		in := tc.in
		ok, tok, d := acquire(t, a, in, 0)
		shadow := d.Results[0]
		if tc.version == 1 {
			shadow = d.Results[len(d.Results)-1]
		}
		if !ok || tok == "" || shadow.Allowed {
			t.Fatalf("%v: allowed %v token %q, shadow allowed %v; want allowed with a lease, the shadow refused",
				in.Attrs, ok, tok, shadow.Allowed)
		}
		if raw, err := base64.RawURLEncoding.DecodeString(tok[1:]); err != nil || raw[0] != tc.version {
			t.Errorf("%v: token %q version %v (%v), want %d", in.Attrs, tok, raw[0], err, tc.version)
		}
		if ok, left := b.RenewLease(tok, time.Minute, nowNs()); !ok || left != time.Minute {
			t.Errorf("%v: renew through the other daemon: %v %v, want true 1m", in.Attrs, ok, left)
		}
		if !b.ReleaseLease(tok, nowNs()) {
			t.Errorf("%v: release through the other daemon: false", in.Attrs)
		}
		if a.ReleaseLease(tok, nowNs()) {
			t.Errorf("%v: second release: true", in.Attrs)
		}
		if n, m := held("shfull:b:{v=1}"), held("shfull:c:{w=1}"); n != 0 || m != 0 {
			t.Fatalf("%v: after the release b holds %d slots and c %d, want 0", in.Attrs, n, m)
		}
	}
}

// A global lease renewed through another daemon is still held for the connection that
// took it: HoldsLeases (which keeps an idle connection open past --idle-timeout) asks
// Redis once this daemon's own view says the lease ran out. Before, it went by that view
// alone, so the idle timeout cut the connection at the lease's first expiry and its
// close released in Redis the lease the other daemon had renewed, its request still
// running.
func TestGlobalLeaseRenewedElsewhereStillHeld(t *testing.T) {
	rdb := realRedis(t)
	const yaml = `
rules:
  - name: cg
    key: u
    concurrency: { max: 1, lease: 1s }
    mode: global
`
	a := globalLimiter(t, rdb, yaml, "renewel:")
	b := globalLimiter(t, rdb, yaml, "renewel:")
	const owner = 7
	ok, tok, _ := acquire(t, a, &Input{Attrs: attrs("u=1"), Cost: 1}, owner)
	if !ok || tok == "" {
		t.Fatalf("allowed %v token %q", ok, tok)
	}
	if ok, _ := b.RenewLease(tok, time.Minute, nowNs()); !ok {
		t.Fatal("renew through the other daemon: false")
	}
	later := nowNs() + int64(2*time.Second) // past the lease as a knew it
	if !a.HoldsLeases(owner, later) {
		t.Fatal("HoldsLeases false for a lease renewed through the other daemon for a minute")
	}
	if ok, _, _ := acquire(t, b, &Input{Attrs: attrs("u=1"), Cost: 1}, 0); ok {
		t.Fatal("the renewed lease's slot is free")
	}
	// Released through the other daemon: no longer held.
	if !b.ReleaseLease(tok, nowNs()) {
		t.Fatal("release through the other daemon: false")
	}
	if a.HoldsLeases(owner, later+int64(time.Minute)) {
		t.Fatal("HoldsLeases true for a lease released through the other daemon")
	}
}

// The bound on live leases holds for global leases too: each is tracked by the daemon
// that took it (about 550 bytes). Past the bound a check matching a global concurrency
// rule is refused as if full, takes nothing in Redis (its rate rules in the same call
// not charged either), and is counted capped; a release makes room. Before, the bound
// counted local leases only, so a daemon's global leases (a gateway leaking them, with a
// long lease) grew its memory without bound.
func TestGlobalLeasesBound(t *testing.T) {
	rdb := realRedis(t)
	const yaml = `
rules:
  - name: cg
    key: user
    concurrency: { max: 5, lease: 1h }
    mode: global
  - name: rate
    match: { path: /rated }
    key: user
    limit: { requests: 100, per: 1h }
    mode: global
  - name: cl
    match: { path: /local }
    key: user
    concurrency: { max: 5, lease: 1h }
    mode: local
`
	l := globalLimiter(t, rdb, yaml, "bound:")
	l.Leases().SetMax(2)
	_, a, _ := acquire(t, l, &Input{Attrs: attrs("user=ann"), Cost: 1}, 0)
	if ok, _, _ := acquire(t, l, &Input{Attrs: attrs("user=bob"), Cost: 1}, 0); !ok || a == "" {
		t.Fatal("the first two leases refused")
	}
	for _, in := range []*Input{
		{Attrs: attrs("user=cid"), Cost: 1},
		{Attrs: attrs("user=cid", "path=/rated"), Cost: 1}, // one script call with the rate rule
		{Attrs: attrs("user=cid", "path=/local"), Cost: 1}, // a local lease counts them too
	} {
		ok, tok, d := acquire(t, l, in, 0)
		if ok || tok != "" || d.Results[0].Allowed || d.Results[0].RetryAfter != time.Second {
			t.Fatalf("%v past a bound of 2: allowed %v lease %q cg %+v; want refused as full", in.Attrs, ok, tok, d.Results[0])
		}
	}
	if n := l.Leases().Capped(); n != 3 {
		t.Errorf("capped %d, want 3", n)
	}
	if n := rdb.ZCard(context.Background(), "bound:cg:{user=cid}").Val(); n != 0 {
		t.Fatalf("Redis holds %d slots of the refused checks", n)
	}
	var d Decision
	if err := l.Check(nowNs(), &Input{Attrs: attrs("user=cid", "path=/rated"), Cost: 0}, &d); err != nil {
		t.Fatal(err)
	}
	if r := d.Results[1]; r.Name != "rate" || r.Remaining != 100 {
		t.Fatalf("the refused check charged the rate rule: %+v", r)
	}
	if !l.ReleaseLease(a, nowNs()) {
		t.Fatal("release: false")
	}
	if ok, _, _ := acquire(t, l, &Input{Attrs: attrs("user=cid"), Cost: 1}, 0); !ok {
		t.Fatal("refused after a release made room")
	}
}

// The bound on live leases counts the bytes of a global lease's keys too: leases on
// distinct 4,000-byte keys (a client's own API key), each tracked with its keys and its
// token until it is seen freed, stop at the bound's worth of memory. Before, each
// counted as one lease: 200 of them under a bound of 200 held 1.9 MB of keys and tokens.
func TestGlobalLeasesBoundCountsKeyBytes(t *testing.T) {
	rdb := realRedis(t)
	l := globalLimiter(t, rdb, `
rules:
  - name: cg
    key: api_key
    concurrency: { max: 1, lease: 1h }
    mode: global
`, "bytes:")
	const bound = 200
	l.Leases().SetMax(bound)
	var toks []string
	for i := range bound {
		if ok, tok, _ := acquire(t, l, &Input{Attrs: attrs(fmt.Sprintf("api_key=%08d%s", i, strings.Repeat("k", 3992))), Cost: 1}, 0); ok {
			toks = append(toks, tok)
		}
	}
	ls := l.Leases()
	ls.mu.Lock()
	held, units := 0, 0
	for _, gl := range ls.global {
		held += len(gl.token)
		for _, p := range gl.parts {
			held += len(p.Key)
		}
		units += gl.keyUnits()
	}
	ku := ls.keyUnits
	ls.mu.Unlock()
	if units != ku {
		t.Fatalf("keyUnits %d, the tracked leases' keys take %d", ku, units)
	}
	// The bound is checked before a lease is taken: the last one may pass it by its own
	// keys (about 9 KB here).
	if limit := 2 * bound * slotKeyUnit; held > limit || len(toks) == 0 {
		t.Fatalf("%d global leases tracked with %d bytes of keys and tokens; want some, with at most %d", len(toks), held, limit)
	}
	for _, tok := range toks {
		if !l.ReleaseLease(tok, nowNs()) {
			t.Fatal("release: false")
		}
	}
	ls.mu.Lock()
	ku, n := ls.keyUnits, len(ls.global)
	ls.mu.Unlock()
	if ku != 0 || n != 0 {
		t.Fatalf("keyUnits %d with %d global leases tracked, after every one was released", ku, n)
	}
}

// Global leases released through another daemon stay tracked by the daemon that took
// them (it cannot know) until their expiry; at the bound on live leases that daemon asks
// Redis about the global leases it tracks and forgets those gone, so such releases do not
// keep it refusing. (With 1h leases released through the other daemons, a daemon taking
// 300 a second would otherwise hold the bound after an hour, and refuse every check of a
// concurrency rule.)
func TestGlobalLeasesBoundReleasedElsewhere(t *testing.T) {
	rdb := realRedis(t)
	const yaml = `
rules:
  - name: cg
    key: user
    concurrency: { max: 5, lease: 1h }
    mode: global
`
	a := globalLimiter(t, rdb, yaml, "boundel:")
	b := globalLimiter(t, rdb, yaml, "boundel:")
	a.Leases().SetMax(2)
	var toks []string
	for _, u := range []string{"ann", "bob"} {
		ok, tok, _ := acquire(t, a, &Input{Attrs: attrs("user=" + u), Cost: 1}, 0)
		if !ok {
			t.Fatal("the first two leases refused")
		}
		toks = append(toks, tok)
	}
	if ok, _, _ := acquire(t, a, &Input{Attrs: attrs("user=cid"), Cost: 1}, 0); ok {
		t.Fatal("a third lease past a bound of 2 allowed")
	}
	for _, tok := range toks {
		if !b.ReleaseLease(tok, nowNs()) {
			t.Fatal("release through the other daemon: false")
		}
	}
	time.Sleep(relieveEvery + 50*time.Millisecond) // the refusal above asked Redis last
	if ok, _, _ := acquire(t, a, &Input{Attrs: attrs("user=cid"), Cost: 1}, 0); !ok {
		t.Fatal("refused at the bound though both leases were released through the other daemon")
	}
}

// A global lease over two rules of different leases, renewed (through another daemon)
// after its shorter part ran out by Redis's clock, is not renewed, on a real redis-server
// and a real 3-master Cluster; before, lease.lua renewed the part still live and the
// answer was renewed: true. Its live part keeps its slot until released.
func TestGlobalLeaseRenewAfterAPartRanOut(t *testing.T) {
	yaml := `
rules:
  - name: quick
    key: user
    concurrency: { max: 1, lease: 200ms }
    mode: global
  - name: slow
    key: user
    concurrency: { max: 1, lease: 1m }
    mode: global
`
	onRealRedises(t, yaml, func(t *testing.T, _ string, _ redis.UniversalClient, a, b *Limiter) {
		in := &Input{Attrs: attrs("user=ren"), Cost: 1}
		ok, tok, _ := acquire(t, a, in, 1)
		if !ok || tok == "" {
			t.Fatal("refused")
		}
		if renewed, _ := b.RenewLease(tok, 0, nowNs()); !renewed {
			t.Fatal("renew while both parts are live said false")
		}
		time.Sleep(400 * time.Millisecond) // quick's part runs out (200 ms)
		if renewed, in := b.RenewLease(tok, 0, nowNs()); renewed {
			t.Fatalf("renew after quick's part ran out: renewed, first part in %v; want false", in)
		}
		if ok, _, _ := acquire(t, b, &Input{Attrs: attrs("user=ren"), Cost: 1}, 2); ok {
			t.Fatal("a second request took the slot slow's live part holds")
		}
		if !b.ReleaseLease(tok, nowNs()) {
			t.Fatal("release of the live part said false")
		}
		if ok, _, _ := acquire(t, b, &Input{Attrs: attrs("user=ren"), Cost: 1}, 2); !ok {
			t.Fatal("refused after the release")
		}
	})
}

// onRealRedises runs f on two limiters (two daemons) with the rules yaml, sharing a real
// redis-server, then a real 3-master Cluster: name is "standalone" or "cluster".
func onRealRedises(t *testing.T, yaml string, f func(t *testing.T, name string, rdb redis.UniversalClient, a, b *Limiter)) {
	cl := redistest.StartCluster(t)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	t.Cleanup(func() { cc.Close() })
	for _, tc := range []struct {
		name string
		rdb  redis.UniversalClient
	}{{"standalone", realRedis(t)}, {"cluster", cc}} {
		t.Run(tc.name, func(t *testing.T) {
			f(t, tc.name, tc.rdb, globalLimiter(t, tc.rdb, yaml, "rl:"), globalLimiter(t, tc.rdb, yaml, "rl:"))
		})
	}
}

// A lease over a local and a global concurrency rule whose global part ran out is not
// renewed, and its local part keeps its expiry (proto/PROTOCOL.md: "its other slots left
// as they were"), whether the renewal asks each rule's own lease or an hour. Before, the
// local part was extended before the global part was refused: renewed: false, and the
// local slot held a whole lease longer (an hour with lease_ms 3,600,000) by a request the
// gateway had been told had lost its lease.
func TestMixedLeaseRenewRefusedKeepsLocalExpiry(t *testing.T) {
	yaml := `
rules:
  - name: quick
    key: user
    concurrency: { max: 5, lease: 200ms }
    mode: global
  - name: here
    key: user
    concurrency: { max: 1, lease: 1m }
    mode: local
`
	for _, d := range []time.Duration{0, time.Hour} {
		t.Run(fmt.Sprint(d), func(t *testing.T) {
			l := globalLimiter(t, realRedis(t), yaml, fmt.Sprintf("mixren%d:", d))
			user := attrs("user=mix")
			t0 := nowNs()
			dec := &Decision{Owner: 1}
			if err := l.Check(t0, &Input{Attrs: user, Cost: 1}, dec); err != nil || !dec.Allowed {
				t.Fatalf("acquire: %v %+v", err, dec.Results)
			}
			tok := l.LeaseToken(dec)
			if !strings.Contains(tok, tokenJoin) {
				t.Fatalf("token %q: want a local and a global half", tok)
			}
			time.Sleep(400 * time.Millisecond) // quick's part runs out in Redis (200 ms)
			if renewed, in := l.RenewLease(tok, d, nowNs()); renewed {
				t.Fatalf("renew after the global part ran out: renewed, first part in %v; want false", in)
			}
			// Just past the local part's own lease, its slot is free again.
			later := t0 + int64(time.Minute) + int64(100*time.Millisecond)
			dec = &Decision{Owner: 2}
			if err := l.Check(later, &Input{Attrs: user, Cost: 1}, dec); err != nil {
				t.Fatal(err)
			}
			if !dec.Allowed {
				t.Fatalf("refused just past the local part's lease: %+v; the refused renewal extended it", dec.Results)
			}
		})
	}
}

// A client whose requests a local concurrency rule refuses (its one slot held), retrying
// without pause, holds nothing of a Redis-backed rule of the tenant meanwhile: another
// user's ask (cost 0) is never refused while they run, the tenant's rule having room for
// it, whether that rule is a global concurrency rule or a rate rule in global or hybrid
// mode. Before, the local concurrency rule was decided only by its own take, after the
// Redis store had taken for the request; the slot or unit was given back a round trip
// later and held meanwhile: on the real daemon, with two daemons on one Redis, 5,129 of
// 7,238 asks on the other daemon were refused in 2 s.
func TestRefusedByLocalLeaseHoldsNothingInRedis(t *testing.T) {
	rdb := realRedis(t)
	for _, tc := range []struct{ name, rule string }{
		{"global-lease", "concurrency: { max: 2, lease: 1m }\n    mode: global"},
		{"global-rate", "limit: { requests: 2, per: 1h }\n    mode: global"},
		{"hybrid-rate", "limit: { requests: 2, per: 1h }\n    mode: hybrid"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := globalLimiter(t, rdb, `
rules:
  - name: tenant
    key: tenant
    `+tc.rule+`
  - name: peruser
    key: user
    concurrency: { max: 1, lease: 1m }
    mode: local
`, "rl:"+tc.name+":")
			ann := &Input{Attrs: attrs("tenant=acme", "user=ann"), Cost: 1}
			if ok, _, _ := acquire(t, l, ann, 1); !ok {
				t.Fatal("ann's first request")
			}
			stop := make(chan struct{})
			var wg gosync.WaitGroup
			wg.Add(1)
			go func() { // ann, refused by her local slot
				defer wg.Done()
				d := &Decision{Owner: 2}
				for {
					select {
					case <-stop:
						return
					default:
					}
					if err := l.Check(nowNs(), ann, d); err != nil || d.Allowed {
						t.Errorf("ann: allowed %v, err %v", d.Allowed, err)
						return
					}
				}
			}()
			bob := &Input{Attrs: attrs("tenant=acme", "user=bob"), Cost: 0}
			asks, refused := asksFor(t, l, bob, &Decision{Owner: 3}, 500*time.Millisecond)
			close(stop)
			wg.Wait()
			if refused != 0 {
				t.Errorf("%d of %d asks refused while ann's requests were being refused by her local slot", refused, asks)
			}
		})
	}
}

// A lease over a local and a global concurrency rule, released while Redis cannot be
// reached, answers released: false (PROTOCOL.md: false when a global release cannot reach
// Redis), its local slot freed all the same; released again once Redis is back, it frees
// the global slot and answers true; a third time, false. Before, the first release
// answered true, its global slot still held in Redis, and a client had no cause to
// release it again.
func TestMixedLeaseReleaseRedisFrozen(t *testing.T) {
	srv, rdb := realRedisServer(t, time.Second)
	yaml := `
rules:
  - name: shared
    key: user
    concurrency: { max: 5, lease: 1m }
    mode: global
  - name: here
    key: user
    concurrency: { max: 1, lease: 1m }
    mode: local
`
	l := globalLimiter(t, rdb, yaml, "mixrel:")
	user := attrs("user=mia")
	dec := &Decision{Owner: 1}
	if err := l.Check(nowNs(), &Input{Attrs: user, Cost: 1}, dec); err != nil || !dec.Allowed {
		t.Fatalf("acquire: %v %+v", err, dec.Results)
	}
	tok := l.LeaseToken(dec)
	if !strings.Contains(tok, tokenJoin) {
		t.Fatalf("token %q: want a local and a global half", tok)
	}
	held := func() int64 {
		t.Helper()
		keys, err := rdb.Keys(context.Background(), "mixrel:*").Result()
		if err != nil || len(keys) != 1 {
			t.Fatalf("keys %v, %v; want the global rule's one", keys, err)
		}
		return rdb.ZCard(context.Background(), keys[0]).Val()
	}
	if n := held(); n != 1 {
		t.Fatalf("%d global slots held after the acquire, want 1", n)
	}
	srv.Freeze()
	released := l.ReleaseLease(tok, nowNs())
	srv.Thaw()
	if released {
		t.Fatal("release with Redis frozen: released true, its global slot still held")
	}
	if n := held(); n != 1 {
		t.Fatalf("%d global slots held after the failed release, want 1", n)
	}
	// The local slot is free: another request of the user takes it (its global part too).
	dec2 := &Decision{Owner: 2}
	if err := l.Check(nowNs(), &Input{Attrs: user, Cost: 1}, dec2); err != nil || !dec2.Allowed {
		t.Fatalf("a second request after the local part's release: %v %+v", err, dec2.Results)
	}
	if !l.ReleaseLease(tok, nowNs()) {
		t.Fatal("released again with Redis back: false, want true (its global slot freed)")
	}
	if n := held(); n != 1 { // the second request's
		t.Fatalf("%d global slots held after the second release, want 1", n)
	}
	if l.ReleaseLease(tok, nowNs()) {
		t.Fatal("released a third time: true, want false")
	}
}

// asksFor checks in with l, into d, again and again for dur, and returns how many checks
// it made and how many of them were refused.
func asksFor(t *testing.T, l *Limiter, in *Input, d *Decision, dur time.Duration) (asks, refused int) {
	t.Helper()
	for deadline := time.Now().Add(dur); time.Now().Before(deadline); asks++ {
		if err := l.Check(nowNs(), in, d); err != nil {
			t.Fatal(err)
		}
		if !d.Allowed {
			refused++
		}
	}
	return asks, refused
}

// On a Redis Cluster, a global lease whose parts are on two masters, given up (its
// connection closed) while one master does not answer (its clients paused): the part on
// the master that answered is freed, the other's release times out. Once that master
// answers, the sweep releases the part left, long before the lease (an hour) runs out,
// and the lease is counted closed once. Before, the part freed made the lease count
// closed at once, forgotten: the other part held its slot for the whole hour, and every
// client of that rule's key was refused.
func TestGlobalLeasePartlyReleasedOnClusterReleasedBySweep(t *testing.T) {
	cl := redistest.StartCluster(t)
	rdb, err := rlsync.Open(rlsync.Config{Cluster: cl.Addrs, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	cc := rdb.(*redis.ClusterClient)
	yaml := `
rules:
  - name: by-user
    key: user
    concurrency: { max: 1, lease: 1h }
    mode: global
  - name: by-tenant
    key: tenant
    concurrency: { max: 1, lease: 1h }
    mode: global
`
	a := globalLimiter(t, rdb, yaml, "rl:")
	ctx := context.Background()
	tenantKey := "rl:by-tenant:{tenant=acme}"
	tm, err := cc.MasterForKey(ctx, tenantKey)
	if err != nil {
		t.Fatal(err)
	}
	user := "" // one whose key is on another master than the tenant's
	for i := 0; i < 1000 && user == ""; i++ {
		u := fmt.Sprint("u", i)
		if m, err := cc.MasterForKey(ctx, "rl:by-user:{user="+u+"}"); err == nil && m.Options().Addr != tm.Options().Addr {
			user = u
		}
	}
	var paused *redistest.Server
	for _, n := range cl.Nodes {
		if n.Addr == tm.Options().Addr {
			paused = n
		}
	}
	if user == "" || paused == nil {
		t.Fatal("the test needs the two keys on two masters")
	}
	in := &Input{Attrs: attrs("user="+user, "tenant=acme"), Cost: 1}
	// A lease taken and released first: the release script is loaded on both masters, as
	// on a daemon that has run for a while.
	ok, tok, _ := acquire(t, a, in, 41)
	if !ok || !a.ReleaseLease(tok, nowNs()) {
		t.Fatal("the first lease: refused, or not released")
	}
	if ok, _, _ := acquire(t, a, in, 42); !ok {
		t.Fatal("refused")
	}
	if out, err := paused.Command("CLIENT", "PAUSE", "6000", "ALL"); err != nil {
		t.Fatalf("CLIENT PAUSE: %q %v", out, err)
	}
	start := time.Now()
	a.ReleaseOwner(42, nowNs())
	if el := time.Since(start); el >= 6*time.Second {
		t.Fatalf("the release took %s, past the pause: this test needs it to give up during it", el)
	}
	for { // the pause over
		if out, err := paused.Command("PING"); err == nil && out == "PONG" {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n := cc.ZCard(ctx, "rl:by-user:{user="+user+"}").Val(); n != 0 {
		t.Fatalf("the answering master's part: %d held after the release; want 0 (this test needs it freed)", n)
	}
	if n := cc.ZCard(ctx, tenantKey).Val(); n != 1 {
		t.Fatalf("the paused master's part: %d held after the release; want 1 (this test needs it unrun)", n)
	}
	a.Sweep(nowNs()) // long before the hour is out
	if n := cc.ZCard(ctx, tenantKey).Val(); n != 0 {
		t.Errorf("the paused master's part: %d held after a sweep with it back; want 0", n)
	}
	for _, rule := range []string{"by-user", "by-tenant"} {
		if s := stats(a, rule); s.InFlight != 0 || s.Closed != 1 || s.Released != 1 || s.Expired != 0 {
			t.Errorf("%s stats after the sweep: %+v; want 0 in flight, 1 released (the first lease), 1 closed", rule, s)
		}
	}
	if ok, _, _ := acquire(t, a, &Input{Attrs: attrs("user=other", "tenant=acme"), Cost: 1}, 44); !ok {
		t.Error("a lease of the tenant refused after the sweep: the part given up still holds its slot")
	}
}

// A global check refused because a key's slots are full frees first this daemon's global
// leases on that key held by owners whose connections are gone (SetGlobalOwnerGone:
// closed by their clients, not yet seen ending by the daemon), in Redis as their close
// would, and asks again: allowed. A holder not gone keeps its slot; the checking owner
// and owner 0 are not asked about; a key whose holders were found not gone is not asked
// about again for reapGoneEvery; the gone owner's close, seen later, frees nothing more,
// and its lease is counted closed once.
func TestGlobalLeasesFullKeyReapsGoneOwners(t *testing.T) {
	rdb := realRedis(t)
	yaml := "rules:\n  - name: two\n    key: user\n    concurrency: { max: 2, lease: 10s }\n    mode: global\n"
	l := globalLimiter(t, rdb, yaml, "reap:")
	in := &Input{Attrs: attrs("user=ann"), Cost: 1}
	var mu gosync.Mutex
	gone := map[uint64]bool{}
	var asked []uint64
	l.Leases().SetGlobalOwnerGone(func(owner uint64) bool {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, owner)
		return gone[owner]
	})
	askedNow := func() []uint64 {
		mu.Lock()
		defer mu.Unlock()
		out := asked
		asked = nil
		slices.Sort(out)
		return out
	}
	now := nowNs()
	check := func(at int64, owner uint64) *Decision {
		t.Helper()
		d := &Decision{Owner: owner}
		if err := l.Check(at, in, d); err != nil {
			t.Fatal(err)
		}
		return d
	}
	for _, o := range []uint64{7, 8} {
		if d := check(now, o); !d.Allowed {
			t.Fatalf("owner %d: refused %+v", o, d.Results[0])
		}
	}
	if a := askedNow(); len(a) != 0 {
		t.Fatalf("asked about %v while the key had room", a)
	}
	if d := check(now, 9); d.Allowed {
		t.Fatal("allowed past max while no holder is gone")
	}
	if a := fmt.Sprint(askedNow()); a != "[7 8]" {
		t.Fatalf("asked about %s; want owners 7 and 8", a)
	}
	if d := check(now+int64(reapGoneEvery)/2, 9); d.Allowed {
		t.Fatal("allowed past max while no holder is gone")
	}
	if a := askedNow(); len(a) != 0 {
		t.Fatalf("asked about %v within reapGoneEvery of finding none gone", a)
	}
	mu.Lock()
	gone[7] = true
	mu.Unlock()
	now += int64(reapGoneEvery)
	d := check(now, 8) // owner 8 is not asked about itself
	if !d.Allowed || d.Results[0].Remaining != 0 {
		t.Fatalf("owner 7 gone: allowed %v, %+v; want allowed, 0 free", d.Allowed, d.Results[0])
	}
	if a := fmt.Sprint(askedNow()); a != "[7]" {
		t.Fatalf("asked about %s; want only owner 7", a)
	}
	if n := l.ReleaseOwner(7, now); n != 0 {
		t.Fatalf("owner 7's close, seen later: freed %d; want 0 (freed already)", n)
	}
	if s := stats(l, "two"); s.Closed != 1 || s.InFlight != 2 || s.Expired != 0 {
		t.Errorf("stats %+v; want 1 closed, 2 in flight", s)
	}
	if n := rdb.ZCard(context.Background(), "reap:two:{user=ann}").Val(); n != 2 {
		t.Fatalf("Redis holds %d members; want 2 (owner 8's)", n)
	}
	now += int64(reapGoneEvery)
	if d := check(now, 0); d.Allowed {
		t.Fatal("owner 8 holds both slots, not gone: allowed")
	}
	if a := fmt.Sprint(askedNow()); a != "[8]" {
		t.Fatalf("asked about %s; want [8]", a)
	}
}

// A global token's body reads only as it is written: not with a CR or LF anywhere in it
// (Go's base64 skips them: a lease with a line break added was taken for the lease), nor
// with its last character's unused bits set (the same bytes again).
func TestGlobalTokenBodyIsExact(t *testing.T) {
	for n := 1; n <= 12; n++ {
		raw := make([]byte, n)
		for i := range raw {
			raw[i] = byte(37*i + n)
		}
		body := tokenEncoding.EncodeToString(raw)
		if got, ok := decodeTokenBody(body); !ok || !bytes.Equal(got, raw) {
			t.Fatalf("%q read as % x %v, want % x", body, got, ok, raw)
		}
		for _, bad := range []string{body + "\n", body + "\r\n", "\n" + body, body[:1] + "\r" + body[1:], body[:len(body)-1] + "\n" + body[len(body)-1:]} {
			if got, ok := decodeTokenBody(bad); ok {
				t.Errorf("%q read as % x; want refused", bad, got)
			}
		}
		// The last character with an unused bit set, where the length leaves some.
		if unused := 6*len(body) - 8*n; unused > 0 {
			last := strings.IndexByte(base64URLAlphabet, body[len(body)-1])
			bad := body[:len(body)-1] + string(base64URLAlphabet[last|1])
			if bad != body {
				if got, ok := decodeTokenBody(bad); ok {
					t.Errorf("%q (unused bits set) read as % x; want refused", bad, got)
				}
			}
		}
	}
}

const base64URLAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
