package daemon

import (
	"bufio"
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/VictoriaMetrics/metrics"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// Metrics is one daemon's metrics: its own metrics.Set (so several daemons can run in
// one process), per-rule counters looked up by rule pointer (no string work per check),
// a latency histogram of atomic buckets, and a top-K sketch of rejected clients per rule.
// Labels are rule names and results, never client keys, except the K clients /top names.
type Metrics struct {
	set   *metrics.Set
	topK  int
	start time.Time
	// topLabels and topSalt say how rlsidecar_top_rejected names a client; set before
	// the first scrape (SetTopLabels).
	topLabels TopLabels
	topSalt   []byte

	checkDur latencyHist
	storeDur latencyHist
	syncDur  latencyHist // periodic hybrid syncs; written once one was observed
	synced   atomic.Bool
	redis    atomic.Bool // WithRedis

	byRule atomic.Pointer[[]*ruleMetrics] // by rules.Rule.Index of the active set
	mu     sync.Mutex                     // guards what follows
	byName map[string]*ruleMetrics
	config struct {
		version, source string
		loaded          time.Time
		set             *rules.Set
	}
	funcs  []funcMetric
	leases *limiter.Leases // the concurrency leases reported, nil: none (SetLeases)

	bannedKeys          func() map[string]int // the gauge rlsidecar_banned_keys (SetBannedKeys)
	inline              *ruleMetrics
	reloadOK, reloadErr *metrics.Counter
	// lastReloadFailed and lastReloadOK: whether the last reload attempt failed, and when
	// one last succeeded (Unix seconds; the start, until a reload does).
	lastReloadFailed  atomic.Bool
	lastReloadOK      atomic.Int64
	flushOK, flushErr *metrics.Counter
	closed            [nCloseReasons]*metrics.Counter // by closeReason; [0] unused
	storeByOpResult   sync.Map                        // "op|result" → *metrics.Counter
	errorsByCode      sync.Map                        // error code → *metrics.Counter (rlsidecar_error_answers_total)
	envoyErrsByCode   sync.Map                        // gRPC code → *metrics.Counter (rlsidecar_envoy_error_answers_total)
}

type ruleMetrics struct {
	rule                                      *rules.Rule // of the active set
	name                                      string
	series                                    []ruleSeries // the counters below, as writeRules writes them
	allowed, rejected, shadowRejected, degrad *metrics.Counter
	warnings, delayed, bans                   *metrics.Counter
	top                                       *topK
}

// ruleSeries is one of a rule's counters and its series name (family and labels).
type ruleSeries struct {
	family, labels string
	c              *metrics.Counter
}

type funcMetric struct {
	name, typ, help string
	f               func() float64
}

// NewMetrics returns the metrics of a daemon of the given version, keeping the topK
// most rejected clients per rule.
func NewMetrics(version string, topK int) *Metrics {
	metrics.ExposeMetadata(true) // TYPE and HELP lines, as Prometheus expects
	if topK <= 0 {
		topK = 10
	}
	m := &Metrics{set: metrics.NewSet(), topK: topK, byName: map[string]*ruleMetrics{}, start: time.Now()}
	m.inline = m.ruleLocked("~inline")
	// No rules yet: a decision before SetRules counts its inline limits only (its rules'
	// series come with SetRules). Nil, the first Record dereferenced it.
	m.byRule.Store(&[]*ruleMetrics{})
	m.reloadOK = m.set.NewCounter(`rlsidecar_config_reloads_total{result="success"}`)
	m.reloadErr = m.set.NewCounter(`rlsidecar_config_reloads_total{result="error"}`)
	m.lastReloadOK.Store(m.start.Unix())
	m.set.NewGauge(`rlsidecar_config_last_reload_successful`, func() float64 {
		if m.lastReloadFailed.Load() {
			return 0
		}
		return 1
	})
	m.set.NewGauge(`rlsidecar_config_last_reload_success_timestamp_seconds`, func() float64 { return float64(m.lastReloadOK.Load()) })
	for r := closeReason(1); r < nCloseReasons; r++ {
		m.closed[r] = m.set.NewCounter(fmt.Sprintf(`rlsidecar_connections_closed_total{reason=%q}`, r))
	}
	// The error codes a client's request may earn, at 0 from the start: a query on them
	// gets 0, not "no data", until the first.
	for _, code := range []string{proto.CodeBadRequest, proto.CodeUnknownOp, proto.CodeInvalidLimit, proto.CodeFrameTooLarge, proto.CodeAttrTooLarge, proto.CodeInternal} {
		m.errorCounter(code)
	}
	m.set.NewGauge(fmt.Sprintf(`rlsidecar_build_info{version=%q}`, version), func() float64 { return 1 })
	m.set.RegisterMetricsWriter(m.writeCustom)
	return m
}

func (m *Metrics) ruleLocked(name string) *ruleMetrics {
	if rm := m.byName[name]; rm != nil {
		return rm
	}
	q := fmt.Sprintf("%q", name)
	rm := &ruleMetrics{name: name, top: newTopK(m.topK)}
	// Not registered in m.set: writeRules writes them from byName, so that a reload
	// removing rules drops their series by deleting them from the map. Unregistered one
	// by one, each a linear search of the set's list and a copy of it, taking 50,000
	// rules away took minutes, the set's lock held, and every scrape waited.
	counter := func(family, labels string) *metrics.Counter {
		c := new(metrics.Counter)
		rm.series = append(rm.series, ruleSeries{family: family, labels: labels, c: c})
		return c
	}
	rm.allowed = counter("rlsidecar_checks_total", `{rule=`+q+`,result="allowed"}`)
	rm.rejected = counter("rlsidecar_checks_total", `{rule=`+q+`,result="rejected"}`)
	rm.shadowRejected = counter("rlsidecar_checks_total", `{rule=`+q+`,result="shadow_rejected"}`)
	rm.degrad = counter("rlsidecar_degraded_decisions_total", `{rule=`+q+`}`)
	rm.warnings = counter("rlsidecar_warnings_total", `{rule=`+q+`}`)
	rm.delayed = counter("rlsidecar_delayed_total", `{rule=`+q+`}`)
	rm.bans = counter("rlsidecar_bans_total", `{rule=`+q+`}`)
	m.byName[name] = rm
	return rm
}

// SetRules makes the metrics follow a newly active rule set. Counters of rules that
// keep their name keep counting; the series of the rules it no longer has (by name) are
// unregistered, with their top-K, and their lease statistics once no lease of theirs is
// held (pruneLeases). A check decided under the old set that counts for a removed rule
// after this is dropped: its counter is no longer exported (record, flushTally,
// BanStarted), so a removed rule's series never comes back unless a rule of its name is
// in force again, and then it starts at 0.
func (m *Metrics) SetRules(set *rules.Set, loaded time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	inForce := make(map[string]bool, len(set.Rules))
	table := make([]*ruleMetrics, len(set.Rules))
	for i, r := range set.Rules {
		inForce[r.Name] = true
		rm := *m.ruleLocked(r.Name) // the same counters, tagged with this set's rule
		rm.rule = r
		table[i] = &rm
	}
	for name, rm := range m.byName {
		if rm == m.inline || inForce[name] {
			continue
		}
		delete(m.byName, name) // its series with it (writeRules)
	}
	m.byRule.Store(&table)
	m.config.version, m.config.source, m.config.loaded, m.config.set = set.Version, set.Source, loaded, set
	if m.leases != nil {
		pruneLeases(m.leases, set)
	}
}

// Reloaded counts a reload attempt, and records whether it failed: while the file in
// place is broken, rlsidecar_config_last_reload_successful is 0, and the next reload
// that succeeds (the file fixed, or put back) sets it to 1.
func (m *Metrics) Reloaded(err error) {
	m.lastReloadFailed.Store(err != nil)
	if err != nil {
		m.reloadErr.Inc()
	} else {
		m.reloadOK.Inc()
		m.lastReloadOK.Store(time.Now().Unix())
	}
}

// WithRedis adds the series of a daemon with Redis (its syncs, its calls' durations):
// a local-mode daemon does not export them, as zeros that read like a Redis never
// called. Call it before the daemon serves.
//
// Its calls' counters, rlsidecar_store_requests_total, are there at 0 for every op and
// result from the start: a series born at its first error showed no increase, so rate()
// and increase() missed the errors of an outage the breaker cut short (a global
// check's breaker opens on its third failure: a Redis stopped for seconds added a
// global_check error series born at 8 and staying there, which the dashboard's panel of
// Redis calls showed as no error at all).
func (m *Metrics) WithRedis() {
	m.flushOK = m.set.NewCounter(`rlsidecar_sync_flushes_total{result="success"}`)
	m.flushErr = m.set.NewCounter(`rlsidecar_sync_flushes_total{result="error"}`)
	for _, op := range storeOps {
		m.storeCounter(op, "success")
		m.storeCounter(op, "error")
	}
	m.redis.Store(true)
}

// storeOps are the ops of rlsidecar_store_requests_total (ObserveStore).
var storeOps = []string{"global_check", "hybrid_sync", "hybrid_fetch", "heartbeat", "ping", "lease_acquire", "lease_release"}

// storeCounter returns the counter of calls to Redis of op with result, created at 0 if
// needed.
func (m *Metrics) storeCounter(op, result string) *metrics.Counter {
	key := op + "|" + result
	c, ok := m.storeByOpResult.Load(key)
	if !ok {
		c, _ = m.storeByOpResult.LoadOrStore(key, m.set.GetOrCreateCounter(
			fmt.Sprintf(`rlsidecar_store_requests_total{op=%q,result=%q}`, op, result)))
	}
	return c.(*metrics.Counter)
}

// Flushed counts a hybrid sync cycle.
func (m *Metrics) Flushed(err error) {
	if m.flushOK == nil { // no Redis (WithRedis)
		return
	}
	if err != nil {
		m.flushErr.Inc()
	} else {
		m.flushOK.Inc()
	}
}

// ObserveStore records one call to Redis: op is global_check, hybrid_sync, hybrid_fetch
// (an exact sync a request waits for), heartbeat, ping, lease_acquire or lease_release
// (storeOps).
func (m *Metrics) ObserveStore(op string, d time.Duration, err error) {
	result := "success"
	if err != nil {
		result = "error"
	}
	m.storeCounter(op, result).Inc()
	m.storeDur.observe(d)
	if op == "hybrid_sync" {
		m.Flushed(err)
	}
}

// HybridSynced records one periodic hybrid sync (rlsidecar_hybrid_sync_duration_seconds):
// how long it took; keys is how many keys it carried.
func (m *Metrics) HybridSynced(d time.Duration, keys int) {
	m.syncDur.observe(d)
	m.synced.Store(true)
}

// GaugeFunc and CounterFunc expose a value read at scrape time.
// SetBannedKeys makes the gauge rlsidecar_banned_keys{rule} report f's counts of the
// keys banned now per rule, read at each scrape.
func (m *Metrics) SetBannedKeys(f func() map[string]int) {
	m.mu.Lock()
	m.bannedKeys = f
	m.mu.Unlock()
}

// ClientName is how the metrics, /top and /bans name a client (the part of a key inside
// its hash tag): a keyed hash unless --top-labels raw.
func (m *Metrics) ClientName(client string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.topLabels == TopRaw {
		return client
	}
	return ClientLabel(m.topSalt, client)
}

func (m *Metrics) GaugeFunc(name, help string, f func() float64) {
	m.mu.Lock()
	m.funcs = append(m.funcs, funcMetric{name, "gauge", help, f})
	m.mu.Unlock()
}

func (m *Metrics) CounterFunc(name, help string, f func() float64) {
	m.mu.Lock()
	m.funcs = append(m.funcs, funcMetric{name, "counter", help, f})
	m.mu.Unlock()
}

// BanStarted counts a ban of rule's that no answer reported starting: a shared ban
// raised by this daemon's batch of hybrid refusals (limiter.OnSharedBanStarted).
// A rule no longer in force is not counted (see SetRules).
func (m *Metrics) BanStarted(rule string) {
	m.mu.Lock()
	rm := m.byName[rule]
	m.mu.Unlock()
	if rm != nil {
		rm.bans.Inc()
	}
}

// Record counts one decision: per rule, allowed, rejected or shadow_rejected (a rule
// whose store was not asked, limiter.Result.Unasked, is none of them: not counted; nor
// is an inline limit repeated in one request counted again, limiter.Result.Repeat),
// degraded decisions, and the rejected client in the rule's top-K. (Latency is observed
// per batch of frames, see Answered.)
func (m *Metrics) Record(d *limiter.Decision) { m.record(d, nil) }

// record is Record. With t, a connection's tally, the allowed checks of the active rules
// are counted there, and reach the shared counters at the connection's next flush
// (flushTally).
func (m *Metrics) record(d *limiter.Decision, t *batchTally) {
	tp := m.byRule.Load()
	table := *tp
	if t != nil && t.table != tp {
		// The counts so far are by the indexes of the table they were taken under.
		m.flushTally(t)
		t.table = tp
		if cap(t.n) < len(table) {
			t.n = make([]uint64, len(table))
		}
		t.n = t.n[:len(table)]
	}
	for i := range d.Results {
		r := &d.Results[i]
		rm, x := m.inline, -1 // x: rm's index in table
		if r.Rule != nil {
			if i := r.Rule.Index; i < len(table) && table[i].rule == r.Rule {
				rm, x = table[i], i
			} else {
				m.mu.Lock() // a check that started on the previous rule set
				rm = m.byName[r.Name]
				m.mu.Unlock()
				if rm == nil {
					continue // its rule is no longer in force: its series are gone (SetRules)
				}
			}
		}
		if r.Repeat {
			continue // a copy of an earlier inline limit's result, counted there
		}
		switch {
		case r.Unasked:
			// Its store was not asked (the request was refused first): it decided
			// nothing, so rlsidecar_checks_total does not count it, neither as allowed
			// nor as rejected, nor /top.
		case r.Allowed && t != nil && x >= 0:
			if t.n[x] == 0 {
				t.touched = append(t.touched, x)
			}
			t.n[x]++
		case r.Allowed:
			rm.allowed.Inc()
		case r.Shadow:
			rm.shadowRejected.Inc()
			rm.top.add(clientOf(r.Key))
		default:
			rm.rejected.Inc()
			rm.top.add(clientOf(r.Key))
		}
		if r.Degraded {
			rm.degrad.Inc()
		}
		if r.Warning {
			rm.warnings.Inc()
		}
		if r.Delay > 0 {
			rm.delayed.Inc()
		}
		if r.BanStarted {
			rm.bans.Inc()
		}
	}
}

// batchTally is one connection's count of allowed checks per rule, not yet in the shared
// counters: a check adds to it (record), and the connection adds it to the counters once
// per batch of answers, before writing them (flushTally). An atomic add per rule and
// check, on counters that every core adds to, costs a cache-line transfer whenever
// another core added last (BenchmarkRecordTally); once per batch, it is one for many
// checks. A batchTally is its connection goroutine's; the zero value is ready.
type batchTally struct {
	table   *[]*ruleMetrics // the rule table n is indexed by
	n       []uint64        // allowed checks by rule index
	touched []int           // the indexes of n that are not 0
}

// flushTally adds t's counts to the counters and zeroes them.
func (m *Metrics) flushTally(t *batchTally) {
	if len(t.touched) == 0 {
		return
	}
	table := *t.table
	for _, i := range t.touched {
		table[i].allowed.Add(int(t.n[i]))
		t.n[i] = 0
	}
	t.touched = t.touched[:0]
}

// Answered observes n requests that arrived at arrived (frames read together share it)
// and were answered at now, both read from the daemon's monotonic clock: one clock
// reading per batch, not per request.
func (m *Metrics) Answered(n int, arrived, now int64) {
	if n > 0 {
		m.checkDur.observeN(time.Duration(now-arrived), uint64(n))
	}
}

// TopLabels is how the rlsidecar_top_rejected metric names a client. The zero value is
// TopHashed.
type TopLabels uint8

const (
	// TopHashed labels a client with a short keyed hash of its key (see [ClientLabel]):
	// stable, not reversible without the salt, and matched to the key on /top.
	TopHashed TopLabels = iota
	// TopRaw labels a client with its key as sent: API keys and IP addresses end up in
	// the metrics store.
	TopRaw
	// TopOff exports no rlsidecar_top_rejected series; /top still answers.
	TopOff
)

// ParseTopLabels parses "hashed", "raw" or "off".
func ParseTopLabels(s string) (TopLabels, error) {
	switch s {
	case "hashed":
		return TopHashed, nil
	case "raw":
		return TopRaw, nil
	case "off":
		return TopOff, nil
	}
	return 0, fmt.Errorf("%q: use hashed, raw or off", s)
}

// SetTopLabels chooses how rlsidecar_top_rejected names clients. salt keys the hash of
// TopHashed; nil picks a random one (stable for the life of the process). Call it before
// the metrics are scraped.
func (m *Metrics) SetTopLabels(mode TopLabels, salt []byte) {
	if mode == TopHashed && len(salt) == 0 {
		salt = make([]byte, 32)
		_, _ = rand.Read(salt) // crypto/rand.Read never fails (Go 1.24+)
	}
	m.mu.Lock()
	m.topLabels, m.topSalt = mode, salt
	m.mu.Unlock()
}

// ClientLabel is the label TopHashed gives a client key: "h:" and the first 12 hex
// digits (48 bits) of HMAC-SHA256(salt, key). Keyed, because client keys have little
// entropy (all IPv4 addresses are 2^32 guesses): with a known salt, or none, anyone
// could hash every candidate and read the key back. 48 bits keep the K names of a rule
// distinct (a collision among 10 is about 10^-13 likely) and the label short.
func ClientLabel(salt []byte, client string) string {
	h := hmac.New(sha256.New, salt)
	h.Write([]byte(client))
	return "h:" + hex.EncodeToString(h.Sum(nil)[:6])
}

// clientOf is the client part of a key: what is inside its hash tag.
func clientOf(key []byte) []byte {
	for i, c := range key {
		if c == '{' {
			rest := key[i+1:]
			for j, c := range rest {
				if c == '}' {
					return rest[:j]
				}
			}
			return rest
		}
	}
	return key
}

// Top returns, per rule, the clients most often rejected, with their raw keys (and, with
// TopHashed, the label the metric gives each): the loopback /top endpoint shows them.
func (m *Metrics) Top() map[string][]topItem {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string][]topItem{}
	for name, rm := range m.byName {
		if l := rm.top.list(); len(l) > 0 {
			if m.topLabels == TopHashed {
				for i := range l {
					l[i].Label = ClientLabel(m.topSalt, l[i].Client)
				}
			}
			out[name] = l
		}
	}
	return out
}

