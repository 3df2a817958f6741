package limiter

import (
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/rules"
)

const (
	policyRules = `
rules:
  - name: quota
    key: user
    limit: { requests: 4000000000, per: day, tz: Europe/Paris }
    warn_at: 0.8
  - name: queue
    key: user
    limit: { requests: 1000000, per: 1s }
    delay: 100ms
  - name: login
    key: ip
    limit: { requests: 1000000, per: 1m }
    penalty: { after: 5, within: 1m, ban: 1m }
`
	plainRules = `
rules:
  - name: quota
    key: user
    algorithm: fixed_window
    limit: { requests: 4000000000, per: 1d }
  - name: queue
    key: user
    limit: { requests: 1000000, per: 1s }
  - name: login
    key: ip
    limit: { requests: 1000000, per: 1m }
`
)

// BenchmarkCheckPolicies measures a check under rules with every policy (a calendar
// quota with warn_at, a delayed token bucket, a penalty) as a ratio to the same rules
// without them, alternating blocks of 1024 checks of each in one run (the machine is
// shared: compare the ratio, not the ns). Clients are drawn Zipf(1.1) from 1,048,576
// users and IPs; the keys drawn are stored before timing, so allocs/op is the steady
// state.
func BenchmarkCheckPolicies(b *testing.B) {
	const users, draws, block = 1 << 20, 1 << 16, 1024
	z := rand.NewZipf(rand.New(rand.NewPCG(1, 2)), 1.1, 1, users-1)
	ins := make([]Input, draws)
	for i := range ins {
		u := strconv.FormatUint(z.Uint64(), 10)
		ins[i] = Input{Attrs: []rules.Attr{{Name: "user", Value: "u-" + u}, {Name: "ip", Value: "10." + u}}, Cost: 1}
	}
	pol, plain := newLimiter(b, policyRules), newLimiter(b, plainRules)
	var d Decision
	now := t0
	for i := range ins { // store every key drawn
		_ = pol.Check(now, &ins[i], &d)
		_ = plain.Check(now, &ins[i], &d)
	}
	var tPol, tPlain time.Duration
	var nPol, nPlain int
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for n := 0; n < b.N; n += 2 * block {
		for _, side := range [2]*Limiter{pol, plain} {
			start := time.Now()
			for k := range block {
				in := &ins[(i+k)&(draws-1)]
				if err := side.Check(now, in, &d); err != nil || !d.Allowed {
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
		now += int64(time.Millisecond)
	}
	b.ReportMetric(float64(tPol)/float64(nPol), "ns/check-policies")
	b.ReportMetric(float64(tPlain)/float64(nPlain), "ns/check-plain")
	b.ReportMetric((float64(tPol)/float64(nPol))/(float64(tPlain)/float64(nPlain)), "ratio-policies/plain")
}
