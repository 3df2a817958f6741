package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/checker"
	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// recoveryRules: a hybrid and a global rule, both failing closed, with limits far above
// what the benchmark offers: an answer allowed and not degraded is a normal one.
const recoveryRules = `rules:
  - name: api
    match: { path: /api }
    key: user
    limit: { requests: 1000000000, per: 1h }
    mode: hybrid
    on_store_failure: closed
  - name: otp
    match: { path: /otp }
    key: user
    limit: { requests: 1000000000, per: 1h }
    mode: global
    on_store_failure: closed
`

// recoveryDaemon is one daemon under BenchmarkRecovery, with the time each of its rules
// took to answer normally after each outage.
type recoveryDaemon struct {
	name           string
	c              *checker.Conn
	global, hybrid []time.Duration
}

// BenchmarkRecovery measures how soon the real daemon answers normally again once Redis
// is back: one daemon lives through a series of outages of its Redis (killed, restarted
// on the same port, a pause between them) while one client checks a global and a hybrid
// rule in turn every 2 ms. After each restart, once Redis answers PING, it times the
// first answer allowed and not degraded on each rule.
//
// The outages repeat on one daemon because go-redis's dial gate, which the daemon's
// dialers keep from closing (sync/dialgate.go), was reached by failed dials adding up
// over several outages: a breaker's probe landing on it failed without reaching Redis.
// Without that gate, a recovery is bounded by the breakers' cool-down (1 s by default).
//
// With RLSIDECAR_BENCH_VS set to the path of another rlsidecar binary, a daemon of that
// build goes through the same outages on the same Redis, checked by the same loop, and
// its figures are reported as vs-*: the two builds side by side in one run. The figures
// of docs/reliability.md's "Redis back" row, the gate's before and after (70cd2f1 is the
// commit that kept it open):
//
//	mkdir -p /tmp/pregate && git archive 70cd2f1^ | tar -x -C /tmp/pregate && (cd /tmp/pregate && go build -o /tmp/rls-pregate ./cmd/rlsidecar)
//	RLSIDECAR_BENCH_VS=/tmp/rls-pregate RLSIDECAR_BENCH_RECOVERY_KILLS=25 RLSIDECAR_BENCH_RECOVERY_OUTAGE=2s \
//	  go test -count=1 -run '^$' -bench 'BenchmarkRecovery$' -benchtime 1x -v ./bench
//
// Without the settings it runs 2 outages of 0.5 s, the CI smoke pass. With
// RLSIDECAR_BENCH_RECOVERY_FREEZE=1 Redis is SIGSTOPped instead of killed (no dial fails: the
// kernel still accepts connections, and calls time out). -v logs each recovery.
func BenchmarkRecovery(b *testing.B) {
	kills, outage, gap := 2, 500*time.Millisecond, time.Second
	if s := os.Getenv("RLSIDECAR_BENCH_RECOVERY_KILLS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			b.Fatalf("RLSIDECAR_BENCH_RECOVERY_KILLS=%q: want a count of outages", s)
		}
		kills = n
	}
	if s := os.Getenv("RLSIDECAR_BENCH_RECOVERY_OUTAGE"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			b.Fatalf("RLSIDECAR_BENCH_RECOVERY_OUTAGE=%q: want a duration", s)
		}
		outage = d
	}
	freeze := os.Getenv("RLSIDECAR_BENCH_RECOVERY_FREEZE") != ""
	cfg := filepath.Join(b.TempDir(), "recovery.yaml")
	if err := os.WriteFile(cfg, []byte(recoveryRules), 0o644); err != nil {
		b.Fatal(err)
	}
	srv := redistest.StartStandalone(b)
	args := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--sync-interval", "50ms"}
	ds := []*recoveryDaemon{{name: "", c: dialFaultClient(b, startServerNamed(b, "recovery", args...).socket)}}
	if installVS(b) {
		ds = append(ds, &recoveryDaemon{name: "vs-", c: dialFaultClient(b, startServerAt(b, vsName, "vs-recovery.sock", args...).socket)})
	}
	api := []string{"path=/api", "user=u1"}
	otp := []string{"path=/otp", "user=u1"}

	for k := 0; k < kills; k++ {
		for _, d := range ds {
			for _, attrs := range [][]string{api, otp} {
				waitNormal(b, d.c, 15*time.Second, attrs...)
			}
		}
		time.Sleep(gap)

		if freeze {
			srv.Freeze()
		} else {
			srv.Stop()
		}
		for i, start := 0, time.Now(); time.Since(start) < outage; i++ {
			attrs := api
			if i%2 == 1 {
				attrs = otp
			}
			for _, d := range ds {
				if _, _, err := d.c.Check(attrs...); err != nil {
					b.Fatal(err)
				}
			}
			time.Sleep(2 * time.Millisecond)
		}
		if freeze {
			srv.Thaw()
			if _, err := srv.Command("PING"); err != nil {
				b.Fatal(err)
			}
		} else {
			srv.Restart(b) // returns once Redis answers PING
		}
		up := time.Now()

		// Each daemon's rules in turn, until every one has answered normally.
		took := make(map[*recoveryDaemon][2]time.Duration)
		for pending := 2 * len(ds); pending > 0; time.Sleep(2 * time.Millisecond) {
			if time.Since(up) > 15*time.Second {
				b.Fatalf("outage %d: a rule still not answering normally 15 s after Redis was back", k+1)
			}
			for _, d := range ds {
				t := took[d]
				for j, attrs := range [][]string{otp, api} {
					if t[j] != 0 {
						continue
					}
					r, _, err := d.c.Check(attrs...)
					if err != nil {
						b.Fatal(err)
					}
					if r.Allowed && !r.Degraded {
						t[j] = time.Since(up)
						pending--
					}
				}
				took[d] = t
			}
		}
		for _, d := range ds {
			t := took[d]
			d.global, d.hybrid = append(d.global, t[0]), append(d.hybrid, t[1])
			b.Logf("outage %d of %v: %sglobal %.3f s, %shybrid %.3f s", k+1, outage, d.name, t[0].Seconds(), d.name, t[1].Seconds())
		}
	}

	// A recovery over 1.2 s took more than the breakers' cool-down (1 s) and the
	// probe's own round trip: something other than the breaker held it up.
	const slow = 1200 * time.Millisecond
	for _, d := range ds {
		for _, m := range []struct {
			rule string
			took []time.Duration
		}{{"global", d.global}, {"hybrid", d.hybrid}} {
			b.ReportMetric(percentile(m.took, 0.5).Seconds(), d.name+m.rule+"-p50-s")
			b.ReportMetric(slices.Max(m.took).Seconds(), d.name+m.rule+"-max-s")
			over := 0
			for _, t := range m.took {
				if t > slow {
					over++
				}
			}
			b.ReportMetric(float64(over), fmt.Sprintf("%s%s-over-%.1fs", d.name, m.rule, slow.Seconds()))
		}
	}
}
