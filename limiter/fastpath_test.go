package limiter

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	"pgregory.net/rapid"
)

// fastPathRules are the rules TestFastPathMatchesGeneral draws its sets from: every
// algorithm, shadow, deny, unlimited plans, split, warn_at, delay, a penalty, a
// concurrency rule (which takes the check off the all-local path) and replaces.
var fastPathRules = []string{
	"  - name: per-ip\n    key: ip\n    limit: { requests: 5, per: 1s }\n",
	"  - name: holds\n    match: { method: POST, path: \"/v1/events/*/holds\" }\n    key: user\n    limit: { requests: 3, per: 10s }\n    plans: { partner: 6, internal: unlimited }\n",
	"  - name: sliding\n    key: user\n    algorithm: sliding_window\n    limit: { requests: 4, per: 2s }\n    warn_at: 0.5\n",
	"  - name: fixed\n    match: { method: GET }\n    key: [user, ip]\n    algorithm: fixed_window\n    limit: { requests: 3, per: 1s }\n",
	"  - name: dark\n    key: ip\n    limit: { requests: 1, per: 1s }\n    shadow: true\n    warn_at: 0.8\n",
	"  - name: closed\n    match: { path: /closed }\n    key: ip\n    limit: deny\n",
	"  - name: queue\n    key: user\n    limit: { requests: 2, per: 1s }\n    delay: 2s\n",
	"  - name: login\n    match: { path: /login }\n    key: ip\n    limit: { requests: 2, per: 1m }\n    penalty: { after: 2, within: 1m, ban: 5s }\n",
	"  - name: split\n    key: user\n    limit: { requests: 8, per: 1s }\n    split: 2\n",
	"  - name: pool\n    match: { path: /pool }\n    key: user\n    concurrency: { max: 2, lease: 1s }\n",
	"  - name: vip\n    match: { plan: partner }\n    key: user\n    limit: { requests: 10, per: 1s }\n    replaces: [per-ip]\n",
}

// TestFastPathMatchesGeneral: the fast paths of a check (the local batch gathered by
// Prepare, an all-local check going straight to the local store, the ban check skipped
// without penalty rules) decide exactly as the general path does (Decision.general), on
// random rule sets and request sequences: same decisions, same results, same state after.
func TestFastPathMatchesGeneral(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		picked := rapid.SliceOfNDistinct(rapid.IntRange(0, len(fastPathRules)-1), 1, 5, rapid.ID).Draw(t, "rules")
		var b strings.Builder
		b.WriteString("rules:\n")
		for _, i := range picked {
			b.WriteString(fastPathRules[i])
		}
		set, err := rules.Parse("fast.yaml", []byte(b.String()))
		if err != nil {
			// A rule replacing one not picked: not a valid set.
			t.Skip(err)
		}
		fast := New(set, localbucket.NewStore(localbucket.Options{}))
		general := New(set, localbucket.NewStore(localbucket.Options{}))
		var df, dg Decision
		dg.general = true
		now := t0
		for n := rapid.IntRange(1, 40).Draw(t, "n"); n > 0; n-- {
			now += rapid.Int64Range(0, int64(700*time.Millisecond)).Draw(t, "dt")
			in := Input{Cost: rapid.Uint64Range(0, 3).Draw(t, "cost")}
			in.Attrs = append(in.Attrs,
				rules.Attr{Name: "method", Value: rapid.SampledFrom([]string{"GET", "POST"}).Draw(t, "method")},
				rules.Attr{Name: "path", Value: rapid.SampledFrom([]string{"/v1/events/7/holds", "/login", "/closed", "/pool", "/"}).Draw(t, "path")},
			)
			if rapid.Bool().Draw(t, "has user") {
				in.Attrs = append(in.Attrs, rules.Attr{Name: "user", Value: rapid.SampledFrom([]string{"ann", "bob", "a b|c"}).Draw(t, "user")})
			}
			in.Attrs = append(in.Attrs, rules.Attr{Name: "ip", Value: rapid.SampledFrom([]string{"10.0.0.1", "::1"}).Draw(t, "ip")})
			if plan := rapid.SampledFrom([]string{"", "partner", "internal"}).Draw(t, "plan"); plan != "" {
				in.Attrs = append(in.Attrs, rules.Attr{Name: "plan", Value: plan})
			}
			if rapid.IntRange(0, 4).Draw(t, "inline") == 0 {
				in.Limits = []Inline{{Key: "tenant-1", Limit: 3, WindowMs: 1000}}
			}
			ef := fast.Check(now, &in, &df)
			eg := general.Check(now, &in, &dg)
			if fmt.Sprint(ef) != fmt.Sprint(eg) {
				t.Fatalf("errors differ: fast %v, general %v", ef, eg)
			}
			if got, want := summary(&df), summary(&dg); got != want {
				t.Fatalf("request %+v at %d:\nfast    %s\ngeneral %s", in, now, got, want)
			}
		}
	})
}

// summary prints everything a caller can read from d.
func summary(d *Decision) string {
	var b strings.Builder
	fmt.Fprintf(&b, "allowed=%v deciding=%d degraded=%v warning=%v delay=%v banned=%v lease=%d unlimited=%v",
		d.Allowed, d.Deciding, d.Degraded, d.Warning, d.Delay, d.Banned, d.Lease, d.Unlimited)
	for i := range d.Results {
		r := d.Results[i]
		key := string(r.Key)
		r.Key = nil
		fmt.Fprintf(&b, "\n  %+v key=%s", r, key)
	}
	return b.String()
}

// The general path is not the fast one: the knob the differential test relies on takes
// effect (else the test above would compare a path with itself).
func TestFastPathKnob(t *testing.T) {
	l := newLimiter(t, benchRules)
	in := Input{Attrs: attrs("method=POST", "path=/v1/events/7/holds", "user=u", "ip=1.2.3.4"), Cost: 1}
	var fast, general Decision
	general.general = true
	for _, d := range []*Decision{&fast, &general} {
		if _, err := l.Prepare(&in, d); err != nil {
			t.Fatal(err)
		}
	}
	if !fast.localReady || general.localReady {
		t.Fatalf("after Prepare: fast batch ready %v, general %v; want true, false", fast.localReady, general.localReady)
	}
	if !reflect.DeepEqual(fast.local.at, []int{0, 1}) {
		t.Fatalf("fast batch covers ops %v, want [0 1]", fast.local.at)
	}
}