// WritePrometheus writes every metric in the Prometheus text format, each family with
// its TYPE and HELP lines.
func (m *Metrics) WritePrometheus(w io.Writer) {
	var b bytes.Buffer
	m.set.WritePrometheus(&b)
	w.Write(withHelp(b.Bytes()))
}

// setHelp is the HELP text of the families the metrics Set writes, which it writes as a
// bare "# HELP name" (promtool check metrics: "no help text").
var setHelp = map[string]string{
	"rlsidecar_checks_total":                                 "Checks decided, by rule and result: allowed, rejected, or shadow_rejected (a shadow rule's refusal, not enforced). Inline limits count under rule ~inline.",
	"rlsidecar_degraded_decisions_total":                     "Checks a rule's on_store_failure policy decided because the store it needs did not answer, by rule.",
	"rlsidecar_warnings_total":                               "Allowed checks after which a rule had used at least its warn_at fraction, by rule.",
	"rlsidecar_delayed_total":                                "Checks allowed after a wait (delay_ms, a rule with delay), by rule.",
	"rlsidecar_bans_total":                                   "Bans this daemon started, by rule (its penalty).",
	"rlsidecar_config_reloads_total":                         "Rule reloads, by result: success, or error (the rules in force were kept).",
	"rlsidecar_config_last_reload_successful":                "1 when the last reload of the rules succeeded (or none was tried), 0 while the file in place failed to load and older rules are in force.",
	"rlsidecar_config_last_reload_success_timestamp_seconds": "When the rules were last loaded successfully (the daemon's start, until a reload succeeds), in Unix seconds.",
	"rlsidecar_sync_flushes_total":                           "Hybrid-mode syncs of admitted counts with Redis, by result.",
	"rlsidecar_connections_closed_total":                     "Connections the daemon refused or cut off, by reason; a client's own close and a shutdown are not counted.",
	"rlsidecar_build_info":                                   "The daemon's version, as a label; always 1.",
	"rlsidecar_error_answers_total":                          "Requests answered with an error, by code (bad_request, unknown_op, invalid_limit, frame_too_large, attr_too_large, internal, ...): a client sending malformed frames shows here.",
	"rlsidecar_envoy_error_answers_total":                    "Calls of Envoy's rate limit API answered with an error status, by gRPC code (InvalidArgument, DeadlineExceeded, ResourceExhausted, ...): unless Envoy's filter sets failure_mode_deny, each is a request no limit was applied to.",
	"rlsidecar_store_requests_total":                         "Calls to Redis, by op (global_check, hybrid_sync, hybrid_fetch, heartbeat, lease_acquire, lease_release, ping: a probe of an open breaker, or of a Cluster master no heartbeat reaches) and result.",
}

