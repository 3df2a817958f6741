package sync

import "testing"

// TestSlot compares Slot with what `redis-cli cluster keyslot` answered for the same keys
// (Redis 7.0.15).
func TestSlot(t *testing.T) {
	for _, tc := range []struct {
		key  string
		want uint16
	}{
		{"foo", 12182},
		{"bar", 5061},
		{"a", 15495},
		{"123456789", 12739},
		{"{user1000}.following", 3443},
		{"{user1000}.followers", 3443},
		{"foo{}{bar}", 8363},    // an empty tag: the whole key is hashed
		{"foo{{bar}}zap", 4015}, // the tag is "{bar"
		{"foo{bar}{zap}", 5061}, // the first tag only: same as "bar"
		{"{}", 15257},           // empty tag
		{"rl:login:{ip=10.0.0.1}", 4917},
		{"rl:a:{u1}", 4574},
		{"rl:b:{u2}", 8637},
		{"", 0},
	} {
		if got := Slot(tc.key); got != tc.want {
			t.Errorf("Slot(%q) = %d, want %d", tc.key, got, tc.want)
		}
	}
}

func BenchmarkSlot(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		Slot("login:{user=alice%40example.com|ip=10.0.0.1}")
	}
}
