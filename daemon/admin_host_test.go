package daemon

import (
	"bufio"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// doHost sends method path to base with the Host header host, and returns the status
// and body.
func doHost(t *testing.T, method, base, path, host string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, base+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	return do(t, req)
}

// do sends req and returns its status and body.
func do(t *testing.T, req *http.Request) (int, string) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// A web page that rebinds its DNS name to 127.0.0.1 makes the browser send the admin
// endpoint requests whose Host is the page's name: they are refused, the ban stays, and
// nothing is read; requests addressed to an IP address or localhost are served.
func TestAdminRefusesRebindingHost(t *testing.T) {
	lim, now := bannedBy(t, "ip", "10.1.2.3")
	deps := AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Now: func() int64 { return now }}
	base := startAdmin(t, deps)
	port := base[strings.LastIndex(base, ":")+1:]
	if code, body := get(t, base+"/bans"); code != 200 || !strings.Contains(body, `"login"`) {
		t.Fatalf("no ban to lift: %d %s", code, body)
	}

	for _, host := range []string{"attacker.example:" + port, "attacker.example", "ATTACKER.example:" + port, "localhost.attacker.example:" + port} {
		for _, path := range []string{"/top", "/bans", "/rules", "/metrics", "/healthz"} {
			code, body := doHost(t, "GET", base, path, host)
			if code != http.StatusMisdirectedRequest || !strings.Contains(body, "rebinding") || strings.Count(body, "\n") != 1 {
				t.Errorf("GET %s with Host %s: %d %q; want 421 and a line saying why", path, host, code, body)
			}
		}
		if code, body := doHost(t, "DELETE", base, "/bans/login/ip=10.1.2.3", host); code != http.StatusMisdirectedRequest {
			t.Errorf("DELETE with Host %s: %d %q; want 421", host, code, body)
		}
	}
	if _, body := get(t, base+"/bans"); !strings.Contains(body, `"login"`) {
		t.Fatalf("a request with a foreign Host lifted the ban: %s", body)
	}

	for _, host := range []string{"127.0.0.1:" + port, "127.0.0.1", "localhost:" + port, "LocalHost", "localhost.:" + port, "[::1]:" + port, "[::1]", "10.0.0.7:" + port} {
		if code, body := doHost(t, "GET", base, "/top", host); code != 200 {
			t.Errorf("GET /top with Host %s: %d %q", host, code, body)
		}
	}
	// HTTP/1.0 sends no Host: no browser does that, so it is served.
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "GET /healthz HTTP/1.0\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("GET /healthz over HTTP/1.0 without Host: %d", resp.StatusCode)
	}
	if code, body := doHost(t, "DELETE", base, "/bans/login/ip=10.1.2.3", "localhost:"+port); code != http.StatusNoContent {
		t.Fatalf("DELETE with Host localhost: %d %q", code, body)
	}
}

