package daemon

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// rlsidecar_top_rejected never carries a client's key unless asked to (--top-labels raw):
// by default a keyed hash, the one /top shows beside the raw key; off exports nothing.
func TestTopLabels(t *testing.T) {
	const secret = "api_key=sk_live_51Hx"
	salt := []byte("fixed salt for the test")
	hashed := ClientLabel(salt, secret)
	if !strings.HasPrefix(hashed, "h:") || len(hashed) != 14 || strings.Contains(hashed, "sk_live") {
		t.Fatalf("label %q: want h: and 12 hex digits", hashed)
	}
	if ClientLabel([]byte("another salt"), secret) == hashed {
		t.Fatal("the label does not depend on the salt")
	}
	for _, tc := range []struct {
		mode       string
		wantMetric string // "" when no series
	}{
		{"hashed", `rlsidecar_top_rejected{rule="~inline",client="` + hashed + `"} 2`},
		{"raw", `rlsidecar_top_rejected{rule="~inline",client="` + secret + `"} 2`},
		{"off", ""},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			mode, err := ParseTopLabels(tc.mode)
			if err != nil {
				t.Fatal(err)
			}
			m := NewMetrics("test", 10)
			m.SetTopLabels(mode, salt)
			m.SetRules(rules.Default(), time.Now())
			d := &limiter.Decision{Deciding: 0, Results: []limiter.Result{{Name: "acme", Key: []byte("~inline/token_bucket/1/1000/1:{" + secret + "}")}}}
			m.Record(d)
			m.Record(d)
			var buf bytes.Buffer
			m.WritePrometheus(&buf)
			out := buf.String()
			if tc.wantMetric != "" && !strings.Contains(out, tc.wantMetric+"\n") {
				t.Errorf("want %s in:\n%s", tc.wantMetric, out)
			}
			if tc.mode != "raw" && strings.Contains(out, "sk_live") {
				t.Errorf("the key leaks into the metrics:\n%s", out)
			}
			if tc.mode == "off" && strings.Contains(out, "rlsidecar_top_rejected{") {
				t.Errorf("off exports a series:\n%s", out)
			}
			top := m.Top()["~inline"]
			if len(top) != 1 || top[0].Client != secret {
				t.Fatalf("/top: %+v, want the raw key", top)
			}
			if tc.mode == "hashed" && top[0].Label != hashed {
				t.Errorf("/top label %q, want %q", top[0].Label, hashed)
			}
		})
	}
	if _, err := ParseTopLabels("plain"); err == nil {
		t.Error("ParseTopLabels accepted plain")
	}
}

