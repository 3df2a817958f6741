package rules

// keep marks the bytes AppendEscaped writes as they are.
var keep = func() (t [256]bool) {
	for c := 'A'; c <= 'Z'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c] = true
	}
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for _, c := range "-._~:@/+" {
		t[c] = true
	}
	return t
}()

const upperHex = "0123456789ABCDEF"

// AppendEscaped appends s to dst, keeping the bytes A-Z a-z 0-9 - . _ ~ : @ / + and
// writing every other byte as %XX (uppercase hex), so "a|b{c}" becomes "a%7Cb%7Bc%7D".
// The encoding is injective and its output never contains '{', '}', '|', '=' or '%'
// other than as the start of an escape, which is what keeps client keys unambiguous and
// hash tags intact. It does not allocate when dst has room.
func AppendEscaped(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if !keep[s[i]] {
			return appendEscapedFrom(dst, s, i)
		}
	}
	return append(dst, s...) // the common case: nothing to escape, one copy
}

// appendEscapedFrom is AppendEscaped when s[i] is the first byte to escape.
func appendEscapedFrom(dst []byte, s string, i int) []byte {
	start := 0
	for ; i < len(s); i++ {
		c := s[i]
		if keep[c] {
			continue
		}
		dst = append(dst, s[start:i]...)
		dst = append(dst, '%', upperHex[c>>4], upperHex[c&0xF])
		start = i + 1
	}
	return append(dst, s[start:]...)
}
