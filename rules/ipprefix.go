package rules

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// IPPrefix is a rule's ip_prefix: the key attribute Attr, when its value is an IP
// address, is keyed by the address's network, its first IPv4 bits (an IPv4 address, or
// an IPv4-mapped IPv6 one) or IPv6 bits (any other IPv6 address) — so a client holding a
// /64 has one bucket, not one per address.
//
// ip_prefix: {ipv6: 64} on a rule keyed on ip is {Attr: "ip", IPv4: 32, IPv6: 64}: the
// ip 2001:db8:1:2::7 is keyed as ip/64=2001:db8:1:2:: and 192.0.2.7 as ip/32=192.0.2.7.
type IPPrefix struct {
	Attr string
	IPv4 int // 0 to 32
	IPv6 int // 0 to 128
}

var ipPrefixFields = []string{"attr", "ipv4", "ipv6"}

// ipPrefix reads a rule's ip_prefix; nil when it is invalid (errors recorded). key is the
// rule's key as read (nil when it was invalid: attr is then not checked against it).
func (p *parser) ipPrefix(n *yaml.Node, field string, key []string) *IPPrefix {
	f, ok := p.mapping(n, field, ipPrefixFields)
	if f == nil {
		return nil
	}
	ip := &IPPrefix{IPv4: 32, IPv6: 128}
	bits := func(name string, most int, out *int) bool {
		v := f[name]
		if isNull(v) {
			return false
		}
		if v.Kind != yaml.ScalarNode || v.ShortTag() != "!!int" {
			p.errorf(v, field+"."+name, "expected a prefix length (a whole number from 0 to %d), got %s", most, describe(v))
			ok = false
			return true
		}
		b, err := strconv.Atoi(v.Value)
		if err != nil || b < 0 || b > most {
			p.errorf(v, field+"."+name, "%s is not a prefix length from 0 to %d", v.Value, most)
			ok = false
			return true
		}
		*out = b
		return true
	}
	has4 := bits("ipv4", 32, &ip.IPv4)
	has6 := bits("ipv6", 128, &ip.IPv6)
	if !has4 && !has6 {
		p.errorf(n, field, "give ipv4, ipv6 or both: the prefix lengths to key addresses by, e.g. { ipv4: 24, ipv6: 64 }")
		ok = false
	}
	if v := f["attr"]; !isNull(v) {
		if s, sok := p.str(v, field+".attr"); !sok {
			ok = false
		} else if key != nil && !slices.Contains(key, s) {
			p.errorf(v, field+".attr", "%q is not an attribute of the rule's key (%s)", s, strings.Join(key, ", "))
			ok = false
		} else {
			ip.Attr = s
		}
	} else if len(key) == 1 {
		ip.Attr = key[0]
	} else if len(key) > 1 {
		p.errorf(n, field+".attr", "missing: the key has several attributes (%s); name the one holding the address", strings.Join(key, ", "))
		ok = false
	}
	if !ok {
		return nil
	}
	return ip
}

// ipChar marks the bytes an IP address is written with (zone aside): hex digits, ':' and
// '.'. A value with any other byte is not parsed at all: netip.ParseAddr allocates its
// error.
var ipChar = func() (t [256]bool) {
	for _, c := range "0123456789abcdefABCDEF:." {
		t[c] = true
	}
	return t
}()

// maxIPText is the longest address text, zone aside:
// 0000:0000:0000:0000:0000:ffff:255.255.255.255.
const maxIPText = 45

// parseIP parses v as an IP address, as netip.ParseAddr does, dropping an IPv6 zone
// (fe80::1%eth0 is fe80::1) and unmapping an IPv4-mapped IPv6 address or one of NAT64's
// well-known prefix (unmap64). ok is false when v
// is not an address. It does not allocate for an address, nor for a value that has a
// byte an address is not written with (see ipChar) or not the colons or dots of one.
func parseIP(v string) (a netip.Addr, ok bool) {
	// One pass over the address's bytes, stopping at a zone's '%' or at any other byte
	// an address is not written with, or past the longest address.
	i := 0
	for n := min(len(v), maxIPText+1); i < n && ipChar[v[i]]; i++ {
	}
	s, zoned := v[:i], false
	if i < len(v) {
		if v[i] != '%' || i == len(v)-1 { // not an address byte, or an empty zone
			return a, false
		}
		zoned = true
	}
	// An IPv6 address has two colons or more, an IPv4 one three dots and none: a
	// number or a hex id (12345, cafe) is not parsed.
	if len(s) < 2 || len(s) > maxIPText {
		return a, false
	}
	if c := strings.Count(s, ":"); c < 2 && (c > 0 || strings.Count(s, ".") != 3) {
		return a, false
	}
	a, err := netip.ParseAddr(s)
	if err != nil || zoned && !a.Is6() { // netip takes a zone on IPv6 only
		return netip.Addr{}, false
	}
	return unmap64(a.Unmap()), true
}

// unmap64 returns the IPv4 address an address of NAT64's well-known prefix,
// 64:ff9b::/96 (RFC 6052), carries in its last 32 bits, else a. Behind a NAT64 or
// SIIT-DC translator every IPv4 client reaches the gateway as such an address: keyed
// as IPv6, ipv6: 64 put all of them in one bucket (64:ff9b::/64), and keyed whole,
// each IPv4 client had its own only by chance of the translator keeping its address.
// Network-specific prefixes are the operator's own and cannot be told apart: they
// are keyed as IPv6.
func unmap64(a netip.Addr) netip.Addr {
	if !a.Is6() {
		return a
	}
	b := a.As16()
	if [12]byte(b[:12]) != wellKnown64 {
		return a
	}
	return netip.AddrFrom4([4]byte(b[12:]))
}

var wellKnown64 = [12]byte{0x00, 0x64, 0xff, 0x9b}

// appendIPPart appends the key part of attribute name with value v for ip_prefix p:
// name/bits=network when v is an address (ip/64=2001:db8:1:2::, ip/24=192.0.2.0: the
// network's first address in its canonical text, RFC 5952 for IPv6, so every spelling of
// an address of the network writes the same part), else name=escaped value, as a rule
// without ip_prefix keys it. Attribute names never hold '/' or '=', and an escaped value
// never holds '|', so the two forms never meet.
func appendIPPart(dst []byte, p *IPPrefix, name, v string) []byte {
	dst = append(dst, name...)
	a, ok := parseIP(v)
	if !ok {
		dst = append(dst, '=')
		return AppendEscaped(dst, v)
	}
	bits := p.IPv6
	if a.Is4() {
		bits = p.IPv4
	}
	net, _ := a.Prefix(bits) // bits is in range for the family: checked when parsed
	dst = append(dst, '/')
	dst = strconv.AppendInt(dst, int64(bits), 10)
	dst = append(dst, '=')
	return net.Addr().AppendTo(dst)
}
