package sync

import (
	"runtime"
	gosync "sync"
)

// combiner is the batching that autoPipe (global checks) and the hybrid mode's exact
// syncs share: while one batch is on the wire, the requests that arrive queue, and go
// together as the next batch. A lone request goes at once.
//
// No goroutine of its own: the request that finds no batch in flight sends one; when it
// is done, the first request still queued is woken to send the next, with every request
// queued by then. A queued request waits for the batch in flight and then its own.
// Its zero value is ready; safe for concurrent use.
type combiner[T batchMember] struct {
	mu    gosync.Mutex
	busy  bool // a batch is on its way; the requests queued go as the next one
	queue []T
}

// batchMember is a request that a combiner batches: its channel is told true when the
// request is to send the next batch, and false (by the batch's send) when it is
// answered. It must be buffered (one value).
type batchMember interface {
	wake() chan bool
}

// do queues m and returns once a batch holding it has answered it: the batch is sent by
// the caller of do, or by another's. send sends a batch and tells each member false
// once its answer is in (any time during send, before it returns).
//
// queued, when not nil, is called once m is queued: whatever is queued after it goes in
// its batch, behind it, or in a later batch.
func (c *combiner[T]) do(m T, send func(batch []T), queued func()) {
	c.mu.Lock()
	c.queue = append(c.queue, m)
	lead := !c.busy
	c.busy = true
	c.mu.Unlock()
	if queued != nil {
		queued()
	}
	for {
		if lead {
			c.sendNext(send)
		}
		if lead = <-m.wake(); !lead {
			return
		}
	}
}

// sendNext sends every queued request as one batch and hands the next batch to the
// first request that queued meanwhile.
func (c *combiner[T]) sendNext(send func(batch []T)) {
	// Let the requests already runnable queue first: requests started together (a
	// connection's pipelined checks) then go in one batch, not the first alone and the
	// rest a round trip later. A lone request loses a scheduler pass, not a round trip.
	runtime.Gosched()
	c.mu.Lock()
	batch := c.queue
	c.queue = nil
	c.mu.Unlock()

	send(batch)

	c.mu.Lock()
	var next T
	more := len(c.queue) > 0
	if more {
		next = c.queue[0]
	} else {
		c.busy = false
	}
	c.mu.Unlock()
	if more {
		next.wake() <- true
	}
}
