//go:build peers

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// The differential phase: envoyproxy/ratelimit and rlsidecar's Envoy API, given one
// envoyproxy/ratelimit configuration (rlsidecar's converted by `rlsidecar import-envoy`,
// once as it is, decided locally, once with --mode global, decided in Redis, and once
// with --mode hybrid, one daemon syncing with Redis), answer
// the same ShouldRateLimit calls, each on a fresh store, and their answers are
// compared field by field: the overall code, and each status's code, current_limit
// (requests per unit; the name is rlsidecar's rule name, not compared), limit_remaining
// and whether duration_until_reset is there (its value to within 2 s: envoyproxy/ratelimit
// counts whole seconds). A call whose answers differ must be one of the differences the
// README names ("Envoy, Istio and envoyproxy/ratelimit"), each answer as it says;
// anything else is unexpected, and scripts/test-compare fails on it. The headers and
// body are not compared (they differ by design: README).

// diffConfig is the envoyproxy/ratelimit configuration both are given.
const diffConfig = `domain: diff
descriptors:
  - key: anyv
    rate_limit: { unit: hour, requests_per_unit: 3 }
  - key: exact
    value: v
    rate_limit: { unit: hour, requests_per_unit: 2 }
  - key: pfx
    value: "foo*"
    rate_limit: { unit: hour, requests_per_unit: 2 }
  - key: mid
    value: "a*b"
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: path
    value: api/v1
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: nest
    value: a
    descriptors:
      - key: sub
        rate_limit: { unit: day, requests_per_unit: 2 }
  - key: nest2
    rate_limit: { unit: hour, requests_per_unit: 5 }
    descriptors:
      - key: sub
        value: x
        rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: unl
    rate_limit: { unlimited: true }
  - key: shadow
    shadow_mode: true
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: block
    rate_limit: { unit: hour, requests_per_unit: 0 }
  - key: sec
    rate_limit: { unit: second, requests_per_unit: 100 }
  - key: min
    rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: day
    rate_limit: { unit: day, requests_per_unit: 1 }
  - key: wk
    rate_limit: { unit: week, requests_per_unit: 1 }
  - key: mon
    rate_limit: { unit: month, requests_per_unit: 1 }
  - key: yr
    rate_limit: { unit: year, requests_per_unit: 1 }
  - key: rs
    value: specific
    rate_limit: { name: specific, unit: hour, requests_per_unit: 1 }
  - key: rw
    rate_limit: { unit: hour, requests_per_unit: 5, replaces: [ { name: specific } ] }
  - key: det
    detailed_metric: true
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: share
    value: "s*"
    share_threshold: true
    rate_limit: { unit: hour, requests_per_unit: 2 }
  - key: big
    rate_limit: { unit: hour, requests_per_unit: 10 }
  - key: w
    value: "x*"
    descriptors:
      - key: b
        rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: w
    value: "xy"
    descriptors:
      - key: c
        rate_limit: { unit: hour, requests_per_unit: 2 }
  - key: w
    value: "xy*"
    rate_limit: { unit: hour, requests_per_unit: 3 }
  - key: w
    rate_limit: { unit: hour, requests_per_unit: 4 }
  - key: star
    value: "*"
    rate_limit: { unit: hour, requests_per_unit: 5 }
  - key: star
    rate_limit: { unit: hour, requests_per_unit: 6 }
  - key: quota
    quota_mode: true
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: sh2
    value: "p*"
    share_threshold: true
    descriptors:
      - key: u
        rate_limit: { unit: hour, requests_per_unit: 1 }
`

// diffCall is one call of the battery; when doc is set, the two answers are expected to
// differ as the README says: envoy and rls are the answers, as render writes them.
type diffCall struct {
	label      string
	req        *ratelimitv3.RateLimitRequest
	doc        string
	envoy, rls string
}

func dd(kv ...string) *rlcommon.RateLimitDescriptor {
	d := &rlcommon.RateLimitDescriptor{}
	for _, s := range kv {
		k, v, _ := strings.Cut(s, "=")
		d.Entries = append(d.Entries, &rlcommon.RateLimitDescriptor_Entry{Key: k, Value: v})
	}
	return d
}

func withHits(d *rlcommon.RateLimitDescriptor, n uint64) *rlcommon.RateLimitDescriptor {
	d.HitsAddend = wrapperspb.UInt64(n)
	return d
}

