// Package rlclient is the Go client of rlsidecar: it asks the sidecar daemon over its Unix
// socket whether a request may pass, and turns the answer into HTTP headers and a 429.
//
// Most callers want [New], then [Client.Check] per request, or the ready-made
// [Middleware]. A Client keeps a small pool of connections to the sidecar and pipelines
// requests on each, so one Check costs one frame write and one frame read on a connection
// shared with other goroutines; it is safe for concurrent use.
//
// The sidecar is a dependency that can be down, restarting or slow. The client never lets
// that become the caller's problem: when it cannot get an answer in time it answers by its
// [Policy] — allow (FailOpen, the default) or reject (FailClosed) — and says so in
// [Decision.Unreachable]. Errors are reserved for the caller's bugs (a request the sidecar
// refuses as malformed) and for using a closed Client.
//
// The wire format is the one of package proto, whose PROTOCOL.md is the specification.
package rlclient

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// Policy is what the client answers when the sidecar gives no answer in time: it is down,
// its socket is missing, it refuses or drops the connection, or it is too slow.
// The zero value is FailOpen.
type Policy uint8

const (
	// FailOpen allows the request: rate limiting disappears while the sidecar is away,
	// the service does not. The default.
	FailOpen Policy = iota
	// FailClosed rejects the request: for endpoints where an unlimited burst is worse than
	// an outage (logins, password resets, OTP).
	FailClosed
)

func (p Policy) String() string {
	switch p {
	case FailOpen:
		return "fail-open"
	case FailClosed:
		return "fail-closed"
	}
	return fmt.Sprintf("Policy(%d)", uint8(p))
}

// Defaults for the zero fields of Options.
const (
	DefaultConns       = 4
	DefaultTimeout     = 50 * time.Millisecond
	DefaultDialTimeout = 100 * time.Millisecond
	DefaultMaxFrame    = proto.DefaultMaxFrame // the daemon's default --max-frame
)

// Options configure a Client. Only Socket is required; zero fields take the defaults.
type Options struct {
	Socket      string        // path of the sidecar's Unix socket (required)
	Conns       int           // connections in the pool; default 4
	Timeout     time.Duration // longest wait for one Check when ctx has no earlier deadline; default 50ms
	DialTimeout time.Duration // longest wait for one connection attempt; default 100ms
	Policy      Policy        // the answer when the sidecar gives none; default FailOpen
	// MaxFrame is the largest request frame body the client sends, in bytes; default
	// 65,536. Set it to the daemon's --max-frame: the daemon answers a larger frame with
	// frame_too_large and closes the connection (failing the other requests on it). A
	// request that would be larger is not sent: see ErrRequestTooLarge.
	MaxFrame int
	// Logger receives the warnings of an unreachable sidecar: a line when a first check
	// is decided by the Policy because the sidecar gave no answer, then at most one per
	// OutageLogInterval (10 s) while checks keep being so decided (decided_by_policy:
	// how many since the line before), and one when it answers again. Default (nil):
	// slog.Default() at the time of each line. A handler that drops them
	// (slog.DiscardHandler) silences them.
	Logger *slog.Logger
}

// CheckOptions are the optional parts of a check. A nil *CheckOptions and the zero value
// both mean: cost 1, no inline limits.
type CheckOptions struct {
	// Cost is how much the request consumes from every limit it is checked against.
	// 0 means the default, 1.
	Cost uint64
	// Peek asks without consuming anything (sends cost 0): the answer says whether a
	// request of cost 1 would pass now. Cost is ignored when Peek is set.
	Peek bool
	// Limits are inline limits checked together with the rules the attributes match.
	Limits []proto.InlineLimit
}

