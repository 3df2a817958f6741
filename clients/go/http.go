package rlclient

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// The HTTP mapping of a Decision, shared by every rlsidecar client (README.md, "HTTP
// mapping"; vectors in clients/testdata/http_headers.json).

// ProblemType is the "type" of the problem+json bodies this package writes. "about:blank"
// means the problem is what the status code says (RFC 9457 §4.2.1); the rule and
// retry_after extension members carry the details.
const ProblemType = proto.ProblemType

// Headers returns the rate-limit headers of d; see SetHeaders.
func Headers(d *Decision) http.Header {
	h := make(http.Header, 3)
	SetHeaders(h, d)
	return h
}

// SetHeaders sets on h the headers that describe d, per draft-ietf-httpapi-ratelimit-headers:
//
//   - when d has a deciding rule: RateLimit-Policy and RateLimit, each a structured-field
//     list with one item per non-shadow rule of d.Rules, the deciding rule first, then the
//     others in order: `"per-user";q=5;w=60` (q the limit, w the window in seconds) and
//     `"per-user";r=0;t=12` (r the remaining, t the seconds until more quota is made
//     available: a refusing rule's retry-after, none when no retry can pass it, an
//     allowing rule's reset; proto.AppendRateLimitItem); when d allows, of the rules
//     tied with the deciding rule on remaining the one with the longest reset comes
//     first (the deciding rule among equals, else the first in d.Rules: leastRoom); a
//     rule left Unasked keeps its RateLimit-Policy item, its quota being known, but has
//     no RateLimit item, since its remaining and reset were not read; a Concurrency
//     rule's quota is of requests in flight, with no window:
//     `"conc";q=2;qu="concurrent-requests"` and `"conc";r=1`, with a t only when it
//     refused with a retry hint;
//   - when d allows and some non-shadow rule of d.Rules warns (warn_at): RateLimit-Warning,
//     rlsidecar's own header (not in the draft), a structured-field list of those rules'
//     names in the order of d.Rules, quoted as in RateLimit-Policy: `"per-user", "per-ip"`;
//   - when d rejects: Retry-After, in seconds, at least 1 — except when d.Reason is
//     proto.ReasonCostExceedsCapacity, since no retry can ever pass.
//
// Seconds are rounded up. A decision where nothing matched gets no headers.
func SetHeaders(h http.Header, d *Decision) {
	if d.Rule != "" {
		var pol, cur []byte
		decided := decidingRule(d)
		if decided >= 0 && d.Allowed {
			decided = leastRoom(d, decided)
		}
		if decided >= 0 {
			pol, cur = proto.AppendRateLimitItem(pol, cur, d.Rules[decided].item())
		} else {
			// The deciding rule is missing from Rules: describe it from the top-level
			// fields, which do not carry its window.
			pol, cur = proto.AppendRateLimitItem(pol, cur, &proto.RateLimitItem{Name: d.Rule, Limit: d.Limit, NoWindow: true,
				Remaining: d.Remaining, Allowed: d.Allowed, Reset: d.Reset, RetryAfter: d.RetryAfter})
		}
		for i := range d.Rules {
			r := &d.Rules[i]
			if r.Shadow || i == decided {
				continue
			}
			if r.Unasked {
				// Its figures were not read: its quota stays in RateLimit-Policy, the same
				// from one response to the next, but it has no RateLimit item.
				pol = proto.AppendRateLimitPolicyItem(pol, r.item())
				continue
			}
			pol, cur = proto.AppendRateLimitItem(pol, cur, r.item())
		}
		h.Set("RateLimit-Policy", string(pol))
		h.Set("RateLimit", string(cur))
	}
	if d.Allowed {
		var warn []byte
		for i := range d.Rules {
			if r := &d.Rules[i]; r.Warning && !r.Shadow {
				warn = proto.AppendWarningItem(warn, r.Name)
			}
		}
		if warn != nil {
			h.Set("RateLimit-Warning", string(warn))
		}
	}
	if !d.Allowed && d.Reason != proto.ReasonCostExceedsCapacity {
		h.Set("Retry-After", strconv.FormatInt(proto.RetryAfterSeconds(d.RetryAfter), 10))
	}
}