// A connection's allowed checks are tallied per batch (batchTally), yet every one is in the
// counters before its answer is written, across two connections, rejections, and a
// reload that moves the rules to other indexes mid-connection.
func TestTallyCountsBeforeAnswers(t *testing.T) {
	m := NewMetrics("test", 10)
	s := startServer(t, Config{Metrics: m})
	m.SetRules(s.lim.Rules(), time.Now())
	t.Cleanup(func() { s.Shutdown(context.Background()) })

	counter := func(rule, result string) string {
		var buf bytes.Buffer
		m.WritePrometheus(&buf)
		prefix := `rlsidecar_checks_total{rule="` + rule + `",result="` + result + `"} `
		for _, line := range strings.Split(buf.String(), "\n") {
			if v, ok := strings.CutPrefix(line, prefix); ok {
				return v
			}
		}
		return "absent"
	}
	// pipelined sends n checks at once on c and reads their n answers.
	pipelined := func(c net.Conn, br *bufio.Reader, n int, attrs ...proto.Attr) (allowed int) {
		t.Helper()
		enc := proto.NewEncoder()
		for i := range n {
			enc.EncodeRequest(&proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1, Attrs: attrs})
		}
		if _, err := c.Write(enc.Bytes()); err != nil {
			t.Fatal(err)
		}
		for range n {
			if readResponse(t, br).Allowed {
				allowed++
			}
		}
		return allowed
	}
	dial := func() (net.Conn, *bufio.Reader) { return dialServer(t, s) }
	holds := []proto.Attr{{Name: "method", Value: "POST"}, {Name: "path", Value: "/v1/events/7/holds"},
		{Name: "user", Value: "u1"}, {Name: "ip", Value: "192.0.2.1"}}
	c1, br1 := dial()
	c2, br2 := dial()
	pipelined(c1, br1, 50, holds...)
	pipelined(c2, br2, 70, holds...)
	if got := counter("per-ip", "allowed"); got != "120" {
		t.Errorf("per-ip allowed: %s, want 120", got)
	}
	if got := counter("holds", "allowed"); got != "120" {
		t.Errorf("holds allowed: %s, want 120", got)
	}
	// login allows 10 a minute per ip: 10 allowed (tallied), 5 rejected (counted at once).
	login := []proto.Attr{{Name: "method", Value: "POST"}, {Name: "path", Value: "/login"}, {Name: "ip", Value: "192.0.2.9"}}
	if n := pipelined(c1, br1, 15, login...); n != 10 {
		t.Fatalf("%d of 15 logins allowed, want 10", n)
	}
	if got, want := counter("login", "allowed")+"/"+counter("login", "rejected"), "10/5"; got != want {
		t.Errorf("login allowed/rejected: %s, want %s", got, want)
	}
	// A reload between two batches of c1 that moves every rule to the next index.
	shifted, err := rules.Parse("shifted.yaml", []byte(strings.Replace(benchRules, "rules:\n",
		"rules:\n  - { name: first, match: { path: /elsewhere }, key: ip, limit: { requests: 5, per: 1m } }\n", 1)))
	if err != nil {
		t.Fatal(err)
	}
	pipelined(c1, br1, 3, holds...)
	m.SetRules(shifted, time.Now())
	s.lim.SetRules(shifted)
	pipelined(c1, br1, 4, holds...)
	pipelined(c2, br2, 5, holds...)
	if got := counter("per-ip", "allowed"); got != "147" { // 120 + 15 logins (per-ip passed, login decided) + 3 + 4 + 5
		t.Errorf("per-ip allowed after the reload: %s, want 147", got)
	}
	if got := counter("holds", "allowed"); got != "132" {
		t.Errorf("holds allowed after the reload: %s, want 132", got)
	}
}

