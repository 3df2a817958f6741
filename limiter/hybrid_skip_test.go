package limiter

import (
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// TestHybridSkippedReportsTheCost: a request a local rule refuses asks nothing of its
// hybrid rules (Hybrid.Peek), and their entries report the hybrid key's view for the
// request's cost, as Take would judge it: refused with the retry that cost needs, allowed
// only when the key has room for the whole cost, and cost_exceeds_capacity (Impossible)
// for a cost above its capacity. Before, each was judged as a question (cost 0): a cost of
// 3 on an empty bucket of 5 an hour was told retry in 12 minutes (one token) where three
// take 36, a cost of 3 with 1 unit left was reported admitted by the hybrid rule, and a
// cost of 6 was a refusal with a retry (the client retried, to be refused for good),
// deciding the answer without `reason`.
func TestHybridSkippedReportsTheCost(t *testing.T) {
	rdb := realRedis(t)
	// A long interval and fetch wait: the views stay fresh however slow the machine.
	h := rlsync.NewHybrid(rdb, rlsync.HybridOptions{Interval: 10 * time.Second, FetchWait: 5 * time.Second})
	l := New(mustRules(t, `
rules:
  - name: shared
    key: user
    limit: { requests: 5, per: 1h }
    mode: hybrid
  - name: here
    key: ip
    algorithm: fixed_window
    limit: { requests: 10, per: 1m }
    mode: local
`), localbucket.NewStore(localbucket.Options{})).WithHybrid(h)
	var d Decision
	check := func(cost uint64, kv ...string) {
		t.Helper()
		if err := l.Check(time.Now().UnixNano(), &Input{Attrs: attrs(kv...), Cost: cost}, &d); err != nil {
			t.Fatal(err)
		}
	}
	check(10, "ip=full") // the local rule refuses this ip's later requests, retry within 1m
	check(5, "user=empty")
	if !d.Allowed {
		t.Fatalf("cost 5 of 5: %+v", d.Results)
	}
	check(4, "user=one-left")
	if !d.Allowed {
		t.Fatalf("cost 4 of 5: %+v", d.Results)
	}

	check(3, "user=empty", "ip=full")
	shared := d.Results[0]
	if d.Allowed || shared.Name != "shared" || shared.Unasked || shared.Allowed || shared.Impossible ||
		shared.RetryAfter < 35*time.Minute || shared.RetryAfter > 36*time.Minute+time.Second {
		t.Fatalf("cost 3 on an empty bucket of 5/h: shared %+v; want refused, retry about 36m (three tokens)", shared)
	}
	if r := d.DecidingResult(); r == nil || r.Name != "shared" {
		t.Fatalf("deciding %+v; want shared (the longest retry)", r)
	}

	check(3, "user=one-left", "ip=full")
	if shared := d.Results[0]; shared.Unasked || shared.Allowed || shared.Remaining != 1 || shared.RetryAfter < 23*time.Minute {
		t.Fatalf("cost 3 with 1 left: shared %+v; want refused, 1 left, retry about 24m", shared)
	}

	check(6, "user=one-left", "ip=full")
	shared = d.Results[0]
	if shared.Unasked || shared.Allowed || !shared.Impossible || shared.RetryAfter != 0 {
		t.Fatalf("cost 6 on a capacity of 5: shared %+v; want Impossible, no retry", shared)
	}
	if r := d.DecidingResult(); r == nil || r.Name != "shared" {
		t.Fatalf("deciding %+v; want shared (it never passes)", r)
	}

	check(1, "user=one-left", "ip=full")
	if shared := d.Results[0]; shared.Unasked || !shared.Allowed || shared.Remaining != 1 {
		t.Fatalf("cost 1 with 1 left: shared %+v; want allowed (it fits), 1 left", shared)
	}
}
