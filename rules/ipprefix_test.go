package rules

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

func TestIPPrefixParse(t *testing.T) {
	good := []struct {
		rule string
		want IPPrefix
	}{
		{"key: ip\n    ip_prefix: { ipv4: 24, ipv6: 64 }", IPPrefix{"ip", 24, 64}},
		{"key: ip\n    ip_prefix: { ipv6: 56 }", IPPrefix{"ip", 32, 56}},
		{"key: ip\n    ip_prefix: { ipv4: 0 }", IPPrefix{"ip", 0, 128}},
		{"key: ip\n    ip_prefix: { ipv4: 32, ipv6: 128 }", IPPrefix{"ip", 32, 128}},
		{"key: [remote_address]\n    ip_prefix: { ipv6: 0 }", IPPrefix{"remote_address", 32, 0}},
		{"key: [user, ip]\n    ip_prefix: { attr: ip, ipv6: 48 }", IPPrefix{"ip", 32, 48}},
	}
	for _, tt := range good {
		set := mustParse(t, "rules:\n  - name: r\n    "+tt.rule+"\n    limit: { requests: 1, per: 1s }\n")
		if got := set.Rules[0].IPPrefix; got == nil || *got != tt.want {
			t.Errorf("%s: IPPrefix = %+v, want %+v", tt.rule, got, tt.want)
		}
	}
	bad := []struct{ rule, want string }{
		{"key: ip\n    ip_prefix: { ipv4: 33 }", "test.yaml:4: rules[0].ip_prefix.ipv4: 33 is not a prefix length from 0 to 32"},
		{"key: ip\n    ip_prefix: { ipv6: 129 }", "rules[0].ip_prefix.ipv6: 129 is not a prefix length from 0 to 128"},
		{"key: ip\n    ip_prefix: { ipv6: -1 }", "rules[0].ip_prefix.ipv6: -1 is not a prefix length from 0 to 128"},
		{"key: ip\n    ip_prefix: { ipv6: 99999999999999999999 }", "rules[0].ip_prefix.ipv6: expected a prefix length (a whole number from 0 to 128), got"},
		{"key: ip\n    ip_prefix: { ipv6: 6.4 }", "rules[0].ip_prefix.ipv6: expected a prefix length (a whole number from 0 to 128), got a number 6.4"},
		{"key: ip\n    ip_prefix: { ipv6: /64 }", `rules[0].ip_prefix.ipv6: expected a prefix length (a whole number from 0 to 128), got a string "/64"`},
		{"key: ip\n    ip_prefix: {}", "rules[0].ip_prefix: give ipv4, ipv6 or both"},
		{"key: ip\n    ip_prefix: { attr: ip }", "rules[0].ip_prefix: give ipv4, ipv6 or both"},
		{"key: ip\n    ip_prefix: 64", "rules[0].ip_prefix: expected a mapping, got"},
		{"key: ip\n    ip_prefix: { ipv6: 64, v6: 64 }", `rules[0].ip_prefix: unknown field "v6" (valid: attr, ipv4, ipv6)`},
		{"key: ip\n    ip_prefix: { attr: addr, ipv6: 64 }", `rules[0].ip_prefix.attr: "addr" is not an attribute of the rule's key (ip)`},
		{"key: [user, ip]\n    ip_prefix: { ipv6: 64 }", "rules[0].ip_prefix.attr: missing: the key has several attributes (user, ip); name the one holding the address"},
	}
	for _, tt := range bad {
		src := "rules:\n  - name: r\n    " + tt.rule + "\n    limit: { requests: 1, per: 1s }\n"
		_, err := Parse("test.yaml", []byte(src))
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: error %v, want one containing %q", tt.rule, err, tt.want)
		}
	}
}

