package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// The rule sets: rules r0 … r(n-1), each { method: GET, path: "/v1/svcI/**" }
// keyed by user, and one rule for /v1/items that every request matches.
func ruleCountFile(tb testing.TB, n int) string {
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range n {
		fmt.Fprintf(&b, "  - { name: r%d, match: { method: GET, path: \"/v1/svc%d/**\" }, key: user, limit: { requests: 1000000000, per: 1h } }\n", i, i)
	}
	b.WriteString("  - { name: items, match: { method: GET, path: /v1/items }, key: user, limit: { requests: 1000000000, per: 1h } }\n")
	path := filepath.Join(tb.TempDir(), "rules-"+strconv.Itoa(n+1)+".yaml")
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		tb.Fatal(err)
	}
	return path
}

// itemFrames returns n pre-encoded checks of GET /v1/items over distinct users.
func itemFrames(n int) [][]byte {
	out := make([][]byte, n)
	enc := proto.NewEncoder()
	for i := range out {
		enc.Reset()
		enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "method", Value: "GET"},
			{Name: "path", Value: "/v1/items"},
			{Name: "user", Value: "user-" + strconv.Itoa(i)},
			{Name: "ip", Value: "10.0." + strconv.Itoa(i/256%256) + "." + strconv.Itoa(i%256)},
		}})
		out[i] = append([]byte(nil), enc.Bytes()...)
	}
	return out
}

// startRuleCountPair starts two daemons, one with 4 rules and one with 2,001, and checks
// that both answer the benchmark's request allowed by the one rule it matches.
func startRuleCountPair(b *testing.B) (small, large *server) {
	small = startServerAt(b, "rlsidecar", "rls-4rules.sock", "--config", ruleCountFile(b, 3))
	large = startServerAt(b, "rlsidecar", "rls-2001rules.sock", "--config", ruleCountFile(b, 2000))
	fr := itemFrames(1)
	for _, s := range []*server{small, large} {
		c := dial(b, s.socket)
		if _, err := c.roundTrips(fr, 1, nil); err != nil {
			b.Fatal(err)
		}
		var resp proto.Response
		if err := proto.NewDecoder().DecodeResponse(c.buf, &resp); err != nil || !resp.Allowed || resp.Rule != "items" || len(resp.Rules) != 1 {
			b.Fatalf("%s: %+v, %v; want allowed by items alone", s.socket, resp, err)
		}
	}
	return small, large
}