// withHelp fills in the bare HELP lines of text from setHelp.
func withHelp(text []byte) []byte {
	const bare = "# HELP "
	if !bytes.Contains(text, []byte(bare)) {
		return text
	}
	out := make([]byte, 0, len(text)+1024)
	for len(text) > 0 {
		line := text
		if i := bytes.IndexByte(text, '\n'); i >= 0 {
			line = text[:i+1]
		}
		text = text[len(line):]
		if name, ok := bytes.CutPrefix(bytes.TrimSuffix(line, []byte("\n")), []byte(bare)); ok && bytes.IndexByte(name, ' ') < 0 {
			if help, ok := setHelp[string(name)]; ok {
				out = append(out, bare...)
				out = append(out, name...)
				out = append(out, ' ')
				out = append(out, help...)
				out = append(out, '\n')
				continue
			}
		}
		out = append(out, line...)
	}
	return out
}

var latencyBounds = []float64{1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1}

// latencyHist is a Prometheus histogram of atomic buckets: observing is three atomic
// adds and no lock, so connections do not contend on it.
type latencyHist struct {
	buckets [19]atomic.Uint64 // one per bound, then +Inf
	count   atomic.Uint64
	sumNs   atomic.Uint64
}

func (h *latencyHist) observe(d time.Duration) { h.observeN(d, 1) }

