package main

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// prefetchRulesYAML: a concurrency rule, a rate rule every request of a user matches
// (so that a lease is taken or not all-or-nothing with it), a rule with a penalty, a
// deny rule; global is appended for the run with Redis.
const prefetchRulesYAML = `
rules:
  - name: exports
    match: { path: "/v1/exports/**" }
    key: user
    concurrency: { max: 2, lease: 30s }
  - name: per-user
    key: user
    limit: { requests: 40, per: 1h }
  - name: login
    match: { path: /login }
    key: ip
    limit: { requests: 2, per: 1h }
    penalty: { after: 2, within: 1h, ban: 1h }
  - name: blocked
    match: { path: "/blocked/**" }
    key: user
    limit: deny
`

// prefetchGlobalRulesYAML: prefetchRulesYAML with Redis: the concurrency rule's leases
// in Redis (hybrid, the default with Redis, is global for it: a release or renew waits
// on Redis), the rate rules local (not hybrid, whose
// answers depend on when the syncs ran), and a global rate rule.
var prefetchGlobalRulesYAML = strings.ReplaceAll(prefetchRulesYAML, "    limit: ", "    mode: local\n    limit: ") + `  - name: team
    match: { path: "/v1/team/**" }
    key: team
    limit: { requests: 6, per: 1h }
    mode: global
`

// A daemon fetching ahead (--prefetch-from low: walkAhead decodes and prepares each
// pipelined frame two frames before its turn) answers a pipelined mixed load exactly as
// one that never does (--prefetch-from=0, walkEach), lease tokens aside: rate checks of
// a few users (so that some are refused), concurrency checks taking leases, releases and
// renews of those leases in the same batch as checks of the same users (a release frees
// its slot for the check after it), releases of leases released already, pings, bad
// frames, unknown ops, a penalty rule's bans, a deny rule, inline limits (some invalid),
// and with Redis a global rule (checks that wait on Redis go off the fast path, and the
// local checks of their users after them). Each batch is one write. The binary is built
// without the race detector, so this runs fetching ahead under go test -race too.
//
// The daemon fetching ahead starts below its --prefetch-from, and the first batch's
// burst of new users takes it past: the walk changes from walkEach to walkAhead in the
// middle of a pipelined load.
func TestE2EFetchingAheadAnswersAsNot(t *testing.T) {
	t.Run("local", func(t *testing.T) {
		dir := shortTempDir(t)
		cfg := writeFile(t, dir, "rules.yaml", prefetchRulesYAML)
		ahead := startDaemon(t, "--config", cfg, "--prefetch-from", "2048")
		plain := startDaemon(t, "--config", cfg, "--prefetch-from", "0")
		comparePipelined(t, ahead, plain, false)
	})
	t.Run("global", func(t *testing.T) {
		srv := redistest.StartStandalone(t)
		dir := shortTempDir(t)
		cfg := writeFile(t, dir, "rules.yaml", prefetchGlobalRulesYAML)
		flags := []string{"--config", cfg, "--redis", "redis://" + srv.Addr, "--global-timeout", "5s", "--redis-timeout", "5s"}
		ahead := startDaemon(t, append(flags, "--prefetch-from", "2048", "--redis-prefix", "ahead:")...)
		plain := startDaemon(t, append(flags, "--prefetch-from", "0", "--redis-prefix", "plain:")...)
		comparePipelined(t, ahead, plain, true)
	})
}

// pfSide is one daemon of comparePipelined: its connection and the tokens of the leases
// its answers gave, in the order given.
type pfSide struct {
	c      *rawConn
	tokens []string
}

