// Package plural counts things in the daemon's messages: "1 key", "2 keys", never
// "1 keys" (an error, a lint warning and a refusal each said that once).
package plural

import "strconv"

// Integer is any integer type, so a count can be passed as it is held (a len, a
// uint64 limit) without a conversion at the call.
type Integer interface {
	~int | ~int8 | ~int16 | ~int32 | ~int64 |
		~uint | ~uint8 | ~uint16 | ~uint32 | ~uint64 | ~uintptr
}

// Count is n and noun, with an s unless n is 1: Count(1, "key") is "1 key",
// Count(0, "key") "0 keys". It knows only the regular plural; every noun counted so far
// takes an s.
func Count[N Integer](n N, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	var num string
	if n < 0 {
		num = strconv.FormatInt(int64(n), 10)
	} else {
		num = strconv.FormatUint(uint64(n), 10)
	}
	return num + " " + noun + "s"
}
