// Package tcpaddr listens on a TCP address the way an operator reads it: an IPv4
// address, 0.0.0.0 included, is IPv4 only, and an IPv6 one, [::] included, IPv6 only.
// Go's "tcp" network binds 0.0.0.0 and [::] on both families, which opened the admin
// endpoint and the Envoy API on every IPv6 address of a host whose firewall was written
// for the IPv4 ones. A host name or an empty host (":9464") keeps Go's meaning.
package tcpaddr

import (
	"net"
	"net/netip"
)

// Network returns the network to listen on addr with: "tcp4" for an IPv4 address,
// "tcp6" for an IPv6 one, else "tcp".
func Network(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return "tcp" // net.Listen reports the error
	}
	ip, err := netip.ParseAddr(host)
	switch {
	case err != nil:
		return "tcp"
	case ip.Is4():
		return "tcp4"
	default:
		return "tcp6"
	}
}

// Listen listens on addr, on the network Network gives.
func Listen(addr string) (net.Listener, error) {
	return net.Listen(Network(addr), addr)
}
