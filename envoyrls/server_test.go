package envoyrls

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"google.golang.org/grpc/mem"
	gproto "google.golang.org/protobuf/proto"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

func TestEnvoyUnit(t *testing.T) {
	const (
		sec  = rlsv3.RateLimitResponse_RateLimit_SECOND
		min_ = rlsv3.RateLimitResponse_RateLimit_MINUTE
		hour = rlsv3.RateLimitResponse_RateLimit_HOUR
		day  = rlsv3.RateLimitResponse_RateLimit_DAY
		week = rlsv3.RateLimitResponse_RateLimit_WEEK
		year = rlsv3.RateLimitResponse_RateLimit_YEAR
	)
	tests := []struct {
		limit  uint64
		window time.Duration
		rpu    uint32
		unit   rlsv3.RateLimitResponse_RateLimit_Unit
	}{
		{10, time.Second, 10, sec},
		{10, time.Minute, 10, min_},
		{10, 30 * time.Second, 20, min_}, // the rate kept in the next unit
		{10, 500 * time.Millisecond, 20, sec},
		{100, 90 * time.Second, 4000, hour}, // not whole per minute: per hour
		{7, 13 * time.Second, 32, min_},     // never whole: rounded down in the next unit
		{5, 7 * 24 * time.Hour, 5, week},
		{1, 366 * 24 * time.Hour, 1, year}, // longer than a year: per year, at least 1
		{0, time.Second, 0, sec},           // limit: deny
		{math.MaxUint32, time.Millisecond, math.MaxUint32, sec},
	}
	for _, tt := range tests {
		rpu, unit := envoyUnit(tt.limit, tt.window)
		if rpu != tt.rpu || unit != tt.unit {
			t.Errorf("envoyUnit(%d, %v) = %d per %v, want %d per %v", tt.limit, tt.window, rpu, unit, tt.rpu, tt.unit)
		}
	}
}

func benchServer(b *testing.B) *Server {
	set, err := rules.Parse("b.yaml", []byte(`
rules:
  - name: per-user
    match: { domain: api, descriptor: user }
    key: user
    algorithm: fixed_window
    limit: { requests: 1000000, per: 1s }
`))
	if err != nil {
		b.Fatal(err)
	}
	s, err := New(Config{Addr: "unused:0"}, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
	if err != nil {
		b.Fatal(err)
	}
	return s
}

// BenchmarkShouldRateLimit is one call with one descriptor, in process (no transport):
// what the Envoy transport adds to the limiter's check is building the response.
func BenchmarkShouldRateLimit(b *testing.B) {
	s := benchServer(b)
	req := &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{
		{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: "u1"}}}}}
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := s.ShouldRateLimit(ctx, req); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkShouldRateLimitOverrideZero is a call with a requests_per_unit 0 override
// (refused) beside a descriptor its rules decide (which consumes nothing).
func BenchmarkShouldRateLimitOverrideZero(b *testing.B) {
	s := benchServer(b)
	req := &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{
		{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: "blocked"}},
			Limit: &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 0, Unit: typev3.RateLimitUnit_MINUTE}},
		{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: "u1"}}}}}
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := s.ShouldRateLimit(ctx, req)
			if err != nil || resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
				b.Errorf("%v %v", resp, err)
				return
			}
		}
	})
}

