package bench

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// killLossRules: one hybrid rule keyed by user, a fixed window of a day with a limit far
// above the load, so that every answer is an admission Redis is to count, and the count
// is one field of one hash (n, less the grant still reserved, g) for the whole run.
const killLossRules = `rules:
  - name: killloss
    key: user
    algorithm: fixed_window
    limit: { requests: 1000000000, per: 24h }
    mode: hybrid
    on_store_failure: closed
`

// killLossSync is the daemon's sync interval.
const killLossSync = 100 * time.Millisecond

// killLossWindow is the rule's window: Redis's windows start at multiples of it since
// the epoch.
const killLossWindow = 24 * time.Hour

// BenchmarkKillLoss measures what a hybrid daemon stopped under load leaves uncounted in
// Redis, the figures of docs/reliability.md's "A hybrid daemon SIGKILLed" entry. A real
// redis-server and one real daemon (sync interval 100 ms, the default); 4 connections
// × 32 checks in flight over 50 keys, counting every admitted answer per key; after the
// load (1 s by default, 3 s for the documented figures) the daemon gets SIGKILL
// (sub-benchmark kill) or SIGTERM (term), and once it is gone the benchmark reads what
// Redis counted for each key: n − g, the window's count less the grant the daemon still
// had reserved (a killed daemon never gives it back; a stopped one's last sync does), as
// cmd/rlsidecar's end-to-end tests read a hybrid key. (In practice g is 0 here: the
// key's record of the daemon's last sync showed a grant of 0 and the units used, the
// daemon alone on its keys admitting on credit; n − g stays right if it takes grants.)
//
// A kill loses what the daemon admitted since its last sync, so the loss depends on where
// in the sync interval the kill lands. The daemon's ticker starts with it, a few ms
// before the load, so a load of whole intervals (1 s, 3 s) put most kills just after a
// sync: 17 of 20 kills lost under 1,000 units (0.006 s of traffic or less), the other 3
// 10,000-21,000 (0.09-0.12 s). Repeat r of R therefore signals (r + ½) ÷ R of an
// interval after the load's end: the kills spread evenly over the interval, and with
// R = 1 the one kill lands half way.
//
// Reported per sub-benchmark, over its repeats: admitted and counted (summed), lost
// (admitted − counted), lost-s-mean and lost-s-max (each run's lost ÷ its admitted per
// second: how much of its traffic the daemon took with it), admitted/s, refused
// (answers not allowed: with this limit, only while Redis did not answer), and
// over-count (units Redis counted beyond a key's admitted answers). A unit counted
// that was never admitted is a defect ("nothing admitted is counted twice"): on any key,
// Redis counting more than the answers admitted plus the checks sent and never answered
// (the daemon may have decided, and synced, a check whose answer the kill kept from being
// written) fails the benchmark; so does a SIGTERM that loses a unit.
//
//	RLSIDECAR_BENCH_KILLLOSS_REPEATS=3 RLSIDECAR_BENCH_KILLLOSS_LOAD=3s go test -count=1 -run '^$' -bench 'BenchmarkKillLoss$' -benchtime 1x -v ./bench
//
// RLSIDECAR_BENCH_KILLLOSS_LOAD (a duration, 1s by default), _KEYS (50) and _REPEATS (1)
// set the load; the defaults are the CI smoke pass (about 3 s). -v logs each repeat.
func BenchmarkKillLoss(b *testing.B) {
	load := benchEnvDuration(b, "RLSIDECAR_BENCH_KILLLOSS_LOAD", time.Second)
	keys := benchEnvCount(b, "RLSIDECAR_BENCH_KILLLOSS_KEYS", 50)
	repeats := benchEnvCount(b, "RLSIDECAR_BENCH_KILLLOSS_REPEATS", 1)
	cfg := filepath.Join(b.TempDir(), "killloss.yaml")
	if err := os.WriteFile(cfg, []byte(killLossRules), 0o644); err != nil {
		b.Fatal(err)
	}
	srv := redistest.StartStandalone(b)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	b.Cleanup(func() { rdb.Close() })

	run := 0 // keys are new in every run: one run's counts are not the next's
	for _, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGTERM} {
		name := map[syscall.Signal]string{syscall.SIGKILL: "kill", syscall.SIGTERM: "term"}[sig]
		b.Run(name, func(b *testing.B) {
			var sum killLossRun
			var lostS []float64
			for r := 0; r < repeats; r++ {
				run++
				phase := time.Duration((float64(r) + 0.5) / float64(repeats) * float64(killLossSync))
				k := killLoss(b, rdb, cfg, sig, fmt.Sprintf("r%d-", run), keys, load+phase)
				b.Logf("%s %d: %d admitted in %.2f s (%.0f/s), Redis counted %d, lost %d (%.3f s of traffic), %d refused, %d sent unanswered, over-count %d",
					name, r+1, k.admitted, k.load.Seconds(), k.rate(), k.counted, k.admitted-k.counted, k.lostSeconds(), k.refused, k.unanswered, k.over)
				sum.add(k)
				lostS = append(lostS, k.lostSeconds())
			}
			b.ReportMetric(float64(sum.admitted), "admitted")
			b.ReportMetric(float64(sum.counted), "counted")
			b.ReportMetric(float64(sum.admitted-sum.counted), "lost")
			mean := 0.0
			for _, l := range lostS {
				mean += l / float64(len(lostS))
			}
			b.ReportMetric(mean, "lost-s-mean")
			b.ReportMetric(slices.Max(lostS), "lost-s-max")
			b.ReportMetric(sum.rate(), "admitted/s")
			b.ReportMetric(float64(sum.refused), "refused")
			b.ReportMetric(float64(sum.over), "over-count")
			b.ReportMetric(0, "ns/op") // one op is a whole run: its time says nothing
			if sig == syscall.SIGTERM && sum.counted != sum.admitted {
				b.Errorf("SIGTERM: Redis counted %d of %d admitted: the last sync should settle every unit (unless Redis was away for its 2 s of tries: the daemon's log then says \"the last sync before stopping failed\")", sum.counted, sum.admitted)
			}
		})
	}
}