// Counts tallied under one rule table reach that table's rules when the table changes
// before the connection flushes (a reload between a check and its batch's flush): never
// the rules the new table has at those indexes.
func TestTallyAcrossReload(t *testing.T) {
	parse := func(order ...string) *rules.Set {
		src := "rules:\n"
		for _, name := range order {
			src += "  - { name: " + name + ", key: ip, limit: { requests: 1000, per: 1m } }\n"
		}
		set, err := rules.Parse("t.yaml", []byte(src))
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	allowed := func(set *rules.Set, name string) *limiter.Decision {
		for _, r := range set.Rules {
			if r.Name == name {
				return &limiter.Decision{Deciding: 0, Allowed: true, Results: []limiter.Result{{Name: name, Rule: r, Allowed: true}}}
			}
		}
		t.Fatalf("no rule %s", name)
		return nil
	}
	m := NewMetrics("test", 10)
	set1, set2 := parse("a", "b"), parse("b", "a")
	m.SetRules(set1, time.Now())
	var tally batchTally
	m.record(allowed(set1, "a"), &tally)
	m.record(allowed(set1, "a"), &tally)
	m.SetRules(set2, time.Now()) // b is now at a's index
	m.record(allowed(set2, "b"), &tally)
	m.flushTally(&tally)
	var buf bytes.Buffer
	m.WritePrometheus(&buf)
	for _, want := range []string{
		`rlsidecar_checks_total{rule="a",result="allowed"} 2`,
		`rlsidecar_checks_total{rule="b",result="allowed"} 1`,
	} {
		if !strings.Contains(buf.String(), want+"\n") {
			t.Errorf("want %s in:\n%s", want, buf.String())
		}
	}
}

// BenchmarkRecordTally: two goroutines, one per core, each recording two-rule allowed
// checks as connections do: with a tally flushed every 32 checks (a pipelined batch)
// against an atomic add per rule and check on the shared counters. cpu-ns/check is the
// CPU both cores spend per check.
func BenchmarkRecordTally(b *testing.B) {
	set, err := rules.Parse("test.yaml", []byte(benchRules))
	if err != nil {
		b.Fatal(err)
	}
	d := &limiter.Decision{Deciding: 0, Allowed: true, Results: []limiter.Result{
		{Name: set.Rules[0].Name, Rule: set.Rules[0], Allowed: true},
		{Name: set.Rules[1].Name, Rule: set.Rules[1], Allowed: true}}}
	for _, tallied := range []bool{false, true} {
		name := map[bool]string{false: "per-check", true: "tally-per-32"}[tallied]
		b.Run(name, func(b *testing.B) {
			m := NewMetrics("test", 10)
			m.SetRules(set, time.Now())
			var ru0, ru1 syscall.Rusage
			syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
			b.RunParallel(func(pb *testing.PB) {
				var t batchTally
				n := 0
				for pb.Next() {
					if tallied {
						m.record(d, &t)
						if n++; n%32 == 0 {
							m.flushTally(&t)
						}
					} else {
						m.record(d, nil)
					}
				}
				m.flushTally(&t)
			})
			syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
			cpu := ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano()
			b.ReportMetric(float64(cpu)/float64(b.N), "cpu-ns/check")
		})
	}
}

// Every rule's series exist from the moment its rule set is in force, at 0, as
// rlsidecar_checks_total's do: a concurrency rule's rlsidecar_inflight{rule} and
// rlsidecar_leases_total{rule,result}, a penalty rule's rlsidecar_banned_keys{rule}, so a
// dashboard or an alert sees the rule before its first lease or ban (an absent series is
// not a 0 to `rate()` or to `inflight > N`). Before, they appeared only after the first.
func TestRuleSeriesExistBeforeUse(t *testing.T) {
	set, err := rules.Parse("m.yaml", []byte(`rules:
  - { name: exports, key: user, concurrency: { max: 2 } }
  - { name: login, key: ip, limit: { requests: 5, per: 1m }, penalty: { after: 3, within: 1m, ban: 10m } }
  - { name: plain, key: user, limit: { requests: 5, per: 1m } }
`))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{}))
	m := NewMetrics("test", 10)
	m.SetRules(set, time.Now())
	m.SetLeases(lim.Leases())
	m.SetBannedKeys(func() map[string]int { return lim.BannedKeys(0) })
	var buf bytes.Buffer
	m.WritePrometheus(&buf)
	out := buf.String()
	for _, want := range []string{
		`rlsidecar_inflight{rule="exports"} 0`,
		`rlsidecar_leases_total{rule="exports",result="released"} 0`,
		`rlsidecar_leases_total{rule="exports",result="expired"} 0`,
		`rlsidecar_leases_total{rule="exports",result="closed"} 0`,
		`rlsidecar_banned_keys{rule="login"} 0`,
	} {
		if !strings.Contains(out, "\n"+want+"\n") {
			t.Errorf("no %s in:\n%s", want, out)
		}
	}
	for _, not := range []string{`rlsidecar_inflight{rule="plain"}`, `rlsidecar_banned_keys{rule="plain"}`, `rlsidecar_banned_keys{rule="exports"}`} {
		if strings.Contains(out, not) {
			t.Errorf("%s exported for a rule without it", not)
		}
	}
}

