package sync

import (
	"context"
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A client that used its limit, paused, and came back once the limit allows it again is
// admitted as the exact mode admits it (one daemon alone, each answer beside the local
// bucket's to the same requests at the same times). The pause outlasts two sync
// intervals, so the key's view is stale and clean: the key has cooled. Before, the last
// sync's share grant (asked for the burst's demand) kept it hot: the units the growth of
// its view allowed made it dirty, dirty made it hot, and a hot key waits for its next
// periodic sync: 5 per second, 5 used, a second's pause, then 2 admitted (1 for a
// sliding window) and the rest refused, each told to retry in 1 ms (the view a second
// old), in every trial.
func TestHybridBurstAgainAfterAFullWindow(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	runHybrid(t, h, "d")
	rnd := rand.New(rand.NewSource(5))
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.TokenBucket, localbucket.SlidingWindow} {
		const pause = time.Second + 20*time.Millisecond
		lim := mustLimit(t, alg, 5, time.Second)
		// Two trials whose bursts each lie in one window (by this clock). The phase is
		// any, so a burst may run over a window's turn, more often the longer a loaded
		// machine makes it; its units before the turn with no certain window (the key's
		// first, on credit before any view) are dated by their age, and a few may count
		// in the new window (docs/accuracy.md): the exact mode then admits a unit hybrid
		// refuses, a case of its own (TestHybridBurstAcrossTheTurn), not this one. (A CI
		// run at load 9: "true true true true true false(exact: admitted; retry 997ms)",
		// the burst 2.5 ms over the turn; 7 of 40 bursts started 0.5-4 ms before it.)
		ran := 0
		for trial := 0; ran < 2; trial++ {
			if trial == 8 {
				t.Fatalf("%v: %d of 8 trials had both bursts within a window", alg, ran)
			}
			key := fmt.Sprintf("rl:again:{%d-%d-%d}", alg, trial, time.Now().UnixNano())
			time.Sleep(time.Duration(rnd.Int63n(int64(time.Second)))) // any phase of the window
			b := &beside{h: h, key: key, lim: lim}
			burst := func() bool {
				start := time.Now().UnixNano()
				for range 6 {
					b.step()
				}
				w := int64(lim.Window())
				return alg == localbucket.TokenBucket || start/w == time.Now().UnixNano()/w
			}
			within := burst()
			time.Sleep(pause)
			b.log.WriteString(" |")
			if !burst() || !within {
				t.Logf("%v, trial %d: a burst ran over a window's turn, another trial:%s", alg, trial, b.log.String())
				continue
			}
			ran++
			if b.bad > 0 {
				t.Errorf("%v, a pause of %v, trial %d: %d refused that the exact mode admits:%s", alg, pause, trial, b.bad, b.log.String())
			}
		}
	}
}

// A client that used a fixed window's limit just before the window ended is admitted
// the new window's limit just after it (one daemon alone, each answer beside the local
// bucket's), and the refusal before the turn says the window's end, when a retry
// passes. The key's periodic sync falls between (it asks a share grant for the burst's
// demand, and gets none: the window is used) or after the turn. Before, the burst's
// demand kept the key hot across the turn: 2 or 3 of 5 admitted, the rest refused until
// the key's next sync; and the refusal before the turn said the next sync (100 ms)
// where the window ended 50 ms later.
func TestHybridFixedWindowBurstAfterTheTurn(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	ctx := context.Background()
	const window = time.Second
	w := int64(window)
	lim := mustLimit(t, localbucket.FixedWindow, 5, window)
	ran := 0
	for trial := 0; trial < 8 && ran < 4; trial++ {
		key := fmt.Sprintf("rl:again-turn:{%d-%d}", trial, time.Now().UnixNano())
		sleepUntilBeforeTheEnd(window, 50*time.Millisecond)
		b := &beside{h: h, key: key, lim: lim}
		log := &b.log
		var last localbucket.Result
		step := func() {
			r, want := b.step()
			// Not past the window's end, but for the view's sync's duration (added to
			// every retry, so that none is early by it) and a few ms.
			if lag := lagNs(entryOf(h, key).lag); !r.Allowed && !want.Allowed &&
				r.RetryAfter > want.RetryAfter+lag+int64(5*time.Millisecond) {
				fmt.Fprintf(log, "(retry %v, the window ends in %v, the sync took up to %v)",
					time.Duration(r.RetryAfter), time.Duration(want.RetryAfter), time.Duration(lag))
				b.bad++
			}
			last = r
		}
		for range 6 {
			step()
		}
		// The periodic sync: before the turn in odd trials, at it in even ones.
		sync := func() {
			if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
				t.Fatal(err)
			}
			log.WriteString(" (sync)")
		}
		if trial%2 == 1 {
			sync()
		}
		if time.Now().UnixNano()%w < w/2 {
			continue // the machine slept through the turn: not this case
		}
		time.Sleep(time.Duration(last.RetryAfter))
		log.WriteString(" |")
		if trial%2 == 0 {
			sync()
		}
		for range 6 {
			step()
		}
		ran++
		if b.bad > 0 {
			t.Errorf("trial %d: %d answers unlike the exact mode's:%s", trial, b.bad, log.String())
		}
	}
	if ran == 0 {
		t.Fatal("no trial ran: the machine slept through every turn")
	}
}