// killLossRun is what one run, or the sum of several, admitted and Redis counted.
type killLossRun struct {
	admitted, counted, refused, unanswered int64
	// over is the units Redis counted beyond the answers admitted, summed over the keys
	// where it did: at most the key's checks left unanswered, or the run fails.
	over int64
	load time.Duration // from the first check to the signal
}

// add sums o into k (its load too: k.rate is then the mean rate).
func (k *killLossRun) add(o killLossRun) {
	k.admitted += o.admitted
	k.counted += o.counted
	k.refused += o.refused
	k.unanswered += o.unanswered
	k.over += o.over
	k.load += o.load
}

func (k *killLossRun) rate() float64 { return float64(k.admitted) / k.load.Seconds() }

// lostSeconds is the units lost in seconds of the daemon's admitted traffic.
func (k *killLossRun) lostSeconds() float64 { return float64(k.admitted-k.counted) / k.rate() }

// killLossConn is one load connection and what it saw, per key.
type killLossConn struct {
	c                        net.Conn
	br                       *bufio.Reader
	sent, answered, admitted []int64
	refused                  int64
	err                      error // an error before the signal: the run is void
}

// killLoss runs one daemon under load over keys users prefix+"0" … and stops it with sig
// after load; it returns what the daemon admitted and Redis counted.
func killLoss(b *testing.B, rdb *redis.Client, cfg string, sig syscall.Signal, prefix string, keys int, load time.Duration) killLossRun {
	// The run's counts must all be in one window of Redis's.
	now := time.Now()
	if left := now.Truncate(killLossWindow).Add(killLossWindow).Sub(now); left < load+30*time.Second {
		b.Logf("%v to the end of Redis's %v window: waiting for the next one", left, killLossWindow)
		time.Sleep(left + 10*time.Millisecond)
	}
	d := startServerNamed(b, "killloss", "--config", cfg, "--redis", "redis://"+rdb.Options().Addr,
		"--sync-interval", killLossSync.String())

	const conns, inflight = 4, 32
	frames := make([][]byte, keys)
	enc := proto.NewEncoder()
	for k := range frames {
		enc.Reset()
		// The ID is the key's index: an answer says which key it was for.
		enc.EncodeRequest(&proto.Request{ID: uint64(k), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "user", Value: prefix + strconv.Itoa(k)},
		}})
		frames[k] = append([]byte(nil), enc.Bytes()...)
	}
	var signalled atomic.Bool
	cs := make([]*killLossConn, conns)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range cs {
		c, err := net.Dial("unix", d.socket)
		if err != nil {
			b.Fatal(err)
		}
		cs[i] = &killLossConn{c: c, br: bufio.NewReaderSize(c, 64<<10),
			sent: make([]int64, keys), answered: make([]int64, keys), admitted: make([]int64, keys)}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			cs[i].load(frames, i*keys/conns, inflight, &signalled)
		}()
	}
	time.Sleep(load)
	took := time.Since(start)
	signalled.Store(true)
	if err := d.cmd.Process.Signal(sig); err != nil {
		b.Fatal(err)
	}
	// For SIGKILL, stop's SIGTERM reaches a dead process and it only waits; for SIGTERM
	// it waits up to 5 s for the drain, then kills.
	d.stop()
	if ws, ok := d.cmd.ProcessState.Sys().(syscall.WaitStatus); sig == syscall.SIGTERM && (!ok || !ws.Exited() || ws.ExitStatus() != 0) {
		b.Errorf("SIGTERM: the daemon ended %v, not with exit 0 within 5 s", d.cmd.ProcessState)
	}
	wg.Wait()

	var k killLossRun
	k.load = took
	admitted, unanswered := make([]int64, keys), make([]int64, keys)
	for _, c := range cs {
		if c.err != nil {
			b.Fatalf("load before the signal: %v", c.err)
		}
		k.refused += c.refused
		for j := range keys {
			admitted[j] += c.admitted[j]
			unanswered[j] += c.sent[j] - c.answered[j]
		}
	}
	counted := killLossCounts(b, rdb, prefix, keys)
	for j := range keys {
		k.admitted += admitted[j]
		k.counted += counted[j]
		k.unanswered += unanswered[j]
		k.over += max(0, counted[j]-admitted[j])
		if counted[j] > admitted[j]+unanswered[j] {
			b.Errorf("user=%s%d: Redis counted %d, the daemon answered %d admitted and left %d checks unanswered: counted units never admitted",
				prefix, j, counted[j], admitted[j], unanswered[j])
		}
	}
	return k
}