// decidingRule returns the index in d.Rules of the deciding rule, -1 when none carries its
// name: the first non-shadow entry named d.Rule whose figures are the top-level ones (the
// deciding rule's), else the first non-shadow entry of that name. Names need not be
// unique: inline limits without a name are named by their key, so two limits on one key
// (10 per second and 3 per minute) share a name, and the first of them is not always
// the one that decided.
func decidingRule(d *Decision) int {
	first := -1
	for i := range d.Rules {
		r := &d.Rules[i]
		if r.Shadow || r.Name != d.Rule {
			continue
		}
		if r.Allowed == d.Allowed && r.Limit == d.Limit && r.Remaining == d.Remaining && r.Reset == d.Reset &&
			r.RetryAfter == d.RetryAfter {
			return i
		}
		if first < 0 {
			first = i
		}
	}
	return first
}

// leastRoom returns the index in d.Rules of the rule an allowed d lists first: of the
// non-shadow rules with as little remaining as the deciding rule (d.Rules[decided]), the
// one with the longest reset_ms, the most restrictive; among those, the deciding rule,
// else the first in d.Rules. The daemon's deciding rule, when allowed, is the first with
// the least remaining: with per-second and per-day both at 1 left, per-second, and a
// client reading only the first item of RateLimit would miss the daily limit.
func leastRoom(d *Decision, decided int) int {
	best := decided
	for i := range d.Rules {
		r, b := &d.Rules[i], &d.Rules[best]
		if !r.Shadow && !r.Unasked && r.Remaining == b.Remaining && r.Reset > b.Reset {
			best = i
		}
	}
	return best
}

// tooLargeBody is the problem+json body of a 431: the request's attributes were too large
// to check. Every rlsidecar client writes these bytes.
const tooLargeBody = `{"type":"about:blank","title":"Request Header Fields Too Large","status":431,` +
	`"detail":"This request's attributes (its path or header fields) are too large for the rate limiter to check."}`