// Units admitted here just before a fixed window ended, on credit, and not synced by the
// turn are counted in the window they were admitted in, though the client's requests go
// on after the turn: the new window's limit is the client's. The key's periodic sync
// dates what it carries by its last admission; before, the units admitted after the
// turn carried the ones before it into the new window: 10 a second, 4 on credit 30 ms
// before the end, then 7 of 10 admitted after it (and 1,000 per 2 s sent at once from
// 26 ms before the end through a daemon: about 600 in the new window, where the exact
// mode admits 1,000).
func TestHybridUnitsBeforeTheTurnStayInTheirWindow(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	ctx := context.Background()
	const window = time.Second
	w := int64(window)
	lim := mustLimit(t, localbucket.FixedWindow, 10, window)
	// A trial is off when the daemon's view of the window's end lags past the turn: a
	// sync late on a starved host dates units by their age (docs/accuracy.md). Under
	// -race beside 4 busy loops on 2 cores, one trial of three once counted 3 units
	// before the turn in the new window (7 of 12 admitted after it). The fault this
	// guards is off in every trial, so the test fails when most trials that ran are.
	ran, off := 0, 0
	// A first key's exact sync sets up the connection and loads the script: done
	// before the trials, which then measure the turn alone.
	take(h, time.Now().UnixNano(), "rl:turn-units:{warm}", lim, 1)
	for trial := 0; trial < 6 && ran < 3; trial++ {
		key := fmt.Sprintf("rl:turn-units:{%d-%d}", trial, time.Now().UnixNano())
		sleepUntilBeforeTheEnd(window, 30*time.Millisecond)
		before := 0
		for range 5 {
			if take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
				before++
			}
		}
		if time.Now().UnixNano()%w < w/2 {
			continue // the machine slept through the turn: not this case
		}
		if e := entryOf(h, key); e.pending <= uint64(e.grant) {
			t.Fatalf("trial %d: nothing admitted on credit before the turn (pending %d, grant %d)", trial, e.pending, e.grant)
		}
		now := time.Now().UnixNano()
		time.Sleep(time.Duration(w - now%w + int64(5*time.Millisecond)))
		after := 0
		for range 12 {
			if take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
				after++
			}
		}
		if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
			t.Fatal(err)
		}
		n, _ := rdb.HGet(ctx, key, "n").Int()
		ran++
		if before != 5 || after != 10 || n != 10 {
			off++
			t.Logf("trial %d: %d of 5 admitted before the turn, %d of 12 after it (the exact mode: 5, 10); Redis counts %d in the new window",
				trial, before, after, n)
		}
	}
	if ran == 0 {
		t.Fatal("no trial ran: the machine slept through every turn")
	}
	if 2*off > ran {
		t.Errorf("%d of %d trials unlike the exact mode (logged above)", off, ran)
	}
}

