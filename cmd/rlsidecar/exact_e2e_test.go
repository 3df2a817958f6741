package main

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// exactRules: one rule per kind of limit, each keyed on an attribute of its own so that a
// request names the one it is checked against.
const exactRules = `
rules:
  - { name: tb, key: tb, limit: { requests: 8, per: 1h }, mode: MODE }
  - { name: sw, key: sw, algorithm: sliding_window, limit: { requests: 8, per: 1h }, mode: MODE }
  - { name: fw, key: fw, algorithm: fixed_window, limit: { requests: 8, per: 1h }, mode: MODE }
  - { name: cal, key: cal, limit: { requests: 8, per: day }, mode: MODE }
  - { name: pen, key: pen, limit: { requests: 4, per: 1h }, penalty: { after: 3, within: 1h, ban: 1h }, mode: MODE }
  - { name: both-a, key: both, limit: { requests: 8, per: 1h }, mode: MODE }
  - { name: both-b, key: both, limit: { requests: 5, per: 1h }, mode: MODE }
  - { name: lease, key: lease, concurrency: { max: 3, lease: 1h }, mode: MODE }
  - { name: delay, key: delay, limit: { requests: 1, per: 1s, burst: 1 }, delay: 5s, mode: MODE }
  - { name: warn, key: warn, limit: { requests: 8, per: 1h }, warn_at: 0.75, mode: MODE }
`

