package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// leaseBenchRules: the benchmark's two rate rules, and a concurrency rule that only the
// requests carrying kind=export match.
const leaseBenchRules = `rules:
  - name: per-ip
    key: ip
    limit: { requests: 1000000000, per: 1h }
  - name: holds
    match: { method: POST, path: "/v1/events/*/holds" }
    key: user
    limit: { requests: 1000000000, per: 1h }
  - name: exports
    match: { kind: export }
    key: user
    concurrency: { max: 1000, lease: 30s }
`

// leaseFrames are frames(n, distinct) with kind=export added: the same check, plus a
// concurrency rule.
func leaseFrames(n, distinct int) [][]byte {
	out := make([][]byte, n)
	enc := proto.NewEncoder()
	for i := range out {
		enc.Reset()
		u := i % distinct
		enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "method", Value: "POST"},
			{Name: "path", Value: "/v1/events/" + strconv.Itoa(u%97) + "/holds"},
			{Name: "user", Value: "user-" + strconv.Itoa(u)},
			{Name: "ip", Value: "10.0." + strconv.Itoa(u/256%256) + "." + strconv.Itoa(u%256)},
			{Name: "kind", Value: "export"},
		}})
		out[i] = append([]byte(nil), enc.Bytes()...)
	}
	return out
}

// units sends n units keeping up to inflight frames outstanding and decoding every
// answer: a unit is a check, and when its answer carries a lease, the release of that
// lease (sent as soon as the answer is read, as a gateway's finally would).
func (c *client) units(fr [][]byte, n, inflight int) error {
	dec, enc := proto.NewDecoder(), proto.NewEncoder()
	var resp proto.Response
	var release []string
	sent, outstanding, done := 0, 0, 0
	for done < n {
		c.out = c.out[:0]
		for _, l := range release {
			enc.Reset()
			enc.EncodeRequest(&proto.Request{Op: proto.OpRelease, Lease: l, Cost: 1})
			c.out = append(c.out, enc.Bytes()...)
			outstanding++
		}
		release = release[:0]
		for sent < n && outstanding < inflight {
			c.out = append(c.out, fr[sent%len(fr)]...)
			sent++
			outstanding++
		}
		if len(c.out) > 0 {
			if _, err := c.c.Write(c.out); err != nil {
				return err
			}
		}
		for first := true; first || (c.br.Buffered() >= proto.HeaderSize &&
			int(proto.FrameLength(mustPeek(c.br))) <= c.br.Buffered()-proto.HeaderSize); first = false {
			if err := c.readOne(); err != nil {
				return err
			}
			outstanding--
			if err := dec.DecodeResponse(c.buf, &resp); err != nil {
				return err
			}
			if resp.Lease != "" {
				release = append(release, resp.Lease)
			} else {
				done++
			}
		}
	}
	return nil
}

// BenchmarkSocketLeases: one daemon, alternating in one run, 4 connections × 32 in
// flight, every answer decoded by the client: plain two-rule local checks, and the same
// checks matching a concurrency rule too, each followed by the release of its lease.
// lease-vs-plain is the median over rounds of the time per unit (check, or check plus
// release) with a lease over without. Target: ≤ 2. Reported beside it: the daemon's CPU
// time per unit of each kind (the rest of a unit's time is the client's, and the
// kernel's on its behalf).
func BenchmarkSocketLeases(b *testing.B) {
	path := filepath.Join(b.TempDir(), "leases.yaml")
	if err := os.WriteFile(path, []byte(leaseBenchRules), 0o644); err != nil {
		b.Fatal(err)
	}
	srv := startServerNamed(b, "leases", "--config", path)
	plain, leased := frames(8192, 8192), leaseFrames(8192, 8192)
	const conns, inflight, round = 4, 32, 20000
	var cs []*client
	for range conns {
		cs = append(cs, dial(b, srv.socket))
	}
	// The daemon's CPU time in each kind of run (10 ms ticks: summed over the rounds).
	var cpuPlain, cpuLeased float64
	run := func(fr [][]byte) time.Duration {
		var wg sync.WaitGroup
		cpu0 := srv.cpuSeconds(b)
		defer func() {
			if &fr[0] == &plain[0] {
				cpuPlain += srv.cpuSeconds(b) - cpu0
			} else {
				cpuLeased += srv.cpuSeconds(b) - cpu0
			}
		}()
		start := time.Now()
		for i, c := range cs {
			wg.Go(func() {
				if err := c.units(fr[i*7%len(fr):], round/conns, inflight); err != nil {
					b.Error(err)
				}
			})
		}
		wg.Wait()
		return time.Since(start)
	}
	run(plain) // warm up
	run(leased)
	cpuPlain, cpuLeased = 0, 0
	var ratios []float64
	var tp, tl time.Duration
	for total := 0; total < max(b.N, 5*round); total += round {
		p, l := run(plain), run(leased)
		tp, tl = tp+p, tl+l
		ratios = append(ratios, float64(l)/float64(p))
	}
	slices.Sort(ratios)
	b.ReportMetric(ratios[len(ratios)/2], "lease-vs-plain")
	n := float64(len(ratios) * round)
	b.ReportMetric(float64(tp.Nanoseconds())/n, "plain-ns/check")
	b.ReportMetric(float64(tl.Nanoseconds())/n, "lease-ns/check+release")
	// What of each is the daemon's: the rest is the client's and the kernel's work for it.
	b.ReportMetric(cpuPlain*1e9/n, "daemon-cpu-ns/check")
	b.ReportMetric(cpuLeased*1e9/n, "daemon-cpu-ns/check+release")
}

