package main

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// hostileValues are attribute values that try to leave their Redis hash tag, or to
// make one client's key another's: braces, the key's own separators and escapes, NUL,
// invalid UTF-8, values past the length at which a key part becomes a digest, and
// pairs that differ in one byte.
func hostileValues() []string {
	long := strings.Repeat("x", 5000)
	return []string{
		"a", "A", "", " ", "a b",
		"a}b", "a{b", "{a}", "}", "{", "{}", "}{", "}}{{",
		"a%7Db", "a%7db", "%", "%25", "a|b", "a=b", "a|user=b", "a:b", "a~b", "a/b", "a@b",
		"a\x00b", "a\x00c", "\x00", "\xff\xfe", "\xc3\xa9", "%C3%A9", "\xc3",
		long, long + "y", long + "}", strings.Repeat("}", 2000), strings.Repeat("{", 2000),
		strings.Repeat("\xc3\xa9", 2048), strings.Repeat("\xc3\xa9", 2047) + "\xc3",
		"=" + strings.Repeat("0", 64),
	}
}

// hostileRules, "MODE" replaced: a rule of each algorithm (one with shared bans), a
// calendar window and a concurrency rule keyed by user, and a composite key, each
// admitting one request per client, so that a value whose key collided with another's
// would be refused its first request.
const hostileRules = `
rules:
  - name: tb
    key: user
    limit: { requests: 1, per: 1h }
    penalty: { after: 1, within: 1h, ban: 1h }
    mode: MODE
    on_store_failure: closed
  - name: conc
    key: user
    concurrency: { max: 1, lease: 1h }
    mode: MODE
    on_store_failure: closed
  - name: sw
    key: user
    algorithm: sliding_window
    limit: { requests: 1, per: 1h }
    mode: MODE
    on_store_failure: closed
  - name: fw
    key: user
    algorithm: fixed_window
    limit: { requests: 1, per: 1h }
    mode: MODE
    on_store_failure: closed
  - name: cal
    key: user
    limit: { requests: 1, per: day }
    mode: MODE
    on_store_failure: closed
  - name: pair
    key: [user, tenant]
    limit: { requests: 1, per: 1h }
    mode: MODE
    on_store_failure: closed
`

// Attribute values that try to escape the Redis hash tag or collide keys, through the
// real daemon in every mode, on a standalone Redis and a 3-master Cluster: each value
// is a client of its own (its first request admitted, not degraded, by every rule; its
// second refused), and every key the daemon writes holds one hash tag, whole, so that
// on the Cluster one request's rules share a slot (a key that left its tag would have
// failed the call with CROSSSLOT, degraded and refused).
func TestE2EHostileKeyValues(t *testing.T) {
	cl := redistest.StartCluster(t)
	srv := redistest.StartStandalone(t)
	for _, c := range []struct {
		name  string
		mode  string
		nodes []*redistest.Server
		args  []string
	}{
		{"local", "local", nil, nil},
		{"hybrid", "hybrid", []*redistest.Server{srv}, []string{"--redis", "redis://" + srv.Addr}},
		{"global", "global", []*redistest.Server{srv}, []string{"--redis", "redis://" + srv.Addr}},
		{"hybrid-cluster", "hybrid", cl.Nodes, []string{"--redis-cluster", cl.Addrs[0]}},
		{"global-cluster", "global", cl.Nodes, []string{"--redis-cluster", cl.Addrs[0]}},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, n := range c.nodes {
				if out, err := n.Command("FLUSHALL"); err != nil {
					t.Fatalf("FLUSHALL: %v %s", err, out)
				}
			}
			cfg := writeFile(t, shortTempDir(t), "rules.yaml", strings.ReplaceAll(hostileRules, "MODE", c.mode))
			d := startDaemon(t, append([]string{"--config", cfg, "--sync-interval", "50ms", "--redis-timeout", "3s", "--global-timeout", "3s"}, c.args...)...)
			conn := dialRaw(t, d.socket)
			values := hostileValues()
			id := uint64(0)
			ask := func(user, tenant string) (allowed, degraded bool, rule string) {
				id++
				r := conn.check(id, 1, "user="+user, "tenant="+tenant)
				return r.Allowed, r.Degraded, r.Rule
			}
			for round, want := range []bool{true, false} {
				for i, v := range values {
					// The tenant of each value is another value: the pair's two parts
					// trade separators with the user's.
					if allowed, degraded, rule := ask(v, values[(i+1)%len(values)]); allowed != want || degraded {
						t.Fatalf("round %d, value %d %q: allowed %v (rule %s), degraded %v; want allowed %v, decided by the rules\n%s",
							round, i, trim(v), allowed, rule, degraded, want, d.stderr.String())
					}
				}
			}
			// Inline limits (from the request) keyed by the values themselves: the
			// same, each key its own (an empty key is refused: a key is required).
			for round, want := range []bool{true, false} {
				for i, v := range values {
					if v == "" {
						continue
					}
					id++
					conn.send(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1,
						Limits: []proto.InlineLimit{{Key: v, Limit: 1, WindowMs: 3600000, Mode: c.mode}}})
					r := conn.recv()
					if r.IsError() || r.Allowed != want || r.Degraded {
						t.Fatalf("inline, round %d, value %d %q: %+v; want allowed %v, decided\n%s", round, i, trim(v), r, want, d.stderr.String())
					}
				}
			}
			if c.nodes == nil {
				return
			}
			// Every client key in Redis: one '{' and one '}', its end, so the tag is the
			// client whole. In hybrid mode the keys arrive with the syncs.
			want := 6*len(values) + len(values) - 1
			var keys []string
			waitFor(t, 10*time.Second, strconv.Itoa(want)+" client keys in Redis", func() bool {
				keys = keys[:0]
				for _, n := range c.nodes {
					ks, err := n.Strings("KEYS", "rl:*{*")
					if err != nil {
						t.Fatal(err)
					}
					keys = append(keys, ks...)
				}
				return len(keys) >= want
			})
			tags, inline := map[string]bool{}, map[string]bool{}
			for _, k := range keys {
				open, closing := strings.IndexByte(k, '{'), strings.IndexByte(k, '}')
				if strings.Count(k, "{") != 1 || strings.Count(k, "}") != 1 || closing != len(k)-1 || open > closing {
					t.Fatalf("key %q: want one hash tag, at its end", trim(k))
				}
				if strings.HasPrefix(k, "rl:~inline/") {
					inline[k] = true
					continue
				}
				if strings.HasPrefix(k, "rl:pair~") || strings.HasPrefix(k, "rl:daemons:") {
					continue // the live daemons' set on a Cluster: one a master, {<n>}
				}
				tags[k[open:]] = true
			}
			if len(tags) != len(values) || len(inline) != len(values)-1 {
				t.Fatalf("%d hash tags of the one-attribute rules for %d values, %d inline keys for %d", len(tags), len(values), len(inline), len(values)-1)
			}
		})
	}
}

// trim shortens s for a message.
func trim(s string) string {
	if len(s) > 40 {
		return s[:40] + "…(" + strconv.Itoa(len(s)) + " bytes)"
	}
	return s
}
