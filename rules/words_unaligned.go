//go:build amd64 || arm64 || 386 || ppc64le

package rules

import "unsafe"

// load64 returns s[i:i+8] as a little-endian word, read with one (possibly unaligned)
// load, which this little-endian architecture allows. The caller guarantees 0 <= i and i+8 <= len(s).
func load64(s string, i int) uint64 {
	return *(*uint64)(unsafe.Add(unsafe.Pointer(unsafe.StringData(s)), i))
}

// load32 returns s[i:i+4] as one word; the caller guarantees 0 <= i and i+4 <= len(s).
func load32(s string, i int) uint32 {
	return *(*uint32)(unsafe.Add(unsafe.Pointer(unsafe.StringData(s)), i))
}
