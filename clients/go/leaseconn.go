package rlclient

import (
	"encoding/binary"
	"errors"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// Connections holding leases
//
// The sidecar frees a lease when the connection that took it closes. A connection given up
// for a stall (timedOut: no answer for stallFor while checks timed out on it) may hold the
// leases of requests still running: closing it would free their slots, and after the
// stall the sidecar would admit past a concurrency rule's max (max 1: a second request
// admitted while the first still runs). So such a connection is retired instead: detached
// from its slot (the next check redials, as for a closed one) and no longer sent on, but
// kept open, its reader dropping late answers, until the leases it took are released
// through this Client (on any connection), or have all expired, or the Client is closed.
// Leases are tracked from the answer that took them to their release, answered or not (an
// unanswered one ends the lease too: closing its retired connection frees it); a lease
// never released is forgotten once it has expired.

// leaseEntry is a lease taken on cn, which holds it at least until until.
type leaseEntry struct {
	cn    *conn
	until time.Time
}

// errLeasesDone closes a retired connection whose leases were released or expired.
var errLeasesDone = errors.New("rlclient: a connection given up for a stall closed once its leases ended")

// leaseWindow returns how long the lease of a check answer with these rules lasts at
// least: the longest window of its concurrency entries (a concurrency rule's window is
// its lease). A rate rule's window says nothing of it: before, it counted too, and a
// connection retired for a stall while it held a lease whose release went unanswered
// stayed open for a day when the check also matched a rule of 1 per day, where the lease
// ended in seconds. From a daemon that does not flag its concurrency entries (an earlier
// version), the longest window of all.
func leaseWindow(rules []proto.RuleResult) time.Duration {
	var conc, every uint64
	for i := range rules {
		w := rules[i].WindowMs
		every = max(every, w)
		if rules[i].Concurrency {
			conc = max(conc, w)
		}
	}
	if conc == 0 {
		conc = every
	}
	return ms(conc)
}

// trackLease notes that lease was taken on cn and lasts window (at least) from now.
func (c *Client) trackLease(cn *conn, lease string, window time.Duration) {
	now := time.Now()
	until := now.Add(window)
	c.leaseMu.Lock()
	defer c.leaseMu.Unlock()
	if c.leases == nil {
		c.leases = make(map[string]leaseEntry)
		c.retired = make(map[*conn]struct{})
	}
	if len(c.leases) >= max(c.leasePrune, 1024) {
		// Forget the leases never released that have expired (bounded memory).
		for k, e := range c.leases {
			if now.After(e.until) {
				delete(c.leases, k)
				e.cn.leases--
			}
		}
		c.leasePrune = 2 * len(c.leases)
	}
	if _, ok := c.leases[lease]; ok {
		return
	}
	c.leases[lease] = leaseEntry{cn: cn, until: until}
	cn.leases++
	if until.After(cn.holdUntil) {
		cn.holdUntil = until
	}
}

// leaseRenewed notes that lease now lasts at least in from now.
func (c *Client) leaseRenewed(lease string, in time.Duration) {
	until := time.Now().Add(in)
	c.leaseMu.Lock()
	defer c.leaseMu.Unlock()
	e, ok := c.leases[lease]
	if !ok {
		return
	}
	if until.After(e.until) {
		e.until = until
		c.leases[lease] = e
	}
	if until.After(e.cn.holdUntil) {
		e.cn.holdUntil = until
	}
}

// leaseEnded forgets lease (its release ended, answered or not, or its check's caller had
// left); a retired connection that held it closes once it holds no other.
func (c *Client) leaseEnded(lease string) {
	c.leaseMu.Lock()
	e, ok := c.leases[lease]
	if !ok {
		c.leaseMu.Unlock()
		return
	}
	delete(c.leases, lease)
	e.cn.leases--
	_, retired := c.retired[e.cn]
	done := retired && e.cn.leases <= 0
	c.leaseMu.Unlock()
	if done {
		e.cn.fail(errLeasesDone)
	}
}

// giveUp ends cn after a stall (see timedOut): closed, or retired while it holds leases.
func (cn *conn) giveUp(err error) {
	if !cn.retire(err, nil) {
		cn.fail(err)
	}
}

// retire detaches cn from its slot and keeps it open for the leases it holds (see the top
// of this file); false, doing nothing, when it holds none that are live, or the Client is
// closed. It is called after a stall (giveUp), and after a write that timed out (a
// sidecar that stopped reading while many checks were sent: the socket's buffer is full),
// which may have stopped inside a frame: rest, the rest of that frame, is then written in
// a goroutine of the Client's (until the leases' expiry); else the sidecar, once it reads
// again, would wait --frame-timeout for it and then close the connection, freeing the
// leases all the same.
func (cn *conn) retire(err error, rest []byte) bool {
	c := cn.s.c
	c.leaseMu.Lock()
	if cn.leases <= 0 || !time.Now().Before(cn.holdUntil) || c.closed.Load() {
		c.leaseMu.Unlock()
		return false
	}
	cn.mu.Lock()
	if cn.broken || cn.retiredAt {
		cn.mu.Unlock()
		c.leaseMu.Unlock()
		return true
	}
	cn.retiredAt = true
	if cn.werr == nil {
		cn.werr = err // nothing more is sent on it
	}
	cn.mu.Unlock()
	c.retired[cn] = struct{}{}
	cn.expiry = time.AfterFunc(time.Until(cn.holdUntil), cn.expire)
	if len(rest) > 0 {
		// Added under leaseMu with c not closed: Close, which closes the retired
		// connections before it waits, has not begun waiting.
		c.wg.Add(1)
		go func(deadline time.Time) {
			defer c.wg.Done()
			if cn.nc.SetWriteDeadline(deadline) == nil {
				if _, err := cn.nc.Write(rest); err == nil {
					return
				}
			}
			cn.fail(errLeasesDone)
		}(cn.holdUntil)
	}
	c.leaseMu.Unlock()
	cn.s.detach(cn) // the next check on its slot redials
	cn.closeDead()  // callers waiting for room on it, or to send on it, pick again
	return true
}

// frameRest returns a copy of the rest of the frame that byte n of b (frames, each a
// 4-byte big-endian length and its body) falls in; nil when n ends a frame.
func frameRest(b []byte, n int) []byte {
	for off := 0; off < n && off+proto.HeaderSize <= len(b); {
		end := off + proto.HeaderSize + int(binary.BigEndian.Uint32(b[off:]))
		if n < end {
			if end > len(b) {
				end = len(b)
			}
			return append([]byte(nil), b[n:end]...)
		}
		off = end
	}
	return nil
}

// expire closes a retired connection once every lease it holds has expired.
func (cn *conn) expire() {
	c := cn.s.c
	c.leaseMu.Lock()
	if left := time.Until(cn.holdUntil); cn.leases > 0 && left > 0 {
		cn.expiry.Reset(left)
		c.leaseMu.Unlock()
		return
	}
	c.leaseMu.Unlock()
	cn.fail(errLeasesDone)
}

// forgetRetired drops cn, which is breaking, from the retired connections.
func (cn *conn) forgetRetired() {
	c := cn.s.c
	c.leaseMu.Lock()
	defer c.leaseMu.Unlock()
	if _, ok := c.retired[cn]; ok {
		delete(c.retired, cn)
		cn.expiry.Stop()
	}
}

// closeRetired closes the retired connections (Close; c.closed is set, so no more come).
func (c *Client) closeRetired() {
	c.leaseMu.Lock()
	cns := make([]*conn, 0, len(c.retired))
	for cn := range c.retired {
		cns = append(cns, cn)
	}
	c.leaseMu.Unlock()
	for _, cn := range cns {
		cn.fail(ErrClosed)
	}
}
