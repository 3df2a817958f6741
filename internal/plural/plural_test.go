package plural

import (
	"math"
	"testing"
)

func TestCount(t *testing.T) {
	for _, tt := range []struct {
		got, want string
	}{
		{Count(0, "key"), "0 keys"},
		{Count(1, "key"), "1 key"},
		{Count(2, "key"), "2 keys"},
		{Count(-1, "key"), "-1 keys"},
		{Count(uint64(1), "request"), "1 request"},
		{Count(uint64(math.MaxUint64), "request"), "18446744073709551615 requests"},
		{Count(int64(math.MinInt64), "byte"), "-9223372036854775808 bytes"},
		{Count(uint8(255), "byte"), "255 bytes"},
	} {
		if tt.got != tt.want {
			t.Errorf("got %q, want %q", tt.got, tt.want)
		}
	}
}