// exactBurst sends, from each connection at once, its requests (pipelined, in one write
// when more than one) and returns every answer.
func exactBurst(t *testing.T, cs []*rawConn, reqs func(conn, i int) *proto.Request, per int) []*proto.Response {
	t.Helper()
	got := make([][]*proto.Response, len(cs))
	errs := make(chan error, len(cs))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for ci, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			enc := proto.NewEncoder()
			for i := range per {
				enc.EncodeRequest(reqs(ci, i))
			}
			<-start
			if _, err := c.c.Write(enc.Bytes()); err != nil {
				errs <- err
				return
			}
			for range per {
				frame, err := c.readFrame()
				if err != nil {
					errs <- err
					return
				}
				var r proto.Response
				if err := c.dec.DecodeResponse(frame[proto.HeaderSize:], &r); err != nil {
					errs <- err
					return
				}
				got[ci] = append(got[ci], &r)
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var all []*proto.Response
	for _, g := range got {
		all = append(all, g...)
	}
	return all
}

func checkReq(cost uint64, attrs ...string) *proto.Request {
	req := &proto.Request{ID: 1, Op: proto.OpCheck, Cost: cost}
	for _, a := range attrs {
		k, v, _ := strings.Cut(a, "=")
		req.Attrs = append(req.Attrs, proto.Attr{Name: k, Value: v})
	}
	return req
}

// exactRate checks a burst's answers of a rate limit of limit with cost each: exactly
// min(n, limit/cost) admitted, their remaining each once, refusals with a retry-after.
func exactRate(t *testing.T, what string, all []*proto.Response, limit, cost uint64) {
	t.Helper()
	want := min(uint64(len(all)), limit/cost)
	var rem []uint64
	for _, r := range all {
		if r.IsError() {
			t.Fatalf("%s: error %+v", what, r.Err)
		}
		if r.Degraded {
			t.Fatalf("%s: degraded %+v", what, r)
		}
		if r.Allowed {
			rem = append(rem, r.Remaining)
			if r.RetryAfterMs != 0 {
				t.Errorf("%s: allowed with retry_after %d", what, r.RetryAfterMs)
			}
			continue
		}
		if r.RetryAfterMs == 0 || r.ResetMs == 0 {
			t.Errorf("%s: refused with retry_after %d reset %d: %+v", what, r.RetryAfterMs, r.ResetMs, r)
		}
		if r.Remaining != limit-want*cost {
			t.Errorf("%s: refused with remaining %d, want %d", what, r.Remaining, limit-want*cost)
		}
	}
	slices.Sort(rem)
	var wantRem []uint64
	for i := range want {
		wantRem = append(wantRem, limit-cost*(want-i))
	}
	if !slices.Equal(rem, wantRem) {
		t.Fatalf("%s: admitted %d with remaining %v; want %d with %v", what, len(rem), rem, want, wantRem)
	}
}

// boundedRate checks a burst's answers of a hybrid rule of limit with cost each, spread
// over daemons: at most the limit, and each daemon new to the key one unit more before
// its first sync (docs/accuracy.md, "Why it is bounded": the first units), never an
// error or a degraded answer, every refusal with a retry.
func boundedRate(t *testing.T, what string, all []*proto.Response, limit, cost uint64, daemons int) {
	t.Helper()
	var n uint64
	for _, r := range all {
		if r.IsError() || r.Degraded {
			t.Fatalf("%s: %+v", what, r)
		}
		if r.Allowed {
			n++
		} else if r.RetryAfterMs == 0 || r.ResetMs == 0 {
			t.Errorf("%s: refused with retry_after %d reset %d: %+v", what, r.RetryAfterMs, r.ResetMs, r)
		}
	}
	if n*cost > limit+uint64(daemons-1) {
		t.Fatalf("%s: admitted %d of cost %d, limit %d over %d daemons", what, n, cost, limit, daemons)
	}
}

// testExact fires, round after round, bursts of checks of a new key of each kind of
// limit from every connection of cs at once (several pipelined on each), and checks
// each burst's answers: in local and global mode exactly what the limit admits, the
// remaining each once, nothing lost or counted twice; in hybrid mode (daemons > 1) the
// documented bound, and exactly for what hybrid decides by the global scripts (calendar
// windows, delay) and for leases.
func testExact(t *testing.T, mode string, cs []*rawConn, daemons, rounds int) {
	hybrid := mode == "hybrid"
	rate := func(what string, all []*proto.Response, limit, cost uint64) {
		t.Helper()
		if hybrid {
			boundedRate(t, what, all, limit, cost, daemons)
		} else {
			exactRate(t, what, all, limit, cost)
		}
	}
	clearOfWindowEnd(t, time.Hour, 10*time.Second)
	clearOfWindowEnd(t, 24*time.Hour, 10*time.Second)
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	for round := range rounds {
		key := tag + "-" + strconv.Itoa(round)
		for _, kind := range []string{"tb", "sw", "fw", "cal"} {
			for _, per := range []int{1, 3} {
				for _, cost := range []uint64{1, 3} {
					k := fmt.Sprintf("%s-%d-%d", key, per, cost)
					what := fmt.Sprintf("round %d %s, %d a connection, cost %d", round, kind, per, cost)
					all := exactBurst(t, cs, func(int, int) *proto.Request { return checkReq(cost, kind+"="+k) }, per)
					if kind == "cal" {
						exactRate(t, what, all, 8, cost)
					} else {
						rate(what, all, 8, cost)
					}
					if hybrid && kind != "cal" {
						continue
					}
					// Nothing lost nor counted twice: a question finds what is left.
					q := cs[0].check(2, 0, kind+"="+k)
					if left := 8 - min(uint64(len(all)), 8/cost)*cost; q.Remaining != left {
						t.Fatalf("%s: a question after finds %d left, want %d: %+v", what, q.Remaining, left, q)
					}
				}
			}
		}
		// Questions among the checks (every other request): none consumes.
		for _, kind := range []string{"tb", "sw", "fw", "cal"} {
			if hybrid && kind != "cal" {
				continue
			}
			k := key + "-q-" + kind
			const per = 4
			all := exactBurst(t, cs, func(c, i int) *proto.Request { return checkReq(uint64((c+i)%2), kind+"="+k) }, per)
			var checks []*proto.Response
			for i, r := range all { // each connection's answers in turn, in request order
				if (i/per+i%per)%2 == 1 {
					checks = append(checks, r)
				} else if r.IsError() || r.Remaining > 8 || r.RetryAfterMs != 0 && r.Allowed {
					t.Fatalf("round %d %s: a question answered %+v", round, kind, r)
				}
			}
			exactRate(t, fmt.Sprintf("round %d %s, with questions", round, kind), checks, 8, 1)
		}
		// Delay (1 a second, up to 5 s): one now, five about a second apart (less the
		// time between their arrivals: half a second of slack for a loaded machine), the
		// rest refused.
		{
			k := key + "-delay"
			all := exactBurst(t, cs, func(int, int) *proto.Request { return checkReq(1, "delay="+k) }, 2)
			var delays []uint64
			for _, r := range all {
				if r.IsError() || r.Degraded {
					t.Fatalf("round %d delay: %+v", round, r)
				}
				if r.Allowed {
					delays = append(delays, r.DelayMs)
				} else if r.RetryAfterMs == 0 {
					t.Errorf("round %d delay: refused with retry_after 0: %+v", round, r)
				}
			}
			slices.Sort(delays)
			ok := len(delays) == 6 && delays[0] == 0
			for i := 1; ok && i < len(delays); i++ {
				ok = delays[i] > delays[i-1]+500 && delays[i] <= uint64(i)*1000
			}
			if !ok {
				t.Fatalf("round %d delay: delays %v; want 0 and five a second apart", round, delays)
			}
		}
		// warn_at 0.75 of 8: the answers with 2, 1 and 0 left warn, and only they.
		if !hybrid {
			k := key + "-warn"
			all := exactBurst(t, cs, func(int, int) *proto.Request { return checkReq(1, "warn="+k) }, 2)
			exactRate(t, fmt.Sprintf("round %d warn", round), all, 8, 1)
			for _, r := range all {
				if r.Allowed && r.Warning != (r.Remaining <= 2) {
					t.Fatalf("round %d warn: %d left, warning %v", round, r.Remaining, r.Warning)
				}
			}
		}
		// Inline limits.
		for _, alg := range []string{"token_bucket", "sliding_window", "fixed_window"} {
			k := key + "-" + alg
			all := exactBurst(t, cs, func(int, int) *proto.Request {
				r := checkReq(1)
				r.Limits = []proto.InlineLimit{{Key: k, Limit: 8, WindowMs: 3600_000, Algorithm: alg, Mode: mode}}
				return r
			}, 2)
			rate(fmt.Sprintf("round %d inline %s", round, alg), all, 8, 1)
		}
		// Two rules of 8 and 5: all-or-nothing, the looser one charged only for the 5.
		{
			k := key + "-both"
			all := exactBurst(t, cs, func(int, int) *proto.Request { return checkReq(1, "both="+k) }, 2)
			rate(fmt.Sprintf("round %d two rules", round), all, 5, 1)
			if q := cs[0].check(2, 0, "both="+k); !hybrid && (len(q.Rules) != 2 || q.Rules[0].Name != "both-a" || q.Rules[0].Remaining != 3) {
				t.Fatalf("round %d two rules: after 5 admitted, a question finds %+v; want both-a with 3 left", round, q.Rules)
			}
		}
		// Penalty (4 an hour, banned at the 3rd refusal): 4 admitted, 2 refused, the
		// rest banned.
		{
			k := key + "-pen"
			all := exactBurst(t, cs, func(int, int) *proto.Request { return checkReq(1, "pen="+k) }, 2)
			var admitted, unbanned, banned int
			for _, r := range all {
				switch {
				case r.IsError() || r.Degraded:
					t.Fatalf("round %d penalty: %+v", round, r)
				case r.Allowed:
					admitted++
				case r.Banned:
					banned++
					if r.RetryAfterMs < 3500_000 {
						t.Errorf("round %d penalty: banned with retry_after %d, want about an hour", round, r.RetryAfterMs)
					}
				default:
					unbanned++
					if r.RetryAfterMs == 0 {
						t.Errorf("round %d penalty: refused with retry_after 0: %+v", round, r)
					}
				}
			}
			if !hybrid && (admitted != 4 || unbanned != 2 || banned != len(all)-6) {
				t.Fatalf("round %d penalty: %d admitted, %d refused unbanned, %d banned; want 4, 2, %d", round, admitted, unbanned, banned, len(all)-6)
			}
		}
		// Leases (max 3): exactly 3 granted; a release frees exactly one.
		{
			k := key + "-lease"
			all := exactBurst(t, cs, func(int, int) *proto.Request { return checkReq(1, "lease="+k) }, 2)
			var leases []string
			for _, r := range all {
				if r.IsError() || r.Degraded {
					t.Fatalf("round %d lease: %+v", round, r)
				}
				if r.Allowed {
					if r.Lease == "" {
						t.Fatalf("round %d lease: allowed without a lease: %+v", round, r)
					}
					leases = append(leases, r.Lease)
				} else if r.RetryAfterMs == 0 {
					t.Errorf("round %d lease: refused with retry_after 0: %+v", round, r)
				}
			}
			if len(leases) != 3 {
				t.Fatalf("round %d lease: %d granted of max 3", round, len(leases))
			}
			// One connection releases a lease and asks for one, pipelined, while the
			// others ask: the slot freed goes to exactly one (the check behind the
			// release finds it, unless another took it first).
			all = exactBurst(t, cs, func(c, i int) *proto.Request {
				if c == 0 && i == 0 {
					return &proto.Request{ID: 9, Op: "release", Lease: leases[0]}
				}
				return checkReq(1, "lease="+k)
			}, 2)
			var released, granted int
			for _, r := range all {
				if r.ID == 9 && r.Released {
					released++
				} else if r.ID != 9 && r.Allowed {
					granted++
				}
			}
			if released != 1 || granted != 1 {
				t.Fatalf("round %d lease: released %d, then granted %d; want 1 and 1", round, released, granted)
			}
		}
	}
}

// exactDaemons starts n daemons on rules of mode with args and returns connections to
// them, per connections to each.
func exactDaemons(t *testing.T, mode string, n, per int, args ...string) []*rawConn {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", strings.ReplaceAll(exactRules, "MODE", mode))
	var cs []*rawConn
	for range n {
		d := startDaemon(t, append([]string{"--config", cfg, "--global-timeout", "5s", "--redis-timeout", "5s"}, args...)...)
		for range per {
			cs = append(cs, dialRaw(t, d.socket))
		}
	}
	return cs
}

// Concurrent checks over many connections, each kind of limit, in local mode: exactly
// what the limit admits (TestE2EConcurrentChecksEachTheirOwnRemaining holds the token
// bucket's first checks to it over 1,000 rounds).
func TestE2EExactLocal(t *testing.T) {
	testExact(t, "local", exactDaemons(t, "local", 1, 6), 1, 40)
}

// The same in global mode, on a standalone Redis and a 3-master Cluster.
func TestE2EExactGlobal(t *testing.T) {
	t.Run("standalone", func(t *testing.T) {
		srv := redistest.StartStandalone(t)
		testExact(t, "global", exactDaemons(t, "global", 2, 3, "--redis", "redis://"+srv.Addr), 2, 10)
	})
	t.Run("cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t)
		testExact(t, "global", exactDaemons(t, "global", 2, 3, "--redis-cluster", strings.Join(cl.Addrs, ",")), 2, 5)
	})
}