func (h *latencyHist) observeN(d time.Duration, n uint64) {
	if d < 0 {
		d = 0
	}
	s := d.Seconds()
	i := 0
	for i < len(latencyBounds) && s > latencyBounds[i] {
		i++
	}
	h.buckets[i].Add(n)
	h.count.Add(n)
	h.sumNs.Add(uint64(d) * n)
}

func (h *latencyHist) write(w io.Writer, name, help string) {
	fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name)
	var cum uint64
	for i, b := range latencyBounds {
		cum += h.buckets[i].Load()
		fmt.Fprintf(w, "%s_bucket{le=\"%g\"} %d\n", name, b, cum)
	}
	cum += h.buckets[len(latencyBounds)].Load()
	fmt.Fprintf(w, "%s_bucket{le=\"+Inf\"} %d\n", name, cum)
	fmt.Fprintf(w, "%s_sum %g\n%s_count %d\n", name, float64(h.sumNs.Load())/1e9, name, cum)
}

// SetLeases makes the metrics report ls's concurrency leases by rule:
// rlsidecar_inflight{rule} and rlsidecar_leases_total{rule,result}. Call it before the
// first scrape.
func (m *Metrics) SetLeases(ls *limiter.Leases) {
	m.mu.Lock()
	m.leases = ls
	m.mu.Unlock()
}

