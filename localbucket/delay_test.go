package localbucket

import (
	"testing"
	"time"
)

// TestDelayNginxBurstExample reproduces nginx's documented limit_req example
// (https://nginx.org/en/docs/http/ngx_http_limit_req_module.html):
//
//	limit_req_zone $binary_remote_addr zone=one:10m rate=1r/s;
//	limit_req zone=one burst=5;
//
// "at most 1 request per second ... bursts not exceeding 5 requests": requests beyond
// the rate are delayed so they are processed at 1 r/s, and past 5 waiting ones refused.
// Here a token bucket of 1/s, burst 1, delay 5s: of 7 simultaneous requests, the first
// passes at once, the next five are held 1s, 2s, ..., 5s, the seventh is refused and may
// retry after 1s.
func TestDelayNginxBurstExample(t *testing.T) {
	lim, err := NewLimit(TokenBucket, 1, time.Second, 1)
	if err != nil {
		t.Fatal(err)
	}
	lim = lim.WithDelay(5 * time.Second)
	const now = int64(1_700_000_000) * int64(time.Second)
	var s State
	for i := range 6 {
		var r Result
		s, r = lim.Take(s, now, 1)
		if want := int64(i) * int64(time.Second); !r.Allowed || r.Delay != want || r.RetryAfter != 0 {
			t.Fatalf("request %d: allowed %v delay %v retry %v, want allowed with delay %v",
				i+1, r.Allowed, time.Duration(r.Delay), time.Duration(r.RetryAfter), time.Duration(want))
		}
	}
	before := s
	s, r := lim.Take(s, now, 1)
	if r.Allowed || r.Delay != 0 || r.RetryAfter != int64(time.Second) {
		t.Fatalf("request 7: allowed %v delay %v retry %v, want refused, retry 1s",
			r.Allowed, time.Duration(r.Delay), time.Duration(r.RetryAfter))
	}
	if s != before {
		t.Fatalf("a refused request changed the state: %+v -> %+v", before, s)
	}
	// A peek (cost 0) reports the wait without reserving it.
	if _, r := lim.Take(s, now+int64(time.Second), 0); !r.Allowed || r.Delay != int64(5*time.Second) {
		t.Fatalf("peek 1s later: allowed %v delay %v, want allowed with delay 5s", r.Allowed, time.Duration(r.Delay))
	}
	// One second later, one slot of the queue has drained: one more is held 5s.
	_, r = lim.Take(s, now+int64(time.Second), 1)
	if !r.Allowed || r.Delay != int64(5*time.Second) {
		t.Fatalf("request 8 at +1s: allowed %v delay %v, want delay 5s", r.Allowed, time.Duration(r.Delay))
	}
	if r.LimitedUntil != now+2*int64(time.Second) {
		t.Fatalf("LimitedUntil %d, want now+2s", r.LimitedUntil-now)
	}
}

func TestDelayWithoutDelayUnchanged(t *testing.T) {
	for _, d := range []time.Duration{0, -time.Second} {
		lim, _ := NewLimit(TokenBucket, 10, time.Second, 10)
		lim = lim.WithDelay(d)
		var s State
		for range 10 {
			s, _ = lim.Take(s, 0, 1)
		}
		if _, r := lim.Take(s, 0, 1); r.Allowed || r.Delay != 0 || r.RetryAfter != int64(100*time.Millisecond) {
			t.Fatalf("delay %v: %+v, want refused with retry 100ms", d, r)
		}
	}
	w, _ := NewLimit(FixedWindow, 10, time.Second, 0)
	if w = w.WithDelay(time.Second); w.Delay() != 0 {
		t.Fatal("a window took a delay")
	}
}