// The same over three hybrid daemons on one Redis: within the documented bound, and
// exact where hybrid mode is (calendar windows and delay by the global scripts, leases).
func TestE2EExactHybrid(t *testing.T) {
	srv := redistest.StartStandalone(t)
	testExact(t, "hybrid", exactDaemons(t, "hybrid", 3, 2, "--redis", "redis://"+srv.Addr, "--sync-interval", "50ms"), 3, 10)
}

// A request a rate rule refuses holds no concurrency slot, not even for a moment:
// another client's check of the same slot, at once, finds it free. Before, the daemon
// took the slot, then gave it back when the rate rule refused, and a fresh user's check
// of the account at that moment was refused with its slot free (6 runs of 8 failed, 1 to
// 3 fresh users refused of 1,000; limiter's TestLeaseNotHeldWhileLocalRateRefuses is
// the same without the socket).
func TestE2ELeaseNotHeldByRefused(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - { name: conc, key: acct, concurrency: { max: 1, lease: 1h }, mode: local }
  - { name: rate, key: user, limit: { requests: 1, per: 1h }, mode: local }
`)
	d := startDaemon(t, "--config", cfg)
	cs := make([]*rawConn, 4)
	for i := range cs {
		cs[i] = dialRaw(t, d.socket)
	}
	if r := cs[0].check(1, 1, "user=spent"); !r.Allowed {
		t.Fatalf("first check of user spent refused: %+v", r)
	}
	refused := 0
	const rounds = 1000
	for round := range rounds {
		acct := "acct=" + strconv.Itoa(round)
		fresh := "user=u" + strconv.Itoa(round)
		all := exactBurst(t, cs, func(c, i int) *proto.Request {
			if c == 0 {
				return checkReq(1, acct, fresh)
			}
			return checkReq(1, acct, "user=spent")
		}, 4)
		// cs[0]'s answers come first: its first check is the fresh user's, the other
		// three of that connection are refused by the fresh user's own rate.
		if !all[0].Allowed {
			refused++
		}
		for _, r := range all[4:] {
			if r.Allowed {
				t.Fatalf("round %d: user spent admitted: %+v", round, r)
			}
		}
	}
	if refused > 0 {
		t.Fatalf("%d of %d fresh users refused a free slot, held for a moment by checks their rate rule refused", refused, rounds)
	}
}