// A rule whose store was not asked (limiter.Result.Unasked: the request was refused
// first, by another rule or a ban) decided nothing: rlsidecar_checks_total counts it
// neither as allowed nor as rejected, and /top does not list its client; the rule that
// refused is counted as rejected. Recorded directly and through a connection's tally.
func TestUnaskedRuleNotCounted(t *testing.T) {
	set, err := rules.Parse("t.yaml", []byte(`
rules:
  - { name: first, key: ip, limit: { requests: 1, per: 1m } }
  - { name: later, key: ip, limit: { requests: 1000, per: 1m } }
`))
	if err != nil {
		t.Fatal(err)
	}
	d := &limiter.Decision{Deciding: 0, Allowed: false, Results: []limiter.Result{
		{Name: "first", Rule: set.Rules[0], RetryAfter: time.Minute, Key: []byte("first:{ip=1.1.1.1}")},
		{Name: "later", Rule: set.Rules[1], Allowed: true, Unasked: true, Limit: 1000, Window: time.Minute, Key: []byte("later:{ip=1.1.1.1}")},
	}}
	for _, tallied := range []bool{false, true} {
		m := NewMetrics("test", 10)
		m.SetRules(set, time.Now())
		var tally batchTally
		for range 3 {
			if tallied {
				m.record(d, &tally)
			} else {
				m.Record(d)
			}
		}
		m.flushTally(&tally)
		var buf bytes.Buffer
		m.WritePrometheus(&buf)
		for _, want := range []string{
			`rlsidecar_checks_total{rule="first",result="rejected"} 3`,
			`rlsidecar_checks_total{rule="later",result="allowed"} 0`,
			`rlsidecar_checks_total{rule="later",result="rejected"} 0`,
		} {
			if !strings.Contains(buf.String(), want+"\n") {
				t.Errorf("tallied %v: want %s in:\n%s", tallied, want, buf.String())
			}
		}
		if top := m.Top(); len(top["later"]) != 0 || len(top["first"]) != 1 {
			t.Errorf("tallied %v: /top %+v, want first's client only", tallied, top)
		}
	}
}

// rlsidecar_top_rejected says how often a client was at least refused, not the count
// the sketch's newcomer inherited: after a flood of clients refused once each, a
// client refused once was exported as 10,000. Such one-off newcomers are left out, so a
// flood adds no series per scrape; a client refused again and again is kept, with what
// it is guaranteed to have.
func TestTopRejectedGuaranteedCounts(t *testing.T) {
	m := NewMetrics("test", 3)
	m.SetTopLabels(TopRaw, nil)
	m.SetRules(rules.Default(), time.Now())
	refuse := func(client string, n int) {
		d := &limiter.Decision{Deciding: 0, Results: []limiter.Result{{Name: "acme", Key: []byte("~inline/token_bucket/1/1000/1:{" + client + "}")}}}
		for i := 0; i < n; i++ {
			m.Record(d)
		}
	}
	refuse("user=heavy", 600) // above total/k: always kept
	for i := 0; i < 1000; i++ {
		refuse(fmt.Sprintf("user=once%d", i), 1)
	}
	refuse("user=late", 1) // takes the smallest's place, inheriting its count
	var buf bytes.Buffer
	m.WritePrometheus(&buf)
	var series []string
	for _, line := range strings.Split(buf.String(), "\n") {
		if strings.HasPrefix(line, "rlsidecar_top_rejected{") {
			series = append(series, line)
		}
	}
	want := []string{`rlsidecar_top_rejected{rule="~inline",client="user=heavy"} 600`}
	if !slices.Equal(series, want) {
		t.Fatalf("series %q, want %q", series, want)
	}
	if top := m.Top()["~inline"]; len(top) != 3 || top[0].Client != "user=heavy" {
		t.Fatalf("/top keeps the sketch whole: %+v", top)
	}
}