// Bound beyond loopback, the endpoint serves the scrapers' routes whatever their Host (a
// scraper may address the host by a DNS name), and the routes that show client keys or
// lift bans still only to an IP address, localhost or the name it was bound to.
func TestAdminHostGuardOpen(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})
	for _, tt := range []struct {
		g            hostGuard
		method, path string
		host         string
		want         int
	}{
		{hostGuard{open: true}, "GET", "/metrics", "gw1.internal:9464", 200},
		{hostGuard{open: true}, "HEAD", "/healthz", "gw1.internal:9464", 200},
		{hostGuard{open: true}, "GET", "/readyz", "gw1.internal", 200},
		{hostGuard{open: true}, "GET", "/top", "gw1.internal:9464", 421},
		{hostGuard{open: true}, "GET", "/bans", "gw1.internal:9464", 421},
		{hostGuard{open: true}, "GET", "/rules", "gw1.internal:9464", 421},
		{hostGuard{open: true}, "DELETE", "/bans/r/c", "gw1.internal:9464", 421},
		{hostGuard{open: true}, "POST", "/metrics", "gw1.internal:9464", 421},
		{hostGuard{open: true}, "GET", "/metrics/", "gw1.internal:9464", 421},
		{hostGuard{open: true}, "GET", "/top", "192.0.2.1:9464", 200},
		{hostGuard{open: true, bound: "gw1.internal"}, "GET", "/top", "GW1.internal:9464", 200},
		{hostGuard{open: true, bound: "gw1.internal"}, "DELETE", "/bans/r/c", "gw1.internal", 200},
		{hostGuard{open: true, bound: "gw1.internal"}, "GET", "/top", "gw2.internal", 421},
		{hostGuard{}, "GET", "/metrics", "gw1.internal:9464", 421},
		{hostGuard{}, "GET", "/metrics", "[fe80::1%25eth0]:9464", 200},
	} {
		tt.g.next = ok
		req := httptest.NewRequest(tt.method, "http://x"+tt.path, nil)
		req.Host = tt.host
		w := httptest.NewRecorder()
		tt.g.ServeHTTP(w, req)
		if w.Code != tt.want {
			t.Errorf("%+v %s %s Host %s: %d, want %d", tt.g, tt.method, tt.path, tt.host, w.Code, tt.want)
		}
	}
	if got := boundHost("GW1.Internal:9464"); got != "gw1.internal" {
		t.Errorf("boundHost: %q", got)
	}
	for _, a := range []string{"127.0.0.1:9464", "[::1]:9464", ":9464", "0.0.0.0:9464", "garbage"} {
		if got := boundHost(a); got != "" {
			t.Errorf("boundHost(%q) = %q, want \"\"", a, got)
		}
	}
}

// A ban is lifted by attr=value with the value as the request sent it (URL-escaped in
// the path), not only as the key writes it: the user "{a}" is user=%7Ba%7D in the URL.
func TestAdminLiftBanByRawValue(t *testing.T) {
	lim, now := bannedBy(t, "user", "{a}")
	deps := AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Now: func() int64 { return now }}
	base := startAdmin(t, deps)
	if code, body := doHost(t, "DELETE", base, "/bans/login/user=b", "localhost"); code != http.StatusNotFound || !strings.Contains(body, "as the request sent it") {
		t.Fatalf("lifting the ban of another user: %d %q", code, body)
	}
	if code, body := doHost(t, "DELETE", base, "/bans/login/user=%7Ba%7D", "localhost"); code != http.StatusNoContent {
		t.Fatalf("lifting the ban of user {a} by its value: %d %q", code, body)
	}
	if _, body := get(t, base+"/bans"); strings.Contains(body, `"login"`) {
		t.Fatalf("the ban is still there: %s", body)
	}
}

// bannedBy returns a limiter whose rule login (keyed on attr, a penalty after one
// refusal) has banned the client attr=value, and the time it did.
func bannedBy(t *testing.T, attr, value string) (*limiter.Limiter, int64) {
	t.Helper()
	return bannedAll(t, attr, [][]rules.Attr{{{Name: attr, Value: value}}})
}