// RuleDecision is one matched rule's or inline limit's part of a Decision.
type RuleDecision struct {
	Name       string
	Limit      uint64        // requests per Window
	Window     time.Duration // the rule's window
	Remaining  uint64        // what the rule has left after this request
	Reset      time.Duration // until the rule is back to full
	RetryAfter time.Duration // 0 when this rule allowed; else the earliest time a retry can pass it
	Allowed    bool
	Shadow     bool   // a dry-run rule: reported, never rejecting, never deciding
	Reason     string // "" or proto.ReasonCostExceedsCapacity
	// Policies (a rule's warn_at, delay and penalty):
	Warning bool          // allowed, and the rule has used at least its warn_at fraction
	Delay   time.Duration // allowed, but conforming to this rule only after this wait
	Banned  bool          // the key is banned by this rule; RetryAfter is the ban's remaining time
	// Unasked is true when the request was refused (by another rule, a ban or a deny
	// limit) before this rule's store was asked: it refused nothing (Allowed, no
	// RetryAfter), and its Remaining and Reset are 0 because they were not read, not
	// because nothing is left. SetHeaders gives it a RateLimit-Policy item (its Limit and
	// Window are known) but no RateLimit item.
	Unasked bool
	// Concurrency is true for a concurrency rule's entry: Limit is its max of requests in
	// flight (not per Window), Remaining its free slots after this request, Window its
	// lease duration, and RetryAfter (when refused) a hint. SetHeaders gives it the quota
	// unit "concurrent-requests" and no window.
	Concurrency bool
	// Degraded is true when this rule was decided by its failure policy (on_store_failure),
	// without the store it needed: the rule the Decision's Degraded is about.
	Degraded bool
}

// Decision is the answer to a check.
//
// Example: the token-bucket rule "per-user" allows 5 requests a minute, so it refills one
// request every 12 s. A user sent 5 requests at once 10 s ago. The next Check returns
// Allowed false, Rule "per-user", Limit 5, Remaining 0, RetryAfter 2s (the next whole
// request is refilled 12 s after the burst), Reset 50s (the bucket is full again once
// 5 × 12 s have passed), and Rules holds per-user and every other rule that matched.
// [SetHeaders] turns that into RateLimit-Policy, RateLimit and Retry-After headers.
//
// When nothing matched, Allowed is true and Rule is "".
// When the sidecar gave no answer, the Decision is the client's Policy: Allowed is
// (Policy == FailOpen), Degraded and Unreachable are true, Rule is "" and Cause says why.
type Decision struct {
	Allowed    bool
	Rule       string        // the deciding rule; "" when nothing matched
	Limit      uint64        // the deciding rule's limit (requests per window)
	Remaining  uint64        // what the deciding rule has left after this request
	Reset      time.Duration // until the deciding rule is back to full
	RetryAfter time.Duration // 0 when allowed; else the earliest time a retry can pass
	// Degraded is true when the sidecar decided without the store it needed (a rule's
	// failure policy applied), or when this client applied its own Policy.
	Degraded bool
	// Unreachable is true when this client applied its Policy because the sidecar gave no
	// answer: its socket is missing, it refused or dropped the connection, it did not
	// answer within the timeout, the caller's ctx ended first, or the client is backing
	// off after failed connection attempts.
	Unreachable bool
	Reason      string // the deciding rule's reason: "" or proto.ReasonCostExceedsCapacity
	// Warning is true when allowed and a rule has used at least its warn_at fraction of
	// its limit: log or notify, the request still passes.
	Warning bool
	// Delay is, when allowed, how long to hold the request before forwarding it (a rule
	// with delay; its tokens are already reserved). Middleware waits it.
	Delay time.Duration
	// Banned is true when refused because the key is banned by the deciding rule (its
	// penalty); RetryAfter is then the ban's remaining time.
	Banned bool
	Rules  []RuleDecision
	// Cause is why the client applied its Policy (nil when the sidecar decided). When
	// Unreachable, errors.Is(Cause, ErrUnreachable) holds.
	Cause error
	// Lease is set when the request was allowed and matched concurrency rules: it holds
	// one slot in each until released (Release), renewed (Client.Renew) or expired.
	// Release it when the request ends, in a defer. The sidecar also frees it when the
	// connection that took it closes: the Client keeps its pooled connections open, so
	// that only happens when the Client is closed or a connection breaks.
	Lease string

	c *Client // the client that took Lease
}

