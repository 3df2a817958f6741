package limiter

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/rlsidecar/rlsidecar/localbucket"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// A reload that changes a Redis-backed rule's algorithm or window but keeps its name
// starts the rule's clients on fresh state in Redis (and in the hybrid allowances), as in
// local mode, instead of reading the old rule's state under the new one; a reload that
// only changes the limit keeps the count. The case from issue 9: a client at 4 of 10 in a
// sliding window, reloaded to a fixed window. Real redis-server; windows of an hour or
// more so that no window boundary falls inside the test.
func TestReloadResetsRedisState(t *testing.T) {
	rule := func(mode, alg string, requests int, per string) string {
		return fmt.Sprintf("rules:\n  - name: api\n    key: user\n    algorithm: %s\n    limit: { requests: %d, per: %s }\n    mode: %s\n", alg, requests, per, mode)
	}
	for _, mode := range []string{"global", "hybrid"} {
		for _, tc := range []struct {
			name         string
			fromAlg      string
			toAlg, toPer string
			toRequests   int
			want         int // allowed after the reload before the first refusal
		}{
			{"sliding_to_fixed", "sliding_window", "fixed_window", "1h", 10, 10},
			{"sliding_to_fixed_1d", "sliding_window", "fixed_window", "1d", 10, 10},
			{"fixed_to_sliding", "fixed_window", "sliding_window", "1h", 10, 10},
			{"token_to_sliding", "token_bucket", "sliding_window", "1h", 10, 10},
			{"sliding_window_2h", "sliding_window", "sliding_window", "2h", 10, 10},
			{"limit_raised_keeps_count", "sliding_window", "sliding_window", "1h", 20, 16},
			// A token bucket keeps the units used too, not the fraction of its bucket
			// (before: 4 of 10 used, raised to 20, 12 more; lowered to 5, 3 more).
			{"token_limit_raised_keeps_count", "token_bucket", "token_bucket", "1h", 20, 16},
			{"token_limit_lowered_keeps_count", "token_bucket", "token_bucket", "1h", 5, 1},
		} {
			t.Run(mode+"/"+tc.name, func(t *testing.T) {
				rdb := realRedis(t)
				l := New(mustRules(t, rule(mode, tc.fromAlg, 10, "1h")), localbucket.NewStore(localbucket.Options{})).
					WithGlobal(rlsync.NewGlobal(rdb), time.Second)
				if mode == "hybrid" {
					h := runHybrid(t, rdb)
					l = l.WithHybrid(h)
				}
				var d Decision
				check := upCheck(t, l, &Input{Attrs: attrs("user=u"), Cost: 1}, &d)
				for i := 0; i < 4; i++ {
					if !check() {
						t.Fatalf("request %d before the reload refused: %+v", i+1, d.Results)
					}
				}
				l.SetRules(mustRules(t, rule(mode, tc.toAlg, tc.toRequests, tc.toPer)))
				n := 0
				for tries := 0; n <= tc.want && tries < 1000; tries++ {
					if check() {
						n++
						continue
					}
					// A hybrid daemon may refuse for a moment, until its next sync brings a
					// share grant (a retry of a few ms): a client waits for it, as told. A
					// refusal by the limit says the rest of the window.
					if r := d.DecidingResult(); mode == "hybrid" && r.RetryAfter < time.Second {
						time.Sleep(r.RetryAfter + time.Millisecond)
						continue
					}
					break
				}
				if n != tc.want {
					t.Errorf("after the reload: %d allowed before a refusal, want %d (%+v)", n, tc.want, d.Results)
				}
			})
		}
	}
}

