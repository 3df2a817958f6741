package limiter

import (
	"strconv"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// TestBanNotEarnedOnFallbackShare: when the store is full of limited clients, a new key
// is decided on its rule's fallback state, which every such key shares: a flood of other
// keys spends it. A refusal decided there says nothing of this client, so it earns no
// ban. Before, a client never seen before was refused on the spent share (documented) and
// then banned for the rule's whole ban (10 minutes here) after `after` such refusals: a
// key flood banned every new client.
func TestBanNotEarnedOnFallbackShare(t *testing.T) {
	const yaml = `
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 1m }
    penalty: { after: 2, within: 1m, ban: 10m }
`
	// One shard of 64 keys: easy to fill with limited clients.
	l := New(mustRules(t, yaml), localbucket.NewStore(localbucket.Options{Shards: 1, MaxKeys: 64}))
	var d Decision
	check := func(at int64, ip string) *Decision {
		t.Helper()
		if err := l.Check(t0+at, &Input{Attrs: attrs("ip=" + ip), Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
		return &d
	}
	// The flood: 1,000 keys, each allowed once (the first 64 stored and limited), so the
	// shard is full of limited clients and the fallback share is spent.
	for i := range 1000 {
		check(0, "10.0."+strconv.Itoa(i/256)+"."+strconv.Itoa(i%256))
	}
	if l.buckets.Untracked() == 0 {
		t.Fatal("the flood left the store room: nothing decided on the fallback share")
	}
	ms := int64(time.Millisecond)
	for i := range 4 {
		d := check(int64(i+1)*100*ms, "192.0.2.77")
		if d.Allowed {
			continue // the share had room: allowed, nothing to ban
		}
		if r := d.Results[0]; r.Banned {
			t.Fatalf("request %d of a new client, refused on the flood's fallback share: banned (retry %v)", i+1, r.RetryAfter)
		}
	}
	// A stored client over its own limit is still banned.
	l2 := newLimiter(t, yaml)
	l = l2
	check(0, "1.1.1.1")
	check(ms, "1.1.1.1")
	if d := check(2*ms, "1.1.1.1"); !d.Results[0].Banned {
		t.Fatalf("a stored client refused twice: not banned: %+v", d.Results[0])
	}
}