// comparePipelined writes the same batches to both daemons, one connection each, and
// compares their answers (normalized: pfNorm).
func comparePipelined(t *testing.T, a, b *daemonProc, global bool) {
	sides := []*pfSide{{c: dialRaw(t, a.socket)}, {c: dialRaw(t, b.socket)}}
	r := rand.New(rand.NewPCG(11, 12))
	var held, gone []int // leases (by their order of grant) held, and released
	leaseUser := map[int]string{}
	enc := proto.NewEncoder()
	id := uint64(0)
	for round := range 40 {
		// A batch of requests; a release or renew names a lease by its index, which each
		// side reads as its own token.
		type item struct {
			req   proto.Request
			junk  []byte
			lease int // -1: none
		}
		var batch []item
		add := func(req proto.Request, lease int) {
			id++
			req.ID = id
			batch = append(batch, item{req: req, lease: lease})
		}
		check := func(cost uint64, attrs ...string) proto.Request {
			req := proto.Request{Op: proto.OpCheck, Cost: cost}
			for _, s := range attrs {
				k, v, _ := strings.Cut(s, "=")
				req.Attrs = append(req.Attrs, proto.Attr{Name: k, Value: v})
			}
			return req
		}
		user := func() string { return "user=u" + strconv.Itoa(r.IntN(6)) }
		if round == 0 {
			// New users, one key each: past the --prefetch-from of the side fetching ahead.
			for i := range 3000 {
				add(check(1, "user=new"+strconv.Itoa(i), "path=/v1/things"), -1)
			}
		}
		for range 20 + r.IntN(60) {
			switch k := r.IntN(15); {
			case k < 3:
				add(check(uint64(r.IntN(3)), user(), "path=/v1/things"), -1)
			case k < 6:
				add(check(1, user(), "path=/v1/exports/"+strconv.Itoa(r.IntN(3))), -1)
			case k < 8 && len(held) > 0:
				// The release of a held lease, then a check of its user taking the slot.
				j := r.IntN(len(held))
				l := held[j]
				held = append(held[:j], held[j+1:]...)
				gone = append(gone, l)
				add(proto.Request{Op: proto.OpRelease}, l)
				add(check(1, leaseUser[l], "path=/v1/exports/9"), -1)
			case k == 8 && len(gone) > 0:
				add(proto.Request{Op: proto.OpRelease}, gone[r.IntN(len(gone))]) // false
			case k == 9:
				l := -1
				if len(held) > 0 && r.IntN(3) > 0 {
					l = held[r.IntN(len(held))]
				} else if len(gone) > 0 {
					l = gone[r.IntN(len(gone))]
				}
				if l >= 0 {
					add(proto.Request{Op: proto.OpRenew, LeaseMs: 30000}, l)
				} else {
					add(proto.Request{Op: proto.OpRenew, Lease: "nope", LeaseMs: 30000}, -1)
				}
			case k == 10:
				switch r.IntN(4) {
				case 0:
					add(proto.Request{Op: proto.OpPing}, -1)
				case 1:
					add(proto.Request{Op: "nope", Cost: 1}, -1)
				case 2:
					id++
					batch = append(batch, item{junk: []byte{0x92, 0x01, byte(r.IntN(256))}, lease: -1})
				default:
					add(proto.Request{Op: proto.OpRelease, Lease: "unknown-" + strconv.Itoa(r.IntN(9))}, -1)
				}
			case k == 11:
				add(check(1, "ip=10.0.0."+strconv.Itoa(r.IntN(3)), "path=/login"), -1)
			case k == 12:
				add(check(1, user(), "path=/blocked/x"), -1)
			case k == 13:
				req := check(1, user(), "path=/v1/things")
				req.Limits = []proto.InlineLimit{{Key: "inline-" + strconv.Itoa(r.IntN(2)), Name: "inline", Mode: "local", Limit: uint64(r.IntN(4)), WindowMs: 3_600_000}}
				add(req, -1)
			case global:
				add(check(1, user(), "team=t"+strconv.Itoa(r.IntN(3)), "path=/v1/team/"+strconv.Itoa(r.IntN(2))), -1)
			default:
				add(check(1, user(), "path=/v1/things"), -1)
			}
		}
		// Each side gets the batch in one write, with its own tokens.
		var got [2][]string
		var granted [2][]string // the tokens granted, in order
		for s, sd := range sides {
			var out []byte
			for i := range batch {
				it := &batch[i]
				if it.junk != nil {
					out = append(out, 0, 0, 0, byte(len(it.junk)))
					out = append(out, it.junk...)
					continue
				}
				req := it.req
				if it.lease >= 0 {
					req.Lease = sd.tokens[it.lease]
				}
				enc.Reset()
				enc.EncodeRequest(&req)
				out = append(out, enc.Bytes()...)
			}
			sd.c.write(out)
			for range batch {
				resp := sd.c.recv()
				got[s] = append(got[s], pfNorm(resp))
				if resp.Lease != "" {
					granted[s] = append(granted[s], resp.Lease)
				}
			}
		}
		for i := range got[0] {
			if got[0][i] != got[1][i] {
				t.Fatalf("round %d, answer %d of %d (%s %v, lease %d): fetching ahead\n  %s\nnot fetching ahead\n  %s",
					round, i, len(batch), batch[i].req.Op, batch[i].req.Attrs, batch[i].lease, got[0][i], got[1][i])
			}
		}
		// The leases granted, in the order of the checks that took them.
		g := 0
		for i := range batch {
			if strings.Contains(got[0][i], " lease=true ") {
				l := len(sides[0].tokens)
				for s, sd := range sides {
					sd.tokens = append(sd.tokens, granted[s][g])
				}
				g++
				held = append(held, l)
				for _, a := range batch[i].req.Attrs {
					if a.Name == "user" {
						leaseUser[l] = "user=" + a.Value
					}
				}
			}
		}
	}
	if len(sides[0].tokens) < 10 || len(gone) < 10 {
		t.Fatalf("%d leases granted, %d released: the load does not exercise leases", len(sides[0].tokens), len(gone))
	}
}

