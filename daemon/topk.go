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
//
// The counters are a binary min-heap on Count, index giving each client's position, so
// that counting a client, kept or new, is O(log k). Before, a newcomer to a full sketch
// was a scan of all k for the smallest, under the rule's lock, at each refusal: at
// --top-k 10000 a flood of never-repeating refused keys ran at 163,000 checks/s
// against 1,240,000 at --top-k 10 (one connection, the real binary), and every refusal
// of the rule on any connection waited for the scans.
type topK struct {
	mu    sync.Mutex
	k     int
	items []topItem // a min-heap on Count
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
		t.down(i)
		return
	}
	if len(t.items) < t.k {
		t.index[string(client)] = len(t.items)
		t.items = append(t.items, topItem{Client: string(client), Count: 1})
		t.up(len(t.items) - 1)
		return
	}
	// Replace the smallest, the root: the newcomer inherits its count as the error bound.
	delete(t.index, t.items[0].Client)
	min := t.items[0].Count
	t.items[0] = topItem{Client: string(client), Count: min + 1, Err: min}
	t.index[t.items[0].Client] = 0
	t.down(0)
}

// up moves item i, new, up the heap to its place.
func (t *topK) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if t.items[p].Count <= t.items[i].Count {
			break
		}
		t.items[i], t.items[p] = t.items[p], t.items[i]
		t.index[t.items[i].Client] = i
		t.index[t.items[p].Client] = p
		i = p
	}
}

// down moves item i, whose count grew, down the heap to its place.
func (t *topK) down(i int) {
	n := len(t.items)
	for {
		c := 2*i + 1
		if c >= n {
			break
		}
		if r := c + 1; r < n && t.items[r].Count < t.items[c].Count {
			c = r
		}
		if t.items[i].Count <= t.items[c].Count {
			break
		}
		t.items[i], t.items[c] = t.items[c], t.items[i]
		t.index[t.items[i].Client] = i
		t.index[t.items[c].Client] = c
		i = c
	}
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