// Release frees d's lease (Client.Release); it does nothing and returns false when d
// holds none.
func (d *Decision) Release(ctx context.Context) (bool, error) {
	if d.Lease == "" || d.c == nil {
		return false, nil
	}
	return d.c.Release(ctx, d.Lease)
}

var (
	// ErrClosed is returned by a Check or Ping on a closed Client, and by the checks that
	// were in flight when it closed.
	ErrClosed = errors.New("rlclient: client closed")
	// ErrUnreachable is wrapped by every Decision.Cause of an unreachable decision and by
	// every error of Ping that comes from the transport.
	ErrUnreachable = errors.New("rlclient: sidecar unreachable")
	// ErrRequestTooLarge is wrapped by the error (a *RequestTooLargeError) of a request
	// the client did not send because its frame would be larger than Options.MaxFrame:
	// attribute values (a path, a header) too long to check. Unlike an unreachable
	// sidecar, it does not lead to the Policy: the Decision of such a Check rejects, and
	// WriteRejection and Middleware answer it with 431 Request Header Fields Too Large.
	ErrRequestTooLarge = errors.New("rlclient: request too large to check")
)

// RequestTooLargeError is the error of a request the client did not send: its frame body
// would be Size bytes, more than Max (Options.MaxFrame). errors.Is(err, ErrRequestTooLarge)
// holds for it.
type RequestTooLargeError struct {
	Size int // the frame body's length
	Max  int // Options.MaxFrame
}

func (e *RequestTooLargeError) Error() string {
	return fmt.Sprintf("rlclient: request too large to check: its frame would be %d bytes, more than Options.MaxFrame (%d); not sent", e.Size, e.Max)
}
func (e *RequestTooLargeError) Unwrap() error { return ErrRequestTooLarge }

// tooLarge reports whether err says the request is too large to check: the client did
// not send it (ErrRequestTooLarge), or the sidecar refused its frame (frame_too_large,
// when Options.MaxFrame is larger than the daemon's --max-frame) or one of its values
// (attr_too_large: longer than the daemon's --max-attr-len).
func tooLarge(err error) bool {
	var pe *proto.Error
	return errors.Is(err, ErrRequestTooLarge) || errors.As(err, &pe) && tooLargeCode(pe.Code)
}

// tooLargeCode reports whether an error answer's code says the request is too large to
// check.
func tooLargeCode(code string) bool {
	return code == proto.CodeFrameTooLarge || code == proto.CodeAttrTooLarge
}

// unreachable is a transport failure; errors.Is(err, ErrUnreachable) holds for it.
type unreachable struct {
	what string
	err  error
}

func (e *unreachable) Error() string {
	if e.err == nil {
		return "rlclient: sidecar unreachable: " + e.what
	}
	return "rlclient: sidecar unreachable: " + e.what + ": " + e.err.Error()
}
func (e *unreachable) Unwrap() []error {
	if e.err == nil {
		return []error{ErrUnreachable}
	}
	return []error{ErrUnreachable, e.err}
}

var (
	errTimeout = &unreachable{what: "no answer within the timeout"}
	errNoRoom  = &unreachable{what: "every connection had as many requests in flight as it may until the deadline"}
	// errExpired: the caller's deadline had passed before the request was made; it was
	// not sent, and says nothing of the sidecar (the outage log leaves it out).
	errExpired = &unreachable{what: "the caller's deadline had passed: not sent", err: context.DeadlineExceeded}
)

