package limiter

import (
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/rules"
)

// BenchmarkCheckPoliciesGlobal measures, on a real standalone Redis, a global-mode check
// under rules with every policy (a calendar quota with warn_at, a delayed token bucket,
// a penalty with shared bans) as a ratio to the same rules without them, alternating
// blocks of 256 checks of each in one run (the machine is shared: compare the ratio, not
// the µs). Clients are drawn Zipf(1.1) from 1,048,576 users and IPs. The penalty costs a
// read of the ban key before the check's script: one more round trip.
func BenchmarkCheckPoliciesGlobal(b *testing.B) {
	const users, draws, block = 1 << 20, 1 << 14, 256
	rdb := realRedis(b)
	pol := sharedLimiter(b, rdb, `
rules:
  - name: quota
    key: user
    limit: { requests: 4000000000, per: day, tz: Europe/Paris }
    warn_at: 0.8
    mode: global
  - name: queue
    key: user
    limit: { requests: 1000000, per: 1s }
    delay: 100ms
    mode: global
  - name: login
    key: ip
    limit: { requests: 1000000, per: 1m }
    penalty: { after: 5, within: 1m, ban: 1m }
    mode: global
`)
	plain := sharedLimiter(b, rdb, `
rules:
  - name: quota-plain
    key: user
    algorithm: fixed_window
    limit: { requests: 4000000000, per: 1d }
    mode: global
  - name: queue-plain
    key: user
    limit: { requests: 1000000, per: 1s }
    mode: global
  - name: login-plain
    key: ip
    limit: { requests: 1000000, per: 1m }
    mode: global
`)
	z := rand.NewZipf(rand.New(rand.NewPCG(1, 2)), 1.1, 1, users-1)
	ins := make([]Input, draws)
	for i := range ins {
		u := strconv.FormatUint(z.Uint64(), 10)
		ins[i] = Input{Attrs: []rules.Attr{{Name: "user", Value: "u-" + u}, {Name: "ip", Value: "10." + u}}, Cost: 1}
	}
	var d Decision
	var tPol, tPlain time.Duration
	var nPol, nPlain int
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for n := 0; n < b.N; n += 2 * block {
		for _, side := range [2]*Limiter{pol, plain} {
			start := time.Now()
			for k := range block {
				in := &ins[(i+k)%draws]
				if err := side.Check(time.Now().UnixNano(), in, &d); err != nil || !d.Allowed || d.Degraded {
					b.Fatal(err, d.Results)
				}
			}
			el := time.Since(start)
			if side == pol {
				tPol, nPol = tPol+el, nPol+block
			} else {
				tPlain, nPlain = tPlain+el, nPlain+block
			}
		}
		i += block
	}
	b.ReportMetric(float64(tPol)/float64(nPol), "ns/check-policies")
	b.ReportMetric(float64(tPlain)/float64(nPlain), "ns/check-plain")
	b.ReportMetric((float64(tPol)/float64(nPol))/(float64(tPlain)/float64(nPlain)), "ratio-policies/plain")
}