// Error answers are counted by code: a client sending malformed frames shows in the
// metrics (it was seen nowhere, in no metric nor log).
func TestErrorAnswersCounted(t *testing.T) {
	m := NewMetrics("test", 10)
	// Every code a request may earn is there at 0 before the first (a query on it gets
	// 0, not "no data": found by an audit).
	var fresh bytes.Buffer
	m.WritePrometheus(&fresh)
	for _, code := range []string{"bad_request", "unknown_op", "invalid_limit", "frame_too_large", "attr_too_large", "internal"} {
		if want := `rlsidecar_error_answers_total{code="` + code + `"} 0`; !strings.Contains(fresh.String(), want+"\n") {
			t.Errorf("want %s before any error, in:\n%s", want, fresh.String())
		}
	}
	s := startServer(t, Config{Metrics: m})
	m.SetRules(s.lim.Rules(), time.Now())
	t.Cleanup(func() { s.Shutdown(context.Background()) })
	c, br := dialServer(t, s)
	notAMap := []byte{0, 0, 0, 1, 0x01}                                           // a frame whose body is the integer 1
	unknown := []byte{0, 0, 0, 9, 0x81, 0xa2, 'o', 'p', 0xa4, 'f', 'r', 'o', 'b'} // {op: "frob"}
	for _, f := range [][]byte{notAMap, notAMap, unknown} {
		if _, err := c.Write(f); err != nil {
			t.Fatal(err)
		}
		readResponse(t, br)
	}
	var buf bytes.Buffer
	m.WritePrometheus(&buf)
	for _, want := range []string{`rlsidecar_error_answers_total{code="bad_request"} 2`, `rlsidecar_error_answers_total{code="unknown_op"} 1`} {
		if !strings.Contains(buf.String(), want+"\n") {
			t.Errorf("want %s in:\n%s", want, buf.String())
		}
	}
}

// A daemon with Redis has rlsidecar_store_requests_total at 0 for every op and result
// before its first call (WithRedis), so that rate() and increase() count the first
// failures of an outage; a daemon without Redis has none of them. The real daemon and
// redis-server: cmd/rlsidecar TestStoreRequestSeriesExistBeforeTheFirstCall.
func TestStoreRequestSeriesAtZero(t *testing.T) {
	local := NewMetrics("test", 10)
	var buf bytes.Buffer
	local.WritePrometheus(&buf)
	if strings.Contains(buf.String(), "rlsidecar_store_requests_total") {
		t.Errorf("without Redis, rlsidecar_store_requests_total exported:\n%s", buf.String())
	}
	m := NewMetrics("test", 10)
	m.WithRedis()
	buf.Reset()
	m.WritePrometheus(&buf)
	for _, op := range []string{"global_check", "hybrid_sync", "hybrid_fetch", "heartbeat", "ping", "lease_acquire", "lease_release"} {
		for _, result := range []string{"success", "error"} {
			if want := `rlsidecar_store_requests_total{op="` + op + `",result="` + result + `"} 0`; !strings.Contains(buf.String(), want+"\n") {
				t.Errorf("want %s before any call, in:\n%s", want, buf.String())
			}
		}
	}
	m.ObserveStore("global_check", time.Millisecond, fmt.Errorf("refused"))
	buf.Reset()
	m.WritePrometheus(&buf)
	if want := `rlsidecar_store_requests_total{op="global_check",result="error"} 1`; !strings.Contains(buf.String(), want+"\n") {
		t.Errorf("want %s after one failed call, in:\n%s", want, buf.String())
	}
}

