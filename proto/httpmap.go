package proto

import (
	"encoding/json"
	"strconv"
	"time"
)

// The HTTP mapping of a decision (README.md, "HTTP mapping"; vectors in
// testdata/http_headers.json): the formatting every Go producer of rate-limit headers and
// problem bodies shares — the Go client's middleware and the daemon's Envoy transport —
// so that both write the same bytes.

// ProblemType is the "type" of the problem+json bodies. "about:blank" means the problem
// is what the status code says (RFC 9457 §4.2.1); the rule and retry_after extension
// members carry the details.
const ProblemType = "about:blank"

// RateLimitItem is one rule's figures, as AppendRateLimitItem writes them.
type RateLimitItem struct {
	Name      string
	Limit     uint64
	Window    time.Duration // the rule's window (w: at least 1 s)
	NoWindow  bool          // the window is not known: no w
	Remaining uint64
	Allowed   bool
	// Reset is until the rule is back to full; RetryAfter, when refused, the earliest time
	// a retry can pass it (0: none can).
	Reset, RetryAfter time.Duration
	// Concurrency: a concurrency rule's (its entry's concurrency: true): Limit is its max
	// of requests in flight, Remaining its free slots, RetryAfter (when refused) a hint;
	// Window and Reset are not used.
	Concurrency bool
}

// AppendRateLimitItem appends one rule to the values of the RateLimit-Policy (pol) and
// RateLimit (cur) fields of draft-ietf-httpapi-ratelimit-headers, separating it from the
// items before with ", ": `"per-user";q=5;w=60` (q the limit, w the window in seconds,
// at least 1) and `"per-user";r=0;t=12` (r the remaining, t the seconds until more quota
// is made available). Seconds are rounded up.
//
// t is the draft's "time until additional quota ... is made available", and a response's
// Retry-After must not be earlier than it: for a rule that refused, its RetryAfter (when
// it admits the request again), and no t when no retry can pass it (a deny limit, a cost
// above its capacity); for a rule that allowed, its Reset, when it is back to full.
//
// A concurrency rule's quota is of requests in flight, the draft's quota unit
// "concurrent-requests", and has no time window: `"conc";q=2;qu="concurrent-requests"`
// (no w), and `"conc";r=1` with a t only when it refused with a retry hint (its
// RetryAfter, as for a refusing rate rule); an allowing one has no t, since nothing says
// when a slot frees.
func AppendRateLimitItem(pol, cur []byte, it *RateLimitItem) ([]byte, []byte) {
	return AppendRateLimitPolicyItem(pol, it), AppendRateLimitCurrentItem(cur, it)
}

// AppendRateLimitPolicyItem appends one rule's item to the value of the RateLimit-Policy
// field alone (AppendRateLimitItem), separating it from the items before with ", ": a
// rule whose remaining and reset were not read (a refused request's unasked rule) still
// has its quota, q and w, which the draft asks to stay the same from one response to the
// next, but no RateLimit item.
func AppendRateLimitPolicyItem(pol []byte, it *RateLimitItem) []byte {
	if len(pol) > 0 {
		pol = append(pol, ", "...)
	}
	pol = appendSFString(pol, it.Name)
	pol = append(pol, ";q="...)
	pol = strconv.AppendUint(pol, it.Limit, 10)
	switch {
	case it.Concurrency:
		pol = append(pol, `;qu="concurrent-requests"`...)
	case !it.NoWindow:
		pol = append(pol, ";w="...)
		pol = strconv.AppendInt(pol, max(CeilSeconds(it.Window), 1), 10)
	}
	return pol
}

// AppendRateLimitCurrentItem appends one rule's item to the value of the RateLimit field
// alone (AppendRateLimitItem), separating it from the items before with ", ".
func AppendRateLimitCurrentItem(cur []byte, it *RateLimitItem) []byte {
	if len(cur) > 0 {
		cur = append(cur, ", "...)
	}
	cur = appendSFString(cur, it.Name)
	cur = append(cur, ";r="...)
	cur = strconv.AppendUint(cur, it.Remaining, 10)
	switch {
	case it.Allowed && it.Concurrency:
		// No t: nothing says when a slot frees.
	case it.Allowed:
		cur = append(cur, ";t="...)
		cur = strconv.AppendInt(cur, CeilSeconds(it.Reset), 10)
	case it.RetryAfter > 0:
		cur = append(cur, ";t="...)
		cur = strconv.AppendInt(cur, CeilSeconds(it.RetryAfter), 10)
	}
	return cur
}

// AppendWarningItem appends one warning rule's name to the value of the RateLimit-Warning
// header, rlsidecar's own (not in the IETF draft): an RFC 8941 list of sf-strings quoted
// as in RateLimit-Policy, separated from the items before with ", ": `"per-user", "per-ip"`.
func AppendWarningItem(b []byte, name string) []byte {
	if len(b) > 0 {
		b = append(b, ", "...)
	}
	return appendSFString(b, name)
}

// appendSFString appends s as an RFC 8941 string: `\` and `"` escaped, any byte outside
// printable ASCII (0x20–0x7E) replaced with `_`.
func appendSFString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\\' || c == '"':
			b = append(b, '\\', c)
		case c < 0x20 || c > 0x7e:
			b = append(b, '_')
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// CeilSeconds rounds d up to whole seconds; negative durations count as 0.
func CeilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	s := d / time.Second
	if d%time.Second != 0 {
		s++
	}
	return int64(s)
}

// RetryAfterSeconds is the Retry-After of a rejection whose retry is possible after d:
// whole seconds rounded up, at least 1.
func RetryAfterSeconds(d time.Duration) int64 { return max(CeilSeconds(d), 1) }

// problem is an RFC 9457 problem details body.
type problem struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Status     int    `json:"status"`
	Detail     string `json:"detail"`
	Rule       string `json:"rule,omitempty"`
	RetryAfter int64  `json:"retry_after,omitempty"` // seconds, as in Retry-After
}

// TooManyRequestsBody returns the application/problem+json body of a 429 for a request
// rule rejected ("" when the deciding rule is unknown): retry_after is
// RetryAfterSeconds(retryAfter), or absent when impossible (the cost exceeds what the
// rule can ever admit).
func TooManyRequestsBody(rule string, impossible bool, retryAfter time.Duration) []byte {
	p := problem{Type: ProblemType, Title: "Too Many Requests", Status: 429, Rule: rule}
	limit := "the rate limit"
	if rule != "" {
		limit = "rate limit " + strconv.Quote(rule)
	}
	if impossible {
		p.Detail = "This request costs more than " + limit + " can ever admit: it can never pass under this limit."
	} else {
		p.RetryAfter = RetryAfterSeconds(retryAfter)
		p.Detail = "This request exceeds " + limit + "; retry in " + seconds(p.RetryAfter) + "."
	}
	return marshalProblem(&p)
}

// UnavailableBody returns the application/problem+json body of the 503 a client answers
// when it admits no request without the rate limiter and has no decision from it.
func UnavailableBody() []byte {
	return marshalProblem(&problem{Type: ProblemType, Title: "Service Unavailable", Status: 503,
		Detail: "The rate limiter is unavailable and this service does not admit requests without it; retry in 1 second.", RetryAfter: 1})
}

func marshalProblem(p *problem) []byte {
	body, err := json.Marshal(p)
	if err != nil {
		panic("BUG: marshaling a problem: " + err.Error())
	}
	return body
}

func seconds(n int64) string {
	if n == 1 {
		return "1 second"
	}
	return strconv.FormatInt(n, 10) + " seconds"
}
