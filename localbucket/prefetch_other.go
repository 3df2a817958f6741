//go:build !amd64

package localbucket

func prefetch(uintptr)           {}
func prefetch2(uintptr, uintptr) {}
