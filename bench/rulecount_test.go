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