func TestIPPrefixKey(t *testing.T) {
	set := mustParse(t, `rules:
  - name: net
    key: ip
    ip_prefix: { ipv4: 24, ipv6: 64 }
    limit: { requests: 1, per: 1s }
  - name: whole
    key: ip
    ip_prefix: { ipv4: 32, ipv6: 128 }
    limit: { requests: 1, per: 1s }
  - name: all
    key: ip
    ip_prefix: { ipv4: 0, ipv6: 0 }
    limit: { requests: 1, per: 1s }
  - name: combo
    key: [user, ip]
    ip_prefix: { attr: ip, ipv6: 48 }
    limit: { requests: 1, per: 1s }
`)
	net, whole, all, combo := set.Rules[0], set.Rules[1], set.Rules[2], set.Rules[3]
	tests := []struct {
		r     *Rule
		attrs []Attr
		want  string
	}{
		{net, []Attr{{"ip", "2001:db8:1:2::1"}}, "net:{ip/64=2001:db8:1:2::}"},
		{net, []Attr{{"ip", "2001:0DB8:0001:0002:ffff:ffff:ffff:ffff"}}, "net:{ip/64=2001:db8:1:2::}"}, // uppercase, leading zeros
		{net, []Attr{{"ip", "2001:db8:1:3::1"}}, "net:{ip/64=2001:db8:1:3::}"},
		{net, []Attr{{"ip", "192.0.2.77"}}, "net:{ip/24=192.0.2.0}"},
		{net, []Attr{{"ip", "::ffff:192.0.2.77"}}, "net:{ip/24=192.0.2.0}"},   // mapped: IPv4
		{net, []Attr{{"ip", "64:ff9b::192.0.2.77"}}, "net:{ip/24=192.0.2.0}"}, // NAT64's well-known prefix: IPv4
		{net, []Attr{{"ip", "64:FF9B::C000:24D"}}, "net:{ip/24=192.0.2.0}"},
		{net, []Attr{{"ip", "64:ff9b:1::192.0.2.77"}}, "net:{ip/64=64:ff9b:1::}"}, // a network-specific prefix: IPv6
		{net, []Attr{{"ip", "::FFFF:c000:024d"}}, "net:{ip/24=192.0.2.0}"},
		{net, []Attr{{"ip", "fe80::1%eth0"}}, "net:{ip/64=fe80::}"}, // zone dropped
		{net, []Attr{{"ip", "fe80::1%"}}, "net:{ip=fe80::1%25}"},    // empty zone: not an address
		{net, []Attr{{"ip", "192.0.2.1%eth0"}}, "net:{ip=192.0.2.1%25eth0}"},
		{net, []Attr{{"ip", "192.000.002.001"}}, "net:{ip=192.000.002.001}"}, // IPv4 leading zeros: refused by netip
		{net, []Attr{{"ip", "2001:db8::/64"}}, "net:{ip=2001:db8::/64}"},
		{net, []Attr{{"ip", "unknown"}}, "net:{ip=unknown}"},
		{net, []Attr{{"ip", ""}}, "net:{ip=}"},
		{net, []Attr{{"ip", "ip/64=2001:db8::"}}, "net:{ip=ip/64%3D2001:db8::}"},
		{net, []Attr{{"user", "x"}}, ""},
		{whole, []Attr{{"ip", "2001:db8::1"}}, "whole:{ip/128=2001:db8::1}"},
		{whole, []Attr{{"ip", "2001:0db8:0:0::1"}}, "whole:{ip/128=2001:db8::1}"},
		{whole, []Attr{{"ip", "::ffff:10.0.0.1"}}, "whole:{ip/32=10.0.0.1}"},
		{all, []Attr{{"ip", "2001:db8::1"}}, "all:{ip/0=::}"},
		{all, []Attr{{"ip", "10.0.0.1"}}, "all:{ip/0=0.0.0.0}"},
		{combo, []Attr{{"ip", "2001:db8:aa:bb::1"}, {"user", "ann"}}, "combo:{user=ann|ip/48=2001:db8:aa::}"},
		{combo, []Attr{{"ip", "10.1.2.3"}, {"user", "a|b"}}, "combo:{user=a%7Cb|ip/32=10.1.2.3}"},
		{combo, []Attr{{"ip", "10.1.2.3"}}, ""},
	}
	for _, tt := range tests {
		got, ok := tt.r.AppendKey([]byte("pre"), tt.attrs)
		if ok != (tt.want != "") || string(got) != "pre"+tt.want {
			t.Errorf("%s.AppendKey(%v) = %q, %v; want %q", tt.r.Name, tt.attrs, got, ok, "pre"+tt.want)
		}
		if ok && !validKeyText(string(got[len("pre"):])) {
			t.Errorf("%s.AppendKey(%v) = %q: not a client key's bytes", tt.r.Name, tt.attrs, got)
		}
	}
}