func withOverride(d *rlcommon.RateLimitDescriptor, rpu uint32, unit typev3.RateLimitUnit) *rlcommon.RateLimitDescriptor {
	d.Limit = &rlcommon.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: rpu, Unit: unit}
	return d
}

func req(domain string, hits uint32, ds ...*rlcommon.RateLimitDescriptor) *ratelimitv3.RateLimitRequest {
	return &ratelimitv3.RateLimitRequest{Domain: domain, HitsAddend: hits, Descriptors: ds}
}

// diffBattery is the calls, in order (each system's store starts empty).
func diffBattery() []diffCall {
	var cs []diffCall
	same := func(n int, label string, r *ratelimitv3.RateLimitRequest) {
		for i := range n {
			cs = append(cs, diffCall{label: fmt.Sprintf("%s #%d", label, i+1), req: r})
		}
	}
	doc := func(label string, r *ratelimitv3.RateLimitRequest, why, envoy, rls string) {
		cs = append(cs, diffCall{label: label, req: r, doc: why, envoy: envoy, rls: rls})
	}
	const (
		allOrNothing = "all-or-nothing: a refused call consumes nothing"
		askOnly      = "hits_addend 0 asks whether one more would pass"
	)
	same(4, "key without value", req("diff", 0, dd("anyv=A")))
	same(1, "key without value, another value", req("diff", 0, dd("anyv=B")))
	same(1, "key without value, empty value", req("diff", 0, dd("anyv=")))
	same(3, "exact value", req("diff", 0, dd("exact=v")))
	same(1, "another value", req("diff", 0, dd("exact=w")))
	same(3, "wildcard", req("diff", 0, dd("pfx=foo1")))
	same(1, "wildcard, another value", req("diff", 0, dd("pfx=foo2")))
	same(1, "wildcard, no match", req("diff", 0, dd("pfx=bar")))
	same(2, "a '*' inside a value is literal", req("diff", 0, dd("mid=a*b")))
	same(1, "a '*' inside a value is literal, no match", req("diff", 0, dd("mid=axxb")))
	same(2, "path without '/'", req("diff", 0, dd("path=api/v1")))
	same(3, "nested", req("diff", 0, dd("nest=a", "sub=s")))
	same(1, "nested, other parent", req("diff", 0, dd("nest=b", "sub=s")))
	same(1, "nested, parent alone", req("diff", 0, dd("nest=a")))
	same(2, "nested under a limited parent", req("diff", 0, dd("nest2=n", "sub=x")))
	same(1, "nested, no match", req("diff", 0, dd("nest2=n", "sub=y")))
	same(2, "the parent alone", req("diff", 0, dd("nest2=n")))
	same(1, "deeper than configured", req("diff", 0, dd("anyv=A", "extra=1")))
	same(2, "unlimited", req("diff", 0, dd("unl=1")))
	same(3, "shadow", req("diff", 0, dd("shadow=s")))
	same(1, "quota_mode", req("diff", 0, dd("quota=q")))
	for range 2 {
		doc("quota_mode past the limit", req("diff", 0, dd("quota=q")), "quota_mode is a shadow rule",
			"OK [OK 1/HOUR rem=0]", "OK [OK 1/HOUR rem=0 reset]")
	}
	same(1, "second", req("diff", 0, dd("sec=s"))) // once: a second may end between the answers
	same(3, "minute", req("diff", 0, dd("min=m")))
	same(2, "day", req("diff", 0, dd("day=d")))
	same(2, "week", req("diff", 0, dd("wk=w")))
	same(2, "month", req("diff", 0, dd("mon=m")))
	same(2, "year", req("diff", 0, dd("yr=y")))
	same(2, "replaces", req("diff", 0, dd("rs=specific"), dd("rw=r")))
	same(2, "replaced, alone", req("diff", 0, dd("rs=specific")))
	same(2, "detailed_metric", req("diff", 0, dd("det=z")))
	same(2, "share_threshold", req("diff", 0, dd("share=s1")))
	same(1, "share_threshold, another value", req("diff", 0, dd("share=s2")))
	// Envoy's lookup never backtracks: an exact value, else the first wildcard in order,
	// else the key alone, whether or not what it finds has a limit at this depth.
	same(1, "exact value whose nested key differs", req("diff", 0, dd("w=xy", "b=1")))
	same(1, "exact value, its nested key", req("diff", 0, dd("w=xy", "c=1")))
	same(1, "first wildcard, which has no limit of its own", req("diff", 0, dd("w=xyz")))
	same(2, "first wildcard, nested", req("diff", 0, dd("w=xyz", "b=1")))
	same(1, "the key alone", req("diff", 0, dd("w=zz")))
	same(1, "the key alone, nested (no match)", req("diff", 0, dd("w=zz", "b=1")))
	same(1, "'*' before the key alone", req("diff", 0, dd("star=q")))
	same(1, "'*' and an empty value", req("diff", 0, dd("star=")))
	same(1, "share_threshold above a nested limit", req("diff", 0, dd("sh2=p1", "u=a")))
	same(1, "share_threshold above a nested limit, another value", req("diff", 0, dd("sh2=p2", "u=a")))
	same(1, "share_threshold above a nested limit, another nested value", req("diff", 0, dd("sh2=p3", "u=b")))
	same(1, "hits_addend 0 on a fresh key", req("diff", 0, withHits(dd("big=h0"), 0)))
	same(1, "the call's hits_addend", req("diff", 4, dd("big=h4")))
	same(1, "a descriptor's hits_addend over the call's", req("diff", 4, withHits(dd("big=h4"), 6)))
	doc("hits_addend 0 at the limit", req("diff", 0, withHits(dd("big=h4"), 0)), askOnly,
		"OK [OK 10/HOUR rem=0 reset]", "OVER_LIMIT [OVER_LIMIT 10/HOUR rem=0 reset]")
	same(1, "one more at the limit", req("diff", 0, dd("big=h4")))
	doc("hits_addend over the limit", req("diff", 11, dd("big=h11")), allOrNothing,
		"OVER_LIMIT [OVER_LIMIT 10/HOUR rem=0 reset]", "OVER_LIMIT [OVER_LIMIT 10/HOUR rem=10 reset]")
	doc("one after hits_addend over the limit", req("diff", 0, dd("big=h11")), allOrNothing,
		"OVER_LIMIT [OVER_LIMIT 10/HOUR rem=0 reset]", "OK [OK 10/HOUR rem=9 reset]")
	doc("several descriptors, one over", req("diff", 0, dd("big=m"), dd("exact=v"), dd("nomatch=1")), allOrNothing,
		"OVER_LIMIT [OK 10/HOUR rem=9 reset | OVER_LIMIT 2/HOUR rem=0 reset | OK nolim rem=0]",
		"OVER_LIMIT [OK 10/HOUR rem=10 reset | OVER_LIMIT 2/HOUR rem=0 reset | OK nolim rem=0]")
	doc("several descriptors, after", req("diff", 0, dd("big=m")), allOrNothing,
		"OK [OK 10/HOUR rem=8 reset]", "OK [OK 10/HOUR rem=9 reset]")
	same(1, "several descriptors, the same one twice", req("diff", 0, dd("anyv=D"), dd("anyv=D")))
	doc("several descriptors, the same one twice, again", req("diff", 0, dd("anyv=D"), dd("anyv=D")), allOrNothing,
		"OVER_LIMIT [OK 3/HOUR rem=0 reset | OVER_LIMIT 3/HOUR rem=0 reset]", "OVER_LIMIT [OK 3/HOUR rem=1 reset | OVER_LIMIT 3/HOUR rem=0 reset]")
	same(1, "no match", req("diff", 0, dd("nomatch=1")))
	same(1, "unknown domain", req("nodomain", 0, dd("anyv=1")))
	same(1, "an empty descriptor", req("diff", 0, dd()))
	doc("requests_per_unit 0", req("diff", 0, dd("block=1")), "requests_per_unit: 0 is 0 per SECOND",
		"OVER_LIMIT [OVER_LIMIT 0/HOUR rem=0 reset]", "OVER_LIMIT [OVER_LIMIT 0/SECOND rem=0 reset]")
	doc("empty domain", req("", 0, dd("anyv=1")), "malformed calls are InvalidArgument",
		"ERR Unknown", "ERR InvalidArgument")
	doc("no descriptors", req("diff", 0), "malformed calls are InvalidArgument",
		"ERR Unknown", "ERR InvalidArgument")
	doc("an entry with an empty key", req("diff", 0, dd("=x"), dd("exact=v")), "malformed calls are InvalidArgument",
		"OVER_LIMIT [OK nolim rem=0 | OVER_LIMIT 2/HOUR rem=0 reset]", "ERR InvalidArgument")
	same(3, "override", req("diff", 0, withOverride(dd("ov=o"), 2, typev3.RateLimitUnit_MINUTE)))
	same(2, "override of 0", req("diff", 0, withOverride(dd("ov=z"), 0, typev3.RateLimitUnit_HOUR)))
	same(1, "override of 0, hits_addend 0", req("diff", 0, withHits(withOverride(dd("ov=z"), 0, typev3.RateLimitUnit_HOUR), 0)))
	// exact=v was asked 5 times above, 2 of them admitted: envoyproxy/ratelimit counted
	// all 5 in the counter its override of the same unit shares.
	doc("override of a configured descriptor", req("diff", 0, withOverride(dd("exact=v"), 100, typev3.RateLimitUnit_HOUR)),
		"an override counts apart from the configured limit", "OK [OK 100/HOUR rem=94 reset]", "OK [OK 100/HOUR rem=99 reset]")
	same(1, "override of an empty descriptor", req("diff", 0, withOverride(dd(), 5, typev3.RateLimitUnit_DAY)))
	mult := withOverride(dd("ov=mult"), 2, typev3.RateLimitUnit_SECOND)
	mult.Limit.UnitMultiplier = wrapperspb.UInt32(60)
	doc("override with unit_multiplier", req("diff", 0, mult), "an override's unit_multiplier is honoured",
		"OK [OK 2/SECOND rem=1 reset]", "OK [OK 2/MINUTE rem=1 reset]")
	doc("override in an unknown domain", req("nodomain", 0, withOverride(dd("ov=x"), 1, typev3.RateLimitUnit_HOUR)),
		"an override applies in any domain", "OK [OK nolim rem=0]", "OK [OK 1/HOUR rem=0 reset]")
	return cs
}

