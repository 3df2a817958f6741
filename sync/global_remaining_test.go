package sync

import (
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A token bucket that takes more than 2^53 ns (104 days) to fill answers its remaining as
// the local mode does: burst × interval, global.lua's tau, is rounded past 2^53, and
// remaining was taken from it, one short while the bucket held nearly all of its burst (a
// fresh bucket of 151 at 7 per 22,346,737,943 ms: 150 when asked, 149 after one; the
// wire-protocol audit's, TestE2EWireFuzz, on random long buckets).
func TestGlobalTokenBucketRemainingPastTwo53(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	b := globalBackend{name: "standalone", g: NewGlobal(rdb), rdb: rdb}
	cases := []struct {
		requests uint64
		window   time.Duration
		burst    uint64
	}{
		{7, 22346737943 * time.Millisecond, 151},
		{1, 3 * time.Hour, 9000},
		{3, 10 * 24 * time.Hour, 40},
		{10, 24 * time.Hour, 1500},
		{41, 13 * time.Hour, 115436},
		{1, 17172823927 * time.Millisecond, 60}, // 198 days a token: past 2^52 ns
	}
	for i, c := range cases {
		l := globalLimit(t, localbucket.TokenBucket, c.requests, c.window, c.burst)
		key := fmt.Sprintf("rl:remaining-past-2^53:%d", i)
		want := c.burst
		for step, cost := range []uint64{0, 1, 0, 2, 1, 0, 5} {
			r, _, _, _ := globalCheckOne(t, b, key, l, cost)
			want -= cost
			if !r.Allowed || r.Remaining != want {
				t.Errorf("%d per %v, burst %d (%.0f days to fill): check %d of cost %d: allowed %v, remaining %d; want %d",
					c.requests, c.window, c.burst, float64(c.burst)*c.window.Hours()/float64(c.requests)/24, step, cost, r.Allowed, r.Remaining, want)
			}
		}
	}
}