// bannedAll returns a limiter whose rule login (key: key, a penalty after one refusal)
// has banned each of clients, and the time it did.
func bannedAll(t *testing.T, key string, clients [][]rules.Attr) (*limiter.Limiter, int64) {
	t.Helper()
	set, err := rules.Parse("test.yaml", []byte(`
rules:
  - name: login
    key: `+key+`
    limit: { requests: 1, per: 1m }
    penalty: { after: 1, within: 1m, ban: 10m }
`))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{}))
	now := time.Now().UnixNano()
	for _, attrs := range clients {
		for i := 0; i < 4; i++ {
			var d limiter.Decision
			in := limiter.Input{Attrs: attrs, Cost: 1}
			if err := lim.Check(now, &in, &d); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := len(lim.Bans(now)); got != len(clients) {
		t.Fatalf("%d bans, want %d", got, len(clients))
	}
	return lim, now
}

// banned returns the clients (their keys' forms) rule login has banned.
func banned(lim *limiter.Limiter, now int64) []string {
	var out []string
	for _, b := range lim.Bans(now) {
		out = append(out, string(clientOf([]byte(b.Key))))
	}
	slices.Sort(out)
	return out
}

// The name /bans gives and the raw form overlap: user=%7B is the key's form of the user
// "{" and the raw form of the user "%7B" (whose key's form, user=%257B, sorts first in
// /bans). Sent as user=%257B, the name of "{" URL-escaped is the name of "%7B" as
// written: 409, naming both, and nothing lifted (before, "{" was, whoever was meant);
// each is then reached by the form the answer gives.
func TestAdminLiftBanNameBeforeRawValue(t *testing.T) {
	lim, now := bannedAll(t, "user", [][]rules.Attr{{{Name: "user", Value: "{"}}, {{Name: "user", Value: "%7B"}}})
	deps := AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Now: func() int64 { return now }}
	base := startAdmin(t, deps)
	code, body := doHost(t, "DELETE", base, "/bans/login/user=%257B", "localhost")
	if code != http.StatusConflict || !strings.Contains(body, "(user=%7B)") || !strings.Contains(body, "(user=%25257B)") {
		t.Fatalf("user=%%257B, two clients' name: %d %q; want 409 naming both", code, body)
	}
	if got := banned(lim, now); len(got) != 2 {
		t.Fatalf("a conflict lifted a ban: %q left", got)
	}
	if code, body := doRaw(t, "DELETE", base, "/bans/login/user=%7B"); code != http.StatusNoContent {
		t.Fatalf("lifting user=%%7B as listed: %d %q", code, body)
	}
	if got := banned(lim, now); !slices.Equal(got, []string{"user=%257B"}) {
		t.Fatalf("lifting user=%%7B left %q banned, want the user \"%%7B\" (user=%%257B)", got)
	}
	if code, body := doHost(t, "DELETE", base, "/bans/login/user=%25257B", "localhost"); code != http.StatusNoContent {
		t.Fatalf("lifting user=%%257B: %d %q", code, body)
	}
	if got := banned(lim, now); len(got) != 0 {
		t.Fatalf("still banned: %q", got)
	}
}

// A raw value may hold "|": the user "a|b" is user=a|b as sent, and a key of two
// attributes is lifted by its raw values joined as the key joins them.
func TestAdminLiftBanRawValueWithBar(t *testing.T) {
	lim, now := bannedBy(t, "user", "a|b")
	deps := AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Now: func() int64 { return now }}
	base := startAdmin(t, deps)
	if code, body := doHost(t, "DELETE", base, "/bans/login/user=a%7Cb", "localhost"); code != http.StatusNoContent {
		t.Fatalf("lifting the user a|b: %d %q", code, body)
	}
	if got := banned(lim, now); len(got) != 0 {
		t.Fatalf("still banned: %q", got)
	}

	lim, now = bannedAll(t, "[user, ip]", [][]rules.Attr{{{Name: "user", Value: "{x}"}, {Name: "ip", Value: "1.2.3.4"}}})
	deps = AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Now: func() int64 { return now }}
	base = startAdmin(t, deps)
	if code, body := doHost(t, "DELETE", base, "/bans/login/user=%7Bx%7D%7Cip=1.2.3.4", "localhost"); code != http.StatusNoContent {
		t.Fatalf("lifting user {x} at 1.2.3.4 by raw values (bans %q): %d %q", banned(lim, now), code, body)
	}
	if got := banned(lim, now); len(got) != 0 {
		t.Fatalf("still banned: %q", got)
	}
}

