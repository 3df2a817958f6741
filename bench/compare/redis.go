package main

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// The Redis phase: what one check costs the shared Redis, and how closely a limit shared
// by two instances holds, for rlsidecar's hybrid and global modes and for the peers that
// keep their counts in Redis or in each other (envoyproxy/ratelimit, gubernator GLOBAL).

// CostRow is the Redis work per check of one system on one key shape, from its own
// Redis's INFO read before and after the checks (syncs and heartbeats included):
// commandstats counts each command a Lua script runs as well as the EVALSHA that ran it,
// so CPU is read from INFO cpu (used_cpu_user + used_cpu_sys), not summed over commands.
type CostRow struct {
	System           string             `json:"system"`
	Keys             string             `json:"keys"` // "hot": 4 keys; "sparse": Zipf (s = 1.1) over 1,000,000
	Checks           int                `json:"checks"`
	CommandsPerCheck float64            `json:"redis_commands_per_check"`
	CPUUsecPerCheck  float64            `json:"redis_cpu_usec_per_check"`
	Degraded         int                `json:"degraded"`           // checks a failure policy decided (Redis too slow)
	Commands         map[string]float64 `json:"commands_per_check"` // by command name
}

// AccuracyRow is how many checks a limit shared by instances admitted, each key sent
// three times its limit over 16 connections spread evenly across the instances: "hot",
// one key limited to 1,000 an hour; "sparse", 300 keys limited to 10 an hour each, their
// checks interleaved. Admitted ÷ (limit × keys) is 1 for an exact limiter; above 1 it
// over-admits.
type AccuracyRow struct {
	System    string  `json:"system"`
	Instances int     `json:"instances"`
	Keys      string  `json:"keys"`  // "hot" or "sparse"
	Limit     int     `json:"limit"` // per key`
	Sent      int     `json:"sent"`
	Admitted  int     `json:"admitted"`
	Ratio     float64 `json:"admitted_per_limit"` // admitted ÷ (limit × keys)
	Degraded  int     `json:"degraded"`           // checks a failure policy decided (Redis too slow)
}

// The limits of the accuracy test's keys, per hour (every system's configuration says
// so), and the number of sparse keys.
const (
	hotLimit    = 1000 // the attribute or descriptor acct
	sparseLimit = 10   // seat
	sparseKeyN  = 300
)

// limitKind chooses the limit a check is under.
type limitKind int

const (
	unlimited     limitKind = iota // user: a billion an hour
	hotLimited                     // acct: hotLimit an hour
	sparseLimited                  // seat: sparseLimit an hour
)

// name is the attribute (rlsidecar), descriptor key (envoy) or limit name (gubernator).
func (k limitKind) name() string { return [...]string{"user", "acct", "seat"}[k] }

// limit is the kind's limit per hour.
func (k limitKind) limit() int64 { return [...]int64{1_000_000_000, hotLimit, sparseLimit}[k] }

// admitTimeout bounds one check of the Redis phase: a system that stops answering fails
// its row rather than the run.
const admitTimeout = 10 * time.Second

// admitter sends one check on a key and reports whether it was admitted.
type admitter interface {
	// admit reports whether the check was admitted, and degraded when a failure policy
	// decided it because the system's store did not answer (rlsidecar says so).
	admit(key int, kind limitKind) (ok, degraded bool, err error)
	close()
}

// redisSystem is a system whose checks cost a Redis: dial opens a connection to
// instance i (0 or 1); redisPort is the Redis whose commandstats count.
type redisSystem struct {
	name      string
	redisPort int
	instances int
	dial      func(i int) (admitter, error)
}

// redisStats is what a Redis has done so far: calls by command, and CPU seconds.
type redisStats struct {
	calls map[string]int64
	cpu   float64
}