// A reload that removes a rule (by name) removes its series, of every per-rule family
// (rlsidecar_checks_total, _degraded_decisions_total, _warnings_total, _delayed_total,
// _bans_total, _top_rejected, _inflight, _leases_total), while a rule that stays keeps
// its counts. A check decided under the old rules that counts for the removed rule after
// the reload (directly, through a connection's tally, or a shared ban) does not bring
// its series back; a lease still held under it keeps its rlsidecar_inflight and
// rlsidecar_leases_total until freed. Before, the series of every rule ever in force
// stayed: 40 reloads renaming three rules left 124 rule labels.
func TestRemovedRuleSeriesGo(t *testing.T) {
	parse := func(src string) *rules.Set {
		set, err := rules.Parse("t.yaml", []byte("rules:\n"+src))
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	set1 := parse(`  - { name: kept, key: ip, limit: { requests: 1000, per: 1m } }
  - { name: gone, key: ip, limit: { requests: 1, per: 1m } }
  - { name: gone-c, key: user, concurrency: { max: 5 } }
`)
	set2 := parse(`  - { name: kept, key: ip, limit: { requests: 1000, per: 1m } }
  - { name: new, key: user, limit: { requests: 10, per: 1m } }
`)
	ruleOf := func(set *rules.Set, name string) *rules.Rule {
		for _, r := range set.Rules {
			if r.Name == name {
				return r
			}
		}
		t.Fatalf("no rule %s", name)
		return nil
	}
	lim := limiter.New(set1, localbucket.NewStore(localbucket.Options{}))
	m := NewMetrics("test", 10)
	m.SetTopLabels(TopRaw, nil)
	m.SetLeases(lim.Leases())
	m.SetRules(set1, time.Now())
	scrape := func() string {
		var buf bytes.Buffer
		m.WritePrometheus(&buf)
		return buf.String()
	}
	// Under set1: kept allowed twice; gone refused twice (a top client), one lease of
	// gone-c held, one tallied allowed check of gone not yet flushed.
	now := time.Now().UnixNano()
	var hold limiter.Decision
	if err := lim.Check(now, &limiter.Input{Attrs: []rules.Attr{{Name: "user", Value: "u1"}}, Cost: 1}, &hold); err != nil || !hold.Allowed {
		t.Fatalf("lease: %v %+v", err, hold)
	}
	token := lim.LeaseToken(&hold)
	if token == "" {
		t.Fatal("no lease")
	}
	keptOK := &limiter.Decision{Deciding: 0, Allowed: true, Results: []limiter.Result{{Name: "kept", Rule: ruleOf(set1, "kept"), Allowed: true}}}
	goneNo := &limiter.Decision{Deciding: 0, Results: []limiter.Result{{Name: "gone", Rule: ruleOf(set1, "gone"), Key: []byte("gone:{ip=1.1.1.1}"), Warning: true, Delay: time.Second, BanStarted: true, Degraded: true}}}
	goneOK := &limiter.Decision{Deciding: 0, Allowed: true, Results: []limiter.Result{{Name: "gone", Rule: ruleOf(set1, "gone"), Allowed: true}}}
	m.Record(keptOK)
	m.Record(keptOK)
	m.Record(goneNo)
	m.Record(goneNo)
	var tally batchTally
	m.record(goneOK, &tally)
	for _, want := range []string{
		`rlsidecar_checks_total{rule="gone",result="rejected"} 2`,
		`rlsidecar_top_rejected{rule="gone",client="ip=1.1.1.1"} 2`,
		`rlsidecar_inflight{rule="gone-c"} 1`,
	} {
		if out := scrape(); !strings.Contains(out, want+"\n") {
			t.Fatalf("before the reload, want %s in:\n%s", want, out)
		}
	}

	m.SetRules(set2, time.Now())
	lim.SetRules(set2)
	// In flight across the reload: decided under set1, counted after.
	m.Record(goneNo)
	m.record(goneOK, &tally)
	m.flushTally(&tally)
	m.BanStarted("gone")
	m.Record(keptOK) // under the old rule pointer: still kept's
	out := scrape()
	for _, want := range []string{
		`rlsidecar_checks_total{rule="kept",result="allowed"} 3`,
		`rlsidecar_checks_total{rule="new",result="allowed"} 0`,
		`rlsidecar_inflight{rule="gone-c"} 1`, // its lease is still held
		`rlsidecar_leases_total{rule="gone-c",result="released"} 0`,
	} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("after the reload, want %s in:\n%s", want, out)
		}
	}
	if strings.Contains(out, `rule="gone"`) {
		t.Errorf("series of the removed rule gone:\n%s", out)
	}
	if _, ok := m.Top()["gone"]; ok {
		t.Errorf("/top lists the removed rule gone")
	}

	if !lim.ReleaseLease(token, time.Now().UnixNano()) {
		t.Fatal("release failed")
	}
	// The scrape after the last lease is freed shows that free (it showed nothing, so a
	// lease that expired or closed under a removed rule was never counted anywhere); the
	// one after it, nothing.
	out = scrape()
	for _, want := range []string{`rlsidecar_inflight{rule="gone-c"} 0`, `rlsidecar_leases_total{rule="gone-c",result="released"} 1`} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("the scrape after the last lease was freed: want %s in:\n%s", want, out)
		}
	}
	if out := scrape(); strings.Contains(out, `rule="gone`) {
		t.Errorf("series of removed rules a scrape after their last lease was freed:\n%s", out)
	}

	// Put back, gone starts afresh, at 0.
	set3 := parse(`  - { name: kept, key: ip, limit: { requests: 1000, per: 1m } }
  - { name: gone, key: ip, limit: { requests: 1, per: 1m } }
`)
	m.SetRules(set3, time.Now())
	out = scrape()
	for _, want := range []string{
		`rlsidecar_checks_total{rule="kept",result="allowed"} 3`,
		`rlsidecar_checks_total{rule="gone",result="rejected"} 0`,
		`rlsidecar_bans_total{rule="gone"} 0`,
	} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("gone put back: want %s in:\n%s", want, out)
		}
	}
	if strings.Contains(out, `rule="new"`) {
		t.Errorf("series of the removed rule new:\n%s", out)
	}
}

