package tcpaddr

import (
	"net"
	"strconv"
	"testing"
)

func TestNetwork(t *testing.T) {
	for addr, want := range map[string]string{
		"0.0.0.0:9464":        "tcp4",
		"127.0.0.1:0":         "tcp4",
		"[::]:9464":           "tcp6",
		"[::1]:0":             "tcp6",
		"[fe80::1%eth0]:9464": "tcp6",
		":9464":               "tcp",
		"localhost:9464":      "tcp",
		"no port":             "tcp",
	} {
		if got := Network(addr); got != want {
			t.Errorf("Network(%q) = %q, want %q", addr, got, want)
		}
	}
}

// An IPv4 wildcard leaves the IPv6 wildcard of the same port free: it is not bound.
func TestIPv4WildcardIsIPv4Only(t *testing.T) {
	ln, err := Listen("0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	ln6, err := net.Listen("tcp6", net.JoinHostPort("::", strconv.Itoa(port)))
	if err != nil {
		if _, err6 := net.Listen("tcp6", "[::1]:0"); err6 != nil {
			t.Skip("no IPv6 on this host:", err6)
		}
		t.Fatalf("[::]:%d is taken by a listener on 0.0.0.0:%d: %v", port, port, err)
	}
	ln6.Close()
	// Go's own "tcp" takes both: the check above can tell the difference.
	both, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer both.Close()
	p2 := both.Addr().(*net.TCPAddr).Port
	if l, err := net.Listen("tcp6", net.JoinHostPort("::", strconv.Itoa(p2))); err == nil {
		l.Close()
		t.Log("this host's \"tcp\" on 0.0.0.0 is IPv4 only too")
	}
}