// readStats reads INFO commandstats and INFO cpu of the Redis at port.
func readStats(port int) (redisStats, error) {
	st := redisStats{calls: map[string]int64{}}
	out, err := exec.Command("redis-cli", "-p", strconv.Itoa(port), "INFO", "all").Output()
	if err != nil {
		return st, fmt.Errorf("redis-cli INFO: %w", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		line = strings.TrimSpace(line)
		name, stats, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		if name == "used_cpu_user" || name == "used_cpu_sys" {
			v, _ := strconv.ParseFloat(stats, 64)
			st.cpu += v
			continue
		}
		cmd, ok := strings.CutPrefix(name, "cmdstat_")
		if !ok {
			continue
		}
		for _, kv := range strings.Split(stats, ",") {
			if k, v, _ := strings.Cut(kv, "="); k == "calls" {
				n, _ := strconv.ParseInt(v, 10, 64)
				st.calls[cmd] = n
			}
		}
	}
	return st, nil
}

// redisCost sends n checks of keys (unlimited rules) over 16 connections to instance 0,
// waits for the system's background syncs to settle, and reads what Redis did.
func redisCost(s *redisSystem, shape string, keys []int) (CostRow, error) {
	before, err := readStats(s.redisPort)
	if err != nil {
		return CostRow{}, err
	}
	var degraded atomic.Int64
	if err := spread(16, len(keys), func(int) (admitter, error) { return s.dial(0) }, func(a admitter, i int) error {
		ok, deg, err := a.admit(keys[i], unlimited)
		if deg {
			degraded.Add(1)
		}
		if err == nil && !ok {
			err = fmt.Errorf("check of key %d refused under a limit of a billion", keys[i])
		}
		return err
	}); err != nil {
		return CostRow{}, fmt.Errorf("%s: %w", s.name, err)
	}
	time.Sleep(500 * time.Millisecond) // hybrid syncs every 100 ms: count the last ones
	after, err := readStats(s.redisPort)
	if err != nil {
		return CostRow{}, err
	}
	n := float64(len(keys))
	row := CostRow{System: s.name, Keys: shape, Checks: len(keys), CPUUsecPerCheck: (after.cpu - before.cpu) * 1e6 / n,
		Commands: map[string]float64{}, Degraded: int(degraded.Load())}
	for cmd, c := range after.calls {
		if cmd == "info" {
			continue // ours
		}
		if d := c - before.calls[cmd]; d > 0 {
			row.Commands[cmd] = float64(d) / n
			row.CommandsPerCheck += float64(d) / n
		}
	}
	return row, nil
}

// accuracy sends three times the limit of each key (one fresh hot key at base, or
// sparseKeyN fresh keys from base, interleaved) over 16 connections spread across the
// system's instances, and counts the admitted checks.
func accuracy(s *redisSystem, shape string, base int) (AccuracyRow, error) {
	kind, nkeys := hotLimited, 1
	if shape == "sparse" {
		kind, nkeys = sparseLimited, sparseKeyN
	}
	sent := int(kind.limit()) * 3 * nkeys
	var admitted, degraded atomic.Int64
	if err := spread(16, sent, func(g int) (admitter, error) { return s.dial(g % s.instances) }, func(a admitter, i int) error {
		ok, deg, err := a.admit(base+i%nkeys, kind)
		if ok {
			admitted.Add(1)
		}
		if deg {
			degraded.Add(1)
		}
		return err
	}); err != nil {
		return AccuracyRow{}, fmt.Errorf("%s: %w", s.name, err)
	}
	n := int(admitted.Load())
	return AccuracyRow{System: s.name, Instances: s.instances, Keys: shape, Limit: int(kind.limit()), Sent: sent, Admitted: n,
		Ratio: float64(n) / float64(kind.limit()*int64(nkeys)), Degraded: int(degraded.Load())}, nil
}

// spread runs n calls of do over conns connections (dial opens connection g), each
// taking every conns-th call.
func spread(conns, n int, dial func(g int) (admitter, error), do func(a admitter, i int) error) error {
	as := make([]admitter, conns)
	for g := range as {
		a, err := dial(g)
		if err != nil {
			for _, a := range as[:g] {
				a.close()
			}
			return err
		}
		as[g] = a
	}
	var wg sync.WaitGroup
	errs := make([]error, conns)
	for g, a := range as {
		wg.Go(func() {
			defer a.close()
			for i := g; i < n; i += conns {
				if err := do(a, i); err != nil {
					errs[g] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// sparseKeys is n keys drawn Zipf (s = 1.1) over 1,000,000, above every key the other
// phases used.
func sparseKeys(n int) []int {
	rng := rand.New(rand.NewPCG(7, 42))
	z := rand.NewZipf(rng, 1.1, 1, 999_999)
	out := make([]int, n)
	for i := range out {
		out[i] = 2_000_000_000 + int(z.Uint64())
	}
	return out
}

// hotKeys is n checks over 4 keys.
func hotKeys(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = 3_000_000_000 + i%4
	}
	return out
}

// redisRulesYAML: each mode's rules are chosen by the attribute tier; user is keyed
// under a limit no test reaches, acct and seat under the accuracy test's limits.
const redisRulesYAML = `rules:
  - name: user-hybrid
    match: { tier: hybrid }
    key: user
    mode: hybrid
    limit: { requests: 1000000000, per: 1h }
  - name: acct-hybrid
    match: { tier: hybrid }
    key: acct
    mode: hybrid
    limit: { requests: 1000, per: 1h }
  - name: seat-hybrid
    match: { tier: hybrid }
    key: seat
    mode: hybrid
    limit: { requests: 10, per: 1h }
  - name: user-global
    match: { tier: global }
    key: user
    mode: global
    limit: { requests: 1000000000, per: 1h }
  - name: acct-global
    match: { tier: global }
    key: acct
    mode: global
    limit: { requests: 1000, per: 1h }
  - name: seat-global
    match: { tier: global }
    key: seat
    mode: global
    limit: { requests: 10, per: 1h }
`

// startRedis starts a redis-server on a free port with its files in dir.
func startRedis(dir string) (*process, int, error) {
	port, err := freePort()
	if err != nil {
		return nil, 0, err
	}
	_ = os.MkdirAll(dir, 0o755)
	cmd := exec.Command("redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "no", "--dir", dir)
	if err := cmd.Start(); err != nil {
		return nil, 0, fmt.Errorf("starting redis-server (is it installed?): %w", err)
	}
	p := &process{cmd: cmd}
	deadline := time.Now().Add(10 * time.Second)
	for exec.Command("redis-cli", "-p", strconv.Itoa(port), "PING").Run() != nil {
		if time.Now().After(deadline) {
			p.stop()
			return nil, 0, errors.New("redis-server did not answer PING within 10s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	return p, port, nil
}

// rlsAdmitter checks over the msgpack socket with tier and user or acct attributes.
type rlsAdmitter struct {
	s    *sockChecker
	tier string
	dec  *proto.Decoder
	enc  *proto.Encoder
	resp proto.Response
}

func (r *rlsAdmitter) admit(key int, kind limitKind) (ok, degraded bool, err error) {
	name := kind.name()
	r.enc.Reset()
	r.enc.EncodeRequest(&proto.Request{ID: 1, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
		{Name: "tier", Value: r.tier}, {Name: name, Value: strconv.Itoa(key)}}})
	r.s.fr = [][]byte{r.enc.Bytes()}
	if err := r.s.c.SetDeadline(time.Now().Add(admitTimeout)); err != nil {
		return false, false, err
	}
	if err := r.s.check(0); err != nil {
		return false, false, err
	}
	if err := r.dec.DecodeResponse(r.s.buf, &r.resp); err != nil {
		return false, false, err
	}
	if r.resp.IsError() {
		return false, false, fmt.Errorf("%s: %s", r.resp.Err.Code, r.resp.Err.Message)
	}
	if len(r.resp.Rules) != 1 {
		return false, false, fmt.Errorf("%d rules decided the check, want 1", len(r.resp.Rules))
	}
	if !r.resp.Allowed && kind == unlimited {
		rr := &r.resp.Rules[0]
		return false, r.resp.Degraded, fmt.Errorf("%s refused user %d under a limit of a billion: limit %d, remaining %d, retry after %d ms, reset %d ms, degraded %v",
			rr.Name, key, rr.Limit, rr.Remaining, rr.RetryAfterMs, rr.ResetMs, r.resp.Degraded)
	}
	return r.resp.Allowed, r.resp.Degraded, nil
}

func (r *rlsAdmitter) close() { r.s.close() }

// startRlsidecarRedis starts two rlsidecar daemons sharing one Redis and returns its
// hybrid and global modes as systems.
func startRlsidecarRedis(dir string) ([]*redisSystem, func(), error) {
	rp, port, err := startRedis(filepath.Join(dir, "redis-rls"))
	if err != nil {
		return nil, nil, err
	}
	stops := []func(){rp.stop}
	stop := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	cfg := filepath.Join(dir, "rules-redis.yaml")
	if err := os.WriteFile(cfg, []byte(redisRulesYAML), 0o600); err != nil {
		stop()
		return nil, nil, err
	}
	var socks [2]string
	for i := range socks {
		socks[i] = filepath.Join(dir, fmt.Sprintf("rlsidecar-redis-%d.sock", i))
		p, err := startLogged(exec.Command(filepath.Join(dir, "rlsidecar"), "serve", "--socket", socks[i], "--admin=",
			"--log-level", "warn", "--config", cfg, "--redis", fmt.Sprintf("redis://127.0.0.1:%d", port),
			// The machine may be loaded: a slow answer is measured, not replaced by a
			// failure policy (the answers say when one decided: Degraded). The
			// defaults (50 ms, and 10 ms for a global check) suit a quiet host.
			"--redis-timeout", "1s", "--global-timeout", "1s"), "listening")
		if err != nil {
			stop()
			return nil, nil, err
		}
		stops = append(stops, p.stop)
	}
	var out []*redisSystem
	for _, tier := range []string{"hybrid", "global"} {
		out = append(out, &redisSystem{name: "rlsidecar-" + tier, redisPort: port, instances: 2,
			dial: func(i int) (admitter, error) {
				c, err := net.Dial("unix", socks[i])
				if err != nil {
					return nil, err
				}
				s := &sockChecker{c: c, br: bufio.NewReaderSize(c, 64<<10)}
				return &rlsAdmitter{s: s, tier: tier, dec: proto.NewDecoder(), enc: proto.NewEncoder()}, nil
			}})
	}
	return out, stop, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
