package daemon

import (
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/connlimit"
	"github.com/rlsidecar/rlsidecar/internal/tcpaddr"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// Admin is the admin HTTP endpoint: /metrics (Prometheus text), /healthz (the process
// answers), /readyz (rules loaded: the daemon answers every check, by the rules' failure
// policies while Redis is away), /rules (the active rules, their version and load
// time), /top (the clients most often rejected, per rule), /bans (the penalty rules'
// bans in force; DELETE /bans/{rule}/{client} lifts one, from loopback only).
//
// Every request must name, in its Host header, an IP address, localhost or the host the
// endpoint was bound to (see hostAllowed): a web page that rebinds its own DNS name to
// 127.0.0.1 could otherwise read /top and lift bans through the browser of anyone on the
// host. When the endpoint is bound beyond loopback, GET /metrics, /healthz and /readyz
// take any Host, for scrapers that address the host by a DNS name.
type Admin struct {
	srv *http.Server
	ln  net.Listener
}

// AdminDeps is what the admin endpoint reports on.
type AdminDeps struct {
	Metrics *Metrics
	Limiter *limiter.Limiter
	// StoreReachable reports whether Redis answers (on a Cluster: every master); nil
	// when the daemon has none. It feeds the gauge rlsidecar_store_unreachable, never
	// /readyz.
	StoreReachable func() bool
	// Now is the limiter's clock (the daemon's monotonic one), for the bans' remaining
	// times; nil: the wall clock.
	Now func() int64
	// Draining reports whether the daemon has begun to drain (SIGTERM): it accepts no
	// more connections, and /readyz says so. nil: never.
	Draining func() bool
	// Reloads counts the reloads of the rules, which /rules shows (`rlsidecar reload`
	// waits on them); nil: /rules shows none.
	Reloads *ReloadState
	// Logger takes the HTTP server's own error lines (a client's query with ';', a failed
	// accept), at warning level, so they reach the journal with a priority and stay JSON
	// under --log-format json; nil: net/http's default, plain text on stderr.
	Logger *slog.Logger
}

// ReloadState counts the daemon's reloads of its rules (SIGHUP, the watched file): how
// many have begun, how many have ended, and why the last to end failed. Reloads run one
// at a time, so once Ended reaches a count Begun had, every reload begun by then has
// ended: `rlsidecar reload` reads Begun, sends SIGHUP, and waits for Ended to pass it.
type ReloadState struct {
	mu           sync.Mutex
	begun, ended uint64
	lastError    string
}

// Begin notes a reload begun.
func (r *ReloadState) Begin() {
	r.mu.Lock()
	r.begun++
	r.mu.Unlock()
}

// End notes a reload ended, with its error (nil: the rules in force are the file's).
func (r *ReloadState) End(err error) {
	r.mu.Lock()
	r.ended++
	r.lastError = ""
	if err != nil {
		r.lastError = err.Error()
	}
	r.mu.Unlock()
}

// Get returns the reloads begun and ended, and the last ended one's error ("": none).
func (r *ReloadState) Get() (begun, ended uint64, lastError string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.begun, r.ended, r.lastError
}

// NewAdmin listens on addr (e.g. 127.0.0.1:9464).
func NewAdmin(addr string, deps AdminDeps) (*Admin, error) {
	ln, err := tcpaddr.Listen(addr)
	if err != nil {
		return nil, fmt.Errorf("admin endpoint on %s: %w", addr, err)
	}
	return newAdmin(ln, addr, deps), nil
}

// newAdmin serves the endpoint on ln, bound to addr.
func newAdmin(ln net.Listener, addr string, deps AdminDeps) *Admin {
	if deps.StoreReachable != nil {
		deps.Metrics.GaugeFunc("rlsidecar_store_unreachable", "1 while Redis (on a Cluster: one of its masters, or more) does not answer: hybrid and global rules are decided by their failure policies, on a Cluster for the keys of the masters that do not answer (the daemon stays ready).", func() float64 {
			if deps.StoreReachable() {
				return 0
			}
			return 1
		})
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		w.Header().Set("Vary", "Accept-Encoding")
		if !acceptsGzip(r.Header.Values("Accept-Encoding")) {
			deps.Metrics.WritePrometheus(w)
			return
		}
		w.Header().Set("Content-Encoding", "gzip")
		zw := gzipWriters.Get().(*gzip.Writer)
		zw.Reset(w)
		deps.Metrics.WritePrometheus(zw)
		_ = zw.Close() // a write error is the client's going away: nothing to tell it
		zw.Reset(io.Discard)
		gzipWriters.Put(zw)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if why := notReady(deps); why != "" {
			http.Error(w, why, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	mux.HandleFunc("GET /rules", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, rulesDoc(deps))
	})
	mux.HandleFunc("GET /top", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, deps.Metrics.Top())
	})
	if deps.Now == nil {
		deps.Now = func() int64 { return time.Now().UnixNano() }
	}
	if deps.Limiter != nil {
		deps.Metrics.SetBannedKeys(func() map[string]int { return deps.Limiter.BannedKeys(deps.Now()) })
	}
	mux.HandleFunc("GET /bans", func(w http.ResponseWriter, r *http.Request) {
		// At most ?limit= bans (10,000 by default, as many as a read of the shared bans
		// keeps), those ending last first; X-Total-Count says how many are in force. Unbounded,
		// 100,000 bans in local mode made a 10 MB answer.
		limit := defaultBansLimit
		if v := r.URL.Query().Get("limit"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				http.Error(w, fmt.Sprintf("limit %q: want a count of bans, at least 1", v), http.StatusBadRequest)
				return
			}
			limit = n
		}
		doc := bansDoc(deps)
		w.Header().Set("X-Total-Count", strconv.Itoa(len(doc)))
		if len(doc) > limit {
			sort.SliceStable(doc, func(i, j int) bool { return doc[i].LeftMs > doc[j].LeftMs })
			doc = doc[:limit]
		}
		writeJSON(w, doc)
	})
	// DELETE /bans/{rule}/{client}, read from the request line (hostGuard sends it here
	// before the mux, whose cleaning of the path redirects a client's name holding "//",
	// a referer's value say).
	lift := func(w http.ResponseWriter, r *http.Request) {
		if !fromLoopback(r) {
			http.Error(w, "lifting a ban is allowed from the loopback interface only", http.StatusForbidden)
			return
		}
		// The client as the URL wrote it, its escapes kept (raw), and decoded (client): a
		// name /bans lists holds escapes of its own (api_key=k%7Cip%3D1|ip=2, the api_key
		// "k|ip=1"), which the path's decoding turns into the bytes they stand for, and an
		// attr=value form's parts are split at the "|" the URL wrote, not at one an escape
		// stood for. The request line's own text: r.URL's escaped path is escaped again
		// from the decoded one when the client sent a "|" (not a valid escaped-path byte).
		uri := r.RequestURI
		if !strings.HasPrefix(uri, "/") { // absolute form (http://host/bans/...)
			uri = r.URL.EscapedPath()
		}
		p, _ := strings.CutPrefix(uri, "/bans/")
		p, _, _ = strings.Cut(p, "?")
		rawRule, raw, _ := strings.Cut(p, "/")
		rule, err1 := url.PathUnescape(rawRule)
		client, err2 := url.PathUnescape(raw)
		if err1 != nil || err2 != nil || rule == "" || raw == "" {
			http.Error(w, "use DELETE /bans/{rule}/{client}, URL-escaped", http.StatusBadRequest)
			return
		}
		lifted, conflict, err := liftBan(deps, rule, client, raw)
		if err != nil {
			// Redis did not answer: the ban may well be in force (it is, on every daemon
			// that knows it), and "no ban" would send the operator looking for a typo.
			http.Error(w, fmt.Sprintf("the ban of %q by rule %q is not lifted: Redis did not answer (%v); try again", client, rule, err), http.StatusServiceUnavailable)
			return
		}
		if conflict != nil {
			// A listed name holds no byte that decodes to another listed name's, so the
			// first, as listed, and the second, URL-escaped, each name one client.
			http.Error(w, fmt.Sprintf("%q names two banned clients of rule %q, read URL-escaped (%q) or as written (%q): give the first as listed (%s) or the second URL-escaped (%s)",
				raw, rule, conflict[0], conflict[1], conflict[0], url.PathEscape(conflict[1])), http.StatusConflict)
			return
		}
		if !lifted {
			http.Error(w, fmt.Sprintf("no ban of %q by rule %q (give the client as /bans names it, or as attr=value with the value as the request sent it, URL-escaped)", client, rule), http.StatusNotFound)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
	mux.HandleFunc("DELETE /bans/{rule}/{client...}", lift) // a request line in absolute form
	idle := &idleConns{m: map[net.Conn]time.Time{}, fresh: map[net.Conn]time.Time{}}
	g := hostGuard{next: mux, lift: lift, bound: boundHost(addr), open: !boundLoopback(ln), bodyTimeout: adminBodyTimeout, idle: idle}
	srv := &http.Server{Handler: g, ReadHeaderTimeout: 5 * time.Second, WriteTimeout: adminWriteTimeout, IdleTimeout: adminIdleTimeout,
		ConnState: idle.track, ConnContext: withAdminConn}
	if deps.Logger != nil {
		srv.ErrorLog = slog.NewLogLogger(deps.Logger.Handler(), slog.LevelWarn)
	}
	return &Admin{srv: srv, ln: connlimit.Evicting(ln, maxAdminConns, idle.closeOldest)}
}

// maxAdminConns bounds the admin endpoint's connections at once; past it the one idle
// longest between requests is closed to make room, else the one waiting longest for its
// first request's headers or a body (idleConns.closeOldest), and when there is none the
// new one is closed as soon as it is accepted. Any local user can connect (the endpoint has no
// group, unlike the socket), and each connection holds one of the daemon's descriptors,
// which the gateways' socket needs too: unbounded, a process holding idle keep-alive
// connections up to the descriptor limit made every accept fail (EMFILE), the msgpack
// socket's as well. A scraper or an operator's curl needs one or two.
const maxAdminConns = 64

// idleConns is the admin connections idle between requests (keep-alive), and since
// when; and those that have not yet sent a whole first request, or whose request
// announced a body (fresh: bodied), and since when.
// Before, the connection cap refused every new connection while 64 were held idle: one
// process keeping 64 connections alive (a request on each every 2 minutes, the idle
// timeout) kept the scraper out for as long as it liked. Safe for concurrent use.
type idleConns struct {
	mu    sync.Mutex
	m     map[net.Conn]time.Time
	fresh map[net.Conn]time.Time
}

// track is the server's ConnState hook.
func (ic *idleConns) track(c net.Conn, s http.ConnState) {
	ic.mu.Lock()
	defer ic.mu.Unlock()
	switch s {
	case http.StateIdle:
		ic.m[c] = time.Now()
		delete(ic.fresh, c) // bodied
	case http.StateNew:
		ic.fresh[c] = time.Now()
	default:
		delete(ic.m, c)
		delete(ic.fresh, c)
	}
}

// bodied notes that c's request announced a body (Content-Length, chunked), which no
// route takes: c is closed to make room as a fresh one is, until its request ends. A
// client that writes its body as it sends its headers never waits on it. Before, such
// a connection was closed only by the body timeout (adminBodyTimeout): a process that
// held 64 of them, sending a byte of each body a second and connecting again whenever
// that timeout closed one, kept every scraper out (0 of 30 GET /healthz answered in
// 15 s), as the header timeout's slowloris did before f0d9fa7.
func (ic *idleConns) bodied(c net.Conn) {
	ic.mu.Lock()
	ic.fresh[c] = time.Now()
	ic.mu.Unlock()
}

// adminConnKey keys the request context's connection (withAdminConn).
type adminConnKey struct{}

// withAdminConn is the admin server's ConnContext: a request's context carries its
// connection, for hostGuard to tell idleConns (bodied).
func withAdminConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, adminConnKey{}, c)
}