// BenchmarkCodec is one call with one descriptor in process, from the request's bytes to
// the response's, as the gRPC server runs it: "wire" through the server's codec and
// handler, "generated" through google.golang.org/protobuf and the generated types (what
// the generated handler and grpc-go's proto codec would do).
func BenchmarkCodec(b *testing.B) {
	s := benchServer(b)
	req, err := gproto.Marshal(&rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{
		{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: "u1"}}}}})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	c := newCodec()
	data := mem.BufferSlice{mem.SliceBuffer(req)}
	b.Run("wire", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			out, err := wireHandler(s, ctx, func(v any) error { return c.Unmarshal(data, v) }, nil)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := c.Marshal(out); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("generated", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			in := new(rlsv3.RateLimitRequest)
			if err := gproto.Unmarshal(req, in); err != nil {
				b.Fatal(err)
			}
			out, err := s.ShouldRateLimit(ctx, in)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := gproto.Marshal(out); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// A limit override of requests_per_unit 0 refuses its call, as envoyproxy/ratelimit does
// (OVER_LIMIT, 0 per the unit, nothing remaining, reset at the end of the unit's epoch-
// aligned window), whatever its hits_addend, no retry ever passing; the other
// descriptors of the call consume nothing (all-or-nothing), and nothing is kept for it.
func TestOverrideZero(t *testing.T) {
	s := testServer(t)
	const now = 1_700_000_005_000_000_000 // 25 s into a minute (1,699,999,980 is one's start)
	s.now = func() int64 { return now }
	zero := func(hits *uint64) *commonrl.RateLimitDescriptor {
		d := &commonrl.RateLimitDescriptor{
			Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: "blocked"}},
			Limit:   &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 0, Unit: typev3.RateLimitUnit_MINUTE},
		}
		if hits != nil {
			d.HitsAddend = wrapperspb.UInt64(*hits)
		}
		return d
	}
	h0, h3 := uint64(0), uint64(3)
	// Asked once without consuming, the other descriptor's keys are there before.
	ask := desc1("u")
	ask.HitsAddend = wrapperspb.UInt64(0)
	if _, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{ask}}); err != nil {
		t.Fatal(err)
	}
	keys := s.lim.Store().Len()
	for _, hits := range []*uint64{nil, &h0, &h3, nil} {
		resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{zero(hits), desc1("u")}})
		if err != nil {
			t.Fatalf("hits %v: %v", hits, err)
		}
		st := resp.Statuses[0]
		if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || st.Code != rlsv3.RateLimitResponse_OVER_LIMIT ||
			st.CurrentLimit.GetRequestsPerUnit() != 0 || st.CurrentLimit.GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE ||
			st.CurrentLimit.GetName() != "" || st.LimitRemaining != 0 || st.DurationUntilReset.AsDuration() != 35*time.Second {
			t.Fatalf("hits %v: %v", hits, resp)
		}
		// The other descriptor is reported but not charged: per-user's 5 per second stay 5.
		if o := resp.Statuses[1]; o.Code != rlsv3.RateLimitResponse_OK || o.LimitRemaining != 5 {
			t.Errorf("hits %v: the other descriptor: %v", hits, o)
		}
		h := map[string]string{}
		for _, hv := range resp.ResponseHeadersToAdd {
			h[hv.Key] = hv.Value
		}
		if h["Retry-After"] != "" || !strings.HasPrefix(h["RateLimit-Policy"], `"api.user.override";q=0;w=60`) ||
			!strings.Contains(string(resp.RawBody), "can never pass") {
			t.Errorf("hits %v: headers %v body %s", hits, h, resp.RawBody)
		}
	}
	if n := s.lim.Store().Len(); n != keys {
		t.Errorf("%d keys held after refusals, want %d", n, keys)
	}
}

