package sync

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A reload that changes a token bucket's limit reaches the daemons at different times (a
// rolling config deploy), and until the last has it the checks of one key alternate
// between the two rates. global.lua reads a state written at the other rate as the same
// units used, and cut it to a whole burst of the reading rate at every such read, written
// back: the daemon on the smaller bucket forgave the difference each time it read the
// key, and the other admitted it again. Raised from 10 to 20 per hour on one daemon, after
// 10 used, 10 + one per check through the lagging daemon, without bound (before the fix:
// 10 + 10 + 40 = 60 in 40 rounds). Now a cut is made at most once per window at an
// emission, so the client gets at most max(old, new) plus one smaller burst forgiven
// once, and then both daemons refuse it.
func TestGlobalReloadReachesDaemonsApart(t *testing.T) {
	bs := globalBackends(t)
	for _, bk := range bs {
		for _, c := range []struct {
			name       string
			from, to   uint64 // per hour
			used       uint64 // before the reload, through daemon a
			reloadsOne string // which daemon has the new limit: "a" or "b"
		}{
			{"raise-10-to-20-on-b", 10, 20, 10, "b"},
			{"raise-10-to-20-on-a", 10, 20, 10, "a"},
			{"lower-20-to-10-on-a", 20, 10, 20, "a"},
			{"lower-20-to-10-on-b", 20, 10, 20, "b"},
			{"lower-20-to-10-after-15", 20, 10, 15, "a"},
		} {
			t.Run(bk.name+"/"+c.name, func(t *testing.T) {
				from := globalLimit(t, localbucket.TokenBucket, c.from, time.Hour, c.from)
				to := globalLimit(t, localbucket.TokenBucket, c.to, time.Hour, c.to)
				// Two daemons: two Globals on the same Redis (global mode keeps nothing per key
				// in the daemon).
				a := bk.g
				b := &Global{rdb: bk.rdb, bySlot: bk.g.bySlot}
				key := fmt.Sprintf("rl:gapart:{%s-%s}", bk.name, c.name)
				check := func(g *Global, l *localbucket.Limit) bool {
					t.Helper()
					ops := []GlobalOp{{Key: key, Limit: l, Cost: 1}}
					ok, err := g.Check(globalCtx(t), ops)
					if err != nil {
						t.Fatal(err)
					}
					return ok
				}
				for i := uint64(0); i < c.used; i++ {
					if !check(a, from) {
						t.Fatalf("request %d of %d before the reload refused", i+1, c.used)
					}
				}
				la, lb := from, to
				if c.reloadsOne == "a" {
					la, lb = to, from
				}
				const rounds = 40
				var got [rounds][2]bool
				total := c.used
				for i := range rounds {
					got[i][0] = check(a, la)
					got[i][1] = check(b, lb)
					for _, ok := range got[i] {
						if ok {
							total++
						}
					}
				}
				// An hour's window: a check or two per ms refills nothing to speak of (one unit
				// per 3 or 6 minutes).
				bound := max(c.from, c.to) + min(c.from, c.to)
				t.Logf("%d used, then %d admitted in %d rounds alternating daemons at %d and %d per hour (bound %d)",
					c.used, total-c.used, rounds, la.Requests(), lb.Requests(), bound)
				if total > bound {
					t.Errorf("%d admitted in all (%d before the reload): more than max(%d, %d) + one burst forgiven once = %d",
						total, c.used, c.from, c.to, bound)
				}
				for i := rounds - 10; i < rounds; i++ {
					if got[i][0] || got[i][1] {
						t.Errorf("round %d of %d: admitted %v; want both daemons refusing by then", i+1, rounds, got[i])
					}
				}
				// The daemons agree again (the lagging one reloads): nothing left.
				if check(a, to) || check(b, to) {
					t.Errorf("both at %d per hour after the disagreement: a request admitted", c.to)
				}
			})
		}
	}
}