// concurrencyRules returns whether name is a concurrency rule of set (nil: none).
func concurrencyRules(set *rules.Set) func(name string) bool {
	names := map[string]bool{}
	if set != nil {
		for _, r := range set.Rules {
			if r.Concurrency {
				names[r.Name] = true
			}
		}
	}
	return func(name string) bool { return names[name] }
}

// pruneLeases makes ls forget the lease statistics of the rules that are not
// concurrency rules of set, the rules in force, once none of their leases is held.
func pruneLeases(ls *limiter.Leases, set *rules.Set) { ls.PruneStats(concurrencyRules(set)) }

// writeLeases writes the lease metrics of ls, by rule name in order: for the
// concurrency rules of set (the rules in force; nil: none), at 0 for those that have
// taken no lease yet, so their series exist from the start; and for a rule no longer
// in force (a reload removed it, or made it another kind) only while leases taken under
// it are held, which a reload keeps, and once more after its last lease is freed
// (released, expired or closed), so that those last frees are seen: its series go at
// the scrape after that. (They went at the first scrape after the last free, whose
// counts no scrape then showed: an audit's leases closed, and expired, under a removed
// rule were never exported, so RlsidecarLeasesExpired could not see such a leak.)
func writeLeases(w io.Writer, ls *limiter.Leases, set *rules.Set) {
	type row struct {
		rule string
		s    limiter.LeaseStats
	}
	var rows []row
	inForce := concurrencyRules(set)
	seen := map[string]bool{}
	var drained map[string]bool // removed rules shown with no lease held: forgotten now
	ls.Stats(func(rule string, s limiter.LeaseStats) {
		if !inForce(rule) && s.InFlight <= 0 {
			if drained == nil {
				drained = map[string]bool{}
			}
			drained[rule] = true
		}
		rows = append(rows, row{rule, s})
		seen[rule] = true
	})
	if drained != nil {
		// A lease of such a rule freed since Stats keeps it for the next scrape.
		ls.PruneStats(func(rule string) bool { return !drained[rule] })
	}
	if set != nil {
		for _, r := range set.Rules {
			if r.Concurrency && !seen[r.Name] {
				rows = append(rows, row{rule: r.Name})
				seen[r.Name] = true
			}
		}
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].rule < rows[j].rule })
	fmt.Fprintf(w, "# HELP rlsidecar_leases_capped_total Checks refused because this daemon held the most live leases it keeps (limiter.DefaultMaxLeases).\n# TYPE rlsidecar_leases_capped_total counter\nrlsidecar_leases_capped_total %d\n", ls.Capped())
	fmt.Fprint(w, "# HELP rlsidecar_inflight Concurrency leases this daemon holds now, by rule.\n# TYPE rlsidecar_inflight gauge\n")
	for _, r := range rows {
		fmt.Fprintf(w, "rlsidecar_inflight{rule=%q} %d\n", r.rule, r.s.InFlight)
	}
	fmt.Fprint(w, "# HELP rlsidecar_leases_total Concurrency lease slots freed, by rule and how: released, expired (not released in time: the leak signal) or closed (the connection that took it closed).\n# TYPE rlsidecar_leases_total counter\n")
	for _, r := range rows {
		fmt.Fprintf(w, "rlsidecar_leases_total{rule=%q,result=\"released\"} %d\n", r.rule, r.s.Released)
		fmt.Fprintf(w, "rlsidecar_leases_total{rule=%q,result=\"expired\"} %d\n", r.rule, r.s.Expired)
		fmt.Fprintf(w, "rlsidecar_leases_total{rule=%q,result=\"closed\"} %d\n", r.rule, r.s.Closed)
	}
}