// render writes an answer as the battery compares it (no names, no reset value).
func render(resp *ratelimitv3.RateLimitResponse, err error) string {
	if err != nil {
		st, _ := status.FromError(err)
		return "ERR " + st.Code().String()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%v [", resp.OverallCode)
	for i, s := range resp.Statuses {
		if i > 0 {
			b.WriteString(" | ")
		}
		fmt.Fprintf(&b, "%v ", s.Code)
		if cl := s.CurrentLimit; cl != nil {
			fmt.Fprintf(&b, "%d/%v", cl.RequestsPerUnit, cl.Unit)
		} else {
			b.WriteString("nolim")
		}
		fmt.Fprintf(&b, " rem=%d", s.LimitRemaining)
		if s.DurationUntilReset != nil {
			b.WriteString(" reset")
		}
	}
	b.WriteString("]")
	return b.String()
}

// resetsAgree reports whether two same-shaped answers give each status the same reset to
// within 2 s, where both give one that is not 0.
func resetsAgree(a, b *ratelimitv3.RateLimitResponse) bool {
	for i := range min(len(a.Statuses), len(b.Statuses)) {
		x, y := a.Statuses[i].DurationUntilReset.AsDuration(), b.Statuses[i].DurationUntilReset.AsDuration()
		if x == 0 || y == 0 {
			continue
		}
		if d := x - y; d > 2*time.Second || d < -2*time.Second {
			return false
		}
	}
	return true
}

// differential runs the phase with the service_cmd installed in bin and the rlsidecar
// built in dir: one envoyproxy/ratelimit and three rlsidecar daemons, the rules converted
// as they are by default (no mode: local here, without Redis), with --mode global (on
// Redis, as envoyproxy/ratelimit counts) and with --mode hybrid (on Redis too, under
// a prefix of its own).
func differential(dir, bin string) (*DiffReport, error) {
	cfgFile := filepath.Join(dir, "diff-envoy.yaml")
	if err := os.WriteFile(cfgFile, []byte(diffConfig), 0o644); err != nil {
		return nil, err
	}
	redis, redisPort, err := startRedis(filepath.Join(bin, "redis-diff"))
	if err != nil {
		return nil, err
	}
	defer redis.stop()
	envoyAddr, stopEnvoy, err := runEnvoyRLWith(bin, redisPort, "-diff", diffConfig)
	if err != nil {
		return nil, err
	}
	defer stopEnvoy()
	names := []string{"envoy-ratelimit"}
	addrs := []string{envoyAddr}
	for _, mode := range []string{"", "global", "hybrid"} {
		// The peer is pinned to a build before envoyproxy/ratelimit#1085, which matches a
		// '*' before the end of a value literally (the call "mid=axxb" below).
		name, args := "rlsidecar", []string{"import-envoy", "--wildcards", "trailing", cfgFile}
		if mode != "" {
			name, args = "rlsidecar --mode "+mode, append(args, "--mode", mode)
		}
		converted, err := exec.Command(filepath.Join(dir, "rlsidecar"), args...).Output()
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			return nil, fmt.Errorf("rlsidecar import-envoy: %w: %s", err, ee.Stderr)
		} else if err != nil {
			return nil, fmt.Errorf("rlsidecar import-envoy: %w", err)
		}
		rulesFile := filepath.Join(dir, "diff-rules"+mode+".yaml")
		if err := os.WriteFile(rulesFile, converted, 0o644); err != nil {
			return nil, err
		}
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		serve := []string{"serve", "--socket", filepath.Join(dir, "rlsidecar-diff"+mode+".sock"),
			"--admin=", "--log-level", "warn", "--config", rulesFile, "--envoy-rls", addr}
		if mode != "" {
			// Each mode on keys of its own (a global and a hybrid key of one rule share a name).
			serve = append(serve, "--redis", fmt.Sprintf("redis://127.0.0.1:%d", redisPort), "--global-timeout", "1s", "--redis-prefix", mode+":")
		}
		rp, err := startLogged(exec.Command(filepath.Join(dir, "rlsidecar"), serve...), "listening")
		if err != nil {
			return nil, err
		}
		defer rp.stop()
		names, addrs = append(names, name), append(addrs, addr)
	}
	clients := make([]*envoyChecker, len(addrs))
	for i, addr := range addrs {
		c, err := envoyDialer(addr, nil, false)()
		if err != nil {
			return nil, err
		}
		defer c.close()
		clients[i] = c
		if err := waitReady(names[i]+" (differential)", func() error { return c.checkKey(0) }); err != nil {
			return nil, err
		}
	}
	// Every unit is a whole number of minutes aligned to the epoch: keep the battery
	// inside one minute, so that no window of either system ends between the answers to
	// a call.
	for s := time.Now().Unix() % 60; s < 1 || s > 45; s = time.Now().Unix() % 60 {
		time.Sleep(200 * time.Millisecond)
	}
	rep := &DiffReport{}
	resps := make([]*ratelimitv3.RateLimitResponse, len(clients))
	out := make([]string, len(clients))
	for _, c := range diffBattery() {
		for i, cl := range clients {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			resp, err := cl.c.ShouldRateLimit(ctx, c.req)
			cancel()
			resps[i], out[i] = resp, render(resp, err)
		}
		for i := 1; i < len(clients); i++ {
			rep.Calls++
			dc := DiffCase{Call: c.label, Envoy: out[0], Rlsidecar: out[i], Why: c.doc}
			if i > 1 {
				dc.Call = names[i] + ": " + c.label
			}
			switch {
			case c.doc == "" && out[0] == out[i]:
				if resps[0] != nil && resps[i] != nil && !resetsAgree(resps[0], resps[i]) {
					dc.Why = fmt.Sprintf("duration_until_reset differs by more than 2 s: %v", resetsOf(resps[0], resps[i]))
					rep.Unexpected = append(rep.Unexpected, dc)
					continue
				}
				rep.Same++
			case c.doc == "":
				dc.Why = "expected the same answer"
				rep.Unexpected = append(rep.Unexpected, dc)
			case out[0] == c.envoy && out[i] == c.rls:
				rep.Documented = append(rep.Documented, dc)
			default:
				dc.Why = fmt.Sprintf("%s: expected envoy-ratelimit %q, rlsidecar %q", c.doc, c.envoy, c.rls)
				rep.Unexpected = append(rep.Unexpected, dc)
			}
		}
	}
	return rep, nil
}

func resetsOf(resps ...*ratelimitv3.RateLimitResponse) [][]time.Duration {
	out := make([][]time.Duration, len(resps))
	for i, r := range resps {
		for _, s := range r.Statuses {
			out[i] = append(out[i], s.DurationUntilReset.AsDuration())
		}
	}
	return out
}
