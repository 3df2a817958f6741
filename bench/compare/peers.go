//go:build peers

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	guber "github.com/gubernator-io/gubernator/v2"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// The peers, at the versions the comparison names. Each is installed with `go install`
// into the run's temporary directory (the go build cache makes later runs quick) and runs
// as its own process on free loopback ports.
const (
	gubernatorPkg = "github.com/gubernator-io/gubernator/v2/cmd/gubernator@v2.13.0"
	envoyRLPkg    = "github.com/envoyproxy/ratelimit/src/service_cmd@v1.4.1-0.20260122083618-3fb702589d36"
)

func goInstall(bin, pkg string) error {
	cmd := exec.Command("go", "install", pkg)
	cmd.Env = append(os.Environ(), "GOBIN="+bin, "GOFLAGS=-buildvcs=false", "GOWORK=off")
	cmd.Dir = bin
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("go install %s: %w\n%s", pkg, err, out)
	}
	return nil
}

// startPeers installs and starts the peers it can and returns them as systems; a peer
// that cannot be built or started is left out with a note saying why.
func startPeers(dir string, ks keys) ([]*system, []string, func()) {
	bin := filepath.Join(dir, "peers")
	_ = os.MkdirAll(bin, 0o755)
	var (
		systems []*system
		notes   []string
		stops   []func()
		mu      sync.Mutex
		wg      sync.WaitGroup
	)
	errs := make([]error, 2)
	wg.Go(func() { errs[0] = goInstall(bin, gubernatorPkg) })
	wg.Go(func() { errs[1] = goInstall(bin, envoyRLPkg) })
	wg.Wait()
	if errs[0] != nil {
		notes = append(notes, fmt.Sprintf("gubernator not measured: %v", errs[0]))
	} else if ss, stop, err := startGubernator(bin, ks); err != nil {
		notes = append(notes, fmt.Sprintf("gubernator not measured: %v", err))
	} else {
		mu.Lock()
		systems = append(systems, ss...)
		stops = append(stops, stop)
		mu.Unlock()
	}
	if errs[1] != nil {
		notes = append(notes, fmt.Sprintf("envoy-ratelimit not measured: %v", errs[1]))
	} else if s, stop, err := startEnvoyRL(bin, ks); err != nil {
		notes = append(notes, fmt.Sprintf("envoy-ratelimit not measured: %v", err))
	} else {
		systems = append(systems, s)
		stops = append(stops, stop)
	}
	// rlsidecar's own Envoy API, driven by the same gRPC client as envoyproxy/ratelimit.
	if s, stop, err := startRlsidecarEnvoy(dir, ks); err != nil {
		notes = append(notes, fmt.Sprintf("rlsidecar-envoy not measured: %v", err))
	} else {
		systems = append(systems, s)
		stops = append(stops, stop)
	}
	return systems, notes, func() {
		for _, s := range stops {
			s()
		}
	}
}

// waitReady calls probe until it succeeds or 30 s pass.
func waitReady(name string, probe func() error) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := probe()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after 30s: %w", name, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// --- gubernator

type gubChecker struct {
	c        guber.V1Client
	ks       keys
	behavior guber.Behavior
}

func (g *gubChecker) check(i int) error { return g.checkKey(g.ks[i]) }

func (g *gubChecker) checkKey(k int) error {
	resp, err := g.c.GetRateLimits(context.Background(), &guber.GetRateLimitsReq{Requests: []*guber.RateLimitReq{{
		Name: "per_user", UniqueKey: "user-" + strconv.Itoa(k), Hits: 1, Limit: 1_000_000_000,
		Duration: 60 * guber.Minute, Behavior: g.behavior,
	}}})
	if err != nil {
		return err
	}
	if len(resp.Responses) != 1 || resp.Responses[0].Error != "" || resp.Responses[0].Status != guber.Status_UNDER_LIMIT {
		return fmt.Errorf("gubernator answered %v", resp.Responses)
	}
	return nil
}

func (g *gubChecker) close() {}

