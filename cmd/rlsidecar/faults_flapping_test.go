package main

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// Redis flapping faster than the breaker's cool-down: behind toxiproxy the link hangs
// (a timeout toxic: whatever the daemon sends is dropped, nothing comes back) and comes
// back by turns, every phase 150-300 ms, for 4 s, while one client checks a global rule
// (on_store_failure: closed), a hybrid rule and a request no rule matches, one after
// another on one connection. Every answer arrives, none waits longer than the global
// timeout, the global rule's degraded answers are its policy's, and few checks wait on
// the hanging Redis: the breaker's failures each time it reopens and its failed
// probes, a count set by the flapping and the flags, not by how many checks were made.
//
//	go test -race -count=1 -run TestFaultRedisFlapping ./cmd/rlsidecar
func TestFaultRedisFlapping(t *testing.T) {
	const (
		globalTimeout = 20 * time.Millisecond
		failures      = 3
		cooldown      = time.Second
		flapFor       = 4 * time.Second
	)
	srv := redistest.StartStandalone(t)
	proxy := startToxiproxy(t, srv.Addr)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: otp
    match: { path: /otp }
    key: user
    limit: { requests: 1000000, per: 1h }
    mode: global
    on_store_failure: closed
  - name: api
    match: { path: /api }
    key: ip
    limit: { requests: 1000000, per: 1h }
    mode: hybrid
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+proxy.Listen, "--admin", "127.0.0.1:0",
		"--sync-interval", "50ms", "--global-timeout", globalTimeout.String(),
		"--breaker-failures", fmt.Sprint(failures), "--breaker-cooldown", cooldown.String())
	base := "http://" + adminAddr(t, d)
	c := dialFault(t, d.socket)
	// As in TestFaultToxiproxyLatencyAndResets, the request no rule matches asks no store:
	// its latencies are what the machine adds at that moment.
	shapes := [][]string{{"otp", "path=/otp", "user=u"}, {"api", "path=/api", "ip=i"}, {"none", "path=/unmatched", "ip=i"}}
	for _, s := range shapes {
		waitNormal(t, c, 5*time.Second, s[1:]...)
	}
	const callErrors = `rlsidecar_store_requests_total{op="global_check",result="error"}`
	errorsBefore := scrapeSamples(t, base)[callErrors]

	rec := newRecorder()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); checkLoop(c, rec, stop, shapes) }()
	stopped := false
	stopLoad := func() {
		if !stopped {
			close(stop)
			wg.Wait()
			stopped = true
		}
	}
	defer stopLoad()
	if _, ok := rec.waitFor(5*time.Second, func(s sample) bool { return s.rule == "otp" && !s.degraded }); !ok {
		t.Fatal("no normal otp answer before the flapping")
	}

	// The flapping, the same in every run: hang 150 ms, up 200, hang 300, up 250, ...
	phases := []time.Duration{150 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond, 250 * time.Millisecond}
	start := time.Now()
	var hangs []time.Duration // how long each hang lasted
	for i := 0; time.Since(start) < flapFor; i++ {
		if i%2 == 1 {
			time.Sleep(phases[i%len(phases)])
			continue
		}
		addToxic(t, proxy, "hang", "timeout", "upstream", `{"timeout":0}`)
		from := time.Now()
		time.Sleep(phases[i%len(phases)])
		removeToxic(t, proxy, "hang")
		hangs = append(hangs, time.Since(from))
	}
	end := time.Now()
	stopLoad()
	callErrs := scrapeSamples(t, base)[callErrors] - errorsBefore
	back := time.Now()
	for _, s := range shapes {
		waitNormal(t, c, 5*time.Second, s[1:]...)
	}
	t.Logf("%d hangs in %s; normal answers on every rule %s after the last", len(hangs), end.Sub(start).Round(time.Millisecond), time.Since(back).Round(time.Millisecond))

	byRule := map[string][]sample{}
	for _, s := range rec.between(start, end) {
		if s.err != nil {
			t.Fatalf("%s during the flapping: %v", s.rule, s.err)
		}
		byRule[s.rule] = append(byRule[s.rule], s)
	}
	// slow counts the checks that took the global timeout or longer.
	slow := func(ss []sample) (n int) {
		for _, s := range ss {
			if s.took >= globalTimeout {
				n++
			}
		}
		return n
	}
	baseLat := latencies(byRule["none"])
	if len(baseLat) == 0 {
		t.Fatal("no baseline checks")
	}
	t.Logf("none %5d checks, p50 %s, p99 %s, max %s, %d over %s (baseline: no rule matched)",
		len(baseLat), pct(baseLat, 0.5), pct(baseLat, 0.99), baseLat[len(baseLat)-1], slow(byRule["none"]), globalTimeout)

	// (c) The global rule answers normally (allowed) or by its policy, closed: refused
	// for 1 s, degraded, its rule's entry too. Both are seen, or Redis did not flap.
	var normal, refused, waited int
	for _, s := range byRule["otp"] {
		switch {
		case s.allowed && !s.degraded:
			normal++
		case !s.allowed && s.degraded && s.ruleDegraded && s.retryMs == 1000:
			refused++
			if s.took >= globalTimeout {
				waited++
			}
		default:
			t.Fatalf("otp answered allowed %v, degraded %v (its rule's entry %v), retry %d ms: neither normal nor its policy (closed: refused, retry 1000 ms, degraded)",
				s.allowed, s.degraded, s.ruleDegraded, s.retryMs)
		}
	}
	// The hybrid rule decides locally and never refuses here (a million an hour; its
	// fallback, local, admits too).
	apiDegraded := 0
	for _, s := range byRule["api"] {
		if !s.allowed {
			t.Fatalf("api refused during the flapping (degraded %v)", s.degraded)
		}
		if s.degraded {
			apiDegraded++
		}
	}
	if normal == 0 || refused == 0 || waited == 0 {
		t.Fatalf("otp: %d normal, %d refused by its policy, %d of those waited on Redis: want some of each, or Redis did not flap", normal, refused, waited)
	}

	// (b) The checks that waited on the hanging Redis. The breaker is closed when a hang
	// starts if a probe found Redis up in the phase before: the hang's first `failures`
	// global checks then wait the global timeout each, and open it. While it is open,
	// each probe that finds Redis hanging waits too (a check's, or the daemon's own
	// PING, which no check waits for); probes go at least cooldown/8 apart (its first
	// wait, doubling after each failed probe). So a hang of h costs at most
	// failures + h/(cooldown/8) + 1 waits: 5 for a 150 ms hang, 6 for 300 ms, 55 in
	// the 10 hangs of a run. Measured: 35 in every run on an idle 2-core machine (3 per
	// hang, and one failed probe in each 300 ms hang), 16-36 beside 4 busy loops (fewer
	// checks). Without the breaker every global check in a hang waits, about the hangs'
	// 2.25 s / the global timeout: 97 and 101 with --breaker-failures 1000000 or a
	// breaker that never opens.
	//
	// On a loaded 2-core machine a check refused at once by the open breaker may still
	// take 20 ms on the wire: the process descheduled. The baseline (no rule matched,
	// as many checks as the global rule's, between them) meets the same pauses: its own
	// slow count is added.
	bound := 0
	for _, h := range hangs {
		bound += failures + int(h/(cooldown/8)) + 1
	}
	noise := slow(byRule["none"])
	otpLat := latencies(byRule["otp"])
	t.Logf("otp  %5d checks, p50 %s, p99 %s, max %s: %d normal, %d refused by its policy, %d of those waited (bound %d + %d baseline); %v global_check calls failed",
		len(otpLat), pct(otpLat, 0.5), pct(otpLat, 0.99), otpLat[len(otpLat)-1], normal, refused, waited, bound, noise, callErrs)
	if waited > bound+noise {
		t.Errorf("%d global checks waited on Redis in %d hangs, want at most %d (failures %d + one per cooldown/8 %s of hang + 1, per hang) + %d (the baseline's slow checks)",
			waited, len(hangs), bound+noise, failures, cooldown/8, noise)
	}
	if callErrs > float64(bound) {
		t.Errorf("%v global_check calls to Redis failed in %d hangs, want at most %d", callErrs, len(hangs), bound)
	}

	// (a) No answer waits longer than the global timeout: the p99 of each rule is under
	// it plus the baseline's p99 plus 10 ms (the daemon's own work, the proxy), and none
	// is a stall.
	apiLat := latencies(byRule["api"])
	t.Logf("api  %5d checks, p50 %s, p99 %s, max %s, %d over %s, %d degraded",
		len(apiLat), pct(apiLat, 0.5), pct(apiLat, 0.99), apiLat[len(apiLat)-1], slow(byRule["api"]), globalTimeout, apiDegraded)
	for rule, lat := range map[string][]time.Duration{"otp": otpLat, "api": apiLat} {
		if got, want := pct(lat, 0.99), globalTimeout+10*time.Millisecond+pct(baseLat, 0.99); got > want {
			t.Errorf("%s p99 %s, want < %s (the global timeout + 10 ms + the baseline's p99)", rule, got, want)
		}
		if mx := lat[len(lat)-1]; mx > stallBound {
			t.Errorf("slowest %s check %s, want < %s", rule, mx, stallBound)
		}
	}
}