// sleepUntilBeforeTheEnd sleeps until d before the end of a window of length w (the
// next one's, if this one's is nearer than d).
func sleepUntilBeforeTheEnd(w, d time.Duration) {
	now := time.Now().UnixNano()
	wait := int64(w) - now%int64(w) - int64(d)
	if wait < 0 {
		wait += int64(w)
	}
	time.Sleep(time.Duration(wait))
}

// syncedAt is when key's view on h was read (its entry's synced; 0: never), read under
// its shard's lock: h's syncs (Run) write it meanwhile.
func syncedAt(h *Hybrid, key string) (synced int64) {
	withEntry(h, key, func(e *hentry) { synced = e.synced })
	return synced
}

// stray reports whether key's units waiting to be synced on h may lie outside its
// view's window (flagStray: dated by their age, not by the view's window).
func stray(h *Hybrid, key string) (is bool) {
	withEntry(h, key, func(e *hentry) { is = e.flags&flagStray != 0 })
	return is
}

// beside takes one unit of key on h at a time, each beside a local bucket's answer at
// the same time (the exact mode's): log holds the answers, bad counts the refusals the
// exact mode does not make.
//
// Not one in the lag of the view's window's end, the first such refusal of a trial: the
// view knows the end only within its sync's lag (windowEnd) and takes it at its latest,
// never early, so a unit that needs the turn's room is refused there (a CI run under
// -race: a sliding window of 5 per second, the sixth unit of a burst just after the
// turn, told the next sync). A second one is bad.
type beside struct {
	h    *Hybrid
	key  string
	lim  *localbucket.Limit
	st   localbucket.State
	log  strings.Builder
	bad  int
	edge bool // a refusal in the lag of the view's window's end was not counted bad
}

func (b *beside) step() (r, want localbucket.Result) {
	now := time.Now().UnixNano()
	inLag := inEndLag(b.h, b.key, now)
	r = take(b.h, now, b.key, b.lim, 1)
	b.st, want = b.lim.Take(b.st, now, 1)
	fmt.Fprintf(&b.log, " %v", r.Allowed)
	if want.Allowed && !r.Allowed {
		if inLag && !b.edge {
			b.edge = true
			fmt.Fprintf(&b.log, "(exact: admitted; in the lag of the view's window's end, retry %v)", time.Duration(r.RetryAfter))
			return r, want
		}
		fmt.Fprintf(&b.log, "(exact: admitted; retry %v)", time.Duration(r.RetryAfter))
		b.bad++
	}
	return r, want
}

// inEndLag reports whether now lies between the earliest and the latest end of the
// window of key's view on h (windowEnd): the view cannot tell whether it has ended.
func inEndLag(h *Hybrid, key string, now int64) (in bool) {
	withEntry(h, key, func(e *hentry) {
		end, earliest, ok := windowEnd(e)
		in = ok && now >= earliest && now < end
	})
	return in
}

// The same for a sliding window: units admitted on credit just before its window ended
// count as the previous window's in the next, weighing less as it goes, and the client
// is admitted as the exact mode admits it after the turn (each answer beside the local
// bucket's), then 300 ms later as the previous window's share has fallen. Before, they
// counted whole in the new window: 1,000 per 2 s sent at once through a daemon from 30
// ms before the turn, 1,001 admitted and told 1,960 ms, where the exact mode admitted
// 1,040 and said 1-5 ms.
func TestHybridSlidingUnitsBeforeTheTurn(t *testing.T) {
	rdb := standalone(t)
	h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
	const window = time.Second
	w := int64(window)
	lim := mustLimit(t, localbucket.SlidingWindow, 100, window)
	ran := 0
	for trial := 0; trial < 6 && ran < 3; trial++ {
		key := fmt.Sprintf("rl:slide-turn:{%d-%d}", trial, time.Now().UnixNano())
		sleepUntilBeforeTheEnd(window, 30*time.Millisecond)
		var st localbucket.State
		bad, first := 0, ""
		step := func(phase string) bool {
			now := time.Now().UnixNano()
			r := take(h, now, key, lim, 1)
			var want localbucket.Result
			st, want = lim.Take(st, now, 1)
			if want.Allowed && !r.Allowed {
				if bad++; first == "" {
					first = fmt.Sprintf("%s: refused with retry %v at %v into the window", phase, time.Duration(r.RetryAfter), time.Duration(now%w))
				}
			}
			return want.Allowed
		}
		// A unit by an exact sync (the key new here), then on credit.
		for range 20 {
			step("before the turn")
		}
		if time.Now().UnixNano()%w < w/2 {
			continue // the machine slept through the turn: not this case
		}
		if e := entryOf(h, key); e.pending <= uint64(e.grant) {
			t.Fatalf("trial %d: nothing admitted on credit before the turn (pending %d, grant %d)", trial, e.pending, e.grant)
		}
		now := time.Now().UnixNano()
		time.Sleep(time.Duration(w - now%w + int64(5*time.Millisecond)))
		for n := 0; step("after the turn") && n < 200; n++ {
		}
		time.Sleep(300 * time.Millisecond)
		for range 10 {
			step("300 ms later")
		}
		ran++
		if bad > 0 {
			t.Errorf("trial %d: %d refused that the exact mode admits; the first %s", trial, bad, first)
		}
	}
	if ran == 0 {
		t.Fatal("no trial ran: the machine slept through every turn")
	}
}