func startGubernator(bin string, ks keys) ([]*system, func(), error) {
	grpcAddr, p, err := startGubNode(bin, "")
	if err != nil {
		return nil, nil, err
	}
	dial := func(b guber.Behavior) (*gubChecker, error) {
		c, err := guber.DialV1Server(grpcAddr, nil)
		if err != nil {
			return nil, err
		}
		return &gubChecker{c: c, ks: ks, behavior: b}, nil
	}
	mk := func(name string, b guber.Behavior) *system {
		return &system{name: name, dial: func() (checker, error) { return dial(b) }}
	}
	def := mk("gubernator", guber.Behavior_BATCHING)
	def.memory = func(n int) (MemoryRow, error) {
		before, err := p.rssKB()
		if err != nil {
			return MemoryRow{}, err
		}
		if err := distinctKeys(func() (keyChecker, error) { return dial(guber.Behavior_BATCHING) }, 1_000_000_000, n); err != nil {
			return MemoryRow{}, err
		}
		after, err := p.rssKB()
		if err != nil {
			return MemoryRow{}, err
		}
		return MemoryRow{System: "gubernator", Keys: n, BytesPerKey: float64(after-before) * 1024 / float64(n), Measure: "server RSS growth"}, nil
	}
	return []*system{def, mk("gubernator-global", guber.Behavior_GLOBAL)}, p.stop, nil
}

// startGubNode starts one gubernator node (installed in bin), a cluster of its own, its
// log named by tag, and waits until it answers. It returns its gRPC address.
func startGubNode(bin, tag string) (grpcAddr string, p *process, err error) {
	var ports [3]int
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return "", nil, err
		}
	}
	grpcAddr = fmt.Sprintf("127.0.0.1:%d", ports[0])
	memberlist := fmt.Sprintf("127.0.0.1:%d", ports[2])
	cmd := exec.Command(filepath.Join(bin, "gubernator"))
	cmd.Env = append(os.Environ(),
		"GUBER_GRPC_ADDRESS="+grpcAddr,
		fmt.Sprintf("GUBER_HTTP_ADDRESS=127.0.0.1:%d", ports[1]),
		"GUBER_ADVERTISE_ADDRESS="+grpcAddr,
		"GUBER_PEER_DISCOVERY_TYPE=member-list",
		"GUBER_MEMBERLIST_ADDRESS="+memberlist,
		"GUBER_MEMBERLIST_BIND_ADDRESS="+memberlist,
		"GUBER_MEMBERLIST_KNOWN_NODES="+memberlist, // a cluster of one
		"OTEL_TRACES_EXPORTER=none", "OTEL_SDK_DISABLED=true",
		"GUBER_CACHE_SIZE=2000000", // holds the memory test's million keys
		"GUBER_LOG_LEVEL=error",
	)
	logf, err := logTo(cmd, bin, "gubernator"+tag+".log")
	if err != nil {
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", nil, fmt.Errorf("starting gubernator: %w", err)
	}
	p = &process{cmd: cmd}
	c, err := guber.DialV1Server(grpcAddr, nil)
	if err != nil {
		p.stop()
		return "", nil, err
	}
	probe := &gubChecker{c: c, behavior: guber.Behavior_BATCHING}
	if err := waitReady("gubernator", func() error { return probe.checkKey(0) }); err != nil {
		p.stop()
		return "", nil, fmt.Errorf("%w; its log ends: %s", err, tail(logf))
	}
	return grpcAddr, p, nil
}

// keyChecker checks one key by number.
type keyChecker interface {
	checkKey(k int) error
	close()
}