// GET /bans lists at most ?limit= bans (10,000 by default), those ending last first, and
// says in X-Total-Count how many are in force: unbounded, 100,000 local bans made a
// 10 MB answer.
func TestAdminBansBounded(t *testing.T) {
	var clients [][]rules.Attr
	for i := 0; i < 5; i++ {
		clients = append(clients, []rules.Attr{{Name: "ip", Value: "10.9.9." + strconv.Itoa(i)}})
	}
	lim, now := bannedAll(t, "ip", clients)
	base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Now: func() int64 { return now }})
	resp, err := http.Get(base + "/bans?limit=2")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var doc []banDoc
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		t.Fatal(err)
	}
	if len(doc) != 2 || resp.Header.Get("X-Total-Count") != "5" {
		t.Fatalf("limit=2: %d bans, X-Total-Count %q; want 2 of 5", len(doc), resp.Header.Get("X-Total-Count"))
	}
	if code, body := get(t, base+"/bans?limit=0"); code != http.StatusBadRequest {
		t.Fatalf("limit=0: %d %s; want 400", code, body)
	}
	if _, body := get(t, base+"/bans"); strings.Count(body, `"rule"`) != 5 {
		t.Fatalf("the default bound cut 5 bans: %s", body)
	}
}

// A ban is lifted by the name /bans lists, written in the URL as listed: a key of two
// attributes whose value holds an escape of its own (api_key=k%7Cip%3D1|ip=2, the
// api_key "k|ip=1"), and one whose value holds "/". Before, the path's decoding turned
// the first's escapes into the bytes they stand for, and the route took no "/": both
// were 404, only a doubly escaped form lifted the first, and nothing the second.
func TestAdminLiftBanByListedName(t *testing.T) {
	lim, now := bannedAll(t, "[api_key, ip]", [][]rules.Attr{
		{{Name: "api_key", Value: "k|ip=1"}, {Name: "ip", Value: "2"}},
		{{Name: "api_key", Value: "a/b"}, {Name: "ip", Value: "3"}},
		{{Name: "api_key", Value: "x y"}, {Name: "ip", Value: "4"}},
		{{Name: "api_key", Value: "https://r.example/"}, {Name: "ip", Value: "5"}},
	})
	deps := AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Now: func() int64 { return now }}
	base := startAdmin(t, deps)
	want := []string{"api_key=a/b|ip=3", "api_key=https://r.example/|ip=5", "api_key=k%7Cip%3D1|ip=2", "api_key=x%20y|ip=4"}
	if got := banned(lim, now); !slices.Equal(got, want) {
		t.Fatalf("banned %q, want %q", got, want)
	}
	for _, path := range []string{
		"/bans/login/api_key=k%7Cip%3D1|ip=2",         // as listed
		"/bans/login/api_key=a/b|ip=3",                // as listed, with its "/"
		"/bans/login/api_key=x%20y|ip=4",              // the value as sent ("x y"), URL-escaped
		"/bans/login/api_key=https://r.example/|ip=5", // as listed, its "//" not cleaned away
	} {
		if code, body := doRaw(t, "DELETE", base, path); code != http.StatusNoContent {
			t.Errorf("DELETE %s: %d %q", path, code, body)
		}
	}
	if got := banned(lim, now); len(got) != 0 {
		t.Fatalf("still banned: %q", got)
	}
}

// networkBans is a limiter whose rule login keys [user, ip] with ip_prefix /64 for
// IPv6, banning a client at its first refusal.
func networkBans(t *testing.T) *limiter.Limiter {
	t.Helper()
	set, err := rules.Parse("test.yaml", []byte(`
rules:
  - name: login
    key: [user, ip]
    ip_prefix: { attr: ip, ipv6: 64 }
    limit: { requests: 1, per: 1m }
    penalty: { after: 1, within: 1m, ban: 10m }
`))
	if err != nil {
		t.Fatal(err)
	}
	return limiter.New(set, localbucket.NewStore(localbucket.Options{}))
}

