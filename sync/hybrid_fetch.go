package sync

import (
	"context"
	"sync/atomic"
	"time"
)

// Exact syncs, batched: the requests that wait for an exact sync of their keys (Take)
// go together, as the global mode's checks do (autoPipe). While one batch is on the
// wire the requests that arrive queue, and go as the next batch: one send, many keys
// per script call (fetchCallKeys; on a cluster, keys of one master per call, the masters
// at once). A lone request goes at once, as before. Each request is woken as soon as
// its own keys' replies are applied (on a cluster, a slow master delays only the
// requests whose keys it holds, and the one request sending the batch, which waits for
// all of it), and a call that fails fails only its own keys.
//
// No goroutine of its own: the request that finds no batch in flight sends one; when it
// is done, the first request still queued is woken to send the next. A key is never in
// two batches: its
// snapshot marks it busy (flagBusy) until its reply is applied, and a request on a busy
// key waits for that sync (Take) instead of queueing another.

// fetchReq is one request's exact syncs.
type fetchReq struct {
	items  []syncItem
	left   atomic.Int32 // items not yet applied
	failed atomic.Bool  // an item's sync failed (or was not sent): Redis did not decide it
	done   chan bool    // see batchMember
}

func (r *fetchReq) wake() chan bool { return r.done }

// fetchPipe bounds the calls of one batch's pipeline: in practice all of them, one
// pipeline per node (a batch is the requests that arrived during one round trip).
const fetchPipe = 1 << 16

// fetch runs the exact syncs Take waits for, in the next batch, and returns once they
// are applied. A failure does not count against the breaker (one slow answer on a loaded
// Redis must not degrade every key): the periodic syncs judge Redis, and redisAnswering
// keeps requests from waiting on a Redis they find slow.
//
// A request waits at most for the batch in flight and then its own, each bounded by
// FetchWait. It reports whether every item's sync was answered.
func (h *Hybrid) fetch(items []syncItem) bool {
	r := &fetchReq{items: items, done: make(chan bool, 1)}
	h.fetchQ.do(r, h.sendFetches, nil)
	return !r.failed.Load()
}

// sendFetches sends batch's exact syncs in one send, applies the replies, and wakes
// each request once its items are applied.
func (h *Hybrid) sendFetches(batch []*fetchReq) {
	n := 0
	for _, r := range batch {
		n += len(r.items)
		r.left.Store(int32(len(r.items)))
		for k := range r.items {
			r.items[k].req = r
		}
	}
	items := batch[0].items
	if len(batch) > 1 {
		items = make([]syncItem, 0, n)
		for _, r := range batch {
			items = append(items, r.items...)
		}
	}
	// applied applies items whose replies are in and wakes each request whose items
	// are all applied.
	var sent int64 // when the batch went (daemon clock), set before send calls applied
	applied := func(its []syncItem) {
		h.applyAll(its, true, sent)
		for i := range its {
			r := its[i].req
			if its[i].err != nil {
				r.failed.Store(true)
			}
			if r.left.Add(-1) == 0 {
				r.done <- false
			}
		}
	}
	start := time.Now()
	sent = h.clock()
	ctx, cancel := context.WithTimeout(context.Background(), h.fetchWait)
	h.fetches.Add(uint64(n))
	err := h.send(ctx, items, h.replicaCount(), fetchCallKeys, fetchPipe, applied)
	cancel()
	h.observed("hybrid_fetch", start, err)
}