// ruleFamilies are the families of the rules' counters (ruleSeries), in the order
// writeRules writes them.
var ruleFamilies = []string{"rlsidecar_checks_total", "rlsidecar_degraded_decisions_total",
	"rlsidecar_warnings_total", "rlsidecar_delayed_total", "rlsidecar_bans_total"}

// writeRules writes the rules' counters, each family whole (HELP, TYPE, then its series
// by rule name), as the set writes its own.
func (m *Metrics) writeRules(w io.Writer) {
	m.mu.Lock()
	rms := make([]*ruleMetrics, 0, len(m.byName))
	for _, rm := range m.byName {
		rms = append(rms, rm)
	}
	m.mu.Unlock()
	sort.Slice(rms, func(i, j int) bool { return rms[i].name < rms[j].name })
	bw := bufio.NewWriterSize(w, 64<<10)
	var num []byte
	for _, family := range ruleFamilies {
		fmt.Fprintf(bw, "# HELP %s %s\n# TYPE %s counter\n", family, setHelp[family], family)
		for _, rm := range rms {
			for _, sr := range rm.series {
				if sr.family != family {
					continue
				}
				bw.WriteString(family)
				bw.WriteString(sr.labels)
				bw.WriteByte(' ')
				num = strconv.AppendUint(num[:0], sr.c.Get(), 10)
				bw.Write(num)
				bw.WriteByte('\n')
			}
		}
	}
	bw.Flush()
}