// WriteRejection writes the response for a decision that does not allow the request:
//
//   - when the sidecar rejected it: 429 Too Many Requests with the headers of SetHeaders
//     and an application/problem+json body (RFC 9457) with the extension members "rule"
//     and "retry_after" (seconds; absent when no retry can pass);
//   - when the request was too large to check (d.Cause wraps ErrRequestTooLarge, or is the
//     sidecar's frame_too_large): 431 Request Header Fields Too Large and a problem+json
//     body, whatever the Policy;
//   - when the client applied FailClosed because the sidecar gave no decision
//     (d.Unreachable, or d.Cause set): 503 Service Unavailable, Retry-After: 1, and a
//     problem+json body saying the rate limiter is unavailable.
func WriteRejection(w http.ResponseWriter, d *Decision) {
	h := w.Header()
	var body []byte
	status := http.StatusTooManyRequests
	if tooLarge(d.Cause) {
		status = http.StatusRequestHeaderFieldsTooLarge
		body = []byte(tooLargeBody)
	} else if d.Unreachable || d.Cause != nil {
		status = http.StatusServiceUnavailable
		body = proto.UnavailableBody()
		h.Set("Retry-After", "1")
	} else {
		SetHeaders(h, d)
		body = proto.TooManyRequestsBody(d.Rule, d.Reason == proto.ReasonCostExceedsCapacity, d.RetryAfter)
	}
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// MiddlewareOptions configure Middleware. The zero value checks the default attributes
// at cost 1.
type MiddlewareOptions struct {
	// Attrs returns the attributes to check a request with. Default: DefaultAttrs.
	Attrs func(*http.Request) []proto.Attr
	// Cost returns the request's cost. 0 asks without consuming (CheckOptions.Peek), as the
	// protocol's cost 0 and the other clients' middlewares do. Default (nil): 1 for every
	// request.
	Cost func(*http.Request) uint64
	// OnError handles a request whose check returned an error (a *proto.Error, which is a
	// bug in what Attrs or Cost produced, or ErrClosed): it writes the response itself.
	// When nil, such a request follows the Client's Policy, as for an unreachable sidecar.
	// A request too large to check never reaches OnError: it gets a 431.
	// An unreachable sidecar never reaches it either (CheckAttrs returns no error): the
	// Policy decides, and the Client logs the outage (Options.Logger).
	OnError func(w http.ResponseWriter, r *http.Request, err error)
	// NoLeaseRenewal turns off the renewal of concurrency leases: by default (false) the
	// middleware renews a request's lease while its handler runs (see Middleware), so a
	// request longer than its rule's lease (an upload, a stream) keeps its slot. With it,
	// such a request loses its slot when the lease expires.
	NoLeaseRenewal bool
}

// DefaultAttrs returns the attributes ip (the host of r.RemoteAddr, without the port, as
// PeerIP gives it), method and path, in that order (sorted by name). ip is left out when
// there is no peer address: r.RemoteAddr empty, or a Unix socket's peer, which net/http
// shows as "@" (or the peer's socket path), not an address. The path is
// NormalizePath(r.URL.EscapedPath()): the target's path as it came, each escape decoded
// once, slashes merged and dot segments removed, as every rlsidecar client sends it, so
// that /f%61st, //fast and /a/../fast are all /fast. (r.URL.Path is decoded already;
// normalizing it would decode twice.)
func DefaultAttrs(r *http.Request) []proto.Attr {
	ip := r.RemoteAddr
	if host, _, err := net.SplitHostPort(ip); err == nil {
		ip = host
	}
	if ip == "" || ip[0] == '@' || ip[0] == '/' {
		// No peer address (a handler called outside a server, a test; a server on a Unix
		// socket, whose peer net/http shows as "@", or as its socket's path when it has
		// one): ip is left out, not sent as "" or "@" (every such request would share
		// one per-ip bucket), as the Python and Node middlewares leave it out for a Unix
		// socket's peer, which their servers give as none.
		return []proto.Attr{{Name: "method", Value: r.Method}, {Name: "path", Value: NormalizePath(r.URL.EscapedPath())}}
	}
	return []proto.Attr{{Name: "ip", Value: PeerIP(ip)}, {Name: "method", Value: r.Method}, {Name: "path", Value: NormalizePath(r.URL.EscapedPath())}}
}

// PeerIP returns the ip attribute every rlsidecar client sends for the peer address addr
// (a host, without a port): addr itself, except that an IPv4-mapped IPv6 address,
// "::ffff:" (any case) before a dotted quad, is sent as the IPv4 address it maps
// ("::ffff:203.0.113.7" is "203.0.113.7"). An IPv4 client of a dual-stack listener
// (Node's default, a Python server bound to "::") has that form, which net/http shows as
// the IPv4 address already; sending one form makes one key per client whichever gateway
// asks. The cases are clients/testdata/ips.json.
func PeerIP(addr string) string {
	const mapped = "::ffff:"
	if len(addr) > len(mapped) && strings.EqualFold(addr[:len(mapped)], mapped) {
		if a, err := netip.ParseAddr(addr[len(mapped):]); err == nil && a.Is4() {
			return addr[len(mapped):]
		}
	}
	return addr
}

// Middleware returns net/http middleware that checks every request with c:
//
//   - allowed: it sets the rate-limit headers (SetHeaders) and calls the next handler,
//     after holding the request d.Delay when a rule with delay asks (nginx's limit_req
//     without nodelay); if the request's context ends first, nothing more is written;
//     when the decision holds a concurrency lease, it releases it when the handler
//     returns (or panics), or when the request ends while held, even if the request's
//     context was canceled; until then it renews the lease (Client.Renew, each rule's
//     own lease) at about half of what is left of it, so a handler that runs longer than
//     the lease keeps its slot (unless NoLeaseRenewal);
//   - rejected by the sidecar: 429 with Retry-After and a problem+json body (WriteRejection);
//   - no decision from the sidecar (unreachable, slow): the Client's Policy — FailOpen calls
//     the next handler without rate-limit headers, FailClosed answers 503 with
//     Retry-After: 1 (WriteRejection);
//   - attributes too large to check (ErrRequestTooLarge, or the sidecar's frame_too_large):
//     431 Request Header Fields Too Large (WriteRejection), whatever the Policy and OnError;
//   - another error (see Client.CheckAttrs): OnError when set, otherwise the Policy as above.
//
// A request whose context ended while it was being checked (its client went away) is not
// passed on, whatever the decision allowed.
func Middleware(c *Client, o MiddlewareOptions) func(http.Handler) http.Handler {
	attrs := o.Attrs
	if attrs == nil {
		attrs = DefaultAttrs
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var co CheckOptions
			if o.Cost != nil {
				co.Cost = o.Cost(r)
				co.Peek = co.Cost == 0
			}
			d, err := c.CheckAttrs(r.Context(), attrs(r), &co)
			if err != nil && o.OnError != nil && !tooLarge(err) {
				o.OnError(w, r, err)
				return
			}
			if !d.Allowed {
				WriteRejection(w, &d)
				return
			}
			if d.Lease != "" {
				stop := func() {}
				if !o.NoLeaseRenewal {
					stop = keepLease(c, d.Lease, firstRenewal(&d), leaseLife(&d))
				}
				defer func() {
					stop()
					_, _ = d.Release(context.WithoutCancel(r.Context()))
				}()
			}
			if r.Context().Err() != nil {
				return // the client went away while its request was checked: nothing is forwarded
			}
			if d.Delay > 0 && !wait(r, d.Delay) {
				return // the client went away while its request was held
			}
			SetHeaders(w.Header(), &d)
			next.ServeHTTP(w, r)
		})
	}
}