// A burst that runs through a window's turn (one daemon alone, syncing as it runs, each
// answer beside the local bucket's at the same time): what it admitted on credit before
// the turn is counted in the window it was admitted in. Asked once the burst is over and
// synced, Redis counts the units admitted before the turn as the previous window's (a
// sliding window weighs them less as the new one goes) and those after it as the new
// one's; during the burst no refusal the exact mode would not make waits for the units
// before the turn to leave. The view knows the window's end only within its sync's lag:
// judged from its latest, the units admitted in the lag (a request every 60 µs, as a
// client's through a daemon) were synced with the rest at the next refusal and dated
// after the turn: through a daemon, 1,000 per 2 s from 30 ms before the turn, 1,003
// admitted and the rest told 1,965 ms, where the exact mode said 4 ms.
func TestHybridBurstAcrossTheTurn(t *testing.T) {
	t.Run("standalone", func(t *testing.T) {
		h := NewHybrid(standalone(t), HybridOptions{ID: "d", FetchWait: time.Second})
		runHybrid(t, h, "d")
		burstAcrossTheTurn(t, h)
	})
	// On a Redis Cluster, as the daemon runs there: a breaker per master, each master's
	// keys synced on their own.
	t.Run("cluster", func(t *testing.T) {
		_, rdb, m, _ := clusterMasters(t, time.Second, "rl:burst-turn", 1)
		h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second}).WithMasters(m)
		t.Cleanup(runWithMasters(h, m, time.Second, time.Second))
		burstAcrossTheTurn(t, h)
	})
}

