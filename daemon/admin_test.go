package daemon

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

func startAdmin(t *testing.T, deps AdminDeps) string {
	t.Helper()
	a, err := NewAdmin("127.0.0.1:0", deps)
	if err != nil {
		t.Fatal(err)
	}
	go a.Serve()
	t.Cleanup(func() { _ = a.Shutdown(context.Background()) })
	return "http://" + a.Addr()
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// With Redis down the daemon still answers every check by its rules' failure policies,
// closed ones included: it is ready. An orchestrator must not mark every gateway unready
// at once; degradation shows as rlsidecar_store_unreachable and its alert instead.
func TestReadyWhileStoreDown(t *testing.T) {
	set, err := rules.Parse("test.yaml", []byte(`
rules:
  - name: login
    key: user
    mode: global
    on_store_failure: closed
    limit: { requests: 5, per: 1m }
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		reachable bool
		gauge     string
	}{
		{"reachable", true, "rlsidecar_store_unreachable 0"},
		{"down", false, "rlsidecar_store_unreachable 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := NewMetrics("test", 10)
			base := startAdmin(t, AdminDeps{Metrics: m, Limiter: limiter.New(set, localbucket.NewStore(localbucket.Options{})),
				StoreReachable: func() bool { return tc.reachable }})
			if code, body := get(t, base+"/readyz"); code != 200 {
				t.Fatalf("/readyz: %d %s", code, body)
			}
			if _, body := get(t, base+"/metrics"); !strings.Contains(body, tc.gauge+"\n") {
				t.Fatalf("/metrics lacks %q:\n%s", tc.gauge, body)
			}
		})
	}
}

// /rules describes each rule as the rules file says it: a calendar window by its unit and
// zone, a concurrency rule by max and lease (no algorithm or rate), limit: unlimited and
// deny as such, and match, plans (the rule's own and the top-level ones it takes),
// replaces, warn_at, delay and penalty beside the fields it always had.
func TestRulesEndpointDescribesRules(t *testing.T) {
	set, err := rules.Parse("test.yaml", []byte(`
plans:
  gold: 2x
rules:
  - name: daily-sp
    match: { path: /cal }
    key: ip
    limit: { requests: 3, per: day, tz: America/Sao_Paulo }
    warn_at: 0.5
  - name: exports
    match: { path: "/v1/exports/**" }
    key: user
    concurrency: { max: 2, lease: 30s }
    plans: { partner: 5 }
  - name: login
    match: { path: /login, method: [POST, PUT], tenant: { glob: "acme-*", not: acme-test, not_glob: "*-tmp" } }
    key: [ip, user]
    limit: { requests: 5, per: 1m, burst: 10 }
    plans: { internal: unlimited, partner: 50 }
    penalty: { after: 10, within: 1m, ban: 10m }
    ip_prefix: { attr: ip, ipv6: 56 }
    delay: 2s
    replaces: [daily-sp]
    shadow: true
    mode: local
    split: 4
    on_store_failure: closed
  - name: weekly
    key: user
    limit: { requests: 7, per: week }
    split: auto
  - name: open
    key: ip
    limit: unlimited
  - name: blocked
    match: { ip: 10.0.0.1 }
    key: ip
    limit: deny
`))
	if err != nil {
		t.Fatal(err)
	}
	base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10), Limiter: limiter.New(set, localbucket.NewStore(localbucket.Options{}))})
	code, body := get(t, base+"/rules")
	if code != 200 {
		t.Fatalf("/rules: %d %s", code, body)
	}
	var doc struct {
		Rules []json.RawMessage `json:"rules"`
	}
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatalf("/rules: %v\n%s", err, body)
	}
	want := []string{
		`{"name": "daily-sp", "match": {"path": ["/cal"]}, "key": ["ip"],
		  "algorithm": "fixed_window", "requests": 3, "per": "day", "tz": "America/Sao_Paulo",
		  "plans": {"gold": 6}, "warn_at": 0.5,
		  "mode": "local", "on_store_failure": "local", "shadow": false, "file": "test.yaml", "line": 5}`,
		`{"name": "exports", "match": {"path": ["/v1/exports/**"]}, "key": ["user"],
		  "concurrency": {"max": 2, "lease": "30s"}, "plans": {"gold": 4, "partner": 5},
		  "mode": "local", "on_store_failure": "local", "shadow": false, "file": "test.yaml", "line": 10}`,
		`{"name": "login",
		  "match": {"path": ["/login"], "method": ["POST", "PUT"], "tenant": {"glob": ["acme-*"], "not": ["acme-test"], "not_glob": ["*-tmp"]}},
		  "key": ["ip", "user"], "algorithm": "token_bucket", "requests": 5, "per": "1m", "burst": 10,
		  "plans": {"gold": 10, "internal": "unlimited", "partner": 50},
		  "replaces": ["daily-sp"], "delay": "2s",
		  "penalty": {"after": 10, "within": "1m", "ban": "10m", "factor": 2, "max": "2h40m"},
		  "ip_prefix": {"attr": "ip", "ipv4": 32, "ipv6": 56},
		  "mode": "local", "on_store_failure": "closed", "shadow": true, "split": 4, "file": "test.yaml", "line": 15}`,
		`{"name": "weekly", "key": ["user"], "algorithm": "fixed_window", "requests": 7, "per": "week", "tz": "UTC",
		  "plans": {"gold": 14},
		  "mode": "local", "on_store_failure": "local", "shadow": false, "split": "auto", "file": "test.yaml", "line": 28}`,
		`{"name": "open", "key": ["ip"], "limit": "unlimited",
		  "mode": "local", "on_store_failure": "local", "shadow": false, "file": "test.yaml", "line": 32}`,
		`{"name": "blocked", "match": {"ip": ["10.0.0.1"]}, "key": ["ip"], "limit": "deny",
		  "mode": "local", "on_store_failure": "local", "shadow": false, "file": "test.yaml", "line": 35}`,
	}
	if len(doc.Rules) != len(want) {
		t.Fatalf("/rules has %d rules; want %d:\n%s", len(doc.Rules), len(want), body)
	}
	for i, w := range want {
		var got, exp any
		if err := json.Unmarshal(doc.Rules[i], &got); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal([]byte(w), &exp); err != nil {
			t.Fatalf("want[%d]: %v", i, err)
		}
		if !reflect.DeepEqual(got, exp) {
			t.Errorf("rule %d:\n got %s\nwant %s", i, doc.Rules[i], w)
		}
	}
	// The match conditions keep the file's order (a JSON object's order is not
	// significant to a parser, but it is to the operator reading it).
	if i, j, k := strings.Index(body, `"/login"`), strings.Index(body, `"POST"`), strings.Index(body, `"acme-*"`); !(i < j && j < k) {
		t.Errorf("login's match is not in the file's order (path, method, tenant):\n%s", body)
	}
}

// --admin 0.0.0.0:P listens on IPv4 only: the IPv6 wildcard of its port stays free (Go's
// "tcp" took both, exposing the endpoint on IPv6 addresses a firewall for IPv4 misses).
func TestAdminIPv4WildcardIsIPv4Only(t *testing.T) {
	if ln, err := net.Listen("tcp6", "[::1]:0"); err != nil {
		t.Skip("no IPv6 on this host:", err)
	} else {
		ln.Close()
	}
	a, err := NewAdmin("0.0.0.0:0", AdminDeps{Metrics: NewMetrics("test", 10)})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Shutdown(context.Background())
	_, port, _ := net.SplitHostPort(a.Addr())
	ln6, err := net.Listen("tcp6", net.JoinHostPort("::", port))
	if err != nil {
		t.Fatalf("the admin endpoint on 0.0.0.0:%s holds [::]:%s too: %v", port, port, err)
	}
	ln6.Close()
}

// Connections held idle between requests (keep-alive) up to the cap do not keep a new
// client out: the one idle longest is closed to make room. Before, the 65th connection
// was closed as soon as accepted, for as long as the 64 were kept alive (a request on
// each within the 2-minute idle timeout), so one local process kept the scraper out.
func TestAdminIdleConnectionsYield(t *testing.T) {
	base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10)})
	addr := strings.TrimPrefix(base, "http://")
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for i := range maxAdminConns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		resp.Body.Close() // and held open, idle (keep-alive)
	}
	for i := range 3 {
		client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
		resp, err := client.Get(base + "/healthz")
		if err != nil {
			t.Fatalf("new client %d beside %d idle connections: %v", i, maxAdminConns, err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("new client %d: %s", i, resp.Status)
		}
	}
}

// The admin endpoint answers any local user (it has no group, unlike the socket), so its
// connections are capped: each holds one of the daemon's descriptors, which the
// gateways' socket needs too. Before, idle keep-alive connections were held without
// bound and forever (no IdleTimeout): a local process holding as many as the daemon's
// descriptor limit made every accept fail with EMFILE, on the msgpack socket as well,
// and the gateways' connections waited in the backlog unanswered.
func TestAdminConnectionsCapped(t *testing.T) {
	base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10)})
	addr := strings.TrimPrefix(base, "http://")
	const tries = 200
	answered := 0
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range tries {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
			continue
		}
		if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
			resp.Body.Close()
			answered++ // and held open, idle, by the server (keep-alive)
		}
	}
	// Each new connection past the cap closes the one idle longest (or is itself
	// closed): the server holds at most 64 open, which read no end of file.
	open := 0
	for _, c := range conns {
		c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); errors.Is(err, os.ErrDeadlineExceeded) {
			open++
		}
	}
	if open > 64 || answered < 64 {
		t.Fatalf("%d of %d connections held open at once, %d answered; want at most 64 open", open, tries, answered)
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	deadline := time.Now().Add(2 * time.Second)
	for {
		resp, err := http.Get(base + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no answer once the held connections closed: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Connections whose clients send requests and read none of the answers do not keep a
// new client out for good: once an answer has not been taken for adminWriteTimeout, the
// connection is closed. Before, each such connection's write blocked on its full socket
// forever, and as they were busy (not idle) none was closed to make room: 64 of them
// kept every scraper and `rlsidecar reload` out for as long as their process lived.
func TestAdminStalledReadersYield(t *testing.T) {
	old := adminWriteTimeout
	adminWriteTimeout = 300 * time.Millisecond
	defer func() { adminWriteTimeout = old }()
	m := NewMetrics("test", 10)
	// An answer larger than the two sockets' buffers hold, both made small (the server's
	// on its listening socket, which its connections inherit): the server's first write
	// blocks. Small buffers keep the answer small, which 64 handlers render at once
	// (16 MB each took 20-40 s under -race on a busy machine).
	m.GaugeFunc("rlsidecar_test_big", strings.Repeat("x", 1<<20), func() float64 { return 1 })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	setBuf := func(opt int) func(syscall.RawConn) error {
		return func(rc syscall.RawConn) error {
			return rc.Control(func(fd uintptr) {
				_ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, opt, 4096)
			})
		}
	}
	rc, err := ln.(*net.TCPListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if err := setBuf(syscall.SO_SNDBUF)(rc); err != nil {
		t.Fatal(err)
	}
	a := newAdmin(ln, ln.Addr().String(), AdminDeps{Metrics: m})
	go a.Serve()
	t.Cleanup(func() { _ = a.Shutdown(context.Background()) })
	d := &net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error { return setBuf(syscall.SO_RCVBUF)(rc) }}
	crowdAdmin(t, "http://"+a.Addr(), d, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "read no answers")
}

// crowdAdmin holds maxAdminConns connections to the admin endpoint at base, dialed by d,
// each having sent request, and fails t unless a new client's GET /healthz is answered
// within 20 s beside them (what says what the held connections do, for the failure).
func crowdAdmin(t *testing.T, base string, d *net.Dialer, request, what string) {
	t.Helper()
	addr := strings.TrimPrefix(base, "http://")
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for range maxAdminConns {
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		if _, err := io.WriteString(c, request); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
		resp, err := client.Get(base + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("a new client beside %d connections that %s: %v", maxAdminConns, what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Connections whose clients have begun their first request and not finished it do not
// keep a new client out: the one waiting longest is closed to make room, as an idle one
// is. Either its headers come a byte a second (slowloris), or its request announced a
// body that comes a byte at a time (no route takes one). Before, none was, and the new
// client's connection was closed as it was accepted until the header or body timeout
// (5 s) closed one; a process dialing again at each close kept the endpoint for itself
// (bodies: 0 of 30 GET /healthz answered in 15 s against the real daemon). The new
// client must be answered before that timeout could have closed any of them.
func TestAdminUnfinishedRequestsYield(t *testing.T) {
	for _, tc := range []struct{ name, held string }{
		{"headers", "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "},
		{"bodies", "POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\nx"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10)})
			addr := strings.TrimPrefix(base, "http://")
			for range maxAdminConns {
				c, err := net.Dial("tcp", addr)
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				if _, err := io.WriteString(c, tc.held); err != nil {
					t.Fatal(err)
				}
			}
			// Let the endpoint accept them all (were one left in the listen queue, the
			// client below would take the last place and pass without any being closed).
			time.Sleep(time.Second)
			client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: time.Second}
			var err error
			for time.Since(start) < 4*time.Second { // the held requests are not yet 5 s late
				var resp *http.Response
				if resp, err = client.Get(base + "/healthz"); err == nil {
					resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						return
					}
					err = fmt.Errorf("status %d", resp.StatusCode)
				}
				time.Sleep(100 * time.Millisecond)
			}
			t.Fatalf("a new client beside %d connections that have not finished their %s: %v", maxAdminConns, tc.name, err)
		})
	}
}

// A client that sends requests announcing a body and never sends the body holds no
// admin connection for long. Before, the server waited for the body without a deadline
// (ReadHeaderTimeout covers the headers only, the write timeout only writes): one local
// process doing so on 64 connections, which are never idle and so never closed to make
// room, kept every scraper and `rlsidecar reload` out for as long as it liked.
func TestAdminUnfinishedBodiesYield(t *testing.T) {
	old := adminBodyTimeout
	adminBodyTimeout = 300 * time.Millisecond
	defer func() { adminBodyTimeout = old }()
	base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10)})
	crowdAdmin(t, base, &net.Dialer{}, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n", "never sent their requests' bodies")
}

// Likewise for requests the host guard refuses (a Host naming no address of the
// endpoint): the refusal is answered, and the server then waits for the announced body
// as for any other. Before, the guard refused before the body's deadline was set, and
// 64 such connections, never idle, kept every other client out for good.
func TestAdminRefusedUnfinishedBodiesYield(t *testing.T) {
	old := adminBodyTimeout
	adminBodyTimeout = 300 * time.Millisecond
	defer func() { adminBodyTimeout = old }()
	base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10)})
	crowdAdmin(t, base, &net.Dialer{}, "GET /bans HTTP/1.1\r\nHost: rebound.example\r\nContent-Length: 10\r\n\r\n", "were refused and never sent their requests' bodies")
}

// recordsTo is a slog.Handler sending each record it takes to a channel.
type recordsTo chan slog.Record

func (c recordsTo) Enabled(context.Context, slog.Level) bool      { return true }
func (c recordsTo) Handle(_ context.Context, r slog.Record) error { c <- r; return nil }
func (c recordsTo) WithAttrs([]slog.Attr) slog.Handler            { return c }
func (c recordsTo) WithGroup(string) slog.Handler                 { return c }

// emfileOnce is a listener whose first Accept fails as at the descriptor limit.
type emfileOnce struct {
	net.Listener
	failed bool
}

func (l *emfileOnce) Accept() (net.Conn, error) {
	if !l.failed {
		l.failed = true
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	return l.Listener.Accept()
}

// TestAdminServerErrorsGoToTheLogger: net/http's own lines (here its accept loop's, out
// of descriptors) go to the daemon's logger at warning level. They went in plain text to
// stderr, where the journal gave them no priority and they broke --log-format json.
func TestAdminServerErrorsGoToTheLogger(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	records := make(recordsTo, 16)
	a := newAdmin(&emfileOnce{Listener: ln}, ln.Addr().String(), AdminDeps{Metrics: NewMetrics("test", 10), Logger: slog.New(records)})
	go a.Serve()
	t.Cleanup(func() { _ = a.Shutdown(context.Background()) })
	select {
	case r := <-records:
		if r.Level != slog.LevelWarn || !strings.Contains(r.Message, "too many open files") {
			t.Fatalf("logged %v %q, want a warning naming the failed accept", r.Level, r.Message)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the HTTP server's line about its failed accept never reached the logger")
	}
}