// load sends frames, from first on, keeping inflight unanswered, until the daemon
// closes the connection; an error before signalled is set is kept in c.err.
func (c *killLossConn) load(frames [][]byte, first, inflight int, signalled *atomic.Bool) {
	dec := proto.NewDecoder()
	var resp proto.Response
	var out, buf []byte
	next, pending, writing := first, 0, true
	for {
		if writing {
			out = out[:0]
			for ; pending < inflight; pending++ {
				k := next % len(frames)
				out = append(out, frames[k]...)
				// Counted as sent before the write: a write that fails part-way may
				// have handed the daemon some of it.
				c.sent[k]++
				next++
			}
			if len(out) > 0 {
				if _, err := c.c.Write(out); err != nil {
					if !signalled.Load() {
						c.err = err
						return
					}
					// The daemon is going: read what it still answers.
					writing = false
				}
			}
		}
		var err error
		buf, err = proto.ReadFrame(c.br, buf[:0], 1<<20)
		if err != nil {
			if !signalled.Load() {
				c.err = err
			}
			return
		}
		if err := dec.DecodeResponse(buf, &resp); err != nil {
			c.err = err
			return
		}
		if resp.Err.Code == "shutting_down" && signalled.Load() {
			// The drain's notice on the connection (ID 0), not an answer: the
			// requests still unanswered were not read.
			continue
		}
		if resp.Err.Code != "" {
			c.err = fmt.Errorf("an error answer: %+v", resp.Err)
			return
		}
		if resp.ID >= uint64(len(frames)) {
			c.err = fmt.Errorf("an answer to request %d, never sent", resp.ID)
			return
		}
		pending--
		c.answered[resp.ID]++
		if resp.Allowed && !resp.Degraded {
			c.admitted[resp.ID]++
		} else {
			c.refused++
		}
	}
}

// killLossCounts reads what Redis counted for each of the run's keys: the window's
// count n less the grant still reserved g. It reads until two readings 50 ms apart
// agree: a sync the killed daemon had sent may still be in Redis's input.
func killLossCounts(b *testing.B, rdb *redis.Client, prefix string, keys int) []int64 {
	ctx := context.Background()
	read := func() []int64 {
		out := make([]int64, keys)
		for j := range out {
			key := "rl:killloss~fw1d:{user=" + prefix + strconv.Itoa(j) + "}"
			v, err := rdb.HMGet(ctx, key, "n", "g").Result()
			if err != nil {
				b.Fatalf("HMGET %s n g: %v", key, err)
			}
			var n, g int64
			for i, p := range []*int64{&n, &g} {
				if v[i] == nil {
					continue
				}
				s, _ := v[i].(string)
				// Lua writes numbers as doubles: %.14g, exact for these counts.
				x, err := strconv.ParseFloat(s, 64)
				if err != nil {
					b.Fatalf("%s: field %d is %q: %v", key, i, s, err)
				}
				*p = int64(x)
			}
			out[j] = n - g
		}
		return out
	}
	last := read()
	for deadline := time.Now().Add(5 * time.Second); ; {
		time.Sleep(50 * time.Millisecond)
		now := read()
		if slices.Equal(now, last) {
			return now
		}
		if time.Now().After(deadline) {
			b.Fatal("Redis's counts still changing 5 s after the daemon stopped")
		}
		last = now
	}
}