// The cut global.lua makes of a token bucket read at another rate, step by step on states
// written into Redis: more units than a whole burst at the reading rate are cut to a
// whole burst, recorded in the key (gce, gct); another read within that window at the
// same rate keeps the units (a refused client stays refused); after the window, or at
// another rate (a second lowering), it cuts again.
func TestGlobalRescaleCutOncePerWindow(t *testing.T) {
	for _, bk := range globalBackends(t) {
		t.Run(bk.name, func(t *testing.T) {
			rdb := bk.rdb
			key := fmt.Sprintf("rl:gcut:{%s}", bk.name)
			l10 := globalLimit(t, localbucket.TokenBucket, 10, time.Hour, 10) // e 360 s
			l5 := globalLimit(t, localbucket.TokenBucket, 5, time.Hour, 5)    // e 720 s
			e20, e10, e5 := int64(180*time.Second), int64(360*time.Second), int64(720*time.Second)
			// write stores units used at emission e, and the last cut (gce, gct µs; 0: none).
			write := func(units, e, gce, gct int64) {
				t.Helper()
				now := globalRedisNow(t, rdb) / 1000
				if err := rdb.Del(globalCtx(t), key).Err(); err != nil {
					t.Fatal(err)
				}
				f := []any{"t", now + units*e/1000, "f", 0, "er", e}
				if gce != 0 {
					f = append(f, "gce", gce, "gct", gct)
				}
				if err := rdb.HSet(globalCtx(t), key, f...).Err(); err != nil {
					t.Fatal(err)
				}
			}
			// read peeks at l and returns the bucket's time owed (ns) as written back, and the
			// cut recorded.
			read := func(l *localbucket.Limit) (owed time.Duration, gce, gct int64) {
				t.Helper()
				if r, _, _, _ := globalCheckOne(t, bk, key, l, 0); r.Allowed {
					t.Fatalf("peek at %d per hour: allowed, want refused: %+v", l.Requests(), r)
				}
				v, err := rdb.HMGet(globalCtx(t), key, "t", "f", "gce", "gct").Result()
				if err != nil {
					t.Fatal(err)
				}
				num := func(x any) int64 {
					if x == nil {
						return 0
					}
					var n int64
					fmt.Sscan(x.(string), &n)
					return n
				}
				now := globalRedisNow(t, rdb)
				return time.Duration(num(v[0])*1000 + num(v[1]) - now), num(v[2]), num(v[3])
			}
			near := func(what string, got, want time.Duration) {
				t.Helper()
				if d := got - want; d < -time.Second || d > time.Second {
					t.Errorf("%s: %v owed, want %v", what, got, want)
				}
			}
			// 20 units at 20 per hour, read at 10: cut to a whole burst, recorded.
			write(20, e20, 0, 0)
			owed, gce, gct := read(l10)
			near("first read at 10 per hour", owed, time.Hour)
			if now := globalRedisNow(t, rdb) / 1000; gce != e10 || now-gct > int64(time.Second/time.Microsecond) || gct > now {
				t.Errorf("the cut recorded: gce %d gct %d (now %d), want %d and about now", gce, gct, now, e10)
			}
			// The other daemon, at 20, fills it again; read at 10 within the window: kept.
			write(20, e20, e10, gct)
			owed, _, _ = read(l10)
			near("read at 10 per hour again within the window", owed, 2*time.Hour)
			if ttl := rdb.PTTL(globalCtx(t), key).Val(); ttl < 2*time.Hour {
				t.Errorf("TTL %v with the units kept, want at least the 2 h owed", ttl)
			}
			// The cut an hour and a second ago: cut again.
			write(20, e20, e10, gct-int64((time.Hour+time.Second)/time.Microsecond))
			owed, _, _ = read(l10)
			near("read at 10 per hour a window after the cut", owed, time.Hour)
			// Lowered again, to 5: a cut at 10 says nothing of 5.
			write(10, e10, e10, globalRedisNow(t, rdb)/1000)
			owed, gce, _ = read(l5)
			near("read at 5 per hour after a cut at 10", owed, time.Hour)
			if gce != e5 {
				t.Errorf("the cut at 5 per hour recorded gce %d, want %d", gce, e5)
			}
			if gpe, _ := rdb.HGet(globalCtx(t), key, "gpe").Int64(); gpe != e10 {
				t.Errorf("the cut before it: gpe %d, want %d", gpe, e10)
			}
			if ttl := rdb.PTTL(globalCtx(t), key).Val(); ttl < time.Hour {
				t.Errorf("TTL %v after the cut, want at least the hour owed", ttl)
			}
		})
	}
}