// validKeyText reports whether key is name:{client} with client of the bytes escaping
// writes (and '=', '|'), so that the hash tag is exactly the client.
func validKeyText(key string) bool {
	i := strings.IndexByte(key, '{')
	if i < 0 || !strings.HasSuffix(key, "}") || strings.Count(key, "{") != 1 || strings.Count(key, "}") != 1 {
		return false
	}
	for _, c := range []byte(key[i+1 : len(key)-1]) {
		if !keep[c] && c != '%' && c != '=' && c != '|' {
			return false
		}
	}
	return true
}

// Two addresses of one network (by the rule's prefix length for their family, IPv4-mapped
// ones as IPv4) always share a key, however they are spelt; addresses of different
// networks, and values that are not addresses, never do, unless they are the same value.
func TestIPPrefixKeyProperty(t *testing.T) {
	spell := func(t *rapid.T, a netip.Addr, label string) string {
		if a.Is4() {
			switch rapid.IntRange(0, 2).Draw(t, label+" form") {
			case 1:
				return "::ffff:" + a.String()
			case 2:
				b := a.As4()
				return fmt.Sprintf("::FFFF:%02X%02X:%x", b[0], b[1], uint16(b[2])<<8|uint16(b[3]))
			}
			return a.String()
		}
		b := a.As16()
		switch rapid.IntRange(0, 3).Draw(t, label+" form") {
		case 1: // every group written out, leading zeros, uppercase
			var s []string
			for i := 0; i < 16; i += 2 {
				s = append(s, fmt.Sprintf("%04X", uint16(b[i])<<8|uint16(b[i+1])))
			}
			return strings.Join(s, ":")
		case 2:
			return a.StringExpanded()
		case 3:
			return a.String() + "%eth0"
		}
		return a.String()
	}
	addr := func(t *rapid.T, label string, v4 bool, near []byte) netip.Addr {
		n := 16
		if v4 {
			n = 4
		}
		b := rapid.SliceOfN(rapid.Byte(), n, n).Draw(t, label)
		if near != nil && rapid.Bool().Draw(t, label+" near") {
			// share a random number of leading bits with near, so that equal networks
			// are common
			k := rapid.IntRange(0, min(n, len(near))*8).Draw(t, label+" shared")
			for i := 0; i < k; i++ {
				m := byte(0x80) >> (i % 8)
				b[i/8] = b[i/8]&^m | near[i/8]&m
			}
		}
		if v4 {
			return netip.AddrFrom4([4]byte(b))
		}
		a := netip.AddrFrom16([16]byte(b))
		if a.Is4In6() {
			a = a.Unmap() // keyed as IPv4: tested as such
		}
		return a
	}
	bytesOf := func(a netip.Addr) []byte {
		if a.Is4() {
			b := a.As4()
			return b[:]
		}
		b := a.As16()
		return b[:]
	}
	sameNet := func(a, b netip.Addr, bits int) bool {
		if a.Is4() != b.Is4() {
			return false
		}
		x, y := bytesOf(a), bytesOf(b)
		for i := 0; i < bits; i++ {
			m := byte(0x80) >> (i % 8)
			if x[i/8]&m != y[i/8]&m {
				return false
			}
		}
		return true
	}
	rapid.Check(t, func(t *rapid.T) {
		p := &IPPrefix{Attr: "ip", IPv4: rapid.IntRange(0, 32).Draw(t, "ipv4"), IPv6: rapid.IntRange(0, 128).Draw(t, "ipv6")}
		r := &Rule{Name: "r", Key: []string{"user", "ip"}, IPPrefix: p}
		r.setKeyLits()
		a := addr(t, "a", rapid.Bool().Draw(t, "a v4"), nil)
		b := addr(t, "b", rapid.Bool().Draw(t, "b v4"), bytesOf(a))
		if a.Is4() != b.Is4() && rapid.Bool().Draw(t, "same family") {
			b = addr(t, "b again", a.Is4(), bytesOf(a))
		}
		bits := p.IPv6
		if a.Is4() {
			bits = p.IPv4
		}
		sa, sb := spell(t, a, "a"), spell(t, b, "b")
		ka, oka := r.AppendKey(nil, []Attr{{"ip", sa}, {"user", "u"}})
		kb, okb := r.AppendKey(nil, []Attr{{"user", "u"}, {"ip", sb}})
		if !oka || !okb {
			t.Fatalf("no key for %q or %q", sa, sb)
		}
		if want := sameNet(a, b, bits); (string(ka) == string(kb)) != want {
			t.Fatalf("%q → %s, %q → %s: same network (v4 /%d, v6 /%d) %v", sa, ka, sb, kb, p.IPv4, p.IPv6, want)
		}
		// A value that is not an address never takes an address's key.
		other := rapid.OneOf(
			rapid.StringMatching(`[0-9a-fA-F:.%/=a-z]{0,40}`),
			rapid.Just(strings.TrimPrefix(string(ka), "r:{user=u|")),
			rapid.Just(sa+"/"+fmt.Sprint(bits)),
		).Draw(t, "other")
		if _, isAddr := parseIP(other); isAddr {
			return
		}
		ko, _ := r.AppendKey(nil, []Attr{{"ip", other}, {"user", "u"}})
		if string(ko) == string(ka) || !validKeyText(string(ko)) {
			t.Fatalf("value %q → %s, address %q → %s", other, ko, sa, ka)
		}
	})
}

