package daemon

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

const benchRules = `
rules:
  - name: per-ip
    key: ip
    limit: { requests: 1000000000, per: 1h }
  - name: holds
    match: { method: POST, path: "/v1/events/*/holds" }
    key: user
    limit: { requests: 1000000000, per: 1h }
  - name: login
    match: { method: POST, path: /login }
    key: ip
    limit: { requests: 10, per: 1m }
`

// benchRulesIPPrefix is benchRules with per-ip keyed by the client's network.
var benchRulesIPPrefix = strings.Replace(benchRules, "    key: ip\n", "    key: ip\n    ip_prefix: { ipv4: 24, ipv6: 64 }\n", 1)

func newTestConn(tb testing.TB, withMetrics ...bool) *conn {
	return newTestConnRules(tb, benchRules, withMetrics...)
}

func newTestConnRules(tb testing.TB, src string, withMetrics ...bool) *conn {
	set, err := rules.Parse("bench.yaml", []byte(src))
	if err != nil {
		tb.Fatal(err)
	}
	cfg := Config{Socket: "unused"}
	if len(withMetrics) > 0 && withMetrics[0] {
		cfg.Metrics = NewMetrics("test", 10)
		cfg.Metrics.SetRules(set, time.Now())
	}
	s, err := New(cfg, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		tb.Fatal(err)
	}
	return &conn{s: s, dec: proto.NewDecoder(), enc: proto.NewEncoder()}
}

func checkFrame() []byte { return checkFrameIP("203.0.113.9") }

func checkFrameIP(ip string) []byte {
	enc := proto.NewEncoder()
	enc.EncodeRequest(&proto.Request{ID: 7, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
		{Name: "method", Value: "POST"}, {Name: "path", Value: "/v1/events/42/holds"},
		{Name: "user", Value: "user-12345"}, {Name: "ip", Value: ip}}})
	return append([]byte(nil), enc.Bytes()[proto.HeaderSize:]...)
}

// TestHandleAllocs: the server's work for one request — decode, decide, encode — does
// not allocate once the client's keys exist.
func TestHandleAllocs(t *testing.T) {
	cn := newTestConn(t, true)
	body := checkFrame()
	now := time.Now().UnixNano()
	cn.handle(body, now)
	allocs := testing.AllocsPerRun(1000, func() {
		cn.enc.Reset()
		cn.handle(body, now)
	})
	if allocs != 0 {
		t.Fatalf("%v allocs per request", allocs)
	}
	var resp proto.Response
	if err := proto.NewDecoder().DecodeResponse(cn.enc.Bytes()[proto.HeaderSize:], &resp); err != nil {
		t.Fatal(err)
	}
	if !resp.Allowed || len(resp.Rules) != 2 || resp.ID != 7 {
		t.Fatalf("%+v", resp)
	}
}

// BenchmarkHandle is the server-side CPU for one two-rule check: decode → match → decide
// → encode, without the socket.
func BenchmarkHandle(b *testing.B) {
	cn := newTestConn(b)
	body := checkFrame()
	now := time.Now().UnixNano()
	b.ReportAllocs()
	for b.Loop() {
		cn.enc.Reset()
		cn.handle(body, now)
	}
}

// BenchmarkHandleIPPrefix is BenchmarkHandle with the per-ip rule keyed by the client's
// network (ip_prefix) and an IPv6 client: what parsing and masking the address costs.
func BenchmarkHandleIPPrefix(b *testing.B) {
	cn := newTestConnRules(b, benchRulesIPPrefix)
	body := checkFrameIP("2001:db8:1:2:aaaa:bbbb:cccc:dddd")
	now := time.Now().UnixNano()
	b.ReportAllocs()
	for b.Loop() {
		cn.enc.Reset()
		cn.handle(body, now)
	}
}

// TestHandleIPPrefixAllocs: a rule with ip_prefix allocates nothing per request either,
// for an address or a value that is not one.
func TestHandleIPPrefixAllocs(t *testing.T) {
	if !strings.Contains(benchRulesIPPrefix, "ip_prefix") {
		t.Fatal("benchRulesIPPrefix has no ip_prefix")
	}
	for _, ip := range []string{"2001:db8:1:2::9", "203.0.113.9", "::ffff:203.0.113.9", "unknown"} {
		cn := newTestConnRules(t, benchRulesIPPrefix, true)
		body := checkFrameIP(ip)
		now := time.Now().UnixNano()
		cn.handle(body, now)
		if allocs := testing.AllocsPerRun(1000, func() {
			cn.enc.Reset()
			cn.handle(body, now)
		}); allocs != 0 {
			t.Errorf("ip %q: %v allocs per request", ip, allocs)
		}
	}
}

// BenchmarkHandleMetrics is BenchmarkHandle with metrics recorded (per-rule counters, the
// latency histogram): the difference is what metrics cost the hot path.
func BenchmarkHandleMetrics(b *testing.B) {
	cn := newTestConn(b, true)
	body := checkFrame()
	now := time.Now().UnixNano()
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		cn.enc.Reset()
		cn.handle(body, now)
		if n++; n%32 == 0 {
			cn.s.cfg.Metrics.flushTally(&cn.tally) // as a flush of a 32-frame batch does
		}
	}
}

// TestCeilMs: durations round up to whole milliseconds, so a client waiting
// retry_after_ms is never early, up to the longest duration without overflowing.
func TestCeilMs(t *testing.T) {
	for _, tc := range []struct {
		d    time.Duration
		want uint64
	}{
		{-time.Second, 0}, {0, 0}, {1, 1}, {time.Millisecond - 1, 1}, {time.Millisecond, 1},
		{time.Millisecond + 1, 2}, {time.Hour, 3_600_000},
		{math.MaxInt64, math.MaxInt64/uint64(time.Millisecond) + 1},
	} {
		if got := ceilMs(tc.d); got != tc.want {
			t.Errorf("ceilMs(%d) = %d, want %d", tc.d, got, tc.want)
		}
	}
}
