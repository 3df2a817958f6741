package daemon

import (
	"math"
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

func newTestConn(tb testing.TB, withMetrics ...bool) *conn {
	set, err := rules.Parse("bench.yaml", []byte(benchRules))
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

func checkFrame() []byte {
	enc := proto.NewEncoder()
	enc.EncodeRequest(&proto.Request{ID: 7, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
		{Name: "method", Value: "POST"}, {Name: "path", Value: "/v1/events/42/holds"},
		{Name: "user", Value: "user-12345"}, {Name: "ip", Value: "203.0.113.9"}}})
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
