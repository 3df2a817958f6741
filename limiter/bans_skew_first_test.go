package limiter

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// TestSharedBansClockSkewBeforeKnown: a daemon whose wall clock is 2 minutes off, that
// has not read the ban index yet (its read at start failed: on a Cluster the index's
// master may be down while the client's is up), enforces the hybrid ban its own refusals
// start for the ban's length. The ban's end is by Redis's clock, and until Known had
// measured the offset of Redis's clock from the daemon's, the daemon took its wall
// clock for Redis's: 2 minutes ahead, it let the ban go at once; 2 minutes behind, it
// answered 2m30s for a 30 s ban. Now the reply of the refusals that start a ban measures
// the offset when none is known yet. Standalone and a 3-master Cluster.
func TestSharedBansClockSkewBeforeKnown(t *testing.T) {
	const ban = 30 * time.Second
	yaml := loginRule(1, "1s", "hybrid", "after: 2, within: 1m, ban: 30s")
	for _, where := range []string{"standalone", "cluster"} {
		for _, skew := range []time.Duration{2 * time.Minute, -2 * time.Minute} {
			t.Run(fmt.Sprintf("%s/%v", where, skew), func(t *testing.T) {
				l := sharedLimiter(t, redisFor(t, where), yaml)
				clock := func() int64 { return time.Now().UnixNano() + int64(skew) }
				in := &Input{Attrs: attrs("ip=10.0.0.1"), Cost: 1}
				var d Decision
				for refusals := 0; refusals < 2; {
					if err := l.Check(clock(), in, &d); err != nil {
						t.Fatal(err)
					}
					if !d.Allowed {
						refusals++
					}
				}
				// The round's flush sends the two refusals, which start the ban; no read of
				// the index (as when it fails).
				if err := l.shared.round(context.Background(), clock(), false); err != nil {
					t.Fatal(err)
				}
				if err := l.Check(clock(), &Input{Attrs: attrs("ip=10.0.0.1")}, &d); err != nil {
					t.Fatal(err)
				}
				if r := d.Results[0].RetryAfter; !d.Banned || r > ban || r < ban-10*time.Second {
					t.Fatalf("clock %v: banned %v retry %v, want the ban's %v", skew, d.Banned, r, ban)
				}
			})
		}
	}
}