// closeOldest closes the connection idle the longest, if any, else the one that has
// waited longest for its first request's headers (a client sends them as it connects:
// they take it well under a millisecond on this host) or for a body (bodied), and
// reports whether it closed one. A client that sends its next request as it is closed sees the connection close
// before any answer, as at the idle timeout, and sends it again (Go's and curl's
// clients do, for a GET). Before, a connection still reading its headers was never
// closed to make room: a process that held 64 of them, sending a byte a second and
// connecting again whenever the header timeout (5 s) closed one, kept every scraper,
// health check and `rlsidecar reload` out (no answer to 25 tries in 15 s).
func (ic *idleConns) closeOldest() bool {
	ic.mu.Lock()
	oldest := oldestOf(ic.m)
	if oldest != nil {
		delete(ic.m, oldest)
	} else if oldest = oldestOf(ic.fresh); oldest != nil {
		delete(ic.fresh, oldest)
	}
	ic.mu.Unlock()
	if oldest == nil {
		return false
	}
	_ = oldest.Close()
	return true
}

// oldestOf returns the connection of m with the earliest time, nil if m is empty.
func oldestOf(m map[net.Conn]time.Time) net.Conn {
	var oldest net.Conn
	var since time.Time
	for c, t := range m {
		if oldest == nil || t.Before(since) {
			oldest, since = c, t
		}
	}
	return oldest
}