// Client asks one sidecar for decisions over a pool of pipelined connections.
// It dials lazily, on the first check of each connection, and redials a broken connection
// on next use, backing off between failed attempts. Safe for concurrent use.
// Close it to stop its goroutines. The zero value is not usable; call New.
type Client struct {
	opts       Options
	dialer     net.Dialer
	slots      []slot
	next       atomic.Uint32 // round-robin counter
	maxPending int           // calls in flight per connection: maxPending (tests lower it)
	// mono is the stall timer's clock (conn.timedOut): the time since New on the monotonic
	// clock, which a step of the wall clock does not move (tests replace it).
	mono func() time.Duration

	ctx    context.Context // canceled by Close: stops dials in progress
	cancel context.CancelFunc
	closed atomic.Bool
	wg     sync.WaitGroup // dial and reader goroutines, and releases of orphaned leases

	outage outageLog // warnings of an unreachable sidecar

	// The leases taken and not yet released, and the connections retired for a stall
	// while holding some (leaseconn.go).
	leaseMu    sync.Mutex
	leases     map[string]leaseEntry
	leasePrune int
	retired    map[*conn]struct{}
}

// New returns a Client for the sidecar listening on o.Socket. It does not dial: the first
// checks do. It fails only on invalid options.
func New(o Options) (*Client, error) {
	if o.Socket == "" {
		return nil, errors.New("rlclient: Options.Socket is required")
	}
	if o.Conns < 0 || o.Timeout < 0 || o.DialTimeout < 0 || o.MaxFrame < 0 {
		return nil, fmt.Errorf("rlclient: negative option (Conns %d, Timeout %v, DialTimeout %v, MaxFrame %d)", o.Conns, o.Timeout, o.DialTimeout, o.MaxFrame)
	}
	if o.Policy > FailClosed {
		return nil, fmt.Errorf("rlclient: unknown %v", o.Policy)
	}
	if o.Conns == 0 {
		o.Conns = DefaultConns
	}
	if o.Conns > 1024 {
		return nil, fmt.Errorf("rlclient: Options.Conns is %d; the limit is 1024", o.Conns)
	}
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	if o.DialTimeout == 0 {
		o.DialTimeout = DefaultDialTimeout
	}
	if o.MaxFrame == 0 {
		o.MaxFrame = DefaultMaxFrame
	}
	c := &Client{opts: o, slots: make([]slot, o.Conns), maxPending: maxPending}
	c.outage.now = time.Now
	start := time.Now() // with its monotonic reading: time.Since uses it
	c.mono = func() time.Duration { return time.Since(start) }
	c.dialer.Timeout = o.DialTimeout
	c.ctx, c.cancel = context.WithCancel(context.Background())
	for i := range c.slots {
		c.slots[i].c, c.slots[i].i = c, i
	}
	return c, nil
}

// Close closes every connection and waits for the client's goroutines to end. Checks in
// flight and later return the Policy decision with ErrClosed. Close is idempotent.
func (c *Client) Close() error {
	if c.closed.Swap(true) {
		c.wg.Wait()
		return nil
	}
	c.cancel()
	for i := range c.slots {
		c.slots[i].close()
	}
	c.closeRetired()
	c.wg.Wait()
	return nil
}

// Check asks whether a request with these attributes may pass. The attributes are sent
// sorted by name, so equal maps make equal frames. Everything else is as for CheckAttrs.
func (c *Client) Check(ctx context.Context, attrs map[string]string, o *CheckOptions) (Decision, error) {
	cl := getCall()
	for k, v := range attrs {
		cl.req.Attrs = append(cl.req.Attrs, proto.Attr{Name: k, Value: v})
	}
	slices.SortFunc(cl.req.Attrs, func(a, b proto.Attr) int { return strings.Compare(a.Name, b.Name) })
	return c.check(ctx, cl, o)
}

