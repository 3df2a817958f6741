package limiter

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

const t0 = int64(1_700_000_000) * int64(time.Second)

func mustRules(t testing.TB, yaml string) *rules.Set {
	t.Helper()
	set, err := rules.Parse("test.yaml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	return set
}

func newLimiter(t testing.TB, yaml string) *Limiter {
	return New(mustRules(t, yaml), localbucket.NewStore(localbucket.Options{}))
}

func attrs(kv ...string) []rules.Attr {
	var out []rules.Attr
	for _, s := range kv {
		k, v, _ := strings.Cut(s, "=")
		out = append(out, rules.Attr{Name: k, Value: v})
	}
	return out
}

const twoRules = `
rules:
  - name: per-ip
    key: ip
    limit: { requests: 100, per: 1s }
  - name: holds
    match: { method: POST, path: "/v1/events/*/holds" }
    key: user
    limit: { requests: 5, per: 60s }
    plans: { partner: 50, internal: unlimited }
  - name: shadow-login
    match: { path: /login }
    key: ip
    limit: { requests: 1, per: 1h }
    shadow: true
`

func TestDecidingRule(t *testing.T) {
	l := newLimiter(t, twoRules)
	var d Decision
	in := Input{Attrs: attrs("method=POST", "path=/v1/events/7/holds", "user=u1", "ip=1.2.3.4"), Cost: 1}
	if err := l.Check(t0, &in, &d); err != nil {
		t.Fatal(err)
	}
	if !d.Allowed || len(d.Results) != 2 || d.DecidingResult().Name != "holds" || d.DecidingResult().Remaining != 4 {
		t.Fatalf("decision %+v", d)
	}
	// Exhaust holds; the sixth is rejected by holds with a retry of 12 s, per-ip untouched.
	for i := 0; i < 4; i++ {
		_ = l.Check(t0, &in, &d)
	}
	if err := l.Check(t0, &in, &d); err != nil {
		t.Fatal(err)
	}
	r := d.DecidingResult()
	if d.Allowed || r.Name != "holds" || r.RetryAfter != 12*time.Second {
		t.Fatalf("rejection %+v", d)
	}
	if d.Results[0].Remaining != 95 || !d.Results[0].Allowed {
		t.Fatalf("per-ip after a rejection: %+v (want 95 left: the rejected request consumed nothing)", d.Results[0])
	}
}

func TestPlans(t *testing.T) {
	l := newLimiter(t, twoRules)
	var d Decision
	base := attrs("method=POST", "path=/v1/events/7/holds", "user=p1", "ip=9.9.9.9")
	in := Input{Attrs: append(base, rules.Attr{Name: "plan", Value: "partner"}), Cost: 1}
	_ = l.Check(t0, &in, &d)
	if r := d.Results[1]; r.Name != "holds" || r.Limit != 50 || r.Remaining != 49 {
		t.Fatalf("partner plan: %+v", r)
	}
	in.Attrs = append(base, rules.Attr{Name: "plan", Value: "internal"})
	_ = l.Check(t0, &in, &d)
	if len(d.Results) != 1 || d.Results[0].Name != "per-ip" {
		t.Fatalf("unlimited plan still checked: %+v", d.Results)
	}
}

func TestShadowNeverRejectsNorDecides(t *testing.T) {
	l := newLimiter(t, twoRules)
	var d Decision
	in := Input{Attrs: attrs("path=/login", "ip=5.5.5.5"), Cost: 1}
	for i := 0; i < 3; i++ {
		if err := l.Check(t0, &in, &d); err != nil {
			t.Fatal(err)
		}
		if !d.Allowed {
			t.Fatalf("request %d rejected by a shadow rule", i)
		}
		if d.DecidingResult().Name != "per-ip" {
			t.Fatalf("deciding %q", d.DecidingResult().Name)
		}
	}
	if sh := d.Results[1]; !sh.Shadow || sh.Allowed {
		t.Fatalf("shadow result %+v: want reported as rejecting", sh)
	}
}

func TestMissingKeyAttributeSkipsRule(t *testing.T) {
	l := newLimiter(t, twoRules)
	var d Decision
	in := Input{Attrs: attrs("method=POST", "path=/v1/events/7/holds"), Cost: 1}
	_ = l.Check(t0, &in, &d)
	if !d.Allowed || len(d.Results) != 0 || d.Deciding != -1 {
		t.Fatalf("%+v", d)
	}
}

func TestCostExceedsCapacity(t *testing.T) {
	l := newLimiter(t, twoRules)
	var d Decision
	in := Input{Attrs: attrs("ip=7.7.7.7"), Cost: 101}
	_ = l.Check(t0, &in, &d)
	r := d.DecidingResult()
	if d.Allowed || !r.Impossible || r.RetryAfter != 0 {
		t.Fatalf("%+v", d)
	}
}

func TestInlineLimits(t *testing.T) {
	l := newLimiter(t, `rules: []`)
	var d Decision
	in := Input{Limits: []Inline{{Key: "t1", Limit: 2, WindowMs: 1000}, {Key: "t1", Limit: 3, WindowMs: 1000, Name: "other"}}, Cost: 1}
	for i := 0; i < 3; i++ {
		if err := l.Check(t0, &in, &d); err != nil {
			t.Fatal(err)
		}
	}
	// Same key, different limits: separate state. The 2/s one rejects the third.
	if d.Allowed || d.DecidingResult().Name != "t1" || d.Results[1].Name != "other" || d.Results[1].Remaining != 1 {
		t.Fatalf("%+v", d)
	}
	for _, bad := range []Inline{{Limit: 1, WindowMs: 1}, {Key: "k", WindowMs: 1}, {Key: "k", Limit: 1}, {Key: "k", Limit: 1, WindowMs: 1, Algorithm: "leaky"},
		{Key: "k", Limit: 1, WindowMs: 1, Mode: "nope"}, {Key: "k", Limit: 1, WindowMs: 1000, Burst: 2, Algorithm: "fixed_window"}} {
		in := Input{Limits: []Inline{bad}, Cost: 1}
		err := l.Check(t0, &in, &d)
		if _, ok := err.(*InvalidLimitError); !ok {
			t.Errorf("%+v: got %v, want InvalidLimitError", bad, err)
		}
	}
	// Without Redis, an inline limit in hybrid or global mode is decided from a local
	// bucket, marked degraded (the client cannot know whether this daemon has a Redis; it
	// used to be refused as invalid_limit).
	for _, mode := range []string{"hybrid", "global"} {
		in := Input{Limits: []Inline{{Key: "m-" + mode, Limit: 2, WindowMs: 60_000, Mode: mode}}, Cost: 1}
		for i := range 3 {
			if err := l.Check(t0, &in, &d); err != nil {
				t.Fatalf("mode %s without Redis: %v", mode, err)
			}
			if d.Allowed != (i < 2) || !d.Degraded || !d.Results[0].Degraded || d.Results[0].Limit != 2 {
				t.Fatalf("mode %s without Redis, check %d: %+v", mode, i, d)
			}
		}
	}
	// Such a limit keeps its own state, apart from a local one that is otherwise the same
	// (proto/PROTOCOL.md: two inline limits share state only when both are local, or both
	// in Redis), as it does on a daemon whose Redis is down; hybrid and global share it.
	// It shared the local one's bucket (found by an audit): 2, 1, 0 left, then refused.
	same := func(mode string) Inline { return Inline{Key: "same", Limit: 2, WindowMs: 60_000, Mode: mode} }
	for i, il := range []Inline{same("local"), same("local"), same("global"), same("hybrid"), same("local")} {
		in := Input{Limits: []Inline{il}, Cost: 1}
		if err := l.Check(t0, &in, &d); err != nil {
			t.Fatal(err)
		}
		if want := i != 4; d.Allowed != want {
			t.Errorf("check %d, mode %s: allowed %v, want %v (remaining %d)", i, il.Mode, d.Allowed, want, d.Results[0].Remaining)
		}
	}
	both := Input{Limits: []Inline{{Key: "both", Limit: 1, WindowMs: 60_000, Mode: "global"}, {Key: "both", Limit: 1, WindowMs: 60_000}}, Cost: 1}
	if err := l.Check(t0, &both, &d); err != nil || !d.Allowed || len(d.Results) != 2 {
		t.Fatalf("a global and a local inline limit, one request: %v, %+v", err, d)
	}
	if err := l.Check(t0, &both, &d); err != nil || d.Allowed || d.Results[0].Allowed || d.Results[1].Allowed {
		t.Errorf("the same again: both limits of 1 are spent, each on its own: %v, %+v", err, d)
	}
	// A window's burst equal to its limit is what the window holds: the same limit, so a
	// client that always sends burst works with every algorithm; it shares the state of
	// the limit sent without it.
	for _, alg := range []string{"fixed_window", "sliding_window"} {
		with := Input{Limits: []Inline{{Key: "w-" + alg, Limit: 2, WindowMs: 60_000, Burst: 2, Algorithm: alg}}, Cost: 1}
		without := Input{Limits: []Inline{{Key: "w-" + alg, Limit: 2, WindowMs: 60_000, Algorithm: alg}}, Cost: 1}
		for i, in := range []*Input{&with, &without, &with} {
			if err := l.Check(t0, in, &d); err != nil {
				t.Fatalf("%s, burst = limit: %v", alg, err)
			}
			if d.Allowed != (i < 2) {
				t.Fatalf("%s, check %d: allowed %v (a limit of 2, with and without burst 2)", alg, i, d.Allowed)
			}
		}
	}
}

func TestCheckModes(t *testing.T) {
	hybrid := mustRules(t, "rules:\n  - name: h\n    key: user\n    limit: { requests: 1, per: 1s }\n    mode: hybrid\n")
	if err := CheckModes(hybrid, false); err == nil || !strings.Contains(err.Error(), "test.yaml:2") {
		t.Fatalf("hybrid without Redis: got %v", err)
	}
	if err := CheckModes(hybrid, true); err != nil {
		t.Fatal(err)
	}
	global := mustRules(t, "rules:\n  - name: g\n    key: user\n    limit: { requests: 1, per: 1s }\n    mode: global\n")
	if err := CheckModes(global, false); err == nil {
		t.Fatal("global mode accepted without Redis")
	}
	if err := CheckModes(global, true); err != nil {
		t.Fatal(err)
	}
}

// Concurrent requests over two rules never admit more than either limit, and a rejected
// request never charges the other rule.
func TestConcurrentAllOrNothing(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: a
    key: user
    limit: { requests: 50, per: 1h }
  - name: b
    key: ip
    limit: { requests: 30, per: 1h }
`)
	var wg sync.WaitGroup
	var mu sync.Mutex
	admitted := 0
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var d Decision
			in := Input{Attrs: attrs("user=u", "ip=i"), Cost: 1}
			for i := 0; i < 100; i++ {
				_ = l.Check(t0, &in, &d)
				if d.Allowed {
					mu.Lock()
					admitted++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if admitted != 30 {
		t.Fatalf("admitted %d, want 30", admitted)
	}
	var d Decision
	_ = l.Check(t0, &Input{Attrs: attrs("user=u"), Cost: 0}, &d)
	if d.Results[0].Remaining != 20 {
		t.Fatalf("rule a has %d left, want 20", d.Results[0].Remaining)
	}
}

// benchRules: two rules match the benchmark's request, with limits high enough that every
// check is admitted and committed, as most real traffic is.
const benchRules = `
rules:
  - name: per-ip
    key: ip
    limit: { requests: 1000000000, per: 1h }
  - name: holds
    match: { method: POST, path: "/v1/events/*/holds" }
    key: user
    limit: { requests: 1000000000, per: 1h }
  - name: login
    match: { method: POST, path: /login }
    key: ip
    limit: { requests: 10, per: 1m }
`

// The in-process decision for a two-rule request: match, keys, buckets (admitted and
// committed).
func BenchmarkCheck2Rules(b *testing.B) {
	l := newLimiter(b, benchRules)
	in := Input{Attrs: attrs("method=POST", "path=/v1/events/7/holds", "user=u-12345", "ip=203.0.113.9"), Cost: 1}
	var d Decision
	b.ReportAllocs()
	for b.Loop() {
		if err := l.Check(t0, &in, &d); err != nil || len(d.Results) != 2 || !d.Allowed {
			b.Fatal(err, d)
		}
	}
}

func BenchmarkCheck2RulesParallel(b *testing.B) {
	l := newLimiter(b, benchRules)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		in := Input{Attrs: attrs("method=POST", "path=/v1/events/7/holds", "user=u-12345", "ip=203.0.113.9"), Cost: 1}
		var d Decision
		for pb.Next() {
			_ = l.Check(t0, &in, &d)
		}
	})
}

// withoutRedis returns a limiter of rules in hybrid mode whose Redis never answers
// (nothing listens on port 1).
func withoutRedis(t *testing.T, rules string) *Limiter {
	t.Helper()
	rdb, err := rlsync.Open(rlsync.Config{URL: "redis://127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	return New(mustRules(t, rules), localbucket.NewStore(localbucket.Options{})).WithHybrid(rlsync.NewHybrid(rdb, rlsync.HybridOptions{}))
}

// A hybrid key the daemon cannot decide without Redis (new here, no credit left) while
// Redis does not answer is decided by its rule's failure policy, marked degraded, from
// the first request after its exact sync failed: never refused as if over its limit
// while Redis is being judged down (before, a new client got 429s for up to 2 s).
func TestHybridNewKeyWithoutRedisFollowsPolicy(t *testing.T) {
	l := withoutRedis(t, `
rules:
  - name: open
    key: user
    limit: { requests: 100, per: 1h }
    on_store_failure: open
  - name: closed
    key: ip
    limit: { requests: 100, per: 1h }
    on_store_failure: closed
  - name: local
    key: api_key
    limit: { requests: 100, per: 1h }
`)
	var d Decision
	for k, tc := range []struct {
		attr    string
		allowed bool
	}{{"user=u", true}, {"ip=i", false}, {"api_key=k", true}} {
		in := Input{Attrs: attrs(tc.attr), Cost: 1}
		first := 1
		if k == 0 {
			// The first key's credit: one request, before any sync, with nothing known
			// of Redis yet. Its exact sync then fails: the other keys get no credit
			// (Redis would never count it), their rules' policies decide their first
			// request too.
			_ = l.Check(t0, &in, &d)
			if !d.Allowed || d.Degraded {
				t.Fatalf("%s, first request (on credit): %+v", tc.attr, d.Results)
			}
			first = 2
		}
		for i := 0; i < 3; i++ {
			_ = l.Check(t0, &in, &d)
			if d.Allowed != tc.allowed || !d.Degraded || !d.Results[0].Degraded {
				t.Fatalf("%s, request %d with Redis down: allowed %v degraded %v, want allowed %v, degraded: %+v",
					tc.attr, i+first, d.Allowed, d.Degraded, tc.allowed, d.Results)
			}
		}
		if tc.attr == "api_key=k" && d.Results[0].Remaining != 97 { // the local fallback bucket, limit ÷ 1 daemon, 3 taken
			t.Fatalf("local policy: remaining %d, want 97", d.Results[0].Remaining)
		}
	}
}

// Hybrid rules beside local ones stay all-or-nothing: a local rejection gives the hybrid
// allowance back, a hybrid rejection consumes nothing locally. (Take and Undo are local;
// no Redis is reached here, sync's tests cover the flush.)
func TestHybridAllOrNothing(t *testing.T) {
	const rules = `
rules:
  - name: shared
    key: user
    limit: { requests: 2, per: 1h }
    on_store_failure: closed
  - name: here
    key: ip
    limit: { requests: 10, per: 1h }
    mode: local
  - name: tight
    key: api_key
    limit: { requests: 1, per: 1h }
    mode: local
`
	l := withoutRedis(t, rules)
	var d Decision
	// Before its first sync a daemon admits its credit per hybrid key, 1/2N of the limit
	// (here one request); the exact sync it then tries finds no Redis, so shared's failure
	// policy (closed) decides. A hybrid rejection consumes nothing locally: the first
	// passes, the next two are rejected by shared, and ip i was charged once.
	in := Input{Attrs: attrs("user=u", "ip=i"), Cost: 1}
	for i := 0; i < 3; i++ {
		_ = l.Check(t0, &in, &d)
	}
	if d.Allowed || !d.Degraded || d.DecidingResult().Name != "shared" || d.DecidingResult().RetryAfter <= 0 {
		t.Fatalf("third request: %+v", d.Results)
	}
	_ = l.Check(t0, &Input{Attrs: attrs("ip=i"), Cost: 0}, &d)
	if d.Results[0].Name != "here" || d.Results[0].Remaining != 9 {
		t.Fatalf("local rule after hybrid rejections: %+v", d.Results)
	}
	// A local rejection gives the hybrid allowance back: api_key k admits once; user v2's
	// request on k is rejected by tight, and v2 keeps its one credit. (On a daemon whose
	// Redis has not failed yet: once a sync has failed, no new key gets credit.)
	l = withoutRedis(t, rules)
	_ = l.Check(t0, &Input{Attrs: attrs("user=v1", "api_key=k"), Cost: 1}, &d)
	if !d.Allowed {
		t.Fatalf("first request on k: %+v", d.Results)
	}
	_ = l.Check(t0, &Input{Attrs: attrs("user=v2", "api_key=k"), Cost: 1}, &d)
	if d.Allowed || d.DecidingResult().Name != "tight" {
		t.Fatalf("second request on k: %+v", d.Results)
	}
	_ = l.Check(t0, &Input{Attrs: attrs("user=v2"), Cost: 1}, &d)
	if !d.Allowed || d.Results[0].Name != "shared" {
		t.Fatalf("v2 lost its credit to a request tight rejected: %+v", d.Results)
	}
}

func TestSplit(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: s
    key: user
    algorithm: fixed_window
    limit: { requests: 100, per: 1h }
    split: 20
`)
	var d Decision
	in := Input{Attrs: attrs("user=u"), Cost: 1}
	admitted := 0
	for i := 0; i < 10; i++ {
		_ = l.Check(t0, &in, &d)
		if d.Allowed {
			admitted++
		}
	}
	if admitted != 5 || d.Results[0].Limit != 5 {
		t.Fatalf("a daemon with a 100/h limit split 20 ways admitted %d (limit %d), want 5", admitted, d.Results[0].Limit)
	}
	auto := mustRules(t, "rules:\n  - name: a\n    key: user\n    limit: { requests: 10, per: 1s }\n    split: auto\n")
	if err := CheckModes(auto, false); err == nil {
		t.Fatal("split: auto accepted without Redis")
	}
}

