package rlclient

import (
	"bytes"
	"strings"
)

// NormalizePath returns the path attribute of a request whose target (as it came on the
// wire, or r.URL.EscapedPath()) is target: the path every rlsidecar client sends, so that a
// rule limits the same requests whichever gateway asks (clients/testdata/paths.json holds
// the cases every client is tested against). As nginx's $uri with merge_slashes on:
//
//   - an absolute-form target (`http://host/a?q`) counts from its path; the query (from
//     the first '?') and the fragment (from the first '#') are dropped;
//   - every valid %XX escape is decoded once: a decoded byte is never decoded again
//     (/a%2541 is /a%41), and a decoded '/' or '.' counts as one (/a%2Fb is /a/b); an
//     invalid escape stays as it is;
//   - runs of '/' are merged into one, and '.' and '..' segments are removed, a '..' at
//     the root staying at the root (/a/../b and /../b are /b); a trailing '/' stays;
//   - the result always starts with '/'.
//
// So /log%69n, //login and /a/../login are all /login. The result is bytes, not
// necessarily UTF-8 (/%FF is the byte 0xFF after '/').
func NormalizePath(target string) string {
	if i := schemeEnd(target); i > 0 {
		rest := target[i+len("://"):]
		if j := strings.IndexAny(rest, "/?#"); j >= 0 {
			target = rest[j:]
		} else {
			target = ""
		}
	}
	if i := strings.IndexAny(target, "?#"); i >= 0 {
		target = target[:i]
	}
	// Decode into b, after a '/' when the target has none of its own.
	b := make([]byte, 0, len(target)+1)
	if !strings.HasPrefix(target, "/") {
		b = append(b, '/')
	}
	for i := 0; i < len(target); i++ {
		c := target[i]
		if c == '%' && i+2 < len(target) && isHex(target[i+1]) && isHex(target[i+2]) {
			c = unhex(target[i+1])<<4 | unhex(target[i+2])
			i += 2
		}
		b = append(b, c)
	}
	// Walk the segments after the leading '/', writing the result over b: it never gets
	// ahead of the segment being read. out ends with '/' before every segment.
	out := b[:1]
	for i := 1; i <= len(b); {
		j := i
		for j < len(b) && b[j] != '/' {
			j++
		}
		seg := b[i:j]
		switch {
		case len(seg) == 0 || len(seg) == 1 && seg[0] == '.':
			// an empty segment (merged slashes, or a trailing '/') or '.': nothing
		case len(seg) == 2 && seg[0] == '.' && seg[1] == '.':
			if len(out) > 1 { // drop the last segment; at the root, stay there
				out = out[:bytes.LastIndexByte(out[:len(out)-1], '/')+1]
			}
		default:
			out = append(out, seg...)
			if j < len(b) {
				out = append(out, '/')
			}
		}
		i = j + 1
	}
	return string(out)
}

// schemeEnd returns the index of "://" when target begins with a URI scheme followed by
// "://" (an absolute-form request target), else -1.
func schemeEnd(target string) int {
	for i := 0; i < len(target); i++ {
		c := target[i]
		switch {
		case 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z':
		case i > 0 && ('0' <= c && c <= '9' || c == '+' || c == '-' || c == '.'):
		case i > 0 && c == ':':
			if strings.HasPrefix(target[i:], "://") {
				return i
			}
			return -1
		default:
			return -1
		}
	}
	return -1
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func unhex(c byte) byte {
	switch {
	case c <= '9':
		return c - '0'
	case c <= 'F':
		return c - 'A' + 10
	}
	return c - 'a' + 10
}