// Every Redis key of a rule carries the fingerprint of its algorithm and window between
// the rule's name and the hash tag, which stays the client alone.
func TestRedisKeyFingerprint(t *testing.T) {
	rdb := unreachable(t)
	for _, tc := range []struct{ alg, per, want string }{
		{"sliding_window", "1h", "rl:api~sw1h:{user=u}"},
		{"fixed_window", "1d", "rl:api~fw1d:{user=u}"},
		{"token_bucket", "10s", "rl:api~tb10s:{user=u}"},
		{"fixed_window", "1500ms", "rl:api~fw1500ms:{user=u}"},
		{"sliding_window", "90m", "rl:api~sw90m:{user=u}"},
	} {
		l := New(mustRules(t, "rules:\n  - name: api\n    key: user\n    algorithm: "+tc.alg+"\n    limit: { requests: 10, per: "+tc.per+" }\n    mode: global\n    on_store_failure: open\n"),
			localbucket.NewStore(localbucket.Options{})).WithGlobal(rlsync.NewGlobal(rdb), 10*time.Millisecond)
		var d Decision
		if err := l.Check(time.Now().UnixNano(), &Input{Attrs: attrs("user=u"), Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
		if got := string(d.Results[0].Key); got != tc.want {
			t.Errorf("%s per %s: key %q, want %q", tc.alg, tc.per, got, tc.want)
		}
		if tag := rlsync.Slot(string(d.Results[0].Key)); tag != rlsync.Slot("{user=u}") {
			t.Errorf("%s per %s: slot %d, want the client's, %d", tc.alg, tc.per, tag, rlsync.Slot("{user=u}"))
		}
		if strings.Count(string(d.Results[0].Key), "{") != 1 {
			t.Errorf("key %q has more than one '{'", d.Results[0].Key)
		}
	}
}

// A token bucket's limit lowered below what a client used, in global mode: the rescaled
// state (an empty bucket) is written back on the first read, even by a refused check, so
// the bucket refills at the new rate from the reload on. Read again and again from the
// old rate's state instead, it drained at the old rate: 15 of 20 per 4 s used, lowered
// to 10 per 4 s, the first unit came back after 1.2 s, not 0.4 s.
func TestReloadTokenLoweredRefillsAtNewRate(t *testing.T) {
	rule := func(requests int) string {
		return fmt.Sprintf("rules:\n  - name: api\n    key: user\n    limit: { requests: %d, per: 4s }\n    mode: global\n", requests)
	}
	rdb := realRedis(t)
	l := New(mustRules(t, rule(20)), localbucket.NewStore(localbucket.Options{})).WithGlobal(rlsync.NewGlobal(rdb), time.Second)
	var d Decision
	in := Input{Attrs: attrs("user=u"), Cost: 1}
	check := func() bool {
		t.Helper()
		if err := l.Check(time.Now().UnixNano(), &in, &d); err != nil || d.Degraded {
			t.Fatalf("%v, degraded %v", err, d.Degraded)
		}
		return d.Allowed
	}
	for i := range 15 {
		if !check() {
			t.Fatalf("request %d refused", i+1)
		}
	}
	l.SetRules(mustRules(t, rule(10)))
	start := time.Now()
	for !check() {
		if time.Since(start) > 3*time.Second {
			t.Fatal("no unit back within 3 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if took := time.Since(start); took < 300*time.Millisecond || took > 1000*time.Millisecond {
		t.Fatalf("the first unit came back after %v, want about 400ms (one interval at the new rate)", took)
	}
}

// runHybrid returns a hybrid store on rdb syncing every 10ms until the test ends.
func runHybrid(t *testing.T, rdb redis.UniversalClient) *rlsync.Hybrid {
	h := rlsync.NewHybrid(rdb, rlsync.HybridOptions{Interval: 10 * time.Millisecond, FetchWait: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.Run(ctx, "test", func() int64 { return time.Now().UnixNano() }, time.Second, func(err error) { t.Log(err) })
	}()
	t.Cleanup(func() { cancel(); <-done })
	return h
}

// upCheck returns a check of in on l, with Redis up, that says whether it was allowed,
// leaving the decision in d; an error or a degraded answer fails the test.
func upCheck(t *testing.T, l *Limiter, in *Input, d *Decision) func() bool {
	return func() bool {
		t.Helper()
		if err := l.Check(time.Now().UnixNano(), in, d); err != nil {
			t.Fatal(err)
		}
		if d.Degraded {
			t.Fatalf("degraded with Redis up: %+v", d.Results)
		}
		return d.Allowed
	}
}