// BenchmarkSocketRuleCountLatency: one connection, one request at a time, to a daemon with
// 2,001 rules and one with 4, alternating in chunks of 1,000 (each first every other chunk); reports each p50 and their
// ratio (target ≤ 1.1).
func BenchmarkSocketRuleCountLatency(b *testing.B) {
	small, large := startRuleCountPair(b)
	fr := itemFrames(4096)
	cs, cl := dial(b, small.socket), dial(b, large.socket)
	cs.roundTrips(fr, 2000, nil)
	cl.roundTrips(fr, 2000, nil)
	var ls, ll []time.Duration
	b.ResetTimer()
	const chunk = 1000
	for done := 0; done < b.N; done += chunk {
		n := min(chunk, b.N-done)
		var err error
		for j := range 2 { // each goes first every other chunk
			if (j+done/chunk)%2 == 0 {
				ll, err = cl.roundTrips(fr, n, ll)
			} else {
				ls, err = cs.roundTrips(fr, n, ls)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	b.StopTimer()
	ps, pl := percentile(ls, 0.5), percentile(ll, 0.5)
	b.ReportMetric(float64(ps.Nanoseconds())/1e3, "4rules-p50-µs")
	b.ReportMetric(float64(pl.Nanoseconds())/1e3, "2001rules-p50-µs")
	b.ReportMetric(float64(pl)/float64(ps), "p50-ratio")
}

// BenchmarkSocketRuleCountThroughput4x32: 4 connections × 32 in flight to each daemon,
// alternating in chunks of 2,560 (each first every other chunk); reports each
// throughput and the median over chunk pairs of the ratio 2,001 rules ÷ 4 rules (target
// ≥ 0.9).
func BenchmarkSocketRuleCountThroughput4x32(b *testing.B) {
	const conns, inflight = 4, 32
	small, large := startRuleCountPair(b)
	fr := itemFrames(8192)
	var cs, cl []*client
	for range conns {
		cs = append(cs, dial(b, small.socket))
		cl = append(cl, dial(b, large.socket))
	}
	runPipelined(b, cs, fr, conns*2000, inflight)
	runPipelined(b, cl, fr, conns*2000, inflight)
	b.ResetTimer()
	var ts, tl time.Duration
	var ratios []float64 // per chunk pair: a loaded moment hits both, not one total
	total := 0
	const chunk = conns * inflight * 20
	for i := 0; total < b.N; i++ {
		n := min(chunk, b.N-total)
		n = max(n/conns, 1) * conns
		var s, l time.Duration
		if i%2 == 0 { // each goes first every other chunk
			l = runPipelined(b, cl, fr, n, inflight)
			s = runPipelined(b, cs, fr, n, inflight)
		} else {
			s = runPipelined(b, cs, fr, n, inflight)
			l = runPipelined(b, cl, fr, n, inflight)
		}
		ts += s
		tl += l
		ratios = append(ratios, float64(s)/float64(l))
		total += n
	}
	b.StopTimer()
	sort.Float64s(ratios)
	rs, rl := float64(total)/ts.Seconds(), float64(total)/tl.Seconds()
	b.ReportMetric(rs, "4rules-req/s")
	b.ReportMetric(rl, "2001rules-req/s")
	b.ReportMetric(ratios[len(ratios)/2], "throughput-ratio")
}

// BenchmarkSocketReload10k: one connection checking one request at a time against a
// daemon with 10,001 rules, first b.N/2 checks with the rules file left alone, then b.N/2
// while the file is replaced every 300 ms (the daemon's watcher reloads it: YAML,
// validation, the index, then one atomic swap). The two versions differ in the limit of
// the rule every request matches, so each answer says which set decided it; the
// benchmark counts the switches it saw. Reports p50, p99 and the slowest check of both
// phases: a reload must not pause checks (the old set serves until the swap).
func BenchmarkSocketReload10k(b *testing.B) {
	dir := b.TempDir()
	path := filepath.Join(dir, "rules.yaml")
	version := func(limit int) []byte {
		var s strings.Builder
		s.WriteString("rules:\n")
		for i := range 10000 {
			fmt.Fprintf(&s, "  - { name: r%d, match: { method: GET, path: \"/v1/svc%d/**\" }, key: user, limit: { requests: 1000000000, per: 1h } }\n", i, i)
		}
		fmt.Fprintf(&s, "  - { name: items, match: { method: GET, path: /v1/items }, key: user, limit: { requests: %d, per: 1h } }\n", limit)
		return []byte(s.String())
	}
	versions := [2][]byte{version(1000000000), version(999999999)}
	replace := func(data []byte) {
		tmp := filepath.Join(dir, ".rules.tmp")
		if err := os.WriteFile(tmp, data, 0o600); err != nil {
			b.Error(err)
			return
		}
		if err := os.Rename(tmp, path); err != nil {
			b.Error(err)
		}
	}
	replace(versions[0])
	s := startServerAt(b, "rlsidecar", "rls-reload.sock", "--config", path)
	c := dial(b, s.socket)
	fr := itemFrames(4096)
	dec := proto.NewDecoder()
	var resp proto.Response
	var lastLimit uint64
	switches := 0
	check := func(n int, lat []time.Duration) []time.Duration {
		for i := range n {
			start := time.Now()
			if _, err := c.c.Write(fr[i%len(fr)]); err != nil {
				b.Fatal(err)
			}
			if err := c.readOne(); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(start))
			if err := dec.DecodeResponse(c.buf, &resp); err != nil || resp.Rule != "items" {
				b.Fatalf("answer %+v, %v", resp, err)
			}
			if lastLimit != 0 && resp.Limit != lastLimit {
				switches++
			}
			lastLimit = resp.Limit
		}
		return lat
	}
	check(2000, nil)
	b.ResetTimer()
	quiet := check(b.N/2+1, nil)

	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // owned here: stopped and waited for below
		defer close(done)
		t := time.NewTicker(300 * time.Millisecond)
		defer t.Stop()
		for i := 1; ; i++ {
			select {
			case <-stop:
				return
			case <-t.C:
				replace(versions[i%2])
			}
		}
	}()
	reloading := check(b.N/2+1, nil)
	close(stop)
	<-done
	b.StopTimer()
	b.ReportMetric(float64(percentile(quiet, 0.5).Nanoseconds())/1e3, "quiet-p50-µs")
	b.ReportMetric(float64(percentile(quiet, 0.99).Nanoseconds())/1e3, "quiet-p99-µs")
	b.ReportMetric(float64(percentile(quiet, 1).Nanoseconds())/1e3, "quiet-max-µs")
	b.ReportMetric(float64(percentile(reloading, 0.5).Nanoseconds())/1e3, "reloading-p50-µs")
	b.ReportMetric(float64(percentile(reloading, 0.99).Nanoseconds())/1e3, "reloading-p99-µs")
	b.ReportMetric(float64(percentile(reloading, 1).Nanoseconds())/1e3, "reloading-max-µs")
	b.ReportMetric(float64(switches), "swaps-seen")
	// A reload (the 300 ms tick, the watcher's wait, YAML, validation, the index) takes
	// longer than the reloading phase of a short run: at the default -benchtime no swap
	// falls in it, and the two phases compared would both be quiet.
	if switches == 0 && b.N > 1 {
		b.Errorf("no reload seen in the reloading phase (%d checks): the comparison says nothing; run longer, e.g. -benchtime 100000x", b.N/2+1)
	}
}
