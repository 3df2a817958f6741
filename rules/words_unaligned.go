//go:build (amd64 || arm64 || 386 || ppc64le) && !purego

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

// store64 writes w at b[i:i+8] with one store; the caller guarantees 0 <= i and
// i+8 <= len(b).
func store64(b []byte, i int, w uint64) {
	*(*uint64)(unsafe.Add(unsafe.Pointer(unsafe.SliceData(b)), i)) = w
}

// store32 writes w at b[i:i+4]; the caller guarantees 0 <= i and i+4 <= len(b).
func store32(b []byte, i int, w uint32) {
	*(*uint32)(unsafe.Add(unsafe.Pointer(unsafe.SliceData(b)), i)) = w
}