// adminWriteTimeout closes an admin connection whose client has not taken a whole
// answer this long after sending its request. Before, a client that sent requests and
// read none of the answers held its connection for good (the server's write blocked on
// a full socket), and one local process doing so on 64 connections, which are not
// idle and so not closed to make room, kept every scraper and `rlsidecar reload` out.
// Prometheus gives a scrape 10 s by default; /metrics of thousands of rules is a few
// megabytes, written in milliseconds to a client that reads. A variable for the tests.
var adminWriteTimeout = 30 * time.Second

// adminBodyTimeout closes an admin connection whose client has announced a request
// body (Content-Length, chunked) and not sent all of it this long after the request's
// headers. No route takes a body; without it the server waited for one for ever after
// answering, and a local process doing so on 64 connections, which are never idle and
// so never closed to make room, kept every scraper and `rlsidecar reload` out. A
// variable for the tests.
var adminBodyTimeout = 5 * time.Second

// adminIdleTimeout closes an admin connection idle between requests this long (a
// Prometheus scrape every 15 s to 1 m keeps its connection).
const adminIdleTimeout = 2 * time.Minute

// hostGuard refuses requests whose Host header is a name the endpoint was not bound to:
// the mark of DNS rebinding, where a web page's own name is made to resolve to this host
// so that the visitor's browser sends it the page's requests (and hands the page the
// answers, the origin being the page's own). A name cannot be rebound if it is an IP
// address, localhost (which resolvers answer themselves) or the name the operator bound
// the endpoint to.
type hostGuard struct {
	next http.Handler
	lift http.HandlerFunc // DELETE /bans/..., taken before next (see New)
	// bound is the host part of the address the endpoint was given, lower case, when it
	// is a name rather than an IP address ("" otherwise).
	bound string
	// open is true when the endpoint listens beyond loopback. Anyone who reaches it then
	// reads the scrapers' routes by its IP address anyway, and a scraper may address it
	// by a DNS name the daemon cannot know (service discovery), so those routes take any
	// Host. The routes that show client keys or lift bans never do.
	open bool
	// bodyTimeout bounds the wait for an announced body (adminBodyTimeout, read once
	// when the endpoint is made).
	bodyTimeout time.Duration
	// idle is told of the connections whose request announced a body (bodied); nil: none.
	idle *idleConns
}

