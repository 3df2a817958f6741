// Package proto is the rlsidecar wire protocol, version 1: the frame codec, the message
// types and the error codes. PROTOCOL.md beside this file is the canonical specification;
// testdata/vectors.json holds byte-exact frames that every client's tests read.
//
// Every message, both ways, is a frame: a 4-byte unsigned big-endian length L, then exactly
// L bytes holding one msgpack map with string keys. A connection carries many requests; the
// server answers each exactly once, in order.
//
// The codec is built for reuse: a Decoder and an Encoder belong to one connection and are
// reset per frame, so decoding a request and encoding its answer allocate nothing in the
// steady state. Neither is safe for concurrent use.
package proto

import (
	"fmt"
	"strconv"
	"unicode/utf8"
)

// Version is the protocol version a server reports in its ping response.
const Version = 1

// HeaderSize is the size of a frame's length prefix.
const HeaderSize = 4

// DefaultMaxFrame is the largest frame body a server accepts unless configured otherwise.
const DefaultMaxFrame = 65536

// Operations.
const (
	OpCheck   = "check"
	OpPing    = "ping"
	OpRelease = "release" // frees a lease (an addition to v1)
	OpRenew   = "renew"   // extends a lease (an addition to v1)
)

// MaxLeaseLen bounds the lease tokens a daemon issues. A global lease's token carries its
// rules and client keys (so that any daemon can release it): the limiter never answers
// a longer one (limiter.maxGlobalToken), and takes a longer one in a release or renew
// for a lease it did not issue (false), as PROTOCOL.md says of any unknown lease; the
// decoder reads it at any length the frame holds. (A release of one was bad_request
// before; the conformance suite's long leases.) 32 KiB holds a client key of a
// 4,096-byte value every byte of which is escaped (longer values are keyed by their
// digest), in base64; at 2,048 bytes a value of about 1,100 bytes already made a global
// concurrency rule fall to its failure policy.
const MaxLeaseLen = 32 << 10

// Error codes. The first five are fixed by the protocol; the rest are additions.
const (
	CodeBadRequest         = "bad_request"
	CodeUnknownOp          = "unknown_op"
	CodeInvalidLimit       = "invalid_limit"
	CodeFrameTooLarge      = "frame_too_large"
	CodeInternal           = "internal"
	CodeTooManyConnections = "too_many_connections" // the server is at its connection cap and closes this one
	CodeShuttingDown       = "shutting_down"        // the server is draining and closes this connection
	// CodeAttrTooLarge: an attribute's value (or an inline limit's key) is longer than
	// the server's --max-attr-len. The connection stays usable. A gateway answers it as
	// frame_too_large (431): the request's own fields are too large to check.
	CodeAttrTooLarge = "attr_too_large"
)

// Reasons a check rejects without a retry time.
const (
	// ReasonCostExceedsCapacity: the request's cost is larger than the rule's capacity
	// (burst for a token bucket, requests for a window), so no retry can ever pass.
	ReasonCostExceedsCapacity = "cost_exceeds_capacity"
)

// Error is a protocol error: the body of an error response.
type Error struct {
	Code    string
	Message string
}

func (e *Error) Error() string { return e.Code + ": " + e.Message }

