package sync

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// records returns the names of key's sync records.
func records(t *testing.T, rdb redis.UniversalClient, key string) map[string]string {
	t.Helper()
	all, err := rdb.HGetAll(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	recs := map[string]string{}
	for k, v := range all {
		if strings.HasPrefix(k, "s:") {
			recs[k] = v
		}
	}
	return recs
}

// A key kept alive by steady use kept a sync record for every daemon id that ever synced
// it, one per restart under the default --daemon-id, for as long as it was used. Every
// 16th daemon new to a live key now drops the records not written for ten minutes
// (records of the previous script, which carry no time, ten minutes after a prune first
// saw them); the others stay, and the counts stay exact.
func TestHybridPrunesStaleSyncRecords(t *testing.T) {
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow, localbucket.TokenBucket} {
		t.Run(fmt.Sprint(alg), func(t *testing.T) {
			rdb := standalone(t)
			ctx := context.Background()
			// Limits whose state holds a reservation for less than ten minutes (a token
			// bucket's burst, a window or two), so that records go ten minutes after
			// they were written.
			lim := mustLimit(t, alg, 1000, 5*time.Minute)
			if alg == localbucket.SlidingWindow {
				lim = mustLimit(t, alg, 1000, 4*time.Minute)
			}
			if alg == localbucket.TokenBucket {
				l, err := localbucket.NewLimit(alg, 100, 270*time.Second, 200) // a unit every 2.7 s
				if err != nil {
					t.Fatal(err)
				}
				lim = &l
			}
			key := "rl:records:{user=steady}"
			now := time.Now().UnixNano()
			admitted := 0
			// Each daemon's first take of the key waits for its exact sync: FetchWait's
			// default (25 ms) ran out on a loaded machine, and the take was refused.
			const wait = 5 * time.Second
			steady := NewHybrid(rdb, HybridOptions{ID: "steady", FetchWait: wait})
			use := func(h *Hybrid) {
				t.Helper()
				if r := take(h, now, key, lim, 1); !r.Allowed {
					t.Fatalf("refused: %+v", r)
				}
				admitted++
				syncAll(t, now, h)
			}
			// Read before the first unit: the refill counted from tm (slack, below) is then
			// never short of the bucket's own. Read after it, a loaded machine's sync took
			// 0.4 s to come back, refill that slack did not count (Redis counts 163.854
			// units; the daemons admitted 164).
			tm, err := rdb.Time(ctx).Result()
			if err != nil {
				t.Fatal(err)
			}
			use(steady)
			s := tm.Unix()
			// Records of gone daemons: 40 written 11 minutes ago, 3 a minute ago, and 5 by
			// the previous script (no time).
			for i := 0; i < 40; i++ {
				rdb.HSet(ctx, key, fmt.Sprint("s:old-", i), fmt.Sprintf("7 8 0 1 0 %d", s-700))
			}
			for i := 0; i < 3; i++ {
				rdb.HSet(ctx, key, fmt.Sprint("s:recent-", i), fmt.Sprintf("7 8 0 1 0 %d", s-60))
			}
			for i := 0; i < 5; i++ {
				rdb.HSet(ctx, key, fmt.Sprint("s:untimed-", i), "7 8 0 1 0")
			}

			var ds []*Hybrid
			newcomers := func(name string, n int) {
				for i := 0; i < n; i++ {
					h := NewHybrid(rdb, HybridOptions{ID: fmt.Sprint(name, "-", i), FetchWait: wait})
					ds = append(ds, h)
					use(h)
					use(steady)
				}
			}
			newcomers("a", 15)
			if n := len(records(t, rdb, key)); n != 1+40+3+5+15 {
				t.Fatalf("%d records after 15 daemons new to the key, want every one kept until the 16th", n)
			}
			newcomers("b", 1)
			recs := records(t, rdb, key)
			for name := range recs {
				if strings.HasPrefix(name, "s:old-") {
					t.Fatalf("record %s, 11 minutes old, kept by the 16th daemon new to the key", name)
				}
			}
			if n := len(recs); n != 1+3+5+16 {
				t.Fatalf("%d records after the prune, want %d: the steady daemon's, the recent ones, the untimed ones and the 16 new daemons'", n, 1+3+5+16)
			}
			if v := recs["s:a-0"]; len(strings.Fields(v)) != 6 {
				t.Fatalf("record %q: want six fields, the last the time it was written", v)
			}
			// The untimed records go at the first prune ten minutes after one saw them
			// unchanged (their marks, w:<daemon id>, say when).
			if n := ageMarks(t, rdb, key, 601); n != 5 {
				t.Fatalf("%d marks after a prune saw 5 untimed records", n)
			}
			newcomers("c", 16)
			recs = records(t, rdb, key)
			for name := range recs {
				if strings.HasPrefix(name, "s:untimed-") {
					t.Fatalf("record %s kept ten minutes after a prune first saw it", name)
				}
			}
			if n := len(recs); n != 1+3+32 {
				t.Fatalf("%d records after the second prune, want %d", n, 1+3+32)
			}
			if n := ageMarks(t, rdb, key, 0); n != 0 {
				t.Fatalf("%d marks kept with no untimed record left", n)
			}

			// Every daemon still syncs exactly: each admits more, then they all leave.
			for _, h := range append(ds, steady) {
				for i := 0; i < 3; i++ {
					if r := take(h, now, key, lim, 1); !r.Allowed {
						t.Fatalf("refused: %+v", r)
					}
					admitted++
				}
			}
			syncAll(t, now, append(ds, steady)...)
			for _, h := range append(ds, steady) {
				if err := h.Release(ctx, now); err != nil {
					t.Fatal(err)
				}
			}
			end, err := rdb.Time(ctx).Result()
			if err != nil {
				t.Fatal(err)
			}
			var counted, slack float64
			switch alg {
			case localbucket.TokenBucket:
				tt, err := rdb.HGet(ctx, key, "t").Float64()
				if err != nil {
					t.Fatal(err)
				}
				T := 2.7e6 // µs a unit
				counted = (tt - float64(end.UnixMicro())) / T
				slack = float64(end.Sub(tm).Microseconds()) / T // refilled since the first unit
			case localbucket.FixedWindow:
				if w := int64(lim.Window()); tm.UnixNano()/w != end.UnixNano()/w {
					t.Skip("the window turned during the test")
				}
				counted, err = rdb.HGet(ctx, key, "n").Float64()
			default:
				var np []float64
				np, err = hfloats(rdb, key, "n", "p")
				counted = np[0] + np[1]
			}
			if err != nil {
				t.Fatal(err)
			}
			if counted < float64(admitted)-slack-0.01 || counted > float64(admitted)+0.01 {
				t.Fatalf("Redis counts %.3f units (%.3f refilled); the daemons admitted %d", counted, slack, admitted)
			}
		})
	}
}