// distinctKeys checks keys base..base+n-1 once each over 16 connections.
func distinctKeys(dial func() (keyChecker, error), base, n int) error {
	var wg sync.WaitGroup
	errs := make([]error, 16)
	for g := range errs {
		c, err := dial()
		if err != nil {
			return err
		}
		wg.Go(func() {
			defer c.close()
			for k := g; k < n; k += len(errs) {
				if err := c.checkKey(base + k); err != nil {
					errs[g] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// --- envoyproxy/ratelimit

const envoyConfig = `domain: bench
descriptors:
  - key: user
    rate_limit:
      unit: hour
      requests_per_unit: 1000000000
  - key: acct
    rate_limit:
      unit: hour
      requests_per_unit: 1000
  - key: seat
    rate_limit:
      unit: hour
      requests_per_unit: 10
`

type envoyChecker struct {
	conn *grpc.ClientConn
	c    ratelimitv3.RateLimitServiceClient
	ks   keys
	// decided: require the answer to carry the descriptor's limit, proof that a rule
	// decided it (rlsidecar answers OK without one when nothing matches).
	decided bool
}

func (e *envoyChecker) check(i int) error { return e.checkKey(e.ks[i]) }

func (e *envoyChecker) checkKey(k int) error {
	resp, err := e.c.ShouldRateLimit(context.Background(), &ratelimitv3.RateLimitRequest{
		Domain:      "bench",
		Descriptors: []*rlcommon.RateLimitDescriptor{{Entries: []*rlcommon.RateLimitDescriptor_Entry{{Key: "user", Value: "user-" + strconv.Itoa(k)}}}},
		HitsAddend:  1,
	})
	if err != nil {
		return err
	}
	if resp.OverallCode != ratelimitv3.RateLimitResponse_OK {
		return fmt.Errorf("envoy-ratelimit answered %v", resp.OverallCode)
	}
	if e.decided && (len(resp.Statuses) != 1 || resp.Statuses[0].CurrentLimit == nil) {
		return fmt.Errorf("no rule decided the descriptor: %v", resp)
	}
	return nil
}

// envoyDialer returns a dial function for an Envoy rate limit service at addr.
func envoyDialer(addr string, ks keys, decided bool) func() (*envoyChecker, error) {
	return func() (*envoyChecker, error) {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		return &envoyChecker{conn: conn, c: ratelimitv3.NewRateLimitServiceClient(conn), ks: ks, decided: decided}, nil
	}
}

// startRlsidecarEnvoy starts a second rlsidecar daemon (local mode, the comparison's
// rule set) serving Envoy's rate limit service API on a loopback TCP port, as
// envoyproxy/ratelimit does: the descriptor entry user=... is the rule's key.
func startRlsidecarEnvoy(dir string, ks keys) (*system, func(), error) {
	port, err := freePort()
	if err != nil {
		return nil, nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	p, err := startLogged(exec.Command(filepath.Join(dir, "rlsidecar"), "serve", "--socket", filepath.Join(dir, "rlsidecar-envoy.sock"),
		"--admin=", "--log-level", "warn", "--config", filepath.Join(dir, "rules.yaml"), "--envoy-rls", addr), "listening")
	if err != nil {
		return nil, nil, err
	}
	dial := envoyDialer(addr, ks, true)
	probe, err := dial()
	if err != nil {
		p.stop()
		return nil, nil, err
	}
	defer probe.close()
	if err := waitReady("rlsidecar-envoy", func() error { return probe.checkKey(0) }); err != nil {
		p.stop()
		return nil, nil, err
	}
	return &system{name: "rlsidecar-envoy", dial: func() (checker, error) { return dial() }}, p.stop, nil
}

func (e *envoyChecker) close() { _ = e.conn.Close() }

func startEnvoyRL(bin string, ks keys) (*system, func(), error) {
	rp, redisPort, err := startRedis(filepath.Join(bin, "redis"))
	if err != nil {
		return nil, nil, err
	}
	addr, ep, err := runEnvoyRL(bin, redisPort, "")
	if err != nil {
		rp.stop()
		return nil, nil, err
	}
	stop := func() { ep(); rp.stop() }
	dial := envoyDialer(addr, ks, false)
	s := &system{name: "envoy-ratelimit", dial: func() (checker, error) { return dial() }}
	s.memory = func(n int) (MemoryRow, error) {
		before, err := redisUsedMemory(redisPort)
		if err != nil {
			return MemoryRow{}, err
		}
		if err := distinctKeys(func() (keyChecker, error) { return dial() }, 1_000_000_000, n); err != nil {
			return MemoryRow{}, err
		}
		after, err := redisUsedMemory(redisPort)
		if err != nil {
			return MemoryRow{}, err
		}
		return MemoryRow{System: "envoy-ratelimit", Keys: n, BytesPerKey: float64(after-before) / float64(n), Measure: "its Redis used_memory growth"}, nil
	}
	return s, stop, nil
}

// runEnvoyRL starts one envoyproxy/ratelimit service (service_cmd, installed in bin) on
// the Redis at redisPort, its runtime directory named by tag, and waits until it answers.
func runEnvoyRL(bin string, redisPort int, tag string) (string, func(), error) {
	return runEnvoyRLWith(bin, redisPort, tag, envoyConfig)
}

// runEnvoyRLWith is runEnvoyRL with the configuration file config.
func runEnvoyRLWith(bin string, redisPort int, tag, config string) (string, func(), error) {
	var ports [3]int
	for i := range ports {
		p, err := freePort()
		if err != nil {
			return "", nil, err
		}
		ports[i] = p
	}
	grpcPort := ports[0]
	root := filepath.Join(bin, "runtime"+tag)
	cfgDir := filepath.Join(root, "ratelimit", "config")
	if err := os.MkdirAll(cfgDir, 0o755); err != nil {
		return "", nil, err
	}
	if err := os.WriteFile(filepath.Join(cfgDir, "bench.yaml"), []byte(config), 0o644); err != nil {
		return "", nil, err
	}
	cmd := exec.Command(filepath.Join(bin, "service_cmd"))
	cmd.Env = append(os.Environ(),
		"USE_STATSD=false", "LOG_LEVEL=error",
		"REDIS_SOCKET_TYPE=tcp", fmt.Sprintf("REDIS_URL=127.0.0.1:%d", redisPort),
		"RUNTIME_ROOT="+root, "RUNTIME_SUBDIRECTORY=ratelimit", "RUNTIME_WATCH_ROOT=false",
		"GRPC_HOST=127.0.0.1", fmt.Sprintf("GRPC_PORT=%d", grpcPort),
		"HOST=127.0.0.1", fmt.Sprintf("PORT=%d", ports[1]),
		"DEBUG_HOST=127.0.0.1", fmt.Sprintf("DEBUG_PORT=%d", ports[2]),
	)
	logf, err := logTo(cmd, bin, "envoy-ratelimit"+tag+".log")
	if err != nil {
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", nil, fmt.Errorf("starting envoy ratelimit: %w", err)
	}
	p := &process{cmd: cmd}
	addr := fmt.Sprintf("127.0.0.1:%d", grpcPort)
	probe, err := envoyDialer(addr, nil, false)()
	if err != nil {
		p.stop()
		return "", nil, err
	}
	defer probe.close()
	if err := waitReady("envoy-ratelimit", func() error { return probe.checkKey(0) }); err != nil {
		p.stop()
		return "", nil, fmt.Errorf("%w; its log ends: %s", err, tail(logf))
	}
	return addr, p.stop, nil
}

func redisUsedMemory(port int) (int64, error) {
	out, err := exec.Command("redis-cli", "-p", strconv.Itoa(port), "INFO", "memory").Output()
	if err != nil {
		return 0, fmt.Errorf("redis-cli INFO memory: %w", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, errors.New("no used_memory in INFO memory")
}

// logTo sends cmd's output to a file in dir and returns its path.
func logTo(cmd *exec.Cmd, dir, name string) (string, error) {
	path := filepath.Join(dir, name)
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	cmd.Stdout, cmd.Stderr = f, f
	return path, nil
}

// tail returns the last lines of a log, for an error message.
func tail(path string) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(lines[max(0, len(lines)-5):], " | ")
}

// admit checks key under the limit of kind.
func (g *gubChecker) admit(key int, kind limitKind) (ok, degraded bool, err error) {
	name, limit := kind.name(), kind.limit()
	ctx, cancel := context.WithTimeout(context.Background(), admitTimeout)
	defer cancel()
	resp, err := g.c.GetRateLimits(ctx, &guber.GetRateLimitsReq{Requests: []*guber.RateLimitReq{{
		Name: name, UniqueKey: "k-" + strconv.Itoa(key), Hits: 1, Limit: limit,
		Duration: 60 * guber.Minute, Behavior: g.behavior,
	}}})
	if err != nil {
		return false, false, err
	}
	if len(resp.Responses) != 1 || resp.Responses[0].Error != "" {
		return false, false, fmt.Errorf("gubernator answered %v", resp.Responses)
	}
	return resp.Responses[0].Status == guber.Status_UNDER_LIMIT, false, nil
}

// admit checks key under the descriptor of kind.
func (e *envoyChecker) admit(key int, kind limitKind) (ok, degraded bool, err error) {
	name := kind.name()
	ctx, cancel := context.WithTimeout(context.Background(), admitTimeout)
	defer cancel()
	resp, err := e.c.ShouldRateLimit(ctx, &ratelimitv3.RateLimitRequest{
		Domain:      "bench",
		Descriptors: []*rlcommon.RateLimitDescriptor{{Entries: []*rlcommon.RateLimitDescriptor_Entry{{Key: name, Value: strconv.Itoa(key)}}}},
		HitsAddend:  1,
	})
	if err != nil {
		return false, false, err
	}
	switch resp.OverallCode {
	case ratelimitv3.RateLimitResponse_OK:
		return true, false, nil
	case ratelimitv3.RateLimitResponse_OVER_LIMIT:
		return false, false, nil
	}
	return false, false, fmt.Errorf("envoy-ratelimit answered %v", resp.OverallCode)
}

// startRedisPeers starts the peers of the Redis phase, two instances each: two
// envoyproxy/ratelimit services on one Redis (which counts), and two gubernator nodes in
// one cluster, GLOBAL behaviour (no Redis: its cost is left out). The peers were
// installed into dir/peers by startPeers.
func startRedisPeers(dir string) ([]*redisSystem, []string, func()) {
	bin := filepath.Join(dir, "peers")
	var (
		out   []*redisSystem
		notes []string
		stops []func()
	)
	stop := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	if _, err := os.Stat(filepath.Join(bin, "service_cmd")); err == nil {
		if rp, port, err := startRedis(filepath.Join(bin, "redis-acc")); err != nil {
			notes = append(notes, fmt.Sprintf("envoy-ratelimit Redis phase: %v", err))
		} else {
			stops = append(stops, rp.stop)
			var addrs []string
			for i := range 2 {
				addr, st, err := runEnvoyRL(bin, port, fmt.Sprintf("-acc%d", i))
				if err != nil {
					notes = append(notes, fmt.Sprintf("envoy-ratelimit Redis phase: %v", err))
					break
				}
				stops = append(stops, st)
				addrs = append(addrs, addr)
			}
			if len(addrs) == 2 {
				out = append(out, &redisSystem{name: "envoy-ratelimit", redisPort: port, instances: 2,
					dial: func(i int) (admitter, error) { return envoyDialer(addrs[i], nil, false)() }})
			}
		}
	}
	if nodes, stopNodes, err := gubernatorCluster(2); err != nil {
		notes = append(notes, fmt.Sprintf("gubernator-global Redis phase: %v", err))
	} else {
		stops = append(stops, stopNodes)
		out = append(out, &redisSystem{name: "gubernator-global", instances: 2,
			dial: func(i int) (admitter, error) { return dialGub(nodes[i]) }})
		notes = append(notes, "gubernator keeps no counts in Redis (GLOBAL owners sync over gRPC): it has no Redis cost row; "+
			"its two-node cluster runs inside the compare process (gubernator's own cluster package's way: memberlist names "+
			"every node on one host alike), with its default behaviours (GLOBAL sync every 100 ms)")
	}
	return out, notes, stop
}

// gubernatorCluster starts n gubernator daemons in this process on free loopback ports,
// each told of all the others (discovery none, peers set directly, as gubernator's own
// cluster package does), and returns their gRPC addresses.
func gubernatorCluster(n int) ([]string, func(), error) {
	var daemons []*guber.Daemon
	log := logrus.New()
	log.SetLevel(logrus.ErrorLevel)
	stop := func() {
		log.SetLevel(logrus.PanicLevel) // a node stopping first makes the other complain
		closed := make(chan struct{})
		go func() {
			defer close(closed)
			for _, d := range daemons {
				d.Close()
			}
		}()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			// gubernator v2.13.0's Close can wait forever for its GLOBAL manager's
			// goroutines (globalManager.Close's wg.Stop; seen after the sparse accuracy
			// phase, its figures already taken). The nodes live in this process, which
			// exits at the end of the run: leave them rather than hang the report.
		}
	}
	var peers []guber.PeerInfo
	for range n {
		grpcPort, err := freePort()
		if err != nil {
			stop()
			return nil, nil, err
		}
		httpPort, err := freePort()
		if err != nil {
			stop()
			return nil, nil, err
		}
		addr := fmt.Sprintf("127.0.0.1:%d", grpcPort)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		d, err := guber.SpawnDaemon(ctx, guber.DaemonConfig{
			InstanceID: addr, GRPCListenAddress: addr, AdvertiseAddress: addr,
			HTTPListenAddress: fmt.Sprintf("127.0.0.1:%d", httpPort), PeerDiscoveryType: "none",
			Logger: log.WithField("node", addr),
		})
		cancel()
		if err != nil {
			stop()
			return nil, nil, fmt.Errorf("starting a gubernator daemon: %w", err)
		}
		d.PeerInfo = guber.PeerInfo{GRPCAddress: addr, HTTPAddress: d.HTTPListener.Addr().String()}
		daemons = append(daemons, d)
		peers = append(peers, d.PeerInfo)
	}
	var addrs []string
	for _, d := range daemons {
		d.SetPeers(peers)
		addrs = append(addrs, d.PeerInfo.GRPCAddress)
	}
	return addrs, stop, nil
}

// dialGub connects to the gubernator node at addr, checking with GLOBAL behaviour.
func dialGub(addr string) (*gubChecker, error) {
	c, err := guber.DialV1Server(addr, nil)
	if err != nil {
		return nil, err
	}
	return &gubChecker{c: c, behavior: guber.Behavior_GLOBAL}, nil
}