// globalLeaseBenchRules: a global rate rule and a global concurrency rule on the same
// key shape; kind picks which one a request matches.
const globalLeaseBenchRules = `rules:
  - name: rate
    match: { kind: rate }
    key: user
    limit: { requests: 1000000000, per: 1h }
    mode: global
  - name: slots
    match: { kind: lease }
    key: user
    concurrency: { max: 1000000, lease: 30s }
    mode: global
`

// kindFrames are n checks over distinct users, each matching the rule of kind.
func kindFrames(n, distinct int, kind string) [][]byte {
	out := make([][]byte, n)
	enc := proto.NewEncoder()
	for i := range out {
		enc.Reset()
		enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "user", Value: "user-" + strconv.Itoa(i%distinct)},
			{Name: "kind", Value: kind},
		}})
		out[i] = append([]byte(nil), enc.Bytes()...)
	}
	return out
}

// BenchmarkGlobalLeaseAcquire: one daemon on a real redis-server, alternating in one run:
// checks matching one global rate rule, and checks matching one global concurrency rule
// (each acquires a lease in Redis; not released, so the sorted sets grow as a busy
// service's would). Reported: p50 at one connection and time per check at 4 connections
// × 32 in flight, each as acquire over rate (medians of the rounds). Every answer must be
// allowed and not degraded. Target: acquire ≤ 1.3× a global rate check.
func BenchmarkGlobalLeaseAcquire(b *testing.B) {
	acquireVsRate(b, "global-leases", globalLeaseBenchRules, "acquire", true)
}

// globalRateLeaseBenchRules: a global rate rule that every request matches, and a global
// concurrency rule on the same client (one hash slot) that the requests of kind lease
// match too.
const globalRateLeaseBenchRules = `rules:
  - name: rate
    key: user
    limit: { requests: 1000000000, per: 1h }
    mode: global
  - name: slots
    match: { kind: lease }
    key: user
    concurrency: { max: 1000000, lease: 30s }
    mode: global
`

// BenchmarkGlobalRateAndLease: one daemon on a real redis-server, alternating in one run:
// checks matching one global rate rule, and checks matching that rate rule AND a global
// concurrency rule on the same client (one hash slot: the rate take and the lease are
// decided in one global.lua call; before, two calls). Reported as
// BenchmarkGlobalLeaseAcquire's figures, "both" over rate. Target: ≤ 1.3×.
func BenchmarkGlobalRateAndLease(b *testing.B) {
	acquireVsRate(b, "global-rate-lease", globalRateLeaseBenchRules, "both", true)
}

// globalTwoRatesBenchRules: BenchmarkGlobalRateAndLease's rules with a second global
// rate rule in place of the concurrency rule.
const globalTwoRatesBenchRules = `rules:
  - name: rate
    key: user
    limit: { requests: 1000000000, per: 1h }
    mode: global
  - name: rate2
    match: { kind: lease }
    key: user
    limit: { requests: 1000000000, per: 1h }
    mode: global
`

// BenchmarkGlobalTwoRates: BenchmarkGlobalRateAndLease with a second global rate rule in
// place of the lease: what any second rule of the same client costs (one script call,
// one more key), beside which the lease's cost reads.
func BenchmarkGlobalTwoRates(b *testing.B) {
	acquireVsRate(b, "global-two-rates", globalTwoRatesBenchRules, "two", false)
}