// burstAcrossTheTurn is TestHybridBurstAcrossTheTurn on h, whose syncs run.
func burstAcrossTheTurn(t *testing.T, h *Hybrid) {
	const window, limit = time.Second, 1000
	w := int64(window)
	for _, alg := range []localbucket.Algorithm{localbucket.SlidingWindow, localbucket.FixedWindow} {
		lim := mustLimit(t, alg, limit, window)
		ran := false
		for trial := 0; trial < 4 && !ran; trial++ {
			key := fmt.Sprintf("rl:burst-turn:{%v-%d-%d}", alg, trial, time.Now().UnixNano())
			sleepUntilBeforeTheEnd(window, 120*time.Millisecond)
			first := time.Now().UnixNano()
			turn := first - first%w + w
			if turn-first > w/2 {
				continue // the machine slept through the turn: not this case
			}
			// The key's first unit, on credit before any view (of no certain window: dated
			// by its age, which a Redis starved of CPU reads late), then its first sync
			// (kickEvery), before the burst.
			var st localbucket.State
			st, _ = lim.Take(st, first, 1)
			if !take(h, first, key, lim, 1).Allowed {
				t.Fatal("the key's first request was refused")
			}
			for syncedAt(h, key) == 0 && time.Now().UnixNano() < turn-int64(25*time.Millisecond) {
				time.Sleep(time.Millisecond)
			}
			if syncedAt(h, key) == 0 {
				continue // no view before the burst: the machine was too busy for this case
			}
			time.Sleep(time.Duration(turn - int64(20*time.Millisecond) - time.Now().UnixNano()))
			start := time.Now().UnixNano()
			before, after := 1, 0 // admitted before the turn and after it
			// Of those before the turn, admitted within the view's lag of its window's end
			// (stray: the view knows the end only within its sync's lag), which the next
			// sync dates by their age and Redis may count in the new window: either way.
			strayN := 0
			var late []string // refusals the exact mode does not make, told beyond three sync intervals
			lateN := 0
			for now := start; now < turn+int64(200*time.Millisecond); now = time.Now().UnixNano() {
				r := take(h, now, key, lim, 1)
				var l localbucket.Result
				st, l = lim.Take(st, now, 1)
				switch {
				case r.Allowed && now < turn:
					before++
					if stray(h, key) {
						strayN++
					}
				case r.Allowed:
					after++
				case l.Allowed && r.RetryAfter > int64(3*h.Interval()):
					if lateN++; len(late) < 3 {
						late = append(late, fmt.Sprintf("%v after the turn: retry %v", time.Duration(now-turn), time.Duration(r.RetryAfter)))
					}
				}
				for d := now + int64(60*time.Microsecond); time.Now().UnixNano() < d; {
				}
			}
			if before < 50 || before >= limit/2-1 || start >= turn || time.Now().UnixNano()-turn > int64(400*time.Millisecond) || strayN > 20 {
				// Too few before the turn, or too slow after it, or syncs so slow that
				// the view's lag spans many units: the machine was too busy for this case.
				// Or too many: the key's credit (half its room) ran out before the turn,
				// and the exact sync that followed counted them then.
				continue
			}
			ran = true
			t.Logf("%v: %d admitted before the turn (%d within the view's lag of it), %d after; %d refusals the exact mode does not make", alg, before, strayN, after, lateN)
			// A few: the units a sync Redis read just after the turn counted there (below),
			// and those admitted within the view's lag of the turn. (In a CI run under
			// -race, 7 of 305 before the turn were counted after it.)
			if lateN > 5+strayN {
				t.Errorf("%v: %d refused that the exact mode admits (%d of the units before the turn within the view's lag of it), told to wait for the units admitted before the turn: %s", alg, lateN, strayN, strings.Join(late, "; "))
			}
			// Synced since (the view stale), a question is Redis's count.
			time.Sleep(time.Duration(turn + int64(700*time.Millisecond) - time.Now().UnixNano()))
			now := time.Now().UnixNano()
			r := take(h, now, key, lim, 0)
			counted := after
			if alg == localbucket.SlidingWindow {
				counted += before * int(w-(now-turn)) / int(w)
			}
			// A few units either way: a sync sent just before the turn is read by Redis
			// just after it, and counts the request it carries in the new window.
			if left := limit - counted; int(r.Remaining) < left-3-strayN || int(r.Remaining) > left+3 {
				t.Errorf("%v: %d left %v after the turn, where %d admitted before it (%d within the view's lag of it) and %d after leave %d",
					alg, r.Remaining, time.Duration(now-turn).Round(time.Millisecond), before, strayN, after, left)
			}
		}
		if !ran {
			t.Errorf("%v: no trial ran: the machine was too busy at every turn", alg)
		}
	}
}