// Reloads racing with checks: rule a, in every set, loses no count (its counter is one
// across reloads, monotonic), while x and y, each in every other set, come and go; once
// the checks have stopped and a last reload removed both, neither has a series. Run
// with -race.
func TestReloadWhileRecording(t *testing.T) {
	parse := func(other string) *rules.Set {
		set, err := rules.Parse("t.yaml", []byte("rules:\n  - { name: a, key: ip, limit: { requests: 9, per: 1m } }\n"+other))
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	sets := []*rules.Set{
		parse("  - { name: x, key: ip, limit: { requests: 9, per: 1m } }\n"),
		parse("  - { name: y, key: user, limit: { requests: 9, per: 1m } }\n"),
	}
	m := NewMetrics("test", 10)
	m.SetRules(sets[0], time.Now())
	var current atomic.Pointer[rules.Set]
	current.Store(sets[0])
	const workers, checks = 4, 5000
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var tally batchTally
			for i := range checks {
				set := current.Load()
				d := &limiter.Decision{Deciding: 0, Allowed: true, Results: []limiter.Result{
					{Name: "a", Rule: set.Rules[0], Allowed: true},
					{Name: set.Rules[1].Name, Rule: set.Rules[1], Allowed: w%2 == 0, Key: []byte("k:{ip=1}")}}}
				m.record(d, &tally)
				if i%7 == 0 {
					m.flushTally(&tally)
				}
				if i%50 == 0 {
					m.BanStarted(set.Rules[1].Name)
				}
			}
			m.flushTally(&tally)
		}()
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			time.Sleep(50 * time.Microsecond)
			set := sets[i%2]
			m.SetRules(set, time.Now())
			current.Store(set)
			if i > 200 {
				return
			}
		}
	}()
	wg.Wait()
	<-done
	m.SetRules(parse(""), time.Now())
	var buf bytes.Buffer
	m.WritePrometheus(&buf)
	out := buf.String()
	if want := fmt.Sprintf(`rlsidecar_checks_total{rule="a",result="allowed"} %d`, workers*checks); !strings.Contains(out, want+"\n") {
		t.Errorf("want %s in:\n%s", want, out)
	}
	if strings.Contains(out, `rule="x"`) || strings.Contains(out, `rule="y"`) {
		t.Errorf("series of removed rules:\n%s", out)
	}
}

