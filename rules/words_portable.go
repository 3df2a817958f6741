//go:build !(amd64 || arm64 || 386 || ppc64le) || purego

package rules

import "encoding/binary"

// load64 returns s[i:i+8] as a little-endian word, byte by byte: this architecture may
// not allow unaligned loads (or the purego tag asks for bounds-checked code, which the
// tests run too: go test -tags purego ./rules).
func load64(s string, i int) uint64 {
	s = s[i : i+8]
	return uint64(s[0]) | uint64(s[1])<<8 | uint64(s[2])<<16 | uint64(s[3])<<24 |
		uint64(s[4])<<32 | uint64(s[5])<<40 | uint64(s[6])<<48 | uint64(s[7])<<56
}

// load32 returns s[i:i+4] as a little-endian word.
func load32(s string, i int) uint32 {
	s = s[i : i+4]
	return uint32(s[0]) | uint32(s[1])<<8 | uint32(s[2])<<16 | uint32(s[3])<<24
}

// store64 writes w at b[i:i+8], little-endian.
func store64(b []byte, i int, w uint64) { binary.LittleEndian.PutUint64(b[i:], w) }

// store32 writes w at b[i:i+4], little-endian.
func store32(b []byte, i int, w uint32) { binary.LittleEndian.PutUint32(b[i:], w) }