// CheckAttrs asks whether a request with these attributes may pass; they are sent in the
// given order, and where two have the same name the later one's value is sent, in the
// earlier one's place (DefaultAttrs with an "ip" appended from a trusted proxy's header
// sends that ip: the sidecar refuses a repeated name as bad_request, which the Policy
// decided, and FailOpen let every such request past every limit). CheckAttrs neither keeps
// nor changes attrs.
//
// The wait for the answer ends at ctx's deadline or after Options.Timeout, whichever is
// earlier. When the sidecar gives no answer by then — or is unreachable, or drops the
// connection — CheckAttrs returns the Policy decision (see Decision) and a nil error: the
// caller needs no error path for a sidecar that is down.
//
// The error is non-nil only when the sidecar answered the request with an error response
// (a *proto.Error: bad_request, invalid_limit, unknown_op, …, all caused by what the caller
// sent), when the client is closed (ErrClosed), or when the request is too large to check
// (ErrRequestTooLarge: not sent). Except for the last, the Decision is then the Policy
// decision, with Cause set to the error and Unreachable false. A request too large to
// check — ErrRequestTooLarge, or the sidecar's frame_too_large or attr_too_large — gets a Decision that
// rejects whatever the Policy (Allowed false, Cause the error), which WriteRejection answers
// with 431: under FailOpen, attribute values too long to send must not be a way around
// every limit.
func (c *Client) CheckAttrs(ctx context.Context, attrs []proto.Attr, o *CheckOptions) (Decision, error) {
	cl := getCall()
outer:
	for _, a := range attrs {
		for i := range cl.req.Attrs {
			if cl.req.Attrs[i].Name == a.Name {
				cl.req.Attrs[i].Value = a.Value
				continue outer
			}
		}
		cl.req.Attrs = append(cl.req.Attrs, a)
	}
	return c.check(ctx, cl, o)
}

// check sends the check in cl.req (attrs set) and converts the answer.
func (c *Client) check(ctx context.Context, cl *call, o *CheckOptions) (Decision, error) {
	cl.req.Op = proto.OpCheck
	cl.req.Cost = 1
	if o != nil {
		cl.req.Limits = append(cl.req.Limits, o.Limits...)
		switch {
		case o.Peek:
			cl.req.Cost = 0
		case o.Cost != 0:
			cl.req.Cost = o.Cost
		}
	}
	cl, err := c.roundTrip(ctx, cl)
	if err == nil && c.outage.failing.Load() {
		c.answered()
	}
	switch {
	case errors.Is(err, ErrClosed):
		return c.policyDecision(err, false), err
	case errors.Is(err, ErrRequestTooLarge):
		return Decision{Cause: err}, err
	case err != nil:
		c.unreachable(err)
		return c.policyDecision(err, true), nil
	case cl.resp.IsError():
		perr := &proto.Error{Code: cl.resp.Err.Code, Message: cl.resp.Err.Message}
		cl.release()
		if tooLargeCode(perr.Code) {
			return Decision{Cause: perr}, perr
		}
		return c.policyDecision(perr, false), perr
	}
	d := decision(&cl.resp)
	if d.Lease != "" {
		d.c = c
	}
	cl.release()
	return d, nil
}

// Ping asks the sidecar for its version. Unlike Check it reports an unreachable sidecar as
// an error, one that wraps ErrUnreachable. An error response is returned as a *proto.Error.
func (c *Client) Ping(ctx context.Context) (version string, err error) {
	cl := getCall()
	cl.req.Op = proto.OpPing
	cl.req.Cost = 1
	cl, err = c.roundTrip(ctx, cl)
	if err != nil {
		return "", fmt.Errorf("rlclient: ping: %w", err)
	}
	defer cl.release()
	if cl.resp.IsError() {
		return "", &proto.Error{Code: cl.resp.Err.Code, Message: cl.resp.Err.Message}
	}
	return cl.resp.Version, nil
}

// Release frees the slots lease holds. released is false when the lease was unknown,
// expired or already released, which is not an error: releasing is idempotent. Like Ping,
// it reports an unreachable sidecar as an error wrapping ErrUnreachable (the lease then
// expires on its own, or is freed when its connection closes: a connection given up for
// a stall and kept open for its leases is closed once none it holds is live or unreleased);
// an error response is a *proto.Error.
func (c *Client) Release(ctx context.Context, lease string) (released bool, err error) {
	// Answered or not, the caller is done with the lease. A connection retired for a stall
	// (leaseconn.go) that holds no other closes now, which frees it on the sidecar. Before,
	// an unanswered release (the sidecar still stalled) kept that connection open, its
	// descriptor held, until the lease expired (up to an hour).
	defer c.leaseEnded(lease)
	cl := getCall()
	cl.req.Op = proto.OpRelease
	cl.req.Cost = 1
	cl.req.Lease = lease
	cl, err = c.roundTrip(ctx, cl)
	if err != nil {
		return false, fmt.Errorf("rlclient: release: %w", err)
	}
	defer cl.release()
	if cl.resp.IsError() {
		return false, &proto.Error{Code: cl.resp.Err.Code, Message: cl.resp.Err.Message}
	}
	return cl.resp.Released, nil
}