// stoppedServer returns a Server (not serving: called directly) on the rules in yaml, a
// local store, and its limiter, with its clock stopped at now.
func stoppedServer(t *testing.T, now int64, yaml string) (*Server, *limiter.Limiter) {
	t.Helper()
	set, err := rules.Parse("t.yaml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{}))
	s, err := New(Config{Addr: "unused:0"}, lim)
	if err != nil {
		t.Fatal(err)
	}
	s.now = func() int64 { return now }
	return s, lim
}

// A concurrency rule's items are those the clients write (proto.AppendRateLimitItem): a
// quota of concurrent requests, with no window, `"jobs";q=1;qu="concurrent-requests"`;
// allowed, no t (nothing says when a slot frees); refused (its slot held by a lease taken
// beside Envoy's calls), its retry hint as t and Retry-After.
func TestConcurrencyHeaders(t *testing.T) {
	const now = 1_700_000_000_000_000_000
	s, lim := stoppedServer(t, now, `
rules:
  - name: jobs
    match: { domain: api, descriptor: job }
    key: job
    concurrency: { max: 1, lease: 30s }
`)
	call := func() (*rlsv3.RateLimitResponse, map[string]string) {
		t.Helper()
		resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api",
			Descriptors: []*commonrl.RateLimitDescriptor{{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "job", Value: "j1"}}}}})
		if err != nil {
			t.Fatal(err)
		}
		h := map[string]string{}
		for _, hv := range resp.ResponseHeadersToAdd {
			h[hv.Key] = hv.Value
		}
		return resp, h
	}
	const policy = `"jobs";q=1;qu="concurrent-requests"`
	resp, h := call()
	// r=1: the call asks, and takes no slot (TestConcurrencyAsksTakesNoSlot).
	if resp.OverallCode != rlsv3.RateLimitResponse_OK || h["RateLimit-Policy"] != policy || h["RateLimit"] != `"jobs";r=1` {
		t.Fatalf("allowed: %v, headers %v", resp.OverallCode, h)
	}
	// Its current_limit: max in flight, in no unit of time (not 1 per its 30 s lease, 2
	// per minute).
	if cl := resp.Statuses[0].CurrentLimit; cl == nil || cl.RequestsPerUnit != 1 || cl.Unit != rlsv3.RateLimitResponse_RateLimit_UNKNOWN || cl.Name != "jobs" {
		t.Fatalf("current_limit %v, want 1 UNKNOWN", cl)
	}
	// The slot held by a lease Envoy's calls do not release.
	var d limiter.Decision
	in := limiter.Input{Attrs: []rules.Attr{{Name: DomainAttribute, Value: "api"}, {Name: DescriptorAttribute, Value: "job"},
		{Name: "job", Value: "j1"}}, Cost: 1}
	if err := lim.Check(now, &in, &d); err != nil || !d.Allowed || lim.LeaseToken(&d) == "" {
		t.Fatalf("holding the slot: %v, %+v", err, d)
	}
	resp, h = call()
	if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || h["RateLimit-Policy"] != policy ||
		h["RateLimit"] != `"jobs";r=0;t=1` || h["Retry-After"] != "1" {
		t.Fatalf("refused: %v, headers %v", resp.OverallCode, h)
	}
}

// An override longer than 366 days (the limiter's longest window) is refused in the
// descriptor's terms, also when unit × unit_multiplier would pass 2^64 and wrap to a
// short window.
func TestOverrideTooLong(t *testing.T) {
	s := testServer(t)
	over := func(unit typev3.RateLimitUnit, mult uint32) *commonrl.RateLimitDescriptor {
		return &commonrl.RateLimitDescriptor{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "path", Value: "/ov"}},
			Limit: &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1, Unit: unit, UnitMultiplier: wrapperspb.UInt32(mult)}}
	}
	for _, tc := range []struct {
		unit typev3.RateLimitUnit
		mult uint32
		ok   bool
	}{
		{typev3.RateLimitUnit_DAY, 366, true},
		{typev3.RateLimitUnit_DAY, 367, false},
		{typev3.RateLimitUnit_YEAR, 1, true},
		{typev3.RateLimitUnit_YEAR, 2, false},
		{typev3.RateLimitUnit_YEAR, 2924712087, false}, // × 31,536,000,000 ms wraps to about 82 days
		{typev3.RateLimitUnit_SECOND, math.MaxUint32, false},
	} {
		_, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api",
			Descriptors: []*commonrl.RateLimitDescriptor{desc1("u"), over(tc.unit, tc.mult)}})
		switch {
		case tc.ok && err != nil:
			t.Errorf("%v × %d: %v", tc.unit, tc.mult, err)
		case !tc.ok && (status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "descriptors[1].limit: ") ||
			!strings.Contains(err.Error(), "366 days")):
			t.Errorf("%v × %d: %v, want InvalidArgument naming descriptors[1].limit", tc.unit, tc.mult, err)
		}
	}
}

