package daemon

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/rules"
)

// The heavy offender of a skewed stream is found, with memory bounded by k.
func TestTopK(t *testing.T) {
	// Space-Saving keeps every client above 1/k of the stream: heavy is 5000 of 17000,
	// second 2000, the rest never repeat.
	tk := newTopK(10)
	for i := 0; i < 10000; i++ {
		tk.add([]byte(fmt.Sprint("noise-", i)))
		if i%2 == 0 {
			tk.add([]byte("heavy"))
		}
		if i%5 == 0 {
			tk.add([]byte("second"))
		}
	}
	l := tk.list()
	if len(l) != 10 || l[0].Client != "heavy" || l[1].Client != "second" {
		t.Fatalf("%+v", l)
	}
	if l[0].Count-l[0].Err > 5000 || l[0].Count < 5000 {
		t.Fatalf("heavy counted %d ± %d, true 5000", l[0].Count, l[0].Err)
	}
	if len(tk.index) != 10 {
		t.Fatalf("index holds %d", len(tk.index))
	}
}

// A rule's sketch allocates nothing for clients it has not kept: every rule has one, and
// most never reject. Before, its index was sized for k up front: 20 rules at k = 100,000
// took about 60 MB of heap (at --top-k 1000, 10,000 rules took 528 MB; at --top-k
// 1000000000 the daemon took 23 GB before it started).
func TestTopKAllocatesNothingAhead(t *testing.T) {
	var yaml strings.Builder
	yaml.WriteString("rules:\n")
	for i := range 20 {
		fmt.Fprintf(&yaml, "  - { name: r%d, key: user, limit: { requests: 1, per: 1s } }\n", i)
	}
	set, err := rules.Parse("r.yaml", []byte(yaml.String()))
	if err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	m := NewMetrics("test", 100_000)
	m.SetRules(set, time.Now())
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 4<<20 {
		t.Fatalf("21 empty sketches at k = 100,000 hold %d bytes", grew)
	}
	runtime.KeepAlive(m)
}