// banFrom checks one request of user from each of ips at now: the first is allowed, the
// rest refused (the first refusal bans the client).
func banFrom(t *testing.T, lim *limiter.Limiter, now int64, user string, ips ...string) {
	t.Helper()
	for i, ip := range ips {
		var d limiter.Decision
		in := limiter.Input{Attrs: []rules.Attr{{Name: "user", Value: user}, {Name: "ip", Value: ip}}, Cost: 1}
		if err := lim.Check(now, &in, &d); err != nil {
			t.Fatal(err)
		}
		if d.Allowed != (i == 0) {
			t.Fatalf("user %s, request %d from %s: allowed %v", user, i, ip, d.Allowed)
		}
	}
}

// A rule with ip_prefix bans a network: two addresses of one /64 are one client, listed
// by its key's form and lifted by it, or by any of its addresses as the request sent it.
func TestAdminLiftBanOfNetwork(t *testing.T) {
	lim := networkBans(t)
	now := time.Now().UnixNano()
	for _, user := range []string{"ann", "bob"} {
		banFrom(t, lim, now, user, "2001:db8:1:2::1", "2001:db8:1:2::2", "2001:DB8:1:2::3", "2001:db8:1:2:ffff::4")
	}
	if got, want := banned(lim, now), []string{"user=ann|ip/64=2001:db8:1:2::", "user=bob|ip/64=2001:db8:1:2::"}; !slices.Equal(got, want) {
		t.Fatalf("banned %q, want %q", got, want)
	}
	base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Now: func() int64 { return now }})
	if code, body := doRaw(t, "DELETE", base, "/bans/login/user=ann|ip=2001:db8:1:3::1"); code != http.StatusNotFound {
		t.Fatalf("lifting another network's ban: %d %q", code, body)
	}
	if code, body := doRaw(t, "DELETE", base, "/bans/login/user=ann|ip/64=2001:db8:1:2::"); code != http.StatusNoContent {
		t.Fatalf("lifting ann's ban as listed: %d %q", code, body)
	}
	if code, body := doRaw(t, "DELETE", base, "/bans/login/user=bob|ip=2001:0db8:1:2::77"); code != http.StatusNoContent {
		t.Fatalf("lifting bob's ban by an address of the network: %d %q", code, body)
	}
	if got := banned(lim, now); len(got) != 0 {
		t.Fatalf("still banned: %q", got)
	}
}

// With ip_prefix on a composite key, another attribute's value holding a "|" (listed
// escaped, user=a%7Cb) names its network's ban by an address, the value URL-escaped as
// for a rule without ip_prefix. Before, the client was split at every "|" once
// URL-decoded, "b" was no attr=value part, and the lift answered 404.
func TestAdminLiftBanOfNetworkEscapedBar(t *testing.T) {
	lim := networkBans(t)
	now := time.Now().UnixNano()
	banFrom(t, lim, now, "a|b", "2001:db8:1:2::1", "2001:db8:1:2::2", "2001:db8:1:2::3")
	if got, want := banned(lim, now), []string{"user=a%7Cb|ip/64=2001:db8:1:2::"}; !slices.Equal(got, want) {
		t.Fatalf("banned %q, want %q", got, want)
	}
	base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Now: func() int64 { return now }})
	if code, body := doRaw(t, "DELETE", base, "/bans/login/user=a%7Cb|ip=2001:db8:1:2::9"); code != http.StatusNoContent {
		t.Fatalf("lifting the ban by an address of the network: %d %q", code, body)
	}
	if got := banned(lim, now); len(got) != 0 {
		t.Fatalf("still banned: %q", got)
	}
}

// doRaw sends a request whose target is path, byte for byte, as curl sends what it is
// given (Go's client escapes a "|" in a path again).
func doRaw(t *testing.T, method, base, path string) (int, string) {
	t.Helper()
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	return do(t, &http.Request{Method: method, URL: &url.URL{Scheme: u.Scheme, Host: u.Host, Opaque: path}, Host: "localhost", Header: http.Header{}})
}
