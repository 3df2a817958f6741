package bench

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// newClientsRules: one hybrid rule keyed by user with a limit far above the load, under
// on_store_failure: closed: every answer not admitted is the daemon not deciding a key it
// could not wait for Redis on (degraded), never a limit reached.
const newClientsRules = `rules:
  - name: newclients
    key: user
    algorithm: fixed_window
    limit: { requests: 1000000000, per: 24h }
    mode: hybrid
    on_store_failure: closed
`

// BenchmarkHybridNewClients measures how a hybrid daemon whose syncs cannot keep up (more
// keys in use than its Redis, on the same 2 cores, syncs in an interval) serves clients
// new to it: the shape of a public API, many clients seen about once a second beside a
// steady arrival of new ones. One real redis-server and one real daemon (sync interval
// 100 ms); 4 connections × 32 checks in flight over KEYS known users (100,000), walked in
// turn (each seen about once a second at this host's rate), and one check in 100 a new
// client's first, whose second comes 50 new clients later on the same connection (about
// a quarter of a second). A new client's first request is admitted on credit; its second
// needs the view its first sync brings, and waits for that sync (FetchWait, 25 ms) if it
// is on its way; past that its rule's policy decides it (degraded, refused here).
//
// Reported: new-2nd-degraded-% (of the new clients' second requests, counted after the
// first 2 s, once the known users' own first syncs are behind: the steady state),
// degraded-% (of all answers), checks/s. With RLSIDECAR_BENCH_VS set to another rlsidecar
// binary, its daemon runs the same load in alternate runs (a fresh Redis each run) and
// reports vs-new-2nd-degraded-% and vs-degraded-%.
//
//	RLSIDECAR_BENCH_NEWCLIENTS_LOAD=6s RLSIDECAR_BENCH_NEWCLIENTS_REPEATS=3 go test -count=1 -run '^$' -bench 'BenchmarkHybridNewClients$' -benchtime 1x -v ./bench
//
// RLSIDECAR_BENCH_NEWCLIENTS_LOAD (a duration, 3s by default), _KEYS (100000) and
// _REPEATS (1) set the load; the defaults are the CI smoke pass.
func BenchmarkHybridNewClients(b *testing.B) {
	load := benchEnvDuration(b, "RLSIDECAR_BENCH_NEWCLIENTS_LOAD", 3*time.Second)
	keys := benchEnvCount(b, "RLSIDECAR_BENCH_NEWCLIENTS_KEYS", 100_000)
	repeats := benchEnvCount(b, "RLSIDECAR_BENCH_NEWCLIENTS_REPEATS", 1)
	cfg := filepath.Join(b.TempDir(), "newclients.yaml")
	if err := os.WriteFile(cfg, []byte(newClientsRules), 0o644); err != nil {
		b.Fatal(err)
	}
	binaries := []string{"rlsidecar"}
	if installVS(b) {
		binaries = append(binaries, vsName)
	}
	results := map[string][]newClientsRun{}
	for r := 0; r < repeats; r++ {
		for _, bin := range binaries {
			// A Redis of its own each run: no run starts with another's keys or backlog.
			srv := redistest.StartStandalone(b)
			d := startServerAt(b, bin, "newclients.sock", "--config", cfg,
				"--redis", "redis://"+srv.Addr, "--sync-interval", "100ms")
			n := newClients(b, d.socket, keys, load)
			d.stop()
			srv.Stop()
			b.Logf("%s %d: %d checks in %.2f s (%.0f/s), %d degraded (%.2f%%); new clients' second requests after 2 s: %d, %d degraded (%.2f%%)",
				bin, r+1, n.answers, n.took.Seconds(), float64(n.answers)/n.took.Seconds(), n.degraded, n.degradedPct(),
				n.seconds, n.secondsDegraded, n.secondPct())
			results[bin] = append(results[bin], n)
		}
	}
	for _, bin := range binaries {
		prefix := ""
		if bin == vsName {
			prefix = "vs-"
		}
		var second, all, rate []float64
		for _, n := range results[bin] {
			second = append(second, n.secondPct())
			all = append(all, n.degradedPct())
			rate = append(rate, float64(n.answers)/n.took.Seconds())
		}
		b.ReportMetric(median(second), prefix+"new-2nd-degraded-%")
		b.ReportMetric(median(all), prefix+"degraded-%")
		if prefix == "" {
			b.ReportMetric(median(rate), "checks/s")
		}
	}
	b.ReportMetric(0, "ns/op") // one op is a whole run: its time says nothing
}

