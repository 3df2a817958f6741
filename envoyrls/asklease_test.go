package envoyrls

import (
	"context"
	"testing"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// Envoy's protocol has no release, so a concurrency rule there asks whether a slot is
// free and takes none: one Redis call for a global rule, none of its slots held at any
// moment, its free slots as the remaining. Before, each call took a slot and gave it
// back as it was answered, a second Redis call: meanwhile the slot counted against
// every other check (a lease audit's scratch run: max 2, one lease held by a socket
// client, four Envoy callers: 1,394 of 4,209 of the socket's asks refused).
func TestConcurrencyAsksTakesNoSlot(t *testing.T) {
	_, rdb := standaloneRedis(t)
	s := redisServer(t, rdb, `
rules:
  - name: jobs
    match: { domain: api, descriptor: job }
    key: job
    mode: global
    concurrency: { max: 2, lease: 30s }
`)
	ctx := context.Background()
	call := func(job string) *rlsv3.RateLimitResponse {
		t.Helper()
		resp, err := s.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "api",
			Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "job", Value: job}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	call("warm") // the script's first call may go twice (NOSCRIPT, then EVAL)
	before, err := redistest.ScriptCalls(ctx, rdb)
	if err != nil {
		t.Fatal(err)
	}
	resp := call("j1")
	after, err := redistest.ScriptCalls(ctx, rdb)
	if err != nil {
		t.Fatal(err)
	}
	if resp.OverallCode != rlsv3.RateLimitResponse_OK {
		t.Fatalf("call: %v", resp.OverallCode)
	}
	if rem := resp.Statuses[0].LimitRemaining; rem != 2 {
		t.Errorf("limit_remaining %d, want 2 (no slot taken)", rem)
	}
	if n := after - before; n != 1 {
		t.Errorf("%d script calls for one call, want 1 (an ask, no take and give-back)", n)
	}
	keys, err := rdb.Keys(ctx, "*job=j1*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if n := rdb.ZCard(ctx, k).Val(); n != 0 {
			t.Errorf("%s holds %d slots after the call, want 0", k, n)
		}
	}
}
