package daemon

import (
	"sort"
	"sync"
)

// topK is a Space-Saving heavy-hitter sketch: it keeps k counters and, for any stream,
// every client whose true count exceeds total/k is among them; a reported count
// overestimates the true one by at most its err. Bounded memory whatever the stream:
// this is how "who is being limited" is answered without a client key ever becoming a
// metric label beyond these k. Safe for concurrent use.
type topK struct {
	mu    sync.Mutex
	k     int
	items []topItem
	index map[string]int
}

type topItem struct {
	Client string `json:"client"`
	Label  string `json:"label,omitempty"` // the client's label in rlsidecar_top_rejected, when hashed
	Count  uint64 `json:"count"`
	Err    uint64 `json:"error"` // Count may exceed the true count by at most this
}

// newTopK returns an empty sketch of k counters. Nothing is allocated ahead for them:
// every rule has one, most rules reject no one, and the index sized for k in advance
// (make(map, k)) cost about 53 KB a rule at --top-k 1000, 528 MB with 10,000 rules, and
// at --top-k 1000000000 23 GB before the daemon started.
func newTopK(k int) *topK {
	return &topK{k: k, index: map[string]int{}}
}

// add counts one occurrence of client (its bytes are copied when kept).
func (t *topK) add(client []byte) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if i, ok := t.index[string(client)]; ok {
		t.items[i].Count++
		return
	}
	if len(t.items) < t.k {
		t.index[string(client)] = len(t.items)
		t.items = append(t.items, topItem{Client: string(client), Count: 1})
		return
	}
	// Replace the smallest: the newcomer inherits its count as the error bound.
	m := 0
	for i := range t.items {
		if t.items[i].Count < t.items[m].Count {
			m = i
		}
	}
	delete(t.index, t.items[m].Client)
	min := t.items[m].Count
	t.items[m] = topItem{Client: string(client), Count: min + 1, Err: min}
	t.index[t.items[m].Client] = m
}

// list returns the kept clients, most frequent first.
func (t *topK) list() []topItem {
	t.mu.Lock()
	out := append([]topItem(nil), t.items...)
	t.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].Count != out[j].Count {
			return out[i].Count > out[j].Count
		}
		return out[i].Client < out[j].Client
	})
	return out
}
