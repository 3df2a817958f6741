package bench

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

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
// release) with a lease over without. Target: ≤ 2.
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
	run := func(fr [][]byte) time.Duration {
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
	run(plain) // warm up
	run(leased)
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
}