func (g hostGuard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.ContentLength != 0 {
		// No route reads a body, but the server reads what is announced before it takes
		// the connection's next request, and with no deadline of its own: also after a
		// refusal below.
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(g.bodyTimeout))
		if c, ok := r.Context().Value(adminConnKey{}).(net.Conn); ok && g.idle != nil {
			g.idle.bodied(c)
		}
	}
	if !g.hostAllowed(r.Host) && !(g.open && scrapeRoute(r)) {
		names := "an IP address or localhost"
		if g.bound != "" {
			names = "an IP address, localhost or " + g.bound
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusMisdirectedRequest)
		fmt.Fprintf(w, "refused: the admin endpoint answers requests addressed to %s, not to %q (a name that leads here may be a web page rebinding its DNS)\n", names, r.Host)
		return
	}
	if r.Method == http.MethodDelete && g.lift != nil && strings.HasPrefix(r.RequestURI, "/bans/") {
		g.lift(w, r)
		return
	}
	g.next.ServeHTTP(w, r)
}

// hostAllowed reports whether host (a Host header: name or IP, with or without port,
// an IPv6 address in brackets) names this endpoint in a way no web page can rebind. An
// empty Host (HTTP/1.0) is allowed: a browser always sends one.
func (g hostGuard) hostAllowed(host string) bool {
	if host == "" {
		return true
	}
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	} else if len(host) > 1 && host[0] == '[' && host[len(host)-1] == ']' {
		host = host[1 : len(host)-1] // [::1] without a port
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return true
	}
	host = strings.TrimSuffix(strings.ToLower(host), ".") // localhost. is localhost
	return host == "localhost" || g.bound != "" && host == strings.TrimSuffix(g.bound, ".")
}

// scrapeRoute reports whether r asks for what a Prometheus scraper or a health check
// reads: GET (or HEAD) of /metrics, /healthz or /readyz, exactly as the mux routes them.
func scrapeRoute(r *http.Request) bool {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		return false
	}
	switch r.URL.Path {
	case "/metrics", "/healthz", "/readyz":
		return true
	}
	return false
}

// boundHost returns the host of the listen address addr, lower case, when it is a name
// (e.g. "gw1.internal" of gw1.internal:9464); "" when it is an IP address or empty.
func boundHost(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil || host == "" {
		return ""
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return ""
	}
	return strings.ToLower(host)
}

