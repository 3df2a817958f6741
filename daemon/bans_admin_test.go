package daemon

import (
	"net/http"
	"testing"
)

func TestFromLoopback(t *testing.T) {
	for _, tt := range []struct {
		addr string
		want bool
	}{
		{"127.0.0.1:5000", true},
		{"[::1]:5000", true},
		{"127.8.9.10:1", true},
		{"10.0.0.1:5000", false},
		{"[2001:db8::1]:5000", false},
		{"192.168.1.1:80", false},
		{"garbage", false},
		{"", false},
	} {
		if got := fromLoopback(&http.Request{RemoteAddr: tt.addr}); got != tt.want {
			t.Errorf("fromLoopback(%q) = %v, want %v", tt.addr, got, tt.want)
		}
	}
}
