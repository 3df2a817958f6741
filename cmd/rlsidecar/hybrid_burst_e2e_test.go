package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// One client, one hybrid daemon: a burst of 1,300 checks sent one after another at a
// limit of 1,000 a minute is admitted as the exact mode admits it, the first 1,000 all
// passing, whatever periodic syncs fall in the burst. Before, a sync in the burst asked
// a share grant for the units decided by exact syncs since the key's credit ran out,
// which made the key hot; the grant was half the room, and the rest of the burst was
// refused until the next sync: 778-927 of 1,000 on a loaded machine, in about half the
// runs. And a client that used its limit, paused a window, and came back was admitted 2
// of 5 and told to retry in 1 ms (its key hot from the first burst, its view stale).
func TestE2EHybridBurstsOnOneDaemonAsExact(t *testing.T) {
	srv := redistest.StartStandalone(t)
	// Generous timeouts: on a busy machine a new key's exact sync can outlast the
	// default 20 ms, and its answer is then the failure policy's (degraded).
	d := startDaemon(t, "--redis", "redis://"+srv.Addr, "--global-timeout", "3s", "--redis-timeout", "3s")
	c := dialRaw(t, d.socket)
	id := uint64(0)
	check := func(l proto.InlineLimit) *proto.Response {
		id++
		c.send(&proto.Request{ID: id, Op: "check", Cost: 1, Limits: []proto.InlineLimit{l}})
		r := c.recv()
		if r.IsError() || r.Degraded {
			t.Fatalf("check %d: %+v", id, r)
		}
		return r
	}
	for _, alg := range []string{"fixed_window", "token_bucket", "sliding_window"} {
		for trial := range 3 {
			l := proto.InlineLimit{Key: fmt.Sprintf("burst-%s-%d-%d", alg, trial, time.Now().UnixNano()),
				Limit: 1000, WindowMs: 60_000, Algorithm: alg, Mode: "hybrid"}
			clearOfWindowEnd(t, time.Minute, 2*time.Second)
			admitted, first := 0, -1
			for i := range 1300 {
				if r := check(l); r.Allowed {
					admitted++
				} else if first < 0 {
					first = i
				}
			}
			// A token bucket refills about 2 units in the burst's 100 ms.
			if first < 1000 || admitted > 1000+5 {
				t.Errorf("%s trial %d: the first refusal at request %d, %d admitted of a limit of 1,000", alg, trial, first, admitted)
			}
		}
		// Used, a pause of a window, then the limit again.
		l := proto.InlineLimit{Key: fmt.Sprintf("again-%s-%d", alg, time.Now().UnixNano()),
			Limit: 5, WindowMs: 1000, Algorithm: alg, Mode: "hybrid"}
		if alg == "sliding_window" {
			l.Algorithm = "fixed_window" // a sliding window's count of a window ago still weighs
		}
		for round := range 2 {
			var got []string
			for range 6 {
				r := check(l)
				got = append(got, fmt.Sprintf("%v/%d", r.Allowed, r.RetryAfterMs))
			}
			for i, s := range got[:5] {
				if s[:4] != "true" {
					t.Errorf("%s round %d: request %d of 5 refused: %v", l.Algorithm, round, i, got)
					break
				}
			}
			time.Sleep(time.Second + 20*time.Millisecond)
		}
	}
}