// acquireVsRate runs BenchmarkGlobalLeaseAcquire's rounds on a daemon with rules yaml:
// frames of kind rate (a lone global rate rule) against frames of kind lease (which
// acquire a lease when leases is set), reporting name-vs-rate at p50 and 4 × 32, and at 4 × 32 the CPU time
// per check of Redis and of the daemon for each kind.
func acquireVsRate(b *testing.B, daemon, yaml, name string, leases bool) {
	srv := redistest.StartStandalone(b)
	path := filepath.Join(b.TempDir(), daemon+".yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		b.Fatal(err)
	}
	d := startServerNamed(b, daemon, "--config", path, "--redis", "redis://"+srv.Addr,
		"--global-timeout", "1s", "--redis-timeout", "1s")
	rate, lease := kindFrames(8192, 4096, "rate"), kindFrames(8192, 4096, "lease")
	verify := func(c *client, kind string) {
		dec := proto.NewDecoder()
		var resp proto.Response
		c.verify = func(body []byte) error {
			if err := dec.DecodeResponse(body, &resp); err != nil {
				return err
			}
			if resp.IsError() || !resp.Allowed || resp.Degraded || (kind == "lease" && leases) != (resp.Lease != "") {
				return fmt.Errorf("%s answer %+v, want allowed from Redis", kind, resp)
			}
			return nil
		}
	}
	cr, cl := dial(b, d.socket), dial(b, d.socket)
	verify(cr, "rate")
	verify(cl, "lease")
	for _, c := range []*client{cr, cl} {
		if err := c.pipelined(map[*client][][]byte{cr: rate, cl: lease}[c], 2000, 32); err != nil { // warm
			b.Fatal(err)
		}
	}
	var p50 []float64
	var lr, ll []time.Duration
	for i := range max(b.N/500, 5) {
		var err error
		if lr, err = cr.roundTrips(rate[i*97%len(rate):], 500, lr[:0]); err != nil {
			b.Fatal(err)
		}
		if ll, err = cl.roundTrips(lease[i*97%len(lease):], 500, ll[:0]); err != nil {
			b.Fatal(err)
		}
		p50 = append(p50, float64(percentile(ll, 0.5))/float64(percentile(lr, 0.5)))
	}
	b.ReportMetric(median(p50), name+"-vs-rate-p50")

	const conns, inflight, round = 4, 32, 8000
	var csr, csl []*client
	for range conns {
		c := dial(b, d.socket)
		verify(c, "rate")
		csr = append(csr, c)
		c = dial(b, d.socket)
		verify(c, "lease")
		csl = append(csl, c)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	// CPU per check of Redis and of the daemon, each kind's rounds summed: where a ratio
	// comes from on a machine whose two cores the daemon, Redis and the client share.
	var cpu [2]struct{ redis, daemon float64 }
	timed := func(k int, cs []*client, fr [][]byte) time.Duration {
		r0, d0 := costProcUsec(b, rdb), d.cpu(b)
		t := runPipelined(b, cs, fr, round, inflight)
		cpu[k].redis += costProcUsec(b, rdb) - r0
		cpu[k].daemon += float64((d.cpu(b) - d0).Microseconds())
		return t
	}
	var thr []float64
	var tr, tl time.Duration
	for range max(b.N/round, 5) {
		r := timed(0, csr, rate)
		l := timed(1, csl, lease)
		tr, tl = tr+r, tl+l
		thr = append(thr, float64(l)/float64(r))
	}
	b.ReportMetric(median(thr), name+"-vs-rate-4x32")
	n := float64(len(thr) * round)
	b.ReportMetric(float64(tr.Nanoseconds())/n, "rate-ns/check")
	b.ReportMetric(float64(tl.Nanoseconds())/n, name+"-ns/check")
	b.ReportMetric(cpu[0].redis/n, "rate-redis-cpu-us/check")
	b.ReportMetric(cpu[1].redis/n, name+"-redis-cpu-us/check")
	b.ReportMetric(cpu[0].daemon/n, "rate-daemon-cpu-us/check")
	b.ReportMetric(cpu[1].daemon/n, name+"-daemon-cpu-us/check")
}

// pairTrips runs n acquire + release pairs one after another at one connection: a check
// from fr, then the release of the lease its answer carries. It returns each pair's time.
func (c *client) pairTrips(fr [][]byte, n int, lat []time.Duration) ([]time.Duration, error) {
	dec, enc := proto.NewDecoder(), proto.NewEncoder()
	var resp proto.Response
	for i := range n {
		start := time.Now()
		if _, err := c.c.Write(fr[i%len(fr)]); err != nil {
			return lat, err
		}
		if err := c.readOne(); err != nil {
			return lat, err
		}
		if err := dec.DecodeResponse(c.buf, &resp); err != nil {
			return lat, err
		}
		enc.Reset()
		enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpRelease, Lease: resp.Lease, Cost: 1})
		if _, err := c.c.Write(enc.Bytes()); err != nil {
			return lat, err
		}
		if err := c.readOne(); err != nil {
			return lat, err
		}
		lat = append(lat, time.Since(start))
	}
	return lat, nil
}