// boundLoopback reports whether ln listens on a loopback address only (127.0.0.1, ::1;
// "localhost" binds the first of them).
func boundLoopback(ln net.Listener) bool {
	a, ok := ln.Addr().(*net.TCPAddr)
	return ok && a.IP.IsLoopback()
}

// defaultBansLimit is how many bans GET /bans lists unless asked for another count.
const defaultBansLimit = 10_000

// banDoc is one ban as /bans lists it: the client named as in the metrics (a keyed hash
// unless --top-labels raw).
type banDoc struct {
	Rule   string `json:"rule"`
	Client string `json:"client"`
	LeftMs int64  `json:"left_ms"`
	Count  uint32 `json:"count"`
}

func bansDoc(deps AdminDeps) []banDoc {
	out := []banDoc{}
	if deps.Limiter == nil {
		return out
	}
	for _, b := range deps.Limiter.Bans(deps.Now()) {
		out = append(out, banDoc{Rule: b.Rule, Client: deps.Metrics.ClientName(string(clientOf([]byte(b.Key)))),
			LeftMs: int64((b.Left + time.Millisecond - 1) / time.Millisecond), Count: b.Count})
	}
	return out
}

// liftBan lifts the ban of client by rule. client is the name /bans gives it (a label,
// or with --top-labels raw its key's escaped form) or, when no ban has that name, the
// client as the request sent it: attr=value, or attr=value|attr=value for a key of
// several attributes, with the raw values.
//
// The name /bans gives is tried first, over every ban, because the two forms overlap:
// user=%7B is the key's form of the user "{" and also the raw form of the user "%7B"
// (whose key's form, its name, is user=%257B). With both banned, a single pass in list
// order lifted whichever sorted first, the user "%7B" (TestAdminLiftBanNameBeforeRawValue).
//
// A name /bans gives may be read two ways, URL-escaped or as the URL wrote it: with the
// users "{" and "%7B" both banned (listed as user=%7B and user=%257B), user=%257B is the
// first escaped and the second as written. When the two readings name two banned
// clients, nothing is lifted and conflict names both: the caller says which.
func liftBan(deps AdminDeps, rule, client, escaped string) (lifted bool, conflict []string, err error) {
	if deps.Limiter == nil {
		return false, nil, nil
	}
	now := deps.Now()
	bans := deps.Limiter.Bans(now)
	named := func(name string) string { // the key of the ban /bans lists as name
		for _, b := range bans {
			if b.Rule != rule {
				continue
			}
			if c := string(clientOf([]byte(b.Key))); c == name || deps.Metrics.ClientName(c) == name {
				return b.Key
			}
		}
		return ""
	}
	// The name /bans gives, URL-escaped or as the URL wrote it; then the forms of
	// attr=value with values as sent (rawClientForms, escapedClientForm).
	a, b := named(client), ""
	if escaped != client {
		b = named(escaped)
	}
	switch {
	case a != "" && b != "" && a != b:
		return false, []string{string(clientOf([]byte(a))), string(clientOf([]byte(b)))}, nil
	case a != "":
		lifted, err = deps.Limiter.LiftBanErr(a, now)
		return lifted, nil, err
	case b != "":
		lifted, err = deps.Limiter.LiftBanErr(b, now)
		return lifted, nil, err
	}
	raw := append(rawClientForms(client), escapedClientForm(escaped)...)
	raw = append(raw, prefixedClientForms(deps.Limiter.Rules(), rule, client, escaped)...)
	for _, b := range bans {
		if b.Rule != rule {
			continue
		}
		if slices.Contains(raw, string(clientOf([]byte(b.Key)))) {
			lifted, err = deps.Limiter.LiftBanErr(b.Key, now)
			return lifted, nil, err
		}
	}
	// A ban this daemon does not list may still be in force in Redis, for every daemon:
	// one another daemon just started (listed here after its next round and this
	// daemon's next read, about two intervals), or one past the 10,000 a read keeps.
	// Before, its lift answered 404 "no ban" while every global check refused the
	// client as banned. Each form the request may mean is lifted only where Redis holds
	// a ban of it in force, the first such form.
	for i, form := range raw {
		if slices.Contains(raw[:i], form) {
			continue
		}
		if lifted, err = deps.Limiter.LiftSharedBan(rule, form, now); lifted || err != nil {
			return lifted, nil, err
		}
	}
	return false, nil, nil
}

