package localbucket

// prefetch asks the CPU to bring the cache line at addr into its caches, and goes on
// without waiting for it. It never faults, whatever addr is.
//
//go:noescape
func prefetch(addr uintptr)

// prefetch2 is prefetch of a and of b, in one call.
//
//go:noescape
func prefetch2(a, b uintptr)
