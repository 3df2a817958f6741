package sync

import (
	"fmt"
	"strings"
)

// DefaultPrefix starts every Redis key of a daemon unless it is given another
// (--redis-prefix): rule and inline-limit keys, their sync records, the live-daemons set.
const DefaultPrefix = "rl:"

// MaxPrefixLen is the longest prefix CheckPrefix accepts.
const MaxPrefixLen = 64

// CheckPrefix reports why prefix cannot start a daemon's Redis keys, or nil.
//
// A prefix is 1 to MaxPrefixLen printable ASCII characters without spaces, braces or
// other hash-tag syntax, ending with ':'. No braces: the client part of a key stays its
// only hash tag, so a prefix never moves a key to another Cluster slot nor lets a client
// value escape its tag. The final ':' makes deployments disjoint: what follows a prefix is
// a rule name (letters, digits, _ . -), "~inline/…" or "daemons", none containing ':'
// before the tag's '{', so a key under one prefix can never equal a key under another
// ("a:" and "a:b:" cannot both produce "a:b:c:{x}").
func CheckPrefix(prefix string) error {
	switch {
	case prefix == "":
		return fmt.Errorf("redis prefix: must not be empty (the default is %q)", DefaultPrefix)
	case len(prefix) > MaxPrefixLen:
		return fmt.Errorf("redis prefix %.16q…: %d bytes, at most %d", prefix, len(prefix), MaxPrefixLen)
	}
	for i := 0; i < len(prefix); i++ {
		c := prefix[i]
		if c <= ' ' || c >= 0x7f {
			return fmt.Errorf("redis prefix %q: byte %d (%#02x) is not printable ASCII", prefix, i, c)
		}
		if c == '{' || c == '}' {
			return fmt.Errorf("redis prefix %q: must not contain '{' or '}' (they would make a Redis Cluster hash tag)", prefix)
		}
	}
	if !strings.HasSuffix(prefix, ":") {
		return fmt.Errorf("redis prefix %q: must end with ':' (so no two prefixes can make the same key), e.g. %q", prefix, prefix+":")
	}
	return nil
}

// DaemonsKeyFor returns the name of the sorted set of live daemons under prefix (member:
// daemon id, score: Redis time of its last heartbeat, ms). Daemons under different
// prefixes count each other not.
func DaemonsKeyFor(prefix string) string { return prefix + "daemons" }