// manyRules is a rule set of n rules named prefix0, prefix1, ...
func manyRules(t testing.TB, prefix string, n int) *rules.Set {
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range n {
		fmt.Fprintf(&b, "  - { name: %s%d, key: ip, limit: { requests: 1000, per: 1m } }\n", prefix, i)
	}
	set, err := rules.Parse("many.yaml", []byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// A reload that takes rules away drops their series and keeps the others' counts; each
// family is written once (one TYPE line), its series together. Before, each removed
// series was unregistered from the metrics set on its own, a linear search and copy of
// the set's list under its lock: 50,000 rules replaced by 2 took minutes, and scrapes
// waited (BenchmarkSetRulesRemoveMany).
func TestSetRulesRemovesSeries(t *testing.T) {
	m := NewMetrics("test", 10)
	big := manyRules(t, "r", 300)
	m.SetRules(big, time.Now())
	var tally batchTally
	d := &limiter.Decision{Deciding: 0, Allowed: true, Results: []limiter.Result{{Name: "r7", Rule: big.Rules[7], Allowed: true}}}
	m.record(d, &tally)
	m.flushTally(&tally)
	small := manyRules(t, "r", 10) // r0 ... r9: r7 kept
	m.SetRules(small, time.Now())
	var buf bytes.Buffer
	m.WritePrometheus(&buf)
	out := buf.String()
	if !strings.Contains(out, `rlsidecar_checks_total{rule="r7",result="allowed"} 1`+"\n") {
		t.Errorf("the kept rule's count is gone:\n%s", out)
	}
	if strings.Contains(out, `rule="r10"`) || strings.Contains(out, `rule="r299"`) {
		t.Errorf("a removed rule's series is still written")
	}
	for _, family := range ruleFamilies {
		if n := strings.Count(out, "# TYPE "+family+" "); n != 1 {
			t.Errorf("%d TYPE lines of %s, want 1", n, family)
		}
	}
	if n := strings.Count(out, "rlsidecar_checks_total{"); n != 3*11 { // 10 rules and ~inline, 3 results each
		t.Errorf("%d rlsidecar_checks_total series, want 33", n)
	}
}

// BenchmarkSetRulesRemoveMany: a reload from 20,000 rules to 2, the rules' series taken
// away (SetRules), per op: with the set's one-by-one unregistering, about 15 s.
func BenchmarkSetRulesRemoveMany(b *testing.B) {
	big, small := manyRules(b, "r", 20000), manyRules(b, "r", 2)
	for b.Loop() {
		b.StopTimer()
		m := NewMetrics("test", 10)
		m.SetRules(big, time.Now())
		b.StartTimer()
		m.SetRules(small, time.Now())
	}
}

// A decision recorded before any rule set is in force (NewMetrics without SetRules)
// counts what it can, and does not panic: before, the rules' table was nil.
func TestMetricsRecordBeforeSetRules(t *testing.T) {
	m := NewMetrics("test", 0)
	r := &rules.Rule{Name: "x"}
	m.Record(&limiter.Decision{Allowed: true, Deciding: 0, Results: []limiter.Result{
		{Name: "x", Rule: r, Limit: 1, Allowed: true},
		{Name: "inline", Limit: 1, Allowed: true},
	}})
	var b bytes.Buffer
	m.WritePrometheus(&b)
	if !strings.Contains(b.String(), `rule="~inline"`) {
		t.Fatalf("the inline limit's decision is not counted:\n%s", b.String())
	}
}