// Errorf returns an *Error with the given code and a formatted message.
func Errorf(code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// MaxQuoted is how many bytes of a value from a request Quote quotes.
const MaxQuoted = 64

// Quote is s quoted for an error message (as strconv.Quote, and fmt's %q, quote it), cut
// to its first MaxQuoted bytes (at a character boundary) followed by "…" and its length
// when it is longer. A request may send an op, a field name or an algorithm as long as its
// frame, and an answer quoting it whole would be larger still.
func Quote(s string) string {
	if len(s) <= MaxQuoted {
		return strconv.Quote(s)
	}
	n := MaxQuoted
	for n > MaxQuoted-utf8.UTFMax && !utf8.RuneStart(s[n]) {
		n--
	}
	return strconv.Quote(s[:n]) + "… (" + strconv.Itoa(len(s)) + " bytes)"
}

// Attr is one request attribute (method, path, user, api_key, ip, plan, …).
type Attr struct {
	Name  string
	Value string
}

// InlineLimit is a limit sent in the request itself, checked together with the matched rules.
// Zero numeric fields mean absent; the limiter reports missing required fields as invalid_limit.
type InlineLimit struct {
	Key       string // required
	Limit     uint64 // required, >= 1
	WindowMs  uint64 // required, >= 1
	Burst     uint64 // optional, token_bucket only
	Algorithm string // optional: token_bucket (default), sliding_window, fixed_window
	Mode      string // optional: local, hybrid, global
	Name      string // optional; the name reported in responses (default: the key)
}

// Request is a decoded request. After Decoder.DecodeRequest its strings alias the frame
// body that was decoded and stay valid only while that body is unchanged.
type Request struct {
	ID     uint64
	Op     string
	Attrs  []Attr
	Limits []InlineLimit
	Cost   uint64 // 1 when the request did not say; 0 asks without consuming
	// Lease is the lease token of a release or renew request; LeaseMs a renew's new
	// duration (0: each rule's own lease).
	Lease   string
	LeaseMs uint64
}

// Reset clears r for reuse, keeping the capacity of its slices.
func (r *Request) Reset() {
	r.ID = 0
	r.Op = ""
	r.Attrs = r.Attrs[:0]
	r.Limits = r.Limits[:0]
	r.Cost = 1
	r.Lease = ""
	r.LeaseMs = 0
}

// RuleResult is one matched rule's or inline limit's part of a check response.
type RuleResult struct {
	Name         string
	Limit        uint64 // requests per window
	WindowMs     uint64
	Remaining    uint64
	ResetMs      uint64
	RetryAfterMs uint64
	Allowed      bool
	Shadow       bool
	Reason       string // "" or ReasonCostExceedsCapacity (an addition to v1)
	// Additions to v1, each encoded only when set (see PROTOCOL.md, "Policies"):
	Warning bool   // allowed, and the rule has used at least its warn_at fraction
	DelayMs uint64 // allowed, but to be held this long first (a rule with delay)
	Banned  bool   // refused because the key is banned (a rule with penalty)
	// Unasked (an addition to v1, encoded only when set): the request was refused
	// before this rule's store was asked (a Redis round trip is not spent on a refused
	// request); it refused nothing, and its remaining and reset_ms were not read.
	Unasked bool
	// Concurrency (an addition to v1, encoded only when set): the entry is a concurrency
	// rule's (PROTOCOL.md, "Leases"): Limit is its max of requests in flight, Remaining
	// the free slots after this request, WindowMs its lease duration; when refused,
	// RetryAfterMs is a hint.
	Concurrency bool
	// Degraded (an addition to v1, encoded only when set): this rule was decided without
	// the store it needed, by its failure policy (on_store_failure); the answer's
	// top-level degraded is then true too. It tells which of a request's rules fell back.
	Degraded bool
}

// Response is any response: a check answer, a ping answer or an error. A server encodes
// it with the Encoder method for its kind; a client decodes every kind into it.
type Response struct {
	ID uint64

	// check
	Allowed      bool
	Rule         string
	Limit        uint64
	Remaining    uint64
	ResetMs      uint64
	RetryAfterMs uint64
	Degraded     bool
	Rules        []RuleResult
	Reason       string // the deciding rule's reason, "" when none (an addition to v1)
	Lease        string // the lease an allowed check holds, "" when none (an addition to v1)
	// Additions to v1, each encoded only when set (see PROTOCOL.md, "Policies"):
	Warning bool   // allowed, and some non-shadow rule warns
	DelayMs uint64 // allowed: the gateway holds the request this long before forwarding
	Banned  bool   // refused because the key is banned by the deciding rule

	// release and renew (additions to v1)
	Released  bool
	Renewed   bool
	ExpiresMs uint64 // until the renewed lease expires

	// ping
	Version  string
	Protocol uint64

	// error; Err.Code is "" when the response is not an error
	Err Error
}

// Reset clears r for reuse, keeping the capacity of Rules.
func (r *Response) Reset() {
	rules := r.Rules[:0]
	*r = Response{Rules: rules}
}

// IsError reports whether r is an error response.
func (r *Response) IsError() bool { return r.Err.Code != "" }