func (m *Metrics) writeCustom(w io.Writer) {
	m.checkDur.write(w, "rlsidecar_check_duration_seconds", "Time from a request's arrival to its answer, in the daemon.")
	if m.redis.Load() {
		m.storeDur.write(w, "rlsidecar_store_duration_seconds", "Duration of calls to Redis.")
	}
	if m.synced.Load() {
		m.syncDur.write(w, "rlsidecar_hybrid_sync_duration_seconds", "Duration of a periodic hybrid sync (all its pipelines; on a Redis Cluster, each master's sync on its own).")
	}
	m.writeRules(w)
	m.mu.Lock()
	funcs := append([]funcMetric(nil), m.funcs...)
	version := m.config.version
	bannedKeys := m.bannedKeys
	var tops []string
	names := make([]string, 0, len(m.byName))
	for name := range m.byName {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if m.topLabels == TopOff {
			break
		}
		for _, it := range m.byName[name].top.list() {
			// The count the sketch guarantees (Count overstates it by up to Err): a client
			// refused once, that took the place of another, is 1, not the count it
			// inherited (10,000 after a flood of clients refused once each). Such a client
			// (a count of 1 that displaced another) is left out: in a flood of one-off
			// refusals each scrape found new ones, 10 series a scrape, without bound.
			n := it.Count - it.Err
			if it.Err > 0 && n < 2 {
				continue
			}
			client := it.Client
			if m.topLabels == TopHashed {
				client = ClientLabel(m.topSalt, client)
			}
			tops = append(tops, fmt.Sprintf("rlsidecar_top_rejected{rule=%q,client=%q} %d\n", name, client, n))
		}
	}
	leases := m.leases
	set := m.config.set
	m.mu.Unlock()
	if leases != nil {
		writeLeases(w, leases, set)
	}
	for _, f := range funcs {
		fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n%s %g\n", f.name, f.help, f.name, f.typ, f.name, f.f())
	}
	fmt.Fprintf(w, "# HELP rlsidecar_config_info The rule set in force, by version (a hash of its files).\n# TYPE rlsidecar_config_info gauge\nrlsidecar_config_info{version=%q} 1\n", version)
	if bannedKeys != nil {
		byRule := bannedKeys()
		if set != nil { // a penalty rule's series exists before its first ban, at 0
			for _, r := range set.Rules {
				if _, ok := byRule[r.Name]; !ok && r.Penalty != nil {
					byRule[r.Name] = 0
				}
			}
		}
		rules := make([]string, 0, len(byRule))
		for r := range byRule {
			rules = append(rules, r)
		}
		sort.Strings(rules)
		fmt.Fprintf(w, "# HELP rlsidecar_banned_keys Keys banned now, per rule (its penalty).\n# TYPE rlsidecar_banned_keys gauge\n")
		for _, r := range rules {
			fmt.Fprintf(w, "rlsidecar_banned_keys{rule=%q} %d\n", r, byRule[r])
		}
	}
	fmt.Fprintf(w, "# HELP rlsidecar_top_rejected The clients most often rejected per rule (a bounded sketch: top K only), at least this many times each (a client refused once after the sketch filled is left out); client is a keyed hash unless --top-labels raw, matched to the key on /top.\n# TYPE rlsidecar_top_rejected gauge\n%s", strings.Join(tops, ""))
}