// newClientsRun is what one run's load saw.
type newClientsRun struct {
	took                     time.Duration
	answers, degraded        int64
	seconds, secondsDegraded int64 // new clients' second requests after the warm-up
}

func (n newClientsRun) degradedPct() float64 {
	return 100 * float64(n.degraded) / float64(max(1, n.answers))
}
func (n newClientsRun) secondPct() float64 {
	return 100 * float64(n.secondsDegraded) / float64(max(1, n.seconds))
}

// The request IDs of a new client's first and second requests; a known user's is its
// index.
const (
	newClientFirst  = 1 << 40
	newClientSecond = 1 << 41
)

// newClients runs the load on the daemon at socket for load and returns what it saw.
func newClients(b *testing.B, socket string, keys int, load time.Duration) newClientsRun {
	const conns, inflight, every, lag = 4, 32, 100, 50
	const warm = 2 * time.Second
	known := make([][]byte, keys)
	enc := proto.NewEncoder()
	for k := range known {
		enc.Reset()
		enc.EncodeRequest(&proto.Request{ID: uint64(k), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "user", Value: "u" + strconv.Itoa(k)},
		}})
		known[k] = append([]byte(nil), enc.Bytes()...)
	}
	var stop atomic.Bool
	var out newClientsRun
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, conns)
	start := time.Now()
	for i := range conns {
		c, err := net.Dial("unix", socket)
		if err != nil {
			b.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			br := bufio.NewReaderSize(c, 64<<10)
			enc := proto.NewEncoder()
			dec := proto.NewDecoder()
			var resp proto.Response
			var wbuf, rbuf []byte
			var mine newClientsRun
			newFrame := func(id uint64, client int) []byte {
				enc.Reset()
				enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
					{Name: "user", Value: fmt.Sprintf("new%d-%d", i, client)},
				}})
				return enc.Bytes()
			}
			next, sent, pending := i*keys/conns, 0, 0
			for !stop.Load() || pending > 0 {
				wbuf = wbuf[:0]
				for ; pending < inflight && !stop.Load(); pending++ {
					sent++
					switch n := sent / every; {
					case sent%every == 0:
						wbuf = append(wbuf, newFrame(newClientFirst, n)...)
					case sent%every == every/2 && n >= lag:
						wbuf = append(wbuf, newFrame(newClientSecond, n-lag)...)
					default:
						wbuf = append(wbuf, known[next%keys]...)
						next++
					}
				}
				if len(wbuf) > 0 {
					if _, err := c.Write(wbuf); err != nil {
						errs <- err
						return
					}
				}
				var err error
				if rbuf, err = proto.ReadFrame(br, rbuf[:0], 1<<20); err != nil {
					errs <- err
					return
				}
				if err := dec.DecodeResponse(rbuf, &resp); err != nil {
					errs <- err
					return
				}
				if resp.Err.Code != "" {
					errs <- fmt.Errorf("an error answer: %+v", resp.Err)
					return
				}
				pending--
				mine.answers++
				degraded := !resp.Allowed || resp.Degraded
				if degraded {
					mine.degraded++
				}
				if resp.ID == newClientSecond && time.Since(start) > warm {
					mine.seconds++
					if degraded {
						mine.secondsDegraded++
					}
				}
			}
			mu.Lock()
			out.answers += mine.answers
			out.degraded += mine.degraded
			out.seconds += mine.seconds
			out.secondsDegraded += mine.secondsDegraded
			mu.Unlock()
		}()
	}
	time.Sleep(load)
	stop.Store(true)
	wg.Wait()
	out.took = time.Since(start)
	select {
	case err := <-errs:
		b.Fatalf("load: %v", err)
	default:
	}
	if load > warm && out.seconds == 0 {
		b.Fatalf("no new client's second request was answered after %v of %v", warm, load)
	}
	return out
}
