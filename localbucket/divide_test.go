package localbucket

import (
	"math"
	"testing"

	"pgregory.net/rapid"
)

// The multiplicative division agrees with the hardware's for every divisor and dividend
// drawn, edges included.
func TestDivisor(t *testing.T) {
	edges := []uint64{1, 2, 3, 7, 10, 1 << 31, 1<<32 - 1, 1 << 32, 1<<63 - 1, 1 << 63, 1<<63 + 1, math.MaxUint64 - 1, math.MaxUint64}
	for _, d := range edges {
		v := newDivisor(d)
		for _, n := range append(edges, 0, d-1, d, d+1, 2*d, 2*d-1, 3_600_000_000_000) {
			if got, want := v.div(n), n/d; got != want {
				t.Fatalf("%d / %d = %d, want %d", n, d, got, want)
			}
		}
	}
	rapid.Check(t, func(t *rapid.T) {
		d := rapid.OneOf(rapid.Uint64Range(1, 1<<20), rapid.Uint64Range(1, math.MaxUint64)).Draw(t, "d")
		n := rapid.OneOf(rapid.Uint64Range(0, 1<<40), rapid.Uint64()).Draw(t, "n")
		if got, want := newDivisor(d).div(n), n/d; got != want {
			t.Fatalf("%d / %d = %d, want %d", n, d, got, want)
		}
	})
}