// Units admitted while a sync is on its way over a window's turn: Redis, paused from
// just before the turn to just after it, reads a sync sent before it in the next window.
// The units that sync carries were admitted before the turn (its view's window: dated);
// so were those admitted while it was out (the window before the new view's: prev),
// which the key's next request beyond its grant syncs first, by an exact sync. Redis
// then counts all of them in the window they were admitted in, and the new window only
// the request after the turn. Before, both were dated by their age, counted from when
// the daemon sent them, which Redis read after the turn: 30 units in the new window.
func TestHybridSyncOutOverTheTurn(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	const window = time.Second
	for _, alg := range []localbucket.Algorithm{localbucket.FixedWindow, localbucket.SlidingWindow} {
		lim := mustLimit(t, alg, 100, window)
		ran := false
		for trial := 0; trial < 4 && !ran; trial++ {
			h := NewHybrid(rdb, HybridOptions{ID: "d", FetchWait: time.Second})
			key := fmt.Sprintf("rl:out-over-turn:{%v-%d-%d}", alg, trial, time.Now().UnixNano())
			sleepUntilBeforeTheEnd(window, 100*time.Millisecond)
			start := time.Now().UnixNano()
			turn := start - start%int64(window) + int64(window)
			// The key's first unit, and a view of the window before the turn.
			if !take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
				t.Fatal("the first request was refused")
			}
			if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
				t.Fatal(err)
			}
			for range 20 { // on credit
				if !take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
					t.Fatal("refused on credit before the turn")
				}
			}
			time.Sleep(time.Duration(turn - int64(50*time.Millisecond) - time.Now().UnixNano()))
			if err := rdb.Do(ctx, "CLIENT", "PAUSE", "90").Err(); err != nil {
				t.Fatal(err)
			}
			flushed := make(chan error, 1)
			go func() { flushed <- h.Flush(ctx, time.Now().UnixNano()) }()
			time.Sleep(10 * time.Millisecond) // the sync is out, held by Redis
			for range 10 {
				if !take(h, time.Now().UnixNano(), key, lim, 1).Allowed {
					t.Fatal("refused on credit while the sync was out")
				}
			}
			if err := <-flushed; err != nil {
				t.Fatal(err)
			}
			last := time.Now().UnixNano()
			if last <= turn || time.Now().UnixNano() >= turn+int64(window)/2 {
				continue // Redis answered before the turn, or the machine slept: not this case
			}
			if e := entryOf(h, key); e.flags&flagPrev == 0 {
				continue // the units were in the sync after all (it left late): not this case
			}
			if !take(h, last, key, lim, 1).Allowed {
				t.Fatal("the request after the turn was refused")
			}
			if err := h.Flush(ctx, time.Now().UnixNano()); err != nil {
				t.Fatal(err)
			}
			ran = true
			v, err := rdb.HMGet(ctx, key, "n", "p").Result()
			if err != nil {
				t.Fatal(err)
			}
			want := []any{"1", "31"}
			if alg == localbucket.FixedWindow {
				want[1] = v[1] // the window before counts for nothing
			}
			if fmt.Sprint(v) != fmt.Sprint(want) {
				t.Errorf("%v: the new window counts %v and the one before %v; want %v and %v", alg, v[0], v[1], want[0], want[1])
			}
		}
		if !ran {
			t.Errorf("%v: no trial ran", alg)
		}
	}
}

// A sync of units in the window before its view's (modePrev) counts them there once:
// the very same sync again (its answer lost, resent with its token) changes nothing.
func TestHybridPrevSyncReplayedCountsOnce(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	key := fmt.Sprintf("rl:prev-replay:{%d}", time.Now().UnixNano())
	run := func(used, prevGrant, demand, prevTok, tok, window, mode int64) []int64 {
		t.Helper()
		cmd := hybridScript.Run(ctx, rdb, []string{key}, hybridArgs("d1",
			int64(100*time.Millisecond/time.Microsecond), 1, 10000, 100, 0, 1, 0,
			1, 100, int64(time.Hour/time.Microsecond), 0,
			1, used, prevGrant, window, demand, mode, prevTok, tok, 0)...)
		v, err := int64s(cmd)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	a := run(0, 0, 1, 0, 1, 0, int64(modeExact)) // a unit reserved: the view of this hour
	if a[0] != 1 {
		t.Fatalf("the exact sync granted %d, want 1", a[0])
	}
	// 3 units of the hour before (as if this view came while they were admitted), the
	// grant unused, and a unit asked.
	prev := int64(modeExact + modeDated + modePrev)
	run(3, 1, 1, 1, 2, a[4], prev)
	counts := func() string { return fmt.Sprint(rdb.HMGet(ctx, key, "n", "p").Val()) }
	if got := counts(); got != "[1 3]" {
		t.Fatalf("n and p are %v after the units of the hour before: want [1 3] (the grant given back, a unit reserved)", got)
	}
	run(3, 1, 1, 1, 2, a[4], prev)
	if got := counts(); got != "[1 3]" {
		t.Fatalf("n and p are %v after the same sync again: want [1 3]", got)
	}
}
