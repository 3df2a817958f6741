package rlclient

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// OutageLogInterval is the least time between two lines of the outage log while the
// sidecar keeps failing (see Options.Logger).
const OutageLogInterval = 10 * time.Second

// outageLog writes the warnings of an unreachable sidecar: the first check the Policy
// decided at once, then at most one line per OutageLogInterval while checks keep being
// decided by it, each with how many were since the line before, and one line when the
// sidecar answers again. A check the sidecar answers costs one atomic load (failing).
type outageLog struct {
	failing atomic.Bool // a check was decided by the Policy since the sidecar last answered

	mu      sync.Mutex
	now     func() time.Time // time.Now; tests set a clock
	logged  bool             // a failure line was written since the last recovery line
	last    time.Time        // when the last failure line was written
	decided int64            // checks decided by the Policy since the last line
}

// logger is the logger of the outage lines: Options.Logger, else slog's default at the
// time of the line (so a slog.SetDefault after New takes effect).
func (c *Client) logger() *slog.Logger {
	if c.opts.Logger != nil {
		return c.opts.Logger
	}
	return slog.Default()
}

// unreachable records a check the Policy decided because the sidecar gave no answer
// (cause), and writes a line when one is due. A check whose caller's context was
// canceled (its client went away), or whose deadline had passed before it was sent, says
// nothing of the sidecar: it is not counted.
func (c *Client) unreachable(cause error) {
	if errors.Is(cause, context.Canceled) || cause == errExpired {
		// Its caller went away, or its deadline had passed before it was sent. Before,
		// the latter was logged as an outage ("requests pass without rate limiting"),
		// then "answers again", while the sidecar answered every other check.
		return
	}
	o := &c.outage
	o.mu.Lock()
	o.failing.Store(true)
	o.decided++
	now := o.now()
	if !o.last.IsZero() && now.Sub(o.last) < OutageLogInterval {
		o.mu.Unlock()
		return
	}
	still := o.logged
	n := o.decided
	o.logged, o.last, o.decided = true, now, 0
	o.mu.Unlock()

	var msg string
	switch {
	case still:
		msg = "rlclient: rlsidecar still unreachable; requests are decided by the failure policy"
	case c.opts.Policy == FailOpen:
		msg = "rlclient: rlsidecar unreachable; requests pass without rate limiting (fail-open) until it answers"
	default:
		msg = "rlclient: rlsidecar unreachable; requests are refused (fail-closed) until it answers"
	}
	c.logger().Warn(msg, "socket", c.opts.Socket, "policy", c.opts.Policy.String(),
		"decided_by_policy", n, "error", cause.Error())
}

// answered is called when the sidecar answered a check while o.failing is set: it writes
// the recovery line when a failure line is outstanding.
func (c *Client) answered() {
	o := &c.outage
	o.mu.Lock()
	if !o.failing.Load() {
		o.mu.Unlock()
		return
	}
	o.failing.Store(false)
	if !o.logged {
		// Only checks within OutageLogInterval of the last line failed since: the next
		// failure line counts them.
		o.mu.Unlock()
		return
	}
	n := o.decided
	o.logged, o.decided = false, 0
	o.mu.Unlock()
	c.logger().Warn("rlclient: rlsidecar answers again; requests are rate limited",
		"socket", c.opts.Socket, "policy", c.opts.Policy.String(), "decided_by_policy", n)
}