// closeReason is why the daemon closed a connection itself (a client's own close is not
// one): the label of rlsidecar_connections_closed_total.
type closeReason uint32

const (
	closeTooManyConnections closeReason = iota + 1 // refused past MaxConns
	closeFrameTooLarge                             // answered frame_too_large
	closeWriteTimeout                              // the client did not take its answers within WriteTimeout
	closeFrameTimeout                              // a frame begun was not finished within FrameTimeout
	closeIdleTimeout                               // idle past IdleTimeout
	nCloseReasons
)

var closeReasonNames = [nCloseReasons]string{"", "too_many_connections", "frame_too_large", "write_timeout", "frame_timeout", "idle_timeout"}

func (r closeReason) String() string { return closeReasonNames[r] }

// connClosed counts a connection the daemon closed, by why.
func (m *Metrics) connClosed(r closeReason) { m.closed[r].Inc() }

// errorAnswered counts one error answer by its code (a bounded set: the protocol's and
// the project's codes).
func (m *Metrics) errorAnswered(code string) { m.errorCounter(code).Inc() }

// envoyErrorCodes are the gRPC codes a call of Envoy's rate limit API may be answered
// with, by their names (codes.Code.String): a malformed call, a deadline passed, a
// message or a connection's unfinished requests too large, a compressed message or an
// unknown method, a failure of the daemon's own.
var envoyErrorCodes = []string{"InvalidArgument", "DeadlineExceeded", "ResourceExhausted", "Unimplemented", "Internal"}

// WithEnvoy adds, at 0, the series of a daemon serving Envoy's rate limit API: its error
// answers by code, so that a query on them gets 0, not "no data", and rate() and
// increase() count the first errors (a series born at 1 shows no increase). A daemon
// without that API does not export them. Call it before the daemon serves.
func (m *Metrics) WithEnvoy() {
	for _, code := range envoyErrorCodes {
		m.envoyErrorCounter(code)
	}
}

// EnvoyErrorAnswered counts one call of Envoy's rate limit API answered with an error
// status, by its gRPC code's name (envoyrls.ErrorRecorder; a bounded set: gRPC's 17
// codes).
func (m *Metrics) EnvoyErrorAnswered(code string) { m.envoyErrorCounter(code).Inc() }

// envoyErrorCounter returns the counter of Envoy error answers with code, created at 0
// if needed.
func (m *Metrics) envoyErrorCounter(code string) *metrics.Counter {
	c, ok := m.envoyErrsByCode.Load(code)
	if !ok {
		c, _ = m.envoyErrsByCode.LoadOrStore(code, m.set.GetOrCreateCounter(
			fmt.Sprintf(`rlsidecar_envoy_error_answers_total{code=%q}`, code)))
	}
	return c.(*metrics.Counter)
}

// errorCounter returns the counter of error answers with code, created at 0 if needed.
func (m *Metrics) errorCounter(code string) *metrics.Counter {
	c, ok := m.errorsByCode.Load(code)
	if !ok {
		c, _ = m.errorsByCode.LoadOrStore(code, m.set.GetOrCreateCounter(
			fmt.Sprintf(`rlsidecar_error_answers_total{code=%q}`, code)))
	}
	return c.(*metrics.Counter)
}