// A token bucket with a delay (algorithm 4) holds up to its burst plus the delay's units
// at the rate that wrote it, so during a disagreement both daemons may read the key over
// their own burst and cut it. With only the last cut recorded they cut in turn, and every
// check was admitted: 10 per hour on one daemon, 20 on the other, a burst of 10 and a
// delay of 30 minutes on both, 100 rounds of one check through each: 200 of 200 (alone, a
// daemon admits 15 or 20). The key keeps its last two cuts at distinct rates.
func TestGlobalReloadDelayedBucketsApart(t *testing.T) {
	for _, bk := range globalBackends(t) {
		t.Run(bk.name, func(t *testing.T) {
			la := globalLimit(t, localbucket.TokenBucket, 10, time.Hour, 10).WithDelay(30 * time.Minute)
			lb := globalLimit(t, localbucket.TokenBucket, 20, time.Hour, 10).WithDelay(30 * time.Minute)
			a, b := bk.g, &Global{rdb: bk.rdb, bySlot: bk.g.bySlot}
			key := fmt.Sprintf("rl:gdelay:{%s}", bk.name)
			const rounds = 100
			total, late := 0, 0
			for i := range rounds {
				for _, d := range []struct {
					g *Global
					l *localbucket.Limit
				}{{a, &la}, {b, &lb}} {
					ops := []GlobalOp{{Key: key, Limit: d.l, Cost: 1}}
					ok, err := d.g.Check(globalCtx(t), ops)
					if err != nil {
						t.Fatal(err)
					}
					if ok {
						total++
						if i >= rounds-20 {
							late++
						}
					}
				}
			}
			// Alone, 15 at 10 per hour, 20 at 20 per hour: at most the larger and the other
			// forgiven once.
			t.Logf("%d admitted in %d rounds, %d in the last 20", total, rounds, late)
			if total > 35 || late > 0 {
				t.Errorf("%d admitted in %d rounds alternating daemons at 10 and 20 per hour with a delay, %d in the last 20; want at most 35, none late",
					total, rounds, late)
			}
		})
	}
}

// A client whose checks alternate between two plans of one token-bucket rule far apart (30
// and 3 per hour, the README's `partner: 10x`): its 30 units used at 30 per hour, read at 3
// (a check of the other plan, refused, or a peek) are cut to the lower plan's whole burst,
// 3. Read back at 30 per hour, that cut said 3 used, and 27 more were admitted within the
// hour: 57 of a limit of 30, where the local mode admits 0 more (the state's N keeps the
// uncut time) and the bound documented for global mode is one smaller burst, 33. The cut
// now keeps what it left out in the key (fields gu, gue), read by the next read at
// another rate, as the local store does.
func TestGlobalPlanFlappingKeepsUnits(t *testing.T) {
	for _, bk := range globalBackends(t) {
		for _, cost := range []uint64{1, 0} {
			t.Run(fmt.Sprintf("%s/lower-plan-cost-%d", bk.name, cost), func(t *testing.T) {
				partner := globalLimit(t, localbucket.TokenBucket, 30, time.Hour, 30)
				free := globalLimit(t, localbucket.TokenBucket, 3, time.Hour, 3)
				key := fmt.Sprintf("rl:gflap:{%s-%d}", bk.name, cost)
				admitted := func(l *localbucket.Limit, n int) int { return globalAdmitted(t, bk, key, l, n) }
				if got := admitted(partner, 30); got != 30 {
					t.Fatalf("%d of 30 admitted at 30 per hour on a fresh key", got)
				}
				if r, _, _, _ := globalCheckOne(t, bk, key, free, cost); r.Allowed {
					t.Fatalf("a check of cost %d at 3 per hour after 30 used: allowed", cost)
				}
				if got := admitted(partner, 30); got != 0 {
					t.Errorf("back at 30 per hour after 30 used: %d more admitted, want 0", got)
				}
				if got := admitted(free, 3); got != 0 {
					t.Errorf("at 3 per hour again: %d admitted, want 0", got)
				}
			})
		}
	}
}

// globalAdmitted makes n checks of cost 1 of key at l and returns how many were allowed.
func globalAdmitted(t testing.TB, b globalBackend, key string, l *localbucket.Limit, n int) int {
	t.Helper()
	k := 0
	for range n {
		if _, ok, _, _ := globalCheckOne(t, b, key, l, 1); ok {
			k++
		}
	}
	return k
}