// --shadow: every rule counts and reports, none rejects.
func TestShadowAll(t *testing.T) {
	l := newLimiter(t, "rules:\n  - name: r\n    key: user\n    limit: { requests: 1, per: 1h }\n")
	l.SetShadowAll(true)
	var d Decision
	in := Input{Attrs: attrs("user=u"), Cost: 1}
	for i := 0; i < 3; i++ {
		_ = l.Check(t0, &in, &d)
		if !d.Allowed {
			t.Fatalf("request %d rejected with --shadow", i)
		}
	}
	if r := d.Results[0]; !r.Shadow || r.Allowed {
		t.Fatalf("the rule should report a shadow rejection: %+v", r)
	}
	l.SetShadowAll(false)
	_ = l.Check(t0, &in, &d)
	if d.Allowed {
		t.Fatal("allowed after --shadow was turned off")
	}
}

// --shadow covers a check's inline limits too: a dark launch refuses nothing. Before,
// the second check with an inline limit of 1 was refused under --shadow.
func TestShadowAllInlineLimits(t *testing.T) {
	l := newLimiter(t, "rules:\n  - name: r\n    key: user\n    limit: { requests: 100, per: 1h }\n")
	l.SetShadowAll(true)
	var d Decision
	in := Input{Attrs: attrs("user=u"), Limits: []Inline{{Key: "route=/a", Limit: 1, WindowMs: 60_000}}, Cost: 1}
	for i := 0; i < 3; i++ {
		if err := l.Check(t0, &in, &d); err != nil {
			t.Fatal(err)
		}
		if !d.Allowed {
			t.Fatalf("check %d refused under --shadow: %+v", i+1, d.Results)
		}
	}
	if r := d.Results[len(d.Results)-1]; !r.Shadow || r.Allowed || r.Remaining != 0 {
		t.Fatalf("the inline limit should report a shadow refusal: %+v", r)
	}
	l.SetShadowAll(false)
	if err := l.Check(t0, &in, &d); err != nil {
		t.Fatal(err)
	}
	if d.Allowed {
		t.Fatal("the inline limit allowed a check after --shadow was turned off")
	}
}

