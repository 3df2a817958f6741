package daemon

import (
	"fmt"
	"testing"
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
