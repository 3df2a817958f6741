package limiter

import (
	"strconv"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// AppendFingerprint appends to dst the fingerprint of lim's kind of state: '~', the
// algorithm (tb, sw, fw) and the window in its largest whole unit (~sw1h, ~fw1500ms,
// ~tb10s); for a calendar window, ~c, the unit and a hash of the zone (~cday.1a2b3c4d).
// It goes between a rule's name and the hash tag of the rule's Redis keys
// (rl:per-user~sw1h:{user=alice}), so that a reload changing a rule's algorithm or window
// starts its clients on fresh keys (the old ones expire by their TTL) instead of reading
// the old state under the new rule, while a reload changing only the limit keeps the
// counts. It never contains '{', '}' or ':', and rule names cannot contain '~', so keys
// of different rules or kinds never collide and the hash tag stays the client alone.
// Every Redis-backed store that keys state by rule calls it.
func AppendFingerprint(dst []byte, lim *localbucket.Limit) []byte {
	if unit, loc := lim.Calendar(); unit != localbucket.NoCalendar {
		h := uint32(2166136261) // FNV-1a, written out: no allocation per check
		for _, c := range []byte(loc.String()) {
			h = (h ^ uint32(c)) * 16777619
		}
		dst = append(dst, "~c"...)
		dst = append(dst, unit.String()...)
		dst = append(dst, '.')
		return strconv.AppendUint(dst, uint64(h), 16)
	}
	switch lim.Algorithm() {
	case localbucket.TokenBucket:
		dst = append(dst, "~tb"...)
	case localbucket.SlidingWindow:
		dst = append(dst, "~sw"...)
	default:
		dst = append(dst, "~fw"...)
	}
	return appendWindow(dst, lim.Window())
}

// appendWindow appends w in the largest unit that divides it: 1d, 90m, 1500ms, 7ns.
func appendWindow(dst []byte, w time.Duration) []byte {
	for _, u := range [...]struct {
		d    time.Duration
		name string
	}{{24 * time.Hour, "d"}, {time.Hour, "h"}, {time.Minute, "m"}, {time.Second, "s"}, {time.Millisecond, "ms"}} {
		if w >= u.d && w%u.d == 0 {
			return append(strconv.AppendInt(dst, int64(w/u.d), 10), u.name...)
		}
	}
	return append(strconv.AppendInt(dst, int64(w), 10), "ns"...)
}

// insertFingerprint inserts lim's fingerprint into key at i (the end of the rule's
// name), in place: no allocation once key's array has room.
func insertFingerprint(key []byte, i int, lim *localbucket.Limit) []byte {
	var buf [32]byte
	fp := AppendFingerprint(buf[:0], lim)
	n := len(key)
	key = append(key, fp...) // grow by len(fp)
	copy(key[i+len(fp):], key[i:n])
	copy(key[i:], fp)
	return key
}
