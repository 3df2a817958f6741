package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A client whose checks move between two plans of one token-bucket rule far apart (3 per
// hour, `partner: 10x`), through one daemon or spread over several: 30 used at 30 per
// hour, then one check without the plan (refused, or a question of cost 0), then more
// as partner. Its 30 units, read at 3 per hour, are cut to that plan's whole burst, 3;
// read back at 30 per hour that cut said 3 used. Before (the daemons syncing every 10
// checks): 27 more admitted through one daemon, 11 over two or three, Redis then
// counting 30 of 57 and 14 of 41; after a question, none more here, but Redis counting
// 3 of 30, the other 27 left to whoever asked next. scripts/hybrid.lua dropped what the
// cut left out; with it kept (gu), a daemon alone still admitted 9: its view, read at 3
// per hour after the cut, moved up by the raise to 27 of room, and a share of that
// (⌊27 ÷ 2N⌋, 13) as credit before the next sync. The local and global modes admit
// none (TestGlobalPlanFlappingKeepsUnits). Redis counts what the daemons admitted: no
// unit lost, none counted twice.
func TestHybridPlanFlappingKeepsUnits(t *testing.T) {
	srv := redistest.StartStandalone(t)
	std, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { std.Close() })
	cl := redistest.StartCluster(t)
	cc, err := Open(Config{Cluster: cl.Addrs, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	for _, c := range []struct {
		name string
		rdb  redis.UniversalClient
		per  time.Duration
	}{
		{"standalone", std, time.Hour},
		{"cluster", cc, time.Hour},
		// 30 used of 30 per 30 days are 300 days of 3 per 30 days (global.lua kept 52
		// days of them: TestGlobalPlanFlappingKeepsLongUnits).
		{"standalone-30d", std, 30 * 24 * time.Hour},
	} {
		partner := mustLimit(t, localbucket.TokenBucket, 30, c.per)
		free := mustLimit(t, localbucket.TokenBucket, 3, c.per)
		for _, daemons := range []int{1, 2, 3} {
			for _, cost := range []uint64{1, 0} {
				t.Run(fmt.Sprintf("%s/daemons-%d/lower-plan-cost-%d", c.name, daemons, cost), func(t *testing.T) {
					prefix := fmt.Sprintf("rl:hflap-%s-%d-%d:", c.name, daemons, cost)
					hs := flapDaemons(t, c.rdb, prefix, daemons)
					key := prefix + "{k}"
					now := time.Now().UnixNano()
					checks := 0
					// check sends one request of lim through the next daemon, syncing them
					// all every 10 requests (10 ms of the daemons' clock, a tenth of their
					// interval: credit is spent before the next sync).
					check := func(lim *localbucket.Limit, cost uint64) bool {
						t.Helper()
						now += int64(time.Millisecond)
						h := hs[checks%len(hs)]
						checks++
						ops := []HybridOp{{Key: []byte(key), Limit: lim, Cost: cost}}
						ok := h.Take(now, ops)
						if !ok && ops[0].Unreachable {
							t.Fatalf("check %d: refused as Redis not answering: %+v", checks, ops[0].Result)
						}
						if checks%10 == 0 {
							syncAll(t, now, hs...)
						}
						return ok
					}
					used := 0
					for try := 0; used < 30; try++ {
						if try == 300 {
							t.Fatalf("%d of 30 admitted in 300 checks of the higher plan on a fresh key", used)
						}
						if check(partner, 1) {
							used++
						}
					}
					syncAll(t, now, hs...)
					if check(free, cost) {
						t.Fatalf("a check of cost %d at the lower plan after 30 used: allowed", cost)
					}
					syncAll(t, now, hs...)
					more := 0
					for range 30 {
						if check(partner, 1) {
							more++
						}
					}
					if more > 0 {
						t.Errorf("back at the higher plan after 30 used: %d more admitted, want 0", more)
					}
					for range 3 {
						if check(free, 1) {
							t.Errorf("at the lower plan again after 30 used: admitted")
						}
					}
					// Grants given back: Redis counts the units admitted, no more, no fewer
					// (a thirtieth of the window each), as a daemon new to the key reads them.
					syncAll(t, now, hs...)
					syncAll(t, now, hs...)
					r := take(flapDaemons(t, c.rdb, prefix+"new:", 1)[0], now, key, partner, 0)
					want := time.Duration(used+more) * c.per / 30
					if got := time.Duration(r.Reset); r.Allowed || got > want+time.Second || got < want-time.Minute {
						t.Errorf("a new daemon reads %+v: reset %v, want %v (%d admitted)", r, got, want, used+more)
					}
				})
			}
		}
	}
}

// flapDaemons returns n live hybrid stores on rdb, syncing every 100 ms (by the test),
// each counting the n live daemons: their live-daemons key is prefix's, no other test's.
func flapDaemons(t *testing.T, rdb redis.UniversalClient, prefix string, n int) []*Hybrid {
	t.Helper()
	hs := make([]*Hybrid, n)
	for i := range hs {
		hs[i] = NewHybrid(rdb, HybridOptions{Interval: 100 * time.Millisecond, FetchWait: time.Second, Prefix: prefix})
	}
	for round := 0; round < 2; round++ { // the second round sees every first
		for i, h := range hs {
			if _, err := h.Heartbeat(context.Background(), fmt.Sprint("d-", i), time.Minute); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := hs[0].replicaCount(); got != n {
		t.Fatalf("a daemon counts %d live, want %d", got, n)
	}
	return hs
}

// A rolling upgrade: a key a new daemon cut (its gu at 3 per hour, 27 units left out of
// 30 used) that a daemon with the previous hybrid.lua then read at 30 per hour, which
// ignores gu: it rescaled t alone, 3 units, and admitted 12 more (as before: what it
// forgives, it forgives), and left gu in the key. A new daemon reads the key at the
// key's own rate as the previous script wrote it (5 more admitted), and at another rate
// as the later of t and gu, each at its own rate: 27 used, never their sum (47), no unit
// counted twice.
func TestHybridCutUnitsBesidePreviousScript(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	partner := mustLimit(t, localbucket.TokenBucket, 30, time.Hour)
	free := mustLimit(t, localbucket.TokenBucket, 3, time.Hour)
	const key = "rl:hflap-mixed:{k}"
	tm, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	now := tm.UnixMicro()
	ep, ef := int64(2*time.Minute), int64(20*time.Minute)    // the emission intervals, ns
	unit := int64(2 * time.Minute / time.Microsecond)        // a unit at 30 per hour, µs
	if err := rdb.HSet(ctx, key, "t", now+15*unit, "er", ep, // 3 + 12 at 30 per hour
		"gce", ef, "gct", now, "gu", now+27*10*unit, "gue", ef).Err(); err != nil { // 27 at 3 per hour
		t.Fatal(err)
	}
	rdb.Expire(ctx, key, time.Hour)
	c := flapDaemons(t, rdb, "rl:hflap-mixed-c:", 1)[0]
	clock := time.Now().UnixNano()
	more := 0
	for range 5 { // fewer than the gu holds: read back, gu decides
		clock += int64(time.Millisecond)
		more += admitted(t, c, clock, key, partner, 1)
	}
	syncAll(t, clock, c)
	syncAll(t, clock, c)
	if more != 5 {
		t.Fatalf("a new daemon at 30 per hour, 15 used by the key's t: %d of 5 more admitted", more)
	}
	// Another new daemon asks at 3 per hour: the key read at another rate.
	if r := take(flapDaemons(t, rdb, "rl:hflap-mixed-d:", 1)[0], clock, key, free, 0); r.Allowed {
		t.Fatalf("a question at 3 per hour: %+v, want refused", r)
	}
	r := take(flapDaemons(t, rdb, "rl:hflap-mixed-e:", 1)[0], clock, key, partner, 0)
	want := time.Duration(max(15+more, 27)) * 2 * time.Minute
	if got := time.Duration(r.Reset); got > want+time.Second || got < want-time.Minute {
		t.Fatalf("read back at 30 per hour: reset %v, want %v (the later of %d used and the 27 cut; their sum %v)",
			got, want, 15+more, time.Duration(15+more+27)*2*time.Minute)
	}
	if n, err := rdb.HExists(ctx, key, "gu").Result(); err != nil || n {
		t.Fatalf("gu kept after a read at another rate (%v)", err)
	}
}