// escapedClientForm is the key's form of a client written in a URL as attr=value parts
// joined by "|", each value as the request sent it and URL-escaped (api_key=k%7Cip%3D1|ip=2:
// the api_key "k|ip=1" and the ip "2"); nil when it is not of that form.
func escapedClientForm(escaped string) []string {
	if form, ok := partsEscaped(escaped, url.PathUnescape); ok {
		return []string{form}
	}
	return nil
}

// rawClientForms returns the key's forms client may stand for when its values are as
// the request sent them (user=%7B, the URL's escape of "{", is the user "{", whose key
// holds %7B): the whole of client after its first "=" as one value (user=a|b, the user
// "a|b"), and, when client is attr=value parts joined by "|" (a key of several
// attributes), each part's value escaped.
func rawClientForms(client string) []string {
	attr, value, ok := strings.Cut(client, "=")
	if !ok {
		return nil
	}
	forms := []string{attr + "=" + string(rules.AppendEscaped(nil, value))}
	if !strings.Contains(value, "|") {
		return forms
	}
	if form, ok := partsEscaped(client, func(v string) (string, error) { return v, nil }); ok {
		forms = append(forms, form)
	}
	return forms
}

// prefixedClientForms returns the key's forms of client, attr=value parts joined by "|"
// with values as the request sent them, for a rule named rule that has ip_prefix: an
// address's part names its network (ip=2001:db8:1:2::5 is ip/64=2001:db8:1:2::); nil
// for another rule or a client not of that form. With several attributes, the parts are
// those of escaped, the URL's text, split at the "|" it wrote and each value
// URL-decoded (user=a%7Cb|ip=…: the user "a|b"), or those of client split at every "|".
func prefixedClientForms(set *rules.Set, rule, client, escaped string) []string {
	if set == nil {
		return nil
	}
	for _, r := range set.Rules {
		if r.Name != rule || r.IPPrefix == nil {
			continue
		}
		readings := [][]string{{client}}
		if len(r.Key) > 1 {
			readings = [][]string{nil, strings.Split(client, "|")}
			for _, part := range strings.Split(escaped, "|") {
				a, v, ok := strings.Cut(part, "=")
				v, err := url.PathUnescape(v)
				if !ok || err != nil {
					readings[0] = nil
					break
				}
				readings[0] = append(readings[0], a+"="+v)
			}
		}
		var forms []string
	reading:
		for _, parts := range readings {
			attrs := make([]rules.Attr, 0, len(parts))
			for _, part := range parts {
				a, v, ok := strings.Cut(part, "=")
				if !ok {
					continue reading
				}
				attrs = append(attrs, rules.Attr{Name: a, Value: v})
			}
			if key, ok := r.AppendKey(nil, attrs); ok {
				forms = append(forms, string(clientOf(key)))
			}
		}
		return forms
	}
	return nil
}

// partsEscaped is the key's form of attr=value parts joined by "|", each value read by
// value, then escaped as a key escapes it; ok is false when client is not of that form.
func partsEscaped(client string, value func(string) (string, error)) (string, bool) {
	var b []byte
	for i, part := range strings.Split(client, "|") {
		a, v, ok := strings.Cut(part, "=")
		if !ok {
			return "", false
		}
		v, err := value(v)
		if err != nil {
			return "", false
		}
		if i > 0 {
			b = append(b, '|')
		}
		b = append(b, a...)
		b = append(b, '=')
		b = rules.AppendEscaped(b, v)
	}
	return string(b), true
}