// BenchmarkGlobalLeasePair: one daemon on a real redis-server, alternating in one run:
// a global rate check, and a global lease's whole life over the socket, its acquire (a
// check matching one global concurrency rule) then its release (both through Redis,
// lease.lua; the release decided off the connection's fast path). Reported, each as
// pair over rate check (medians of the rounds): p50 at one connection, and time per unit
// at 4 connections × 32 in flight (a unit is a rate check, or an acquire plus its
// release). Every check must be allowed from Redis, every release must free its lease.
// Two Redis round trips against one: about 2× is what it should cost.
func BenchmarkGlobalLeasePair(b *testing.B) {
	srv := redistest.StartStandalone(b)
	path := filepath.Join(b.TempDir(), "global-leases.yaml")
	if err := os.WriteFile(path, []byte(globalLeaseBenchRules), 0o644); err != nil {
		b.Fatal(err)
	}
	d := startServerNamed(b, "global-lease-pair", "--config", path, "--redis", "redis://"+srv.Addr,
		"--global-timeout", "1s", "--redis-timeout", "1s")
	rate, lease := kindFrames(8192, 4096, "rate"), kindFrames(8192, 4096, "lease")
	verify := func(c *client, kind string) *client {
		dec := proto.NewDecoder()
		var resp proto.Response
		c.verify = func(body []byte) error {
			if err := dec.DecodeResponse(body, &resp); err != nil {
				return err
			}
			switch {
			case resp.IsError():
				return fmt.Errorf("%s: error answer %+v", kind, resp)
			case kind == "lease" && resp.Lease == "" && !resp.Released:
				return fmt.Errorf("release answer %+v, want released", resp)
			case (kind == "rate" || resp.Lease != "") && (!resp.Allowed || resp.Degraded):
				return fmt.Errorf("%s answer %+v, want allowed from Redis", kind, resp)
			}
			return nil
		}
		return c
	}
	cr, cl := verify(dial(b, d.socket), "rate"), verify(dial(b, d.socket), "lease")
	if err := cr.pipelined(rate, 2000, 32); err != nil { // warm
		b.Fatal(err)
	}
	if err := cl.units(lease, 1000, 32); err != nil {
		b.Fatal(err)
	}
	var p50 []float64
	var lr, ll []time.Duration
	for i := range max(b.N/500, 5) {
		var err error
		if lr, err = cr.roundTrips(rate[i*97%len(rate):], 500, lr[:0]); err != nil {
			b.Fatal(err)
		}
		if ll, err = cl.pairTrips(lease[i*97%len(lease):], 500, ll[:0]); err != nil {
			b.Fatal(err)
		}
		p50 = append(p50, float64(percentile(ll, 0.5))/float64(percentile(lr, 0.5)))
	}
	b.ReportMetric(median(p50), "pair-vs-rate-p50")
	b.ReportMetric(float64(percentile(lr, 0.5).Nanoseconds()), "rate-p50-ns")
	b.ReportMetric(float64(percentile(ll, 0.5).Nanoseconds()), "pair-p50-ns")

	const conns, inflight, round = 4, 32, 8000
	var csr, csl []*client
	for range conns {
		csr = append(csr, verify(dial(b, d.socket), "rate"))
		csl = append(csl, verify(dial(b, d.socket), "lease"))
	}
	runUnits := func(cs []*client, fr [][]byte) time.Duration {
		var wg sync.WaitGroup
		start := time.Now()
		for i, c := range cs {
			wg.Go(func() {
				if err := c.units(fr[i*7%len(fr):], round/conns, inflight); err != nil {
					b.Error(err)
				}
			})
		}
		wg.Wait()
		return time.Since(start)
	}
	var thr []float64
	var tr, tl time.Duration
	for range max(b.N/round, 5) {
		r, l := runUnits(csr, rate), runUnits(csl, lease)
		tr, tl = tr+r, tl+l
		thr = append(thr, float64(l)/float64(r))
	}
	b.ReportMetric(median(thr), "pair-vs-rate-4x32")
	n := float64(len(thr) * round)
	b.ReportMetric(float64(tr.Nanoseconds())/n, "rate-ns/check")
	b.ReportMetric(float64(tl.Nanoseconds())/n, "pair-ns/acquire+release")
}