// A reload that changes a rule's algorithm or window but keeps its name resets its
// clients' states instead of misreading them (the case from issue 9: a client at 4 of 10
// in a 10 s sliding window, reloaded to a fixed window, was refused for the rest of the
// window — with per: 1d, a day).
func TestReloadAlgorithmChangeResets(t *testing.T) {
	rule := func(alg, per string) string {
		return "rules:\n  - name: api\n    key: user\n    algorithm: " + alg + "\n    limit: { requests: 10, per: " + per + " }\n"
	}
	for _, tc := range []struct{ name, from, to string }{
		{"sliding_to_fixed", rule("sliding_window", "10s"), rule("fixed_window", "10s")},
		{"sliding_to_fixed_1d", rule("sliding_window", "10s"), rule("fixed_window", "1d")},
		{"fixed_to_sliding", rule("fixed_window", "10s"), rule("sliding_window", "10s")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLimiter(t, tc.from)
			var d Decision
			in := Input{Attrs: attrs("user=u"), Cost: 1}
			for i := 0; i < 4; i++ {
				if err := l.Check(t0+int64(i)*int64(time.Millisecond), &in, &d); err != nil || !d.Allowed {
					t.Fatalf("request %d: %v %+v", i, err, d.Results)
				}
			}
			l.SetRules(mustRules(t, tc.to))
			if err := l.Check(t0+600*int64(time.Millisecond), &in, &d); err != nil || !d.Allowed {
				t.Fatalf("after the reload: %v %+v, want allowed", err, d.Results)
			}
			if r := d.Results[0]; r.Remaining != 9 {
				t.Errorf("after the reload: %d remaining, want 9 (a fresh state)", r.Remaining)
			}
		})
	}
}

// Refusals whose retries are the same in whole milliseconds, as answered, are decided
// by the first listed (PROTOCOL.md: ties go to the first), not by a fraction of a
// millisecond the client never sees: a fixed window's and a sliding window's ending at
// the same instant both answered 893 ms, and the second decided.
func TestDecidingTieInWholeMilliseconds(t *testing.T) {
	results := []Result{
		{Name: "a-fixed", RetryAfter: 892*time.Millisecond + 400*time.Microsecond},
		{Name: "b-sliding", RetryAfter: 892*time.Millisecond + 900*time.Microsecond},
		{Name: "c-shorter", RetryAfter: 500 * time.Millisecond},
	}
	if i := deciding(false, results); results[i].Name != "a-fixed" {
		t.Fatalf("deciding %s; want a-fixed, the first of two answered 893 ms", results[i].Name)
	}
	results[1].RetryAfter = 893*time.Millisecond + time.Microsecond // 894 ms answered: longer
	if i := deciding(false, results); results[i].Name != "b-sliding" {
		t.Fatalf("deciding %s; want b-sliding, answered 894 ms", results[i].Name)
	}
}