// pfNorm is an answer without what depends on when it was decided (reset_ms,
// retry_after_ms, expires_ms) or on the daemon (a lease's token: only whether there is
// one).
func pfNorm(r *proto.Response) string {
	var b strings.Builder
	fmt.Fprintf(&b, "id=%d err=%q:%q allowed=%v rule=%s limit=%d remaining=%d lease=%v banned=%v degraded=%v reason=%q warning=%v delay=%d released=%v renewed=%v protocol=%d rules=[",
		r.ID, r.Err.Code, r.Err.Message, r.Allowed, r.Rule, r.Limit, r.Remaining, r.Lease != "", r.Banned, r.Degraded, r.Reason, r.Warning, r.DelayMs, r.Released, r.Renewed, r.Protocol)
	for _, x := range r.Rules {
		fmt.Fprintf(&b, "{%s %d %d %d %v %v %v %v %q} ", x.Name, x.Limit, x.WindowMs, x.Remaining, x.Allowed, x.Shadow, x.Banned, x.Unasked, x.Reason)
	}
	b.WriteString("]")
	return b.String()
}

// The daemon given --max-keys and --prefetch-from as large as an int holds (a way of
// saying "no cap") limits as with the defaults. Before, a shard's share of them
// overflowed negative: such a --max-keys held no key at all, and a limit of 2 an hour
// let every check of a client through (4 of 4 allowed).
func TestE2EHugeMaxKeysAndPrefetchFrom(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", "rules:\n  - name: per-user\n    key: user\n    limit: { requests: 2, per: 1h }\n")
	huge := strconv.Itoa(int(^uint(0) >> 1))
	d := startDaemon(t, "--config", cfg, "--max-keys", huge, "--prefetch-from", huge)
	c := dialRaw(t, d.socket)
	for i, want := range []bool{true, true, false, false} {
		if r := c.check(uint64(i+1), 1, "user=ann"); r.Allowed != want || r.IsError() {
			t.Fatalf("check %d: %+v; want allowed %v (a limit of 2 an hour)", i+1, r, want)
		}
	}
}