// Override counters are one per descriptor, whatever bytes its domain, keys and values
// hold: a value holding NUL bytes (the parts' separator) named the counter of other
// entries (found by a cluster audit: [k="a\x00b\x00c"] was over the limit of [k=a, b=c],
// never used itself). A key without such bytes is the one it was.
func TestOverrideKeysDoNotCollide(t *testing.T) {
	s := testServer(t)
	over := func(domain string, kv ...string) *rlsv3.RateLimitRequest {
		d := &commonrl.RateLimitDescriptor{Limit: &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1, Unit: typev3.RateLimitUnit_HOUR}}
		for i := 0; i < len(kv); i += 2 {
			d.Entries = append(d.Entries, &commonrl.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
		}
		return &rlsv3.RateLimitRequest{Domain: domain, Descriptors: []*commonrl.RateLimitDescriptor{d}}
	}
	for i, req := range []*rlsv3.RateLimitRequest{
		over("n", "k", "a", "b", "c"),
		over("n", "k", "a\x00b\x00c"),
		over("n", "k", "a\x01\x02b\x00c"),
		over("n", "k", "a\x00b\x01\x02c"),
		over("n\x00k", "zz", "q"),
		over("n", "k\x00zz", "q"),
		over("n", "k", "a\x01"),
		over("n", "k", "a\x01\x01"),
	} {
		resp, err := s.ShouldRateLimit(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.OverallCode != rlsv3.RateLimitResponse_OK {
			t.Errorf("descriptor %d (%q %q), its first call: %v; it shares another's counter", i, req.Domain, req.Descriptors[0].Entries, resp.OverallCode)
		}
	}
	// Plain keys stay as they were.
	if got := string(appendKeyPart(nil, "api.example.com/v1")); got != "api.example.com/v1" {
		t.Errorf("a plain part became %q", got)
	}
}

// A rule that several descriptors of one call hit (each its own key) is one policy in
// the RateLimit headers, which are keyed by name: written once, as the deciding
// descriptor's when it decides, else as the one with the least remaining; and warned
// once. Before, each descriptor wrote it again, and a client reading the headers by
// name took whichever it met first.
func TestHeadersOneItemPerRule(t *testing.T) {
	const now = 1_700_000_000_000_000_000
	s, _ := stoppedServer(t, now, `
rules:
  - name: per-user
    match: { domain: api, descriptor: user }
    key: user
    limit: { requests: 10, per: 1m }
    warn_at: 0.5
  - name: per-route
    match: { domain: api, descriptor: route }
    key: route
    limit: { requests: 100, per: 1m }
`)
	desc := func(k, v string) *commonrl.RateLimitDescriptor {
		return &commonrl.RateLimitDescriptor{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: k, Value: v}}}
	}
	call := func(ds ...*commonrl.RateLimitDescriptor) (*rlsv3.RateLimitResponse, map[string]string) {
		t.Helper()
		resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api", Descriptors: ds})
		if err != nil {
			t.Fatal(err)
		}
		h := map[string]string{}
		for _, hv := range resp.ResponseHeadersToAdd {
			if _, dup := h[hv.Key]; dup {
				t.Fatalf("header %s twice", hv.Key)
			}
			h[hv.Key] = hv.Value
		}
		return resp, h
	}
	for range 7 { // user a: 7 of 10 used
		call(desc("user", "a"))
	}
	// After this call a has 2 left, b 9 and the route 99: a decides, and per-user is
	// written once, as a's.
	resp, h := call(desc("user", "b"), desc("route", "r"), desc("user", "a"))
	if resp.OverallCode != rlsv3.RateLimitResponse_OK {
		t.Fatalf("call: %v", resp.OverallCode)
	}
	if want := `"per-user";q=10;w=60, "per-route";q=100;w=60`; h["RateLimit-Policy"] != want {
		t.Errorf("RateLimit-Policy %q, want %q", h["RateLimit-Policy"], want)
	}
	if want := `"per-user";r=2;t=`; !strings.HasPrefix(h["RateLimit"], want) || strings.Count(h["RateLimit"], "per-user") != 1 {
		t.Errorf("RateLimit %q, want one per-user item, a's (%s…)", h["RateLimit"], want)
	}
	if h["RateLimit-Warning"] != `"per-user"` {
		t.Errorf("RateLimit-Warning %q, want per-user once", h["RateLimit-Warning"])
	}
	// Another rule deciding: per-user's item is its least remaining key's (a, 1 left;
	// c has 9).
	for range 99 {
		call(desc("route", "r2"))
	}
	_, h = call(desc("user", "c"), desc("user", "a"), desc("route", "r2"))
	if !strings.HasPrefix(h["RateLimit"], `"per-route";r=0;t=`) || !strings.Contains(h["RateLimit"], `"per-user";r=1;t=`) ||
		strings.Count(h["RateLimit"], "per-user") != 1 {
		t.Errorf("RateLimit %q, want per-route first, then per-user's a (1 left) once", h["RateLimit"])
	}
}