// parseIP agrees with netip.ParseAddr on what is an address, and on which.
func TestParseIPMatchesNetip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := rapid.OneOf(
			rapid.StringMatching(`[0-9a-fA-F:.]{0,46}(%[a-z0-9]{0,3})?`),
			rapid.StringMatching(`(::)?[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}(%[a-z0-9]{0,3})?`),
			rapid.String(),
			rapid.SampledFrom([]string{"::", "::1", "1::", "::1.2.3.4", "1:2:3:4:5:6:1.2.3.4", "::ffff:1.2.3.4", "1:2:3:4:5:6:7::", "1:2:3:4:5:6:7:8:9", ":::", "1.2.3.4:"}),
			rapid.Map(rapid.SliceOfN(rapid.Byte(), 16, 16), func(b []byte) string {
				a := netip.AddrFrom16([16]byte(b))
				if b[0]&1 == 0 {
					return a.StringExpanded()
				}
				return a.String()
			}),
		).Draw(t, "s")
		got, ok := parseIP(s)
		want, err := netip.ParseAddr(s)
		if ok != (err == nil) || ok && got != unmap64(want.WithZone("").Unmap()) {
			t.Fatalf("parseIP(%q) = %v, %v; netip: %v, %v", s, got, ok, want, err)
		}
	})
}

func TestIPPrefixKeyAllocs(t *testing.T) {
	set := mustParse(t, `rules:
  - name: net
    key: ip
    ip_prefix: { ipv4: 24, ipv6: 64 }
    limit: { requests: 1, per: 1s }
`)
	r := set.Rules[0]
	buf := make([]byte, 0, 128)
	for _, v := range []string{"2001:db8:1:2::1", "192.0.2.7", "::ffff:192.0.2.7", "fe80::1%eth0", "unknown", "2001:db8::/64", "12345", "cafe", "1.2.3", "1.2.3.4.5", "10:1", ""} {
		attrs := []Attr{{"method", "GET"}, {"ip", v}}
		if n := testing.AllocsPerRun(100, func() { buf, _ = r.AppendKey(buf[:0], attrs) }); n != 0 {
			t.Errorf("AppendKey with ip %q: %v allocations, want 0", v, n)
		}
	}
}