// ageMarks moves the marks of key's untimed records (w:<daemon id> = "token s") by
// secs into the past, and returns how many there are.
func ageMarks(t *testing.T, rdb redis.UniversalClient, key string, secs int64) int {
	t.Helper()
	ctx := context.Background()
	all, err := rdb.HGetAll(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for f, v := range all {
		if !strings.HasPrefix(f, "w:") {
			continue
		}
		var tok string
		var at int64
		if _, err := fmt.Sscan(v, &tok, &at); err != nil {
			t.Fatalf("mark %s = %q: %v", f, v, err)
		}
		rdb.HSet(ctx, key, f, fmt.Sprint(tok, " ", at-secs))
		n++
	}
	// An earlier build's single mark: when a prune first saw untimed records.
	if sp, err := rdb.HGet(ctx, key, "sp").Int64(); err == nil {
		rdb.HSet(ctx, key, "sp", sp-secs)
		n++
	}
	return n
}

// A daemon still running the previous script (its records carry no time) beside daemons
// running this one, for longer than a record lives (a canary, a slow rolling upgrade):
// its record is rewritten at each of its syncs that changes the key, and must not be
// pruned. Before, every untimed record went once a prune had seen untimed records for
// that long, the live daemon's too: its grant then stayed reserved in the key, units
// nobody held (an audit, a rule of 1,000,000 an hour over an old and a new daemon: 337,112
// units reserved after both had stopped, against 0).
func TestHybridKeepsLiveRecordsOfThePreviousScript(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	ctx := context.Background()
	lim := mustLimit(t, localbucket.FixedWindow, 1000, hourWindow())
	key := "rl:records:{user=canary}"
	now := time.Now().UnixNano()
	admitted := 0
	old := NewHybrid(rdb, HybridOptions{ID: "old"})
	// untime rewrites old's record as the previous script writes it: without its time.
	untime := func() {
		t.Helper()
		v, err := rdb.HGet(ctx, key, "s:old").Result()
		if err != nil {
			t.Fatal(err)
		}
		if f := strings.Fields(v); len(f) == 6 {
			rdb.HSet(ctx, key, "s:old", strings.Join(f[:5], " "))
		}
	}
	use := func(h *Hybrid) {
		t.Helper()
		if r := take(h, now, key, lim, 1); !r.Allowed {
			t.Fatalf("refused: %+v", r)
		}
		admitted++
		syncAll(t, now, h)
		if h == old {
			untime()
		}
	}
	use(old)
	var ds []*Hybrid
	newcomers := func(name string, n int) {
		for i := 0; i < n; i++ {
			h := NewHybrid(rdb, HybridOptions{ID: fmt.Sprint(name, "-", i)})
			ds = append(ds, h)
			use(h)
		}
	}
	newcomers("a", 16) // a prune sees old's record
	use(old)           // old syncs on: its record rewritten
	ageMarks(t, rdb, key, 4000)
	newcomers("b", 16) // a prune an hour later
	if _, err := rdb.HGet(ctx, key, "s:old").Result(); err != nil {
		t.Fatalf("the record of a daemon still running the previous script was pruned: %v", err)
	}
	use(old)
	all := append(ds, old)
	for _, h := range all {
		if err := h.Release(ctx, now); err != nil {
			t.Fatal(err)
		}
	}
	tm, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	if w := int64(lim.Window()); now/w != tm.UnixNano()/w {
		t.Skip("the window turned during the test")
	}
	ng, err := hfloats(rdb, key, "n", "g")
	if err != nil {
		t.Fatal(err)
	}
	if ng[0] != float64(admitted) || ng[1] != 0 {
		t.Fatalf("Redis counts %v units, %v of them reserved, after every daemon gave its grant back; the daemons admitted %d", ng[0], ng[1], admitted)
	}
}

// hfloats reads fields of key as numbers (0 when missing).
func hfloats(rdb redis.UniversalClient, key string, fields ...string) ([]float64, error) {
	vs, err := rdb.HMGet(context.Background(), key, fields...).Result()
	if err != nil {
		return nil, err
	}
	out := make([]float64, len(vs))
	for i, v := range vs {
		if v != nil {
			fmt.Sscan(v.(string), &out[i])
		}
	}
	return out, nil
}

// A record lasts at least as long as its key's state can hold a reservation (a window,
// two sliding ones, a token bucket's burst), plus a minute: a daemon keeps its view of a
// key, grant included, until the key is full again, and its next sync needs the record
// to tell that grant for the key's. An hour's window keeps records 20 minutes old.
func TestHybridKeepsRecordsAsLongAsAReservation(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	lim := mustLimit(t, localbucket.FixedWindow, 1000, hourWindow())
	key := "rl:records:{user=hourly}"
	now := time.Now().UnixNano()
	steady := NewHybrid(rdb, HybridOptions{ID: "steady"})
	take(steady, now, key, lim, 1)
	syncAll(t, now, steady)
	tm, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	rdb.HSet(ctx, key, "s:twenty-minutes", fmt.Sprintf("7 8 3 1 0 %d", tm.Unix()-1200))
	rdb.HSet(ctx, key, "s:two-hours", fmt.Sprintf("7 8 3 1 0 %d", tm.Unix()-7200))
	for i := 0; i < 16; i++ {
		h := NewHybrid(rdb, HybridOptions{ID: fmt.Sprint("new-", i)})
		take(h, now, key, lim, 1)
		syncAll(t, now, h)
	}
	recs := records(t, rdb, key)
	if _, ok := recs["s:twenty-minutes"]; !ok {
		t.Error("a record 20 minutes old dropped from a key whose window is an hour")
	}
	if _, ok := recs["s:two-hours"]; ok {
		t.Error("a record two hours old kept on a key whose window is an hour")
	}
}