// Renew extends the live lease to d from now (0: each of its rules' own lease; at most
// an hour), for a request that runs long. renewed is false when the lease was unknown,
// expired or released, or one of its slots ran out (a rule of a shorter lease); expiresIn
// is then 0. Errors are as for Release.
func (c *Client) Renew(ctx context.Context, lease string, d time.Duration) (renewed bool, expiresIn time.Duration, err error) {
	if d < 0 {
		return false, 0, fmt.Errorf("rlclient: renew: negative duration %v", d)
	}
	cl := getCall()
	cl.req.Op = proto.OpRenew
	cl.req.Cost = 1
	cl.req.Lease = lease
	cl.req.LeaseMs = uint64((d + time.Millisecond - 1) / time.Millisecond)
	cl, err = c.roundTrip(ctx, cl)
	if err != nil {
		return false, 0, fmt.Errorf("rlclient: renew: %w", err)
	}
	defer cl.release()
	if cl.resp.IsError() {
		return false, 0, &proto.Error{Code: cl.resp.Err.Code, Message: cl.resp.Err.Message}
	}
	if cl.resp.Renewed {
		c.leaseRenewed(lease, ms(cl.resp.ExpiresMs))
	}
	return cl.resp.Renewed, ms(cl.resp.ExpiresMs), nil
}

// policyDecision is the answer when the sidecar gave none.
func (c *Client) policyDecision(cause error, unreachable bool) Decision {
	return Decision{Allowed: c.opts.Policy == FailOpen, Degraded: true, Unreachable: unreachable, Cause: cause}
}

// decision converts a check response. Its strings are already owned (DecodeResponse
// allocates them); Rules is copied because resp belongs to a pooled call.
func decision(r *proto.Response) Decision {
	d := Decision{
		Allowed:    r.Allowed,
		Rule:       r.Rule,
		Limit:      r.Limit,
		Remaining:  r.Remaining,
		Reset:      ms(r.ResetMs),
		RetryAfter: ms(r.RetryAfterMs),
		Degraded:   r.Degraded,
		Reason:     r.Reason,
		Lease:      r.Lease,
		Warning:    r.Warning,
		Delay:      ms(r.DelayMs),
		Banned:     r.Banned,
	}
	if len(r.Rules) > 0 {
		d.Rules = make([]RuleDecision, len(r.Rules))
		for i := range r.Rules {
			rr := &r.Rules[i]
			d.Rules[i] = RuleDecision{
				Name:        rr.Name,
				Limit:       rr.Limit,
				Window:      ms(rr.WindowMs),
				Remaining:   rr.Remaining,
				Reset:       ms(rr.ResetMs),
				RetryAfter:  ms(rr.RetryAfterMs),
				Allowed:     rr.Allowed,
				Shadow:      rr.Shadow,
				Reason:      rr.Reason,
				Warning:     rr.Warning,
				Delay:       ms(rr.DelayMs),
				Banned:      rr.Banned,
				Unasked:     rr.Unasked,
				Concurrency: rr.Concurrency,
				Degraded:    rr.Degraded,
			}
		}
	}
	return d
}

// ms converts milliseconds to a Duration, saturating instead of overflowing.
func ms(v uint64) time.Duration {
	if v > math.MaxInt64/uint64(time.Millisecond) {
		return math.MaxInt64
	}
	return time.Duration(v) * time.Millisecond
}
