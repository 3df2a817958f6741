package limiter

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// A reload that takes a hybrid rule to the global mode (mode: global, or a delay added,
// which the global store decides) and back leaves no credit from the view the daemon had
// before: while the rule was global here, this daemon's own global checks spent the
// key's room in Redis, and the hybrid view of the key, unsynced since, still saw it.
// Before, one daemon, 1,000 an hour, 100 used in hybrid mode, the other 900 in global
// mode, then back to hybrid: 450 more admitted at once (its credit, half the old view),
// 1,450 of 1,000, in every algorithm. Real redis-server; a day's window, so that none
// ends inside the test, and a token bucket refills no unit in it.
func TestReloadHybridGlobalHybridKeepsTheLimit(t *testing.T) {
	rule := func(alg, mode, delay string) string {
		return fmt.Sprintf("rules:\n  - name: api\n    key: user\n    algorithm: %s\n    mode: %s\n    limit: { requests: 1000, per: 24h }\n%s", alg, mode, delay)
	}
	for _, tc := range []struct{ name, alg, mode, delay string }{
		{"fixed_window", "fixed_window", "global", ""},
		{"sliding_window", "sliding_window", "global", ""},
		{"token_bucket", "token_bucket", "global", ""},
		{"token_bucket_delay", "token_bucket", "hybrid", "    delay: 1s\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rdb := realRedis(t)
			h := runHybrid(t, rdb)
			l := New(mustRules(t, rule(tc.alg, "hybrid", "")), localbucket.NewStore(localbucket.Options{})).
				WithGlobal(rlsync.NewGlobal(rdb), time.Second).WithHybrid(h)
			var d Decision
			in := Input{Attrs: attrs("user=u"), Cost: 1}
			check := upCheck(t, l, &in, &d)
			// admit checks until one is refused for longer than a sync interval (a
			// hybrid refusal of a few ms waits for the next share grant, as a client
			// told to retry would), at most max; it returns how many were allowed.
			admit := func(max int) int {
				t.Helper()
				n := 0
				for tries := 0; n < max && tries < 10*max; tries++ {
					if check() {
						n++
						continue
					}
					if r := d.DecidingResult(); r.RetryAfter < time.Second {
						time.Sleep(r.RetryAfter + time.Millisecond)
						continue
					}
					break
				}
				return n
			}
			if n := admit(100); n != 100 {
				t.Fatalf("hybrid: %d of the first 100 allowed", n)
			}
			l.SetRules(mustRules(t, rule(tc.alg, tc.mode, tc.delay)))
			// Until the hybrid sync has brought the 100 to Redis: asked there (cost 0
			// consumes nothing), 900 left.
			ask := Input{Attrs: in.Attrs}
			for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				if err := l.Check(time.Now().UnixNano(), &ask, &d); err != nil {
					t.Fatal(err)
				}
				if r := d.DecidingResult(); r.Remaining <= 900 && !d.Degraded {
					break
				} else if time.Now().After(deadline) {
					t.Fatalf("Redis does not count the 100 hybrid units: %+v", r)
				}
			}
			if n := admit(2000); n != 900 {
				t.Fatalf("global: %d allowed, want the 900 left", n)
			}
			l.SetRules(mustRules(t, rule(tc.alg, "hybrid", "")))
			if n := admit(2000); n != 0 {
				t.Errorf("hybrid again: %d more allowed after the 1,000 of 1,000 (%+v)", n, d.Results)
			}
		})
	}
}
