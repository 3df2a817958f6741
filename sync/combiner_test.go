package sync

import (
	gosync "sync"
	"testing"
	"time"
)

type testMember struct {
	id   int
	done chan bool
}

func (m *testMember) wake() chan bool { return m.done }

// TestCombiner: a request arriving while a batch is on the wire goes in the next batch,
// with every other request queued by then; each is sent exactly once and returns only
// once its batch has answered it; a lone request afterwards goes at once, alone.
func TestCombiner(t *testing.T) {
	var c combiner[*testMember]
	const n = 20
	var mu gosync.Mutex
	var batches [][]int
	sent := make(map[int]int)
	release := make(chan struct{})
	send := func(batch []*testMember) {
		mu.Lock()
		ids := make([]int, len(batch))
		for i, m := range batch {
			ids[i] = m.id
			sent[m.id]++
		}
		batches = append(batches, ids)
		first := len(batches) == 1
		mu.Unlock()
		if first {
			<-release // the first batch stays on the wire until the others queued
		}
		for _, m := range batch {
			m.done <- false
		}
	}

	var wg gosync.WaitGroup
	answered := make([]bool, n+1)
	run := func(id int) {
		defer wg.Done()
		c.do(&testMember{id: id, done: make(chan bool, 1)}, send, nil)
		mu.Lock()
		answered[id] = sent[id] == 1
		mu.Unlock()
	}
	wg.Add(1)
	go run(0)
	for { // the first request leads: its batch is on the wire
		mu.Lock()
		started := len(batches) == 1
		mu.Unlock()
		if started {
			break
		}
		time.Sleep(time.Millisecond)
	}
	for id := 1; id < n; id++ {
		wg.Add(1)
		go run(id)
	}
	for {
		c.mu.Lock()
		queued := len(c.queue)
		c.mu.Unlock()
		if queued == n-1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	close(release)
	wg.Wait()
	wg.Add(1)
	run(n) // nothing in flight: it goes at once, alone

	if len(batches) != 3 || len(batches[0]) != 1 || len(batches[1]) != n-1 || len(batches[2]) != 1 {
		t.Fatalf("batches %v: want [0], the %d queued meanwhile, then [%d]", batches, n-1, n)
	}
	for id := 0; id <= n; id++ {
		if !answered[id] || sent[id] != 1 {
			t.Fatalf("request %d: answered %v, sent %d times", id, answered[id], sent[id])
		}
	}
	if c.busy || len(c.queue) != 0 {
		t.Fatalf("idle combiner left busy=%v with %d queued", c.busy, len(c.queue))
	}
}
