package localbucket

import "math/bits"

// divisor divides by a number fixed when a Limit is built, with a multiplication and
// shifts instead of a hardware division (tens of cycles on the CPUs this runs on): the
// method of Granlund and Montgomery, "Division by invariant integers using
// multiplication" (1994), figure 4.1, exact for every 64-bit dividend. The zero value
// is not usable; build it with newDivisor.
type divisor struct {
	m        uint64
	sh1, sh2 uint8
}

// newDivisor returns the divisor of d >= 1.
func newDivisor(d uint64) divisor {
	l := uint(bits.Len64(d - 1)) // ceil(log2 d); 0 for d = 1
	// m = floor(2^64 * (2^l - d) / d) + 1; 2^l - d < d, so the quotient fits. For l = 64,
	// 2^l - d wraps to the right value.
	var hi uint64
	if l < 64 {
		hi = 1<<l - d
	} else {
		hi = -d
	}
	q, _ := bits.Div64(hi, 0, d)
	return divisor{m: q + 1, sh1: uint8(min(l, 1)), sh2: uint8(max(int(l)-1, 0))}
}

// div returns n / d.
func (v divisor) div(n uint64) uint64 {
	t, _ := bits.Mul64(v.m, n)
	return (t + (n-t)>>(v.sh1&63)) >> (v.sh2 & 63) // masked: no test for shifts of 64 or more
}