// wait holds r for d; false when r's context ended first. Both may be ready when the
// select runs (a goroutine scheduled late): the ended context wins, so a request whose
// client went away while it was held is never forwarded. Before, select chose at random.
func wait(r *http.Request, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return r.Context().Err() == nil
	case <-r.Context().Done():
		return false
	}
}

// minRenewal is the shortest wait between two renewals of a lease.
const minRenewal = 10 * time.Millisecond

// firstRenewal is when the middleware first renews d's lease: half the shortest window
// among d's rules. A concurrency rule's entry has its lease as its window; a rate rule's
// window may be shorter, which only brings the first renewal forward (its answer says
// when the lease expires, and the next renewal follows that).
func firstRenewal(d *Decision) time.Duration {
	w := time.Duration(0)
	for i := range d.Rules {
		if rw := d.Rules[i].Window; rw > 0 && (w == 0 || rw < w) {
			w = rw
		}
	}
	if w == 0 {
		w = 2 * time.Second
	}
	return max(w/2, minRenewal)
}

// leaseLife is how long d's lease lasts unless renewed: the shortest window of its
// concurrency entries (a concurrency rule's window is its lease; a renewal of a lease one
// of whose slots ran out answers renewed: false). 0 when d flags none (an earlier daemon).
func leaseLife(d *Decision) time.Duration {
	w := time.Duration(0)
	for i := range d.Rules {
		if rw := d.Rules[i].Window; d.Rules[i].Concurrency && rw > 0 && (w == 0 || rw < w) {
			w = rw
		}
	}
	return w
}

// keepLease renews lease with c, first after first, then at half of what each renewal
// answers is left of it, until the returned stop is called; stop ends the renewing and
// waits for a renewal under way (at most c's timeout), so that the caller's release
// follows every renewal. It stops by itself when a renewal answers that the lease is
// gone (expired, released, unknown), and when the sidecar does not answer until the
// lease's last known expiry (retrying meanwhile at half of what is left of it). life is
// the lease's duration (leaseLife), its expiry until a renewal answers; 0: 2 × first.
// Before, that first expiry was always 2 × first, the shortest window of all the rules: a
// rate rule of 10 per second beside a lease of a minute made it one second, and a sidecar
// that did not answer the renewals of that second (stalled, restarting) ended them for
// good, the lease left to expire under a request still running.
func keepLease(c *Client, lease string, first, life time.Duration) (stop func()) {
	if life <= 0 {
		life = 2 * first
	}
	quit := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		expires := time.Now().Add(life)
		t := time.NewTimer(first)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-t.C:
			}
			renewed, in, err := c.Renew(context.Background(), lease, 0)
			next := time.Duration(0)
			switch {
			case err == nil && !renewed:
				return
			case err == nil:
				expires = time.Now().Add(in)
				next = in / 2
			default:
				left := time.Until(expires)
				if left <= 0 {
					return
				}
				next = left / 2
			}
			t.Reset(max(next, minRenewal))
		}
	}()
	return func() {
		close(quit)
		<-done
	}
}

// item is r's figures for the RateLimit fields.
func (r *RuleDecision) item() *proto.RateLimitItem {
	return &proto.RateLimitItem{Name: r.Name, Limit: r.Limit, Window: r.Window, Remaining: r.Remaining,
		Allowed: r.Allowed, Reset: r.Reset, RetryAfter: r.RetryAfter, Concurrency: r.Concurrency}
}
