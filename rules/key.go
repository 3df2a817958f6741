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

// keep8 is keep as 1s and 0s, to test several bytes with one branch.
var keep8 = func() (t [256]uint8) {
	for c, k := range keep {
		if k {
			t[c] = 1
		}
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
	// The common case is a value with nothing to escape, copied in one append; test its
	// bytes four at a time, one branch each.
	i := 0
	for ; i+4 <= len(s); i += 4 {
		b := s[i : i+4]
		if keep8[b[0]]&keep8[b[1]]&keep8[b[2]]&keep8[b[3]] == 0 {
			break
		}
	}
	for ; i < len(s); i++ {
		if keep8[s[i]] == 0 {
			return appendEscapedFrom(dst, s, i)
		}
	}
	return append(dst, s...)
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