// fromLoopback reports whether r comes from a loopback address.
func fromLoopback(r *http.Request) bool {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// Addr returns the address the endpoint listens on.
func (a *Admin) Addr() string { return a.ln.Addr().String() }

// Serve serves until Shutdown.
func (a *Admin) Serve() error {
	if err := a.srv.Serve(a.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Shutdown stops the endpoint and releases its port, also when Serve was never called
// (a start that failed after binding it).
func (a *Admin) Shutdown(ctx context.Context) error {
	err := a.srv.Shutdown(ctx)
	_ = a.ln.Close() // already closed when Serve ran
	return err
}

// notReady says why the daemon cannot answer, or "" when it can. Redis being away is not
// a reason: every check is then decided by its rule's failure policy (open, closed or
// local), which is an answer. Were it a reason, losing Redis would mark every gateway's
// daemon unready at once; degradation is the gauge rlsidecar_store_unreachable and its
// alert instead. A daemon that drains is not ready: it accepts no more connections.
func notReady(deps AdminDeps) string {
	if deps.Limiter.Rules() == nil {
		return "no rules loaded"
	}
	if deps.Draining != nil && deps.Draining() {
		return "draining: stopping, accepting no more connections"
	}
	return ""
}

// ruleDoc is one rule in /rules, as the rules file says it. A rate rule has algorithm,
// requests, per (a duration, or day, week or month for a calendar window, whose zone is
// tz), and burst when the file gives one; a concurrency rule has concurrency {max, lease}
// instead; limit: unlimited and limit: deny have limit "unlimited" or "deny" and none of
// these. mode is the mode the daemon gives the rule (its own, or the daemon's default).
//
//	{"name": "daily", "match": {"path": ["/cal"]}, "key": ["ip"], "algorithm": "fixed_window",
//	 "requests": 3, "per": "day", "tz": "America/Sao_Paulo", "warn_at": 0.5, "mode": "local", ...}
type ruleDoc struct {
	Name      string   `json:"name"`
	Match     matchDoc `json:"match,omitempty"`
	Key       []string `json:"key"`
	Algorithm string   `json:"algorithm,omitempty"`
	Requests  uint64   `json:"requests,omitempty"`
	Per       string   `json:"per,omitempty"`
	Burst     uint64   `json:"burst,omitempty"`
	TZ        string   `json:"tz,omitempty"`
	// Limit is "unlimited" or "deny" for those rules, as the file writes them.
	Limit       string          `json:"limit,omitempty"`
	Concurrency *concurrencyDoc `json:"concurrency,omitempty"`
	// Plans maps a plan to its requests (a concurrency rule's max) or "unlimited": the
	// rule's own plans and the top-level ones that apply to it, multipliers resolved.
	Plans          map[string]any `json:"plans,omitempty"`
	Replaces       []string       `json:"replaces,omitempty"`
	WarnAt         float64        `json:"warn_at,omitempty"`
	Delay          string         `json:"delay,omitempty"`
	Penalty        *penaltyDoc    `json:"penalty,omitempty"`
	IPPrefix       *ipPrefixDoc   `json:"ip_prefix,omitempty"`
	Mode           string         `json:"mode"`
	OnStoreFailure string         `json:"on_store_failure"`
	Shadow         bool           `json:"shadow"`
	Split          any            `json:"split,omitempty"`
	File           string         `json:"file"`
	Line           int            `json:"line"`
}

type concurrencyDoc struct {
	Max   uint64 `json:"max"`
	Lease string `json:"lease"`
}

// ipPrefixDoc is a rule's ip_prefix, defaults filled in.
type ipPrefixDoc struct {
	Attr string `json:"attr"`
	IPv4 int    `json:"ipv4"`
	IPv6 int    `json:"ipv6"`
}

// penaltyDoc is a rule's penalty, factor and max given their defaults when not written.
type penaltyDoc struct {
	After  uint64  `json:"after"`
	Within string  `json:"within"`
	Ban    string  `json:"ban"`
	Factor float64 `json:"factor"`
	Max    string  `json:"max"`
}

// matchDoc is a rule's match conditions as a JSON object in the file's order: each
// attribute to the list of its values (path: its globs), or to its operators
// {"glob": [...], "not": [...], "not_glob": [...]}.
type matchDoc []rules.MatchCond

func (m matchDoc) MarshalJSON() ([]byte, error) {
	type ops struct {
		Glob    []string `json:"glob,omitempty"`
		Not     []string `json:"not,omitempty"`
		NotGlob []string `json:"not_glob,omitempty"`
	}
	b := []byte{'{'}
	for i, c := range m {
		if i > 0 {
			b = append(b, ',')
		}
		k, err := json.Marshal(c.Attr)
		if err != nil {
			return nil, err
		}
		var v []byte
		if c.Values != nil {
			v, err = json.Marshal(c.Values)
		} else {
			v, err = json.Marshal(ops{Glob: c.Glob, Not: c.Not, NotGlob: c.NotGlob})
		}
		if err != nil {
			return nil, err
		}
		b = append(append(append(b, k...), ':'), v...)
	}
	return append(b, '}'), nil
}

func rulesDoc(deps AdminDeps) any {
	// The reloads' count before the rules: a reload ends (its count) after its rules are in
	// force, so the set read next is at least as new as the last reload counted. Read the
	// other way, a reload ending between the two showed its count beside the rules it
	// replaced, and `rlsidecar reload` printed the old version as the one in force (a CI
	// run of TestE2EReloadCommandWaits).
	var begun, ended uint64
	var reloadErr string
	if deps.Reloads != nil {
		begun, ended, reloadErr = deps.Reloads.Get()
	}
	set := deps.Limiter.Rules()
	out := struct {
		Version string    `json:"version"`
		Source  string    `json:"source"`
		Loaded  time.Time `json:"loaded_at"`
		Shadow  bool      `json:"shadow_all"`
		// The daemon's process, and its reloads (see ReloadState): `rlsidecar reload`
		// makes sure it reads the daemon it signalled, and waits for the reload's end.
		PID          int       `json:"pid"`
		ReloadsBegun uint64    `json:"reloads_begun"`
		Reloads      uint64    `json:"reloads"`
		ReloadError  string    `json:"reload_error"`
		Rules        []ruleDoc `json:"rules"`
	}{Version: set.Version, Source: set.Source, Shadow: deps.Limiter.ShadowAll(), PID: os.Getpid(), Rules: []ruleDoc{}}
	out.ReloadsBegun, out.Reloads, out.ReloadError = begun, ended, reloadErr
	deps.Metrics.mu.Lock()
	out.Loaded = deps.Metrics.config.loaded
	deps.Metrics.mu.Unlock()
	for _, r := range set.Rules {
		out.Rules = append(out.Rules, describeRule(deps.Limiter, r))
	}
	return out
}

// describeRule returns r as /rules shows it.
func describeRule(l *limiter.Limiter, r *rules.Rule) ruleDoc {
	d := ruleDoc{Name: r.Name, Match: r.Match, Key: r.Key, Replaces: r.Replaces, WarnAt: r.WarnAt,
		Mode: l.ModeOf(r).String(), OnStoreFailure: r.OnStoreFailure.String(), Shadow: r.Shadow,
		File: r.File, Line: r.Line}
	switch {
	case r.Unlimited:
		d.Limit = "unlimited"
	case r.Deny:
		d.Limit = "deny"
	case r.Concurrency:
		d.Concurrency = &concurrencyDoc{Max: r.Requests, Lease: rules.FormatPer(r.Per)}
	default:
		d.Algorithm, d.Requests, d.Per, d.Burst = r.Algorithm.String(), r.Requests, rules.FormatPer(r.Per), r.Burst
		if r.Calendar != localbucket.NoCalendar {
			d.Per = r.Calendar.String()
			if r.TZ != nil {
				d.TZ = r.TZ.String()
			}
		}
	}
	if plans := r.Plans(); plans != nil {
		d.Plans = make(map[string]any, len(plans))
		for _, p := range plans {
			if p.Unlimited {
				d.Plans[p.Name] = "unlimited"
			} else {
				d.Plans[p.Name] = p.Requests
			}
		}
	}
	if r.Delay > 0 {
		d.Delay = rules.FormatPer(r.Delay)
	}
	if p := r.Penalty; p != nil {
		d.Penalty = &penaltyDoc{After: p.After, Within: rules.FormatPer(p.Within), Ban: rules.FormatPer(p.Ban), Factor: p.Factor, Max: rules.FormatPer(p.Max)}
	}
	if p := r.IPPrefix; p != nil {
		d.IPPrefix = &ipPrefixDoc{Attr: p.Attr, IPv4: p.IPv4, IPv6: p.IPv6}
	}
	if r.SplitAuto {
		d.Split = "auto"
	} else if r.Split > 0 {
		d.Split = r.Split
	}
	return d
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// gzipWriters keeps the compressors of /metrics answers. A scrape that accepts gzip (as
// Prometheus's does) gets one: the exposition of 20,000 rules is about 7 MB of text, which
// compresses about 10 to 1 (TestMetricsGzip).
var gzipWriters = sync.Pool{New: func() any {
	zw, _ := gzip.NewWriterLevel(io.Discard, gzip.BestSpeed)
	return zw
}}

// acceptsGzip reports whether Accept-Encoding header values list gzip with a weight
// above 0 (RFC 9110, 12.5.3).
func acceptsGzip(values []string) bool {
	for _, v := range values {
		for part := range strings.SplitSeq(v, ",") {
			coding, params, _ := strings.Cut(strings.TrimSpace(part), ";")
			if !strings.EqualFold(strings.TrimSpace(coding), "gzip") {
				continue
			}
			for param := range strings.SplitSeq(params, ";") {
				if q, ok := strings.CutPrefix(strings.ReplaceAll(param, " ", ""), "q="); ok {
					w, err := strconv.ParseFloat(q, 64)
					return err == nil && w > 0
				}
			}
			return true
		}
	}
	return false
}
