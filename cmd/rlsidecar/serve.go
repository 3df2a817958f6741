package main

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/url"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode"

	"github.com/rlsidecar/rlsidecar/daemon"
	"github.com/rlsidecar/rlsidecar/envoyrls"
	"github.com/rlsidecar/rlsidecar/internal/plural"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"

	"github.com/redis/go-redis/v9"
)

// maxLoggedWarnings is how many of a rule set's warnings the daemon logs at a load.
const maxLoggedWarnings = 20

// octalMode is a flag holding a file mode written in octal, like 0660.
type octalMode os.FileMode

func (m *octalMode) String() string { return fmt.Sprintf("%#o", os.FileMode(*m)) }
func (m *octalMode) Set(s string) error {
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil || v > 0o777 {
		return fmt.Errorf("%q is not an octal permission like 0660", s)
	}
	// Connecting to a Unix socket needs write permission on its file: a mode with no
	// write bit (0 among them, which once meant the default) lets no one but root in,
	// and is never what was meant.
	if v&0o222 == 0 {
		return fmt.Errorf("%q lets no one connect (connecting needs a write bit); give permission bits like 0660, or leave the flag out for 0660", s)
	}
	*m = octalMode(v)
	return nil
}

// The daemon's metrics observe the Envoy API's calls in the check latency histogram,
// and count its error answers by gRPC code.
var _ envoyrls.LatencyRecorder = (*daemon.Metrics)(nil)
var _ envoyrls.ErrorRecorder = (*daemon.Metrics)(nil)

// longCallTimeout is the Redis timeout of the client of the calls bounded by more than a
// check's wait (see rlsync.Global.WithLongClient): the longest of their bounds, a closing
// connection's releases and a ban's lift (1 s).
const longCallTimeout = time.Second

func serve(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("serve", stderr)
	config := fs.String("config", "", "rules file (YAML), or a directory whose *.yaml and *.yml files are one rule set; empty: the built-in example rules")
	socket := fs.String("socket", daemon.DefaultSocketPath(), "Unix socket path")
	mode := octalMode(0o660)
	fs.Var(&mode, "socket-mode", "permission bits (octal) of the socket file and of an --envoy-rls unix: socket file; a socket systemd passes has its .socket unit's SocketMode=")
	socketGroup := fs.String("socket-group", "", "group (name or number) given the socket file and an --envoy-rls unix: socket file, for the gateways' users; a socket systemd passes has its .socket unit's SocketGroup=")
	maxFrame := fs.Int("max-frame", 65536, "largest request frame accepted, in bytes")
	maxConns := fs.Int("max-conns", 1024, "connections served at once")
	maxSyncKeys := fs.Int("hybrid-max-sync-keys", 100_000, "hybrid mode: keys one periodic sync carries at most; the rest wait for the next (rlsidecar_hybrid_sync_backlog)")
	maxKeys := fs.Int("max-keys", 4_000_000, "client keys held in memory; past it, the least informative states are evicted (never a limited client before one that is not)")
	prefetchFrom := fs.Int("prefetch-from", 65_536, "local client keys held from which a pipelined connection's checks fetch their keys' state into the CPU's caches a few checks ahead (under about that many they are there already, and fetching costs more than it saves); 0: never")
	maxAttrs := fs.Int("max-attrs", 64, "attributes per request")
	maxAttrLen := fs.Int("max-attr-len", proto.DefaultMaxAttrLen, "bytes per attribute value (and inline limit key); a request with a longer one gets attr_too_large, which the gateways' clients answer with 431 whatever their failure policy. A value over 4,096 bytes is keyed by its SHA-256")
	frameTimeout := fs.Duration("frame-timeout", 5*time.Second, "time a client has to finish sending a frame it has begun")
	writeTimeout := fs.Duration("write-timeout", 5*time.Second, "time a client has to take its answers (on the socket and the Envoy API); a client that stops reading is then cut off")
	idleTimeout := fs.Duration("idle-timeout", 0, "close connections idle this long (0: never); one holding a concurrency lease stays open until its leases are released or run out")
	busyPoll := fs.Duration("busy-poll", 0, "after answering, keep reading a connection this long before sleeping (one connection at a time; costs up to one CPU while checks keep coming; 0: off)")
	drainTimeout := fs.Duration("drain-timeout", 5*time.Second, "on SIGTERM, time to answer what is in flight")
	sweepEvery := fs.Duration("sweep-interval", 5*time.Second, "how often state that carries no information is dropped")
	logFormat := fs.String("log-format", "text", "log format: text or json")
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn, error")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile to this file until exit (a debugging aid)")
	admin := fs.String("admin", defaultAdmin, "admin HTTP endpoint (/metrics /healthz /readyz /rules /top /bans); empty: off")
	topK := fs.Int("top-k", 10, "clients kept per rule in the most-rejected sketch (/top, rlsidecar_top_rejected); at most 10000")
	topLabels := fs.String("top-labels", "hashed", "how rlsidecar_top_rejected names a client: hashed (a keyed 48-bit hash, matched to the key on /top), raw (the key itself: API keys and IPs reach your metrics store) or off")
	topSaltFile := fs.String("top-labels-salt-file", "", "file holding the secret that keys the hashed labels, so they agree across restarts and daemons (default: a random one per process)")
	shadowAll := fs.Bool("shadow", false, "make every rule, and every inline limit a check carries, a shadow: counted and reported, never rejecting (a dark launch)")
	watch := fs.Bool("watch", true, "reload the rules file when it changes (SIGHUP reloads too)")
	redisURL := fs.String("redis", "", "standalone Redis: redis://host:port[/db] or rediss:// (TLS); turns on hybrid mode, the default for rules that name no mode")
	redisCluster := fs.String("redis-cluster", "", "Redis Cluster seed nodes: host:port,host:port (or redis[s]://host:port,host:port)")
	redisPassFile := fs.String("redis-password-file", "", "file holding the Redis password, re-read at each new connection (else $"+rlsync.PasswordEnv+"; a password in the URL shows in ps)")
	redisTLSCA := fs.String("redis-tls-ca-file", "", "rediss://: PEM file of the CAs the Redis server's certificate must chain to, in place of the system's (a private CA); re-read at each new connection")
	redisTLSCert := fs.String("redis-tls-cert-file", "", "rediss://: PEM client certificate presented to a Redis that asks for one (mutual TLS), with --redis-tls-key-file; re-read at each new connection")
	redisTLSKey := fs.String("redis-tls-key-file", "", "rediss://: PEM private key of --redis-tls-cert-file, readable by the daemon's user only; re-read at each new connection")
	redisTLSServerName := fs.String("redis-tls-server-name", "", "rediss://: the name the Redis server's certificate must carry, in place of the host dialed (on a Cluster, of every node's address)")
	redisTimeout := fs.Duration("redis-timeout", 50*time.Millisecond, "bound on every Redis call (hybrid syncs' calls: --sync-interval, global checks' and a new hybrid key's exact sync: --global-timeout, when that is longer; a lease's release or renewal: 250 ms or --global-timeout, the longer, a ban's lift: 1 s)")
	redisPrefix := fs.String("redis-prefix", rlsync.DefaultPrefix, "starts every Redis key of this daemon (limits, sync records, the live-daemons set): deployments sharing one Redis under different prefixes share no budget and count no daemon of the other; ends with ':', no braces")
	syncInterval := fs.Duration("sync-interval", 100*time.Millisecond, "hybrid mode: how often admitted counts are flushed to Redis and the global view read back")
	daemonID := fs.String("daemon-id", "", "this daemon's name in Redis heartbeats and sync records; two live daemons must not share one (default: hostname-pid-random)")
	globalTimeout := fs.Duration("global-timeout", 20*time.Millisecond, "global mode: how long a check waits for Redis before the rule's on_store_failure decides")
	breakerFailures := fs.Int("breaker-failures", 3, "consecutive failed Redis calls that open the circuit breaker (no call waits on Redis while it is open; on a Redis Cluster one breaker per master, for its keys)")
	breakerCooldown := fs.Duration("breaker-cooldown", time.Second, "the longest wait of an open breaker before it lets one probe through (the first after an eighth of it, each failed probe doubling the wait)")
	envoyRLS := fs.String("envoy-rls", "", "also serve Envoy's rate limit service API (gRPC) on unix:PATH or HOST:PORT; empty: off")
	envoyChargeRefused := fs.Bool("envoy-charge-refused", false, "a refused Envoy call still consumes, on each descriptor, what its rules have left, up to its hits_addend, as envoyproxy/ratelimit counts every hit: for the costs Envoy sends once a response is done (apply_on_stream_done), whose answer it ignores")
	envoyTransport := fs.String("envoy-rls-transport", envoyrls.DefaultTransport, "the Envoy listener's transport: native (rlsidecar's own HTTP/2 server for ShouldRateLimit and Health/Check) or grpc-go (google.golang.org/grpc, which also serves Health/Watch)")
	if err := noPositional(fs, args); err != nil {
		return err
	}
	// The admin address given (flag or environment) must be had; the default one yields
	// to another daemon on the host (see lateAdmin).
	adminGiven := false
	fs.Visit(func(f *flag.Flag) { adminGiven = adminGiven || f.Name == "admin" })
	secrets := &scrubber{}
	log, err := newLogger(stderr, *logFormat, *logLevel, secrets)
	if err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}

	if err := checkBounds(
		intAtLeast{"max-frame", *maxFrame, 256}, intAtMost{"max-frame", *maxFrame, min(math.MaxUint32, math.MaxInt)},
		intAtLeast{"max-conns", *maxConns, 1},
		intAtLeast{"hybrid-max-sync-keys", *maxSyncKeys, 1}, intAtLeast{"max-keys", *maxKeys, 1}, intAtLeast{"prefetch-from", *prefetchFrom, 0},
		intAtLeast{"max-attrs", *maxAttrs, 1}, intAtLeast{"max-attr-len", *maxAttrLen, 1},
		intAtLeast{"top-k", *topK, 1}, intAtMost{"top-k", *topK, maxTopK}, intAtLeast{"breaker-failures", *breakerFailures, 1},
		positive{"frame-timeout", *frameTimeout}, positive{"write-timeout", *writeTimeout},
		positive{"sweep-interval", *sweepEvery}, positive{"sync-interval", *syncInterval},
		positive{"redis-timeout", *redisTimeout}, positive{"global-timeout", *globalTimeout},
		positive{"breaker-cooldown", *breakerCooldown},
		notNegative{"idle-timeout", *idleTimeout}, notNegative{"busy-poll", *busyPoll},
		positive{"drain-timeout", *drainTimeout},
	); err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if err := rlsync.CheckPrefix(*redisPrefix); err != nil {
		return fmt.Errorf("%w: --redis-prefix: %v", errUsage, err)
	}
	if !slices.Contains(envoyrls.Transports, *envoyTransport) {
		return fmt.Errorf("%w: --envoy-rls-transport %q: use one of %s", errUsage, *envoyTransport, strings.Join(envoyrls.Transports, ", "))
	}
	for _, name := range unknownEnv(fs, os.Environ()) {
		log.Warn("ignoring an environment variable that sets no flag (a typo?)", "name", name)
	}
	// Signals are taken from here on, before the socket exists: a SIGTERM (or SIGHUP)
	// that arrives while the daemon starts waits in sigs (hups) for the serving loop, which
	// drains (or reloads), instead of killing the process, its socket file left behind,
	// by the signal's default action.
	// SIGHUP has a channel of its own, of one: a reload runs on the serving loop, and
	// os/signal drops a signal whose channel is full. Sharing one channel of 4, a burst
	// of SIGHUPs during a slow reload (a config manager, `systemctl reload` run in a
	// loop) filled it, and a SIGTERM sent then was dropped: the daemon never drained,
	// and systemd killed it at TimeoutStopSec, its last sync not run. One SIGHUP waiting
	// stands for any number: the reload it brings reads the file as it is then.
	sigs := make(chan os.Signal, 4) // SIGTERM, SIGINT
	hups := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	signal.Notify(hups, syscall.SIGHUP)
	defer signal.Stop(sigs)
	defer signal.Stop(hups)
	// A log line written to a pipe whose reader has gone (`serve 2>&1 | logger`, a
	// supervisor's log process that died) fails with EPIPE instead of killing the daemon
	// by SIGPIPE, Go's default for standard output and error: before, its next log line
	// (a reload's, a Redis error's) ended it with status 141, no drain, its socket file
	// left behind.
	signal.Ignore(syscall.SIGPIPE)
	// Sockets passed by systemd (LISTEN_FDS) replace --socket and, the one named "envoy"
	// (rlsidecar-envoy.socket), --envoy-rls; read them once, first.
	activated, err := activatedListeners()
	if err != nil {
		return err
	}
	defer activated.close() // when the daemon fails before serving; Shutdown closes them otherwise
	if activated.socket != nil {
		// The socket unit sets the path, mode and group (ListenStream=, SocketMode=,
		// SocketGroup=): one set here too (RLSIDECAR_SOCKET_GROUP in the settings file) is
		// ignored, said so as --envoy-rls is below, not silently.
		passed := activated.socket.Addr().String()
		var ignored []string
		fs.Visit(func(f *flag.Flag) {
			switch {
			case f.Name == "socket" && f.Value.String() != passed, f.Name == "socket-mode", f.Name == "socket-group":
				ignored = append(ignored, "--"+f.Name+"="+f.Value.String())
			}
		})
		if len(ignored) > 0 {
			log.Warn("ignoring "+strings.Join(ignored, " ")+": systemd passed the socket, whose path, mode and group are its .socket unit's (ListenStream=, SocketMode=, SocketGroup=; systemctl edit rlsidecar.socket)", "socket", passed)
		}
		*socket = passed
	}
	if activated.envoy != nil {
		addr := "unix:" + activated.envoy.Addr().String()
		if *envoyRLS != "" && *envoyRLS != addr {
			log.Warn("ignoring --envoy-rls: systemd passed the Envoy socket (rlsidecar-envoy.socket)", "envoy_rls", *envoyRLS, "socket", addr)
		}
		*envoyRLS = addr
	}
	notify := newNotifier(log)

	haveRedis := *redisURL != "" || *redisCluster != ""
	redisTLS := rlsync.TLSOptions{CAFile: *redisTLSCA, CertFile: *redisTLSCert, KeyFile: *redisTLSKey, ServerName: *redisTLSServerName}
	useTLSFiles := *redisTLSCA != "" || *redisTLSCert != "" || *redisTLSKey != "" || *redisTLSServerName != ""
	if useTLSFiles && !haveRedis {
		return fmt.Errorf("%w: --redis-tls-* options need --redis or --redis-cluster (rediss://)", errUsage)
	}
	id := *daemonID
	if id == "" {
		host, _ := os.Hostname()
		id = defaultDaemonID(host, os.Getpid())
	} else if err := checkDaemonID(id); err != nil {
		return err
	}
	load := func() (*rules.Set, error) {
		if *config == "" {
			return rules.Default(), nil
		}
		set, err := rules.Load(*config)
		if err != nil {
			return nil, err
		}
		return set, limiter.CheckModes(set, haveRedis)
	}
	set, err := load()
	if err != nil {
		return err
	}
	afterFirstLoad()
	// What validate warns of, in the journal too: an operator who skipped validate sees
	// a rule that can never decide, or a rule set with no rules.
	// At most maxLoggedWarnings of them a load, then how many more: 20,000 rules each
	// listing GET without HEAD logged 20,000 lines at every reload.
	logWarnings := func(set *rules.Set) {
		ws := set.Warnings()
		for i, w := range ws {
			if i == maxLoggedWarnings {
				log.Warn(fmt.Sprintf("rules: %d more warnings not logged; rlsidecar validate lists them all", len(ws)-i),
					"version", set.Version)
				break
			}
			log.Warn("rules: "+w.Error(), "version", set.Version)
		}
	}
	if *config != "" {
		logWarnings(set)
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	// One clock for every decision, expiry and health check: monotonic, so a wall clock
	// step neither refills buckets nor rejects active clients (see daemon.Clock).
	clock := daemon.NewSystemClock()
	sopts := localbucket.Options{MaxKeys: *maxKeys, PrefetchFrom: *prefetchFrom}
	if *prefetchFrom == 0 {
		sopts.PrefetchFrom = -1 // never
	}
	store := localbucket.NewStore(sopts)
	lim := limiter.New(set, store)
	lim.SetShadowAll(*shadowAll)
	topMode, err := daemon.ParseTopLabels(*topLabels)
	if err != nil {
		return fmt.Errorf("%w: --top-labels %v", errUsage, err)
	}
	var topSalt []byte
	if *topSaltFile != "" {
		if topSalt, err = os.ReadFile(*topSaltFile); err != nil {
			return fmt.Errorf("reading --top-labels-salt-file: %w", err)
		}
		if topSalt = []byte(strings.TrimSpace(string(topSalt))); len(topSalt) < 16 {
			return fmt.Errorf("%w: --top-labels-salt-file %s holds %s; use at least 16 random ones", errUsage, *topSaltFile, plural.Count(len(topSalt), "byte"))
		}
	}
	metrics := daemon.NewMetrics(version, *topK)
	metrics.SetTopLabels(topMode, topSalt)
	metrics.SetLeases(lim.Leases())
	metrics.SetRules(set, time.Now())
	// Checks are counted only when someone can read the counts.
	recorded := metrics
	if *admin == "" {
		recorded = nil
	}
	var hybrid *rlsync.Hybrid
	var global *rlsync.Global
	var syncMasters, checkMasters *rlsync.Masters // a breaker per Redis master, each
	modeDesc := "local mode"
	redisConns := 0 // the most the Redis clients below may hold (warnFileLimit)
	if haveRedis {
		cfg := rlsync.Config{URL: *redisURL, PasswordFile: *redisPassFile, Timeout: *redisTimeout}
		if *redisPassFile != "" {
			// Read again at each new connection (a rotated password needs no restart),
			// shared by the clients below: a bad change is logged once, and each new
			// password is kept out of the logs as the first is.
			cfg.Passwords, err = rlsync.LoadPasswordFile(*redisPassFile, func(err error) {
				log.Warn("redis: the password file changed and cannot be used", "err", err)
			}, func(password string) {
				secrets.set(password)
				// The new file's mode, as the first's at start: a rotation by rename
				// may have left it readable by every user.
				warnReadableSecrets(log, *socket, [2]string{"redis-password-file", *redisPassFile})
			})
			if err != nil {
				return err
			}
		}
		if useTLSFiles {
			// One set of files for the three clients below: a bad change is logged once.
			redisTLS.OnReloadError = func(err error) {
				log.Warn("redis TLS: a certificate file changed and cannot be used", "err", err)
			}
			if cfg.TLS, err = rlsync.LoadTLS(redisTLS); err != nil {
				return err
			}
		}
		where := rlsync.Redact(*redisURL)
		if *redisCluster != "" {
			cfg.Cluster = []string{*redisCluster}
			where = "cluster " + rlsync.Redact(*redisCluster)
		}
		if pw, err := cfg.Password(); err == nil {
			secrets.set(pw)
		}
		redisConns = 3 * cfg.MaxConns() // the syncs', the checks' and the long calls' clients
		if skipsVerify(*redisURL) {
			log.Warn("the --redis URL's skip_verify=true checks no server certificate: whoever can intercept the connection can read the password and every count, and answer in Redis's place; give the server's CA in --redis-tls-ca-file (and --redis-tls-server-name) instead", "redis", rlsync.Redact(*redisURL))
		}
		for _, name := range []string{"redis", "redis-cluster"} {
			if v, given := flagValue(args, name); given && urlHasPassword(v) {
				log.Warn("the --"+name+" URL on the command line holds a password, which ps shows to every user of this host: give it in $RLSIDECAR_REDIS_PASSWORD or --redis-password-file", "redis", rlsync.Redact(v))
			}
		}
		// Two clients (two connection pools) and two sets of breakers: global checks wait
		// milliseconds, hybrid syncs longer; a Redis too slow for the first, whose
		// timeouts close connections, must not make the second look down. A breaker per
		// master (one on a standalone Redis): a Cluster master that fails degrades its
		// own keys only.
		// The syncs' client likewise: a sync or heartbeat call is bounded by
		// max(--redis-timeout, --sync-interval) (hybrid.Run's timeout below), which the
		// client's own read timeout cut to --redis-timeout before; a new key's exact sync
		// by --global-timeout (FetchWait), which it cut to the longer of those two (each
		// call carries its own deadline, which this timeout does not lengthen).
		cfgSync := cfg
		cfgSync.Timeout = max(*redisTimeout, *syncInterval, *globalTimeout)
		rdb, err := rlsync.Open(cfgSync)
		if err != nil {
			return err
		}
		defer rdb.Close()
		// The checks' client times its calls out no sooner than --global-timeout: go-redis
		// takes the sooner of its own timeout and the call's deadline, so a
		// --global-timeout above --redis-timeout was cut to it (a round trip of the
		// auto-pipeline is given at most --global-timeout from when it is sent).
		cfgChecks := cfg
		cfgChecks.Timeout = max(*redisTimeout, *globalTimeout)
		rdbChecks, err := rlsync.Open(cfgChecks)
		if err != nil {
			return err
		}
		defer rdbChecks.Close()
		// A third client for the calls bounded by more than a check's wait: a lease's
		// release and renewal (at least 250 ms), a closing connection's releases (1 s),
		// refund retries and give-backs (250 ms), the shared bans' rounds and lifts (1 s).
		// On the checks' client they were cut to --redis-timeout (go-redis takes the
		// sooner of its own timeout and the call's deadline): a Redis that paused 150 ms
		// made a release or renewal answer false after 50 ms, and the Go middleware,
		// told its lease was gone, stopped renewing it. Each of these calls carries its
		// own deadline, which this client's timeout does not cut.
		cfgLong := cfg
		cfgLong.Timeout = max(*redisTimeout, *globalTimeout, longCallTimeout)
		rdbLong, err := rlsync.Open(cfgLong)
		if err != nil {
			return err
		}
		defer rdbLong.Close()
		redis.SetLogger(redisLog{log})
		// The scripts into Redis's cache before the first check, which would otherwise
		// send them itself (rlsync.LoadScripts). Bounded: a Redis that does not answer
		// delays the start by at most this, and its checks follow their policies anyway.
		// On the long calls' client, whose own timeout does not cut the bound: on the
		// checks' client each round trip was cut to --redis-timeout (50 ms), and a Redis
		// or a host that took longer at the start (a loaded machine) got the scripts
		// from the first checks, which then missed a short --global-timeout.
		lctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
		if err := rlsync.LoadScripts(lctx, rdbLong); err != nil {
			log.Warn("loading the scripts into Redis failed; the first calls will send them", "err", err)
		}
		// The checks' Cluster client fetches its slot map and Redis's command table now
		// (a PING: docs/reliability.md, "Redis back"), not in the first global check,
		// as LoadScripts did when it went through that client.
		if cc, ok := rdbChecks.(*redis.ClusterClient); ok {
			_ = cc.Ping(lctx).Err()
		}
		cancel()
		// A Redis too old for some commands says so at the start, not in a ban that
		// fails or a key without a TTL later (rlsync.MinRedisVersion).
		vctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
		// Those that answered: a Cluster master that did not (it is away, which the
		// scripts' load above has logged) does not hide another that is too old.
		old, _ := rlsync.CheckVersion(vctx, rdbLong)
		for _, why := range old {
			log.Warn(why)
		}
		cancel()
		// The long calls' client has no breaker to reload its slot map on a failover:
		// both maps that do keep it in step (Masters.Follow).
		syncMasters = rlsync.NewMasters(rdb, *breakerFailures, *breakerCooldown, clock.Mono).Follow(rdbLong)
		checkMasters = rlsync.NewMasters(rdbChecks, *breakerFailures, *breakerCooldown, clock.Mono).Follow(rdbLong)
		hybrid = rlsync.NewHybrid(rdb, rlsync.HybridOptions{Interval: *syncInterval, MaxKeys: *maxKeys, MaxSyncKeys: *maxSyncKeys, ID: id,
			Prefix: *redisPrefix, Clock: clock.Mono, FetchWait: max(*globalTimeout, 25*time.Millisecond)}).
			WithMasters(syncMasters).WithObserver(metrics.ObserveStore).WithSyncObserver(metrics.HybridSynced)
		// Two live daemons under one --daemon-id each take the other's syncs of a key for
		// their own and admit past the limit, silently; a blue/green pair on one host
		// that both read RLSIDECAR_DAEMON_ID from /etc/default/rlsidecar is one. Asked
		// before this daemon's first heartbeat, so a live entry is another daemon's.
		bctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
		if age, live, err := hybrid.LastBeat(bctx, id); err == nil && live {
			log.Warn("another live daemon uses this daemon id: two live daemons must not share one, or both admit past the shared limits; give each its own --daemon-id (RLSIDECAR_DAEMON_ID), or leave it unset for a unique default (a run of this daemon stopped without leaving, killed, looks the same until its heartbeats expire)",
				"daemon_id", id, "last_heartbeat_ago", age.Round(time.Millisecond))
		}
		cancel()
		metrics.WithRedis()
		if err := lim.SetRedisPrefix(*redisPrefix); err != nil {
			return err
		}
		global = rlsync.NewGlobal(rdbChecks).WithAutoPipeline().WithLongClient(rdbLong).WithMasters(checkMasters).WithObserver(metrics.ObserveStore)
		// Deferred after rdbChecks.Close, so run before it: once the server has drained,
		// the lease give-backs still queued go once more, and their worker ends.
		defer global.Close()
		lim.WithHybrid(hybrid).WithGlobal(global, *globalTimeout)
		metrics.CounterFunc("rlsidecar_lease_giveback_dropped_total", "Give-backs of global lease slots dropped (their queue full, or at shutdown): slots an acquire that failed unanswered may have taken stay held until their lease ends.",
			func() float64 { return float64(global.GiveBacksDropped()) })
		metrics.CounterFunc("rlsidecar_global_refund_errors_total", "Refunds of global rules' units that failed (a check refused, or failed, after another hash slot's keys had taken their units, and Redis did not take them back: a timeout, or a refusal still answered after 30 s of resending): those units stay used until they refill. Also lease give-backs whose last round failed: their slots may stay held until their lease ends.",
			func() float64 { return float64(global.RefundErrors()) })
		// Penalty rules in hybrid and global mode share their bans through Redis.
		sharedBans, err := rlsync.NewBans(rdbLong, *redisPrefix) // its calls carry their own deadlines
		if err != nil {
			return err
		}
		lim.WithSharedBans(sharedBans, *globalTimeout)
		lim.OnSharedBanStarted(metrics.BanStarted)
		metrics.GaugeFunc("rlsidecar_breaker_open", "1 while a Redis circuit breaker (hybrid syncs or global checks, of any master) is open.", func() float64 {
			if syncMasters.AnyOpen() || checkMasters.AnyOpen() {
				return 1
			}
			return 0
		})
		metrics.GaugeFunc("rlsidecar_breaker_open_masters", "Redis masters with a circuit breaker (hybrid syncs or global checks) open: their keys follow their rules' failure policies (standalone Redis: 0 or 1).", func() float64 {
			return float64(openMasters(syncMasters, checkMasters))
		})
		modeDesc = "hybrid mode by default, Redis " + where
	}
	warnOpenSockets(log, os.FileMode(mode), *socket, activated.socket != nil, *envoyRLS, activated.envoy != nil)
	srv, err := daemon.New(daemon.Config{
		Socket:       *socket,
		SocketMode:   os.FileMode(mode),
		SocketGroup:  *socketGroup,
		Listener:     activated.socket,
		MaxFrame:     *maxFrame,
		MaxConns:     *maxConns,
		MaxAttrs:     *maxAttrs,
		MaxAttrLen:   *maxAttrLen,
		FrameTimeout: *frameTimeout,
		WriteTimeout: *writeTimeout,
		IdleTimeout:  *idleTimeout,
		BusyPoll:     *busyPoll,
		DrainTimeout: *drainTimeout,
		Version:      version,
		Logger:       log,
		Metrics:      recorded,
		Clock:        clock,
	}, lim)
	if err != nil {
		return err
	}
	warnExposed(log, *admin, *envoyRLS)
	warnFileLimit(log, *maxConns, redisConns, *admin != "", *envoyRLS != "" || activated.envoy != nil)
	// Bind everything before announcing anything, and undo what a failed start created:
	// a socket file left behind would be found by clients and refuse them.
	var adm *daemon.Admin
	var lateAdmin func() (*daemon.Admin, error) // set when the default address was taken
	reloads := new(daemon.ReloadState)          // /rules shows them; `rlsidecar reload` waits on them
	if *admin != "" {
		deps := daemon.AdminDeps{Metrics: metrics, Limiter: lim, Now: clock.Mono, Draining: srv.Draining, Reloads: reloads, Logger: log}
		if hybrid != nil {
			deps.StoreReachable = func() bool { return hybrid.Reachable(clock.Mono()) }
		}
		if adm, err = daemon.NewAdmin(*admin, deps); err != nil {
			if adminGiven || !errors.Is(err, syscall.EADDRINUSE) {
				return err
			}
			// Another daemon on this host (blue/green, or several side by side) holds
			// the default address: serve checks anyway, and take it once it is freed.
			log.Warn("admin endpoint: the default address is taken (another rlsidecar on this host?); serving checks without it, and retrying every second; give each daemon its own --admin, or --admin= for none", "addr", *admin)
			adm, lateAdmin = nil, func() (*daemon.Admin, error) { return daemon.NewAdmin(*admin, deps) }
		}
	}
	if err := srv.Listen(); err != nil {
		if adm != nil {
			_ = adm.Shutdown(context.Background())
		}
		return err
	}
	secretFiles := [][2]string{{"top-labels-salt-file", *topSaltFile}}
	if haveRedis {
		secretFiles = append(secretFiles, [2]string{"redis-password-file", *redisPassFile}, [2]string{"redis-tls-key-file", *redisTLSKey})
	}
	warnReadableSecrets(log, *socket, secretFiles...)
	var rls *envoyrls.Server
	envoyDesc := "" // where the Envoy API is served, for the status line
	started := false
	defer func() {
		if !started {
			_ = srv.Shutdown(context.Background()) // closes the listener: unlinks the socket
			if rls != nil {
				_ = rls.Shutdown(context.Background())
			}
			if adm != nil {
				_ = adm.Shutdown(context.Background())
			}
		}
	}()
	if *envoyRLS != "" {
		rc := envoyrls.Config{Addr: *envoyRLS, SocketMode: os.FileMode(mode), SocketGroup: *socketGroup, Transport: *envoyTransport, Logger: log,
			WriteTimeout: *writeTimeout, FrameTimeout: *frameTimeout, Clock: clock.Now, // the socket's clock: one limiter, one clock
			ChargeRefused: *envoyChargeRefused}
		if activated.envoy != nil {
			rc.Listener = activated.envoy
		}
		if recorded != nil {
			rc.Recorder = recorded // with Answered: Envoy's calls are in rlsidecar_check_duration_seconds
			recorded.WithEnvoy()   // its error answers' series, at 0
		}
		r, err := envoyrls.New(rc, lim)
		if err == nil {
			err = r.Listen()
		}
		if err != nil {
			if activated.socket != nil && strings.HasPrefix(*envoyRLS, "unix:") &&
				(errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM)) {
				// rlsidecar.service can write nowhere (ProtectSystem=strict), and runs as a
				// user that owns no directory under /run.
				err = fmt.Errorf("%w (under systemd, enable rlsidecar-envoy.socket instead: the daemon takes the Envoy socket it passes; docs/operations.md)", err)
			}
			return err
		}
		rls, envoyDesc = r, *envoyRLS
		if a := r.Addr(); a.Network() == "tcp" {
			envoyDesc = a.String() // the port bound, where --envoy-rls asked for :0
		}
		log.Info("envoy rate limit service", "addr", envoyDesc, "activated", activated.envoy != nil, "transport", *envoyTransport)
	}
	// status is the service manager's one-line view (systemctl status).
	status := func() string {
		rs := lim.Rules()
		st := fmt.Sprintf("serving %s (version %s) on %s, %s", plural.Count(len(rs.Rules), "rule"), rs.Version, *socket, modeDesc)
		if envoyDesc != "" {
			st += ", Envoy API on " + envoyDesc
		}
		return st
	}

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	var wg sync.WaitGroup
	// every runs f every d, until ctx ends or f returns false.
	every := func(d time.Duration, f func() bool) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(d)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					if !f() {
						return
					}
				}
			}
		}()
	}
	every(*sweepEvery, func() bool { // the janitor: drops state that carries no information
		lim.Sweep(clock.Mono())
		return true
	})
	// The breakers' openings and closings, logged as they happen (checked every 250 ms):
	// a daemon whose rules are all global has no sync to log a failure, and an operator
	// reading the journal must see when its rules went to their failure policies.
	if checkMasters != nil {
		var w breakerWatch
		every(250*time.Millisecond, func() bool {
			w.observe(log, openMasters(syncMasters, checkMasters), checkMasters.Opened()+syncMasters.Opened())
			return true
		})
	}
	// The global checks' open breakers are probed in the background too, as the hybrid
	// heartbeats probe theirs: without traffic on a global rule, nothing else would
	// close them once Redis is back, and the breaker would read open (and alert) for
	// as long as the daemon stays idle.
	if global != nil {
		every(100*time.Millisecond, func() bool {
			global.ProbeOpen(ctx, max(*globalTimeout, 25*time.Millisecond))
			return true
		})
	}
	// The breakers follow the Cluster's slot map (failovers, reshards); standalone: no-op.
	for _, m := range []*rlsync.Masters{syncMasters, checkMasters} {
		if m.Cluster() {
			wg.Add(1)
			go func() {
				defer wg.Done()
				m.Run(ctx, time.Second)
			}()
		}
	}

	// The hybrid sync: flushes every interval, and once more after the server has drained,
	// so what was admitted before a shutdown reaches Redis.
	syncCtx, stopSync := context.WithCancel(context.Background())
	defer stopSync()
	var syncWG sync.WaitGroup
	if hybrid != nil {
		// The live daemons counted before the first check (Hybrid.Join), once the socket
		// is this daemon's (one that fails to start must not count among them), bounded
		// as the heartbeats are; one that fails is Run's to report, which beats at once.
		jctx, cancel := context.WithTimeout(context.Background(), max(*redisTimeout, *syncInterval))
		_ = hybrid.Join(jctx, id)
		cancel()
		var lastLog time.Time
		syncWG.Add(1)
		go func() {
			defer syncWG.Done()
			hybrid.Run(syncCtx, id, clock.Mono, max(*redisTimeout, *syncInterval), func(err error) {
				if syncCtx.Err() != nil {
					// The last sync, after the drain (or a sync still on its way then):
					// always said, as what it failed to hand in is lost with the process.
					log.Warn("the last sync before stopping failed: what this daemon admitted since its last sync that reached Redis is not counted there", "err", err)
					return
				}
				if time.Since(lastLog) > 10*time.Second { // one line per 10 s while Redis is away
					lastLog = time.Now()
					log.Warn("redis sync failed; deciding from local allowances, and by the failure policies where only Redis could decide", "err", err)
				}
			})
		}()
	}

	// The shared bans: learned once before the first check is served, then refusals
	// summed and bans learned every sync interval, and the refusals counted since the
	// last round sent once more at shutdown.
	if hybrid != nil {
		lctx, cancel := context.WithTimeout(ctx, *syncInterval)
		if err := lim.LearnSharedBans(lctx, clock.Mono()); err != nil {
			log.Warn("redis: reading the penalty bans in force at start failed; enforcing them from the next sync interval", "err", err)
		}
		cancel()
		var lastLog time.Time
		syncWG.Add(1)
		go func() {
			defer syncWG.Done()
			lim.RunSharedBans(syncCtx, *syncInterval, clock.Mono, func(err error) {
				if syncCtx.Err() != nil {
					// The last round, at stop: always said, as the refusals it failed
					// to send (and the bans they start) are lost with the process.
					log.Warn("sharing the penalty bans before stopping failed: the refusals counted since the last round, and the bans they start, do not reach the other daemons", "err", err)
					return
				}
				if time.Since(lastLog) > 10*time.Second {
					lastLog = time.Now()
					log.Warn("redis: sharing the penalty bans failed; enforcing those known", "err", err)
				}
			})
		}()
	}

	// Reloads, from SIGHUP or the file watcher: the whole new set is validated, then
	// swapped in one step; a broken file never replaces the rules in force.
	var reloadMu sync.Mutex
	reloadFailed := false // the last reload failed: the next that succeeds says so (under reloadMu)
	// apply reloads the rules (under reloadMu): from got, the file as read already, or
	// read now when got is nil.
	type loaded struct {
		set *rules.Set
		err error
	}
	apply := func(why string, got *loaded) {
		notify.reloading("reloading the rules (" + why + ")")
		reloads.Begin()
		var failed error
		defer func() { // READY=1 ends the reload, whatever its outcome
			reloads.End(failed)
			st := status()
			if failed != nil {
				st = "reload failed, keeping the rules in force (" + oneLine(failed) + "); " + st
			}
			notify.ready(st)
		}()
		if *config == "" {
			log.Info("built-in rules: nothing to reload", "trigger", why)
			return
		}
		if got == nil {
			set, err := load()
			got = &loaded{set, err}
		}
		newSet, err := got.set, got.err
		metrics.Reloaded(err)
		if err != nil {
			log.Error("reload failed; keeping the rules in force", "trigger", why, "err", err)
			failed, reloadFailed = err, true
			return
		}
		if newSet.Version == lim.Rules().Version {
			// Touched, not changed. Said when asked (SIGHUP), or when it ends a failure
			// (a broken file put back as it was): the log's last word on the rules was
			// the failure's ERROR, and the rules in force read as in doubt.
			if reloadFailed || why == "SIGHUP" {
				log.Info("rules unchanged", "trigger", why, "rules", len(newSet.Rules), "version", newSet.Version)
			}
			reloadFailed = false
			return
		}
		reloadFailed = false
		// Metrics first: their table for the new set is built (under their lock, one
		// entry per rule) while checks still run on the old set, which never waits for
		// it; the other order made checks on the new set wait for that lock.
		metrics.SetRules(newSet, time.Now())
		lim.SetRules(newSet)
		log.Info("rules reloaded", "trigger", why, "rules", len(newSet.Rules), "version", newSet.Version)
		logWarnings(newSet)
	}
	reload := func(why string) {
		reloadMu.Lock()
		defer reloadMu.Unlock()
		apply(why, nil)
	}
	// fileChanged is the watcher's reload. A file read empty is most likely one a writer
	// truncated in place, its bytes not there yet (the watcher looks for an empty file
	// before it calls, but the truncation may come between that look and this read): it
	// is read again (again) rather than reported, unless final. Before, such a read was
	// a failed reload: logged at error level, counted, the alert fired, for a file that
	// was good 2 ms later.
	fileChanged := func(final bool) (again bool) {
		reloadMu.Lock()
		defer reloadMu.Unlock()
		beforeFileRead()
		set, err := load()
		if err != nil && !final && rules.IsEmptyFile(err) {
			log.Debug("rules file read empty: looking again", "err", err)
			return true
		}
		apply("file change", &loaded{set, err})
		return false
	}
	rewatch, rewatching := func() {}, false
	if *watch && *config != "" {
		rewatch, rewatching = startWatching(log, func() (func(), error) {
			return watchConfig(ctx, *config, 100*time.Millisecond, fileChanged,
				func(err error) { log.Warn("watching the rules file", "err", err) })
		})
	}

	ruleSource := set.Source
	if *config == "" {
		ruleSource = "built-in example rules"
	}
	how := "listening on"
	if activated.socket != nil {
		how = "listening (socket activation) on"
	}
	started = true
	// The line for a terminal. In the journal with --log-format json, where a log shipper
	// parses every line of the unit as JSON, the "serving" record below says the same.
	if !(toJournal(stdout) && strings.EqualFold(*logFormat, "json")) {
		fmt.Fprintf(stdout, "rlsidecar %s %s %s (%s from %s, %s)\n", version, how, *socket, plural.Count(len(set.Rules), "rule"), ruleSource, modeDesc)
	}
	if limiter.NoStore {
		log.Error("this daemon was built with -tags rlsidecar_nostore, for measurement: it admits every local check without counting it; never run it for traffic")
	}
	log.Info("serving", "socket", *socket, "activated", activated.socket != nil, "rules", len(set.Rules), "source", ruleSource, "version", set.Version)

	metrics.GaugeFunc("rlsidecar_connections", "Connections being served.", func() float64 { return float64(srv.Connections()) })
	metrics.GaugeFunc("rlsidecar_keys", "Client keys held in memory (local buckets and hybrid allowances).", func() float64 {
		n := lim.Store().Len()
		if hybrid != nil {
			n += hybrid.Len()
		}
		return float64(n)
	})
	metrics.CounterFunc("rlsidecar_evictions_total", "Client states evicted to stay within --max-keys.", func() float64 {
		n := lim.Store().Evictions()
		if hybrid != nil {
			n += hybrid.Evicted()
		}
		return float64(n)
	})
	metrics.CounterFunc("rlsidecar_untracked_decisions_total", "Decisions for client keys the local store could not hold (--max-keys reached with every held client limited): made on their rule's shared fallback state, not their own.",
		func() float64 { return float64(lim.Store().Untracked()) })
	if hybrid != nil {
		metrics.GaugeFunc("rlsidecar_hybrid_sync_backlog", "Hybrid keys that needed a sync and were left for the next one (a sync carries at most --hybrid-max-sync-keys, and sends no more once its time runs short: Redis slower than the keys that change).",
			func() float64 { return float64(hybrid.Backlog()) })
		metrics.CounterFunc("rlsidecar_hybrid_dropped_units_total", "Admitted units lost before they reached Redis because the key cap evicted their key before a sync had carried them: while Redis was away, or syncs fell behind a flood of new keys.",
			func() float64 { return float64(hybrid.Dropped()) })
	}
	serveAdmin := func(adm *daemon.Admin) {
		log.Info("admin endpoint", "addr", adm.Addr())
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := adm.Serve(); err != nil {
				log.Error("admin endpoint stopped", "err", err)
			}
		}()
		go func() {
			<-ctx.Done()
			c, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			_ = adm.Shutdown(c)
		}()
	}
	if adm != nil {
		serveAdmin(adm)
	}
	if lateAdmin != nil {
		every(time.Second, func() bool { // until the default admin address is freed
			adm, err := lateAdmin()
			switch {
			case err == nil:
				serveAdmin(adm)
				return false
			case errors.Is(err, syscall.EADDRINUSE):
				return true
			}
			log.Error("admin endpoint: giving up", "err", err)
			return false
		})
	}

	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve() }()
	rlsErr := make(chan error, 1)
	if rls != nil {
		go func() { rlsErr <- rls.Serve() }()
	}
	// stopRLS stops the Envoy listener with the socket server, answering its calls in
	// flight within the drain timeout.
	stopRLS := func() {
		if rls == nil {
			return
		}
		c, cancel := context.WithTimeout(context.Background(), *drainTimeout)
		defer cancel()
		if err := rls.Shutdown(c); err != nil {
			log.Warn("envoy rate limit service drain incomplete", "err", err)
		}
		<-rlsErr
		rls = nil
	}
	notify.ready(status())
	// A change written between the first load and the watches being in place raised no
	// event: the file is read once more now that they are, and reloaded if it changed.
	if rewatching && *config != "" {
		if now, err := load(); err != nil || now.Version != lim.Rules().Version {
			reload("file change while starting")
		}
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		notify.watchdog(ctx)
	}()

	// drain stops the daemon on the signal sig (SIGTERM, SIGINT).
	drain := func(sig os.Signal) error {
		log.Info("draining", "signal", sig.String())
		notify.stopping("draining (" + sig.String() + ")")
		go func() {
			for s := range sigs {
				if s == syscall.SIGINT {
					log.Warn("second SIGINT: exiting now")
					os.Exit(exitFailure)
				}
			}
		}()
		var rlsDone sync.WaitGroup
		rlsDone.Go(stopRLS)
		err := srv.Shutdown(context.Background())
		<-serveErr
		rlsDone.Wait()
		stop()
		wg.Wait()
		stopSync() // the last flush: nothing the drained connections admitted is lost
		syncWG.Wait()
		if err != nil {
			log.Warn("drain incomplete", "err", err)
		}
		log.Info("stopped")
		return nil
	}

	for {
		select {
		case err := <-rlsErr: // the Envoy listener failed: stop the daemon too
			notify.stopping("stopping: envoy rate limit service: " + oneLine(err))
			rls = nil
			_ = srv.Shutdown(context.Background())
			<-serveErr
			stop()
			wg.Wait()
			stopSync()
			syncWG.Wait()
			return err
		case err := <-serveErr:
			notify.stopping("stopping: " + oneLine(err))
			stopRLS()
			stop()
			wg.Wait()
			stopSync()
			syncWG.Wait()
			return err
		case <-hups:
			select {
			case sig := <-sigs: // a stop waiting too goes first
				return drain(sig)
			default:
			}
			reload("SIGHUP")
			rewatch() // the watched directories found again, as after a change
		case sig := <-sigs:
			return drain(sig)
		}
	}
}

// beforeFileRead runs before the watcher's reload reads the rules: a test's hook, to
// change the file there.
var beforeFileRead = func() {}

// afterFirstLoad runs between the first load of the rules and the watcher's start: a
// test's hook, to change the file there.
var afterFirstLoad = func() {}

// redisLog sends go-redis's own log lines (pool dial failures, …) through slog at debug
// level: the daemon reports Redis trouble itself, once per 10 s, at warn.
type redisLog struct{ log *slog.Logger }

func (l redisLog) Printf(ctx context.Context, format string, v ...any) {
	l.log.Debug("go-redis: " + fmt.Sprintf(format, v...))
}

// newLogger builds the daemon's logger; what secrets names is kept out of it. Written
// to the journal (toJournal), each line starts with its level's syslog priority.
func newLogger(w io.Writer, format, level string, secrets *scrubber) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: use debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv, ReplaceAttr: secrets.replace}
	var out *prefixWriter
	if toJournal(w) {
		out = &prefixWriter{w: w}
		w = out
	}
	var h slog.Handler
	switch strings.ToLower(format) {
	case "text":
		h = slog.NewTextHandler(w, opts)
	case "json":
		h = slog.NewJSONHandler(w, opts)
	default:
		return nil, fmt.Errorf("--log-format %q: use text or json", format)
	}
	if out != nil {
		h = journalHandler{h, out}
	}
	return slog.New(h), nil
}

func validate(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("validate", stderr)
	config := fs.String("config", "", "rules file, or directory of rules files, to check (required)")
	noRedis := fs.Bool("no-redis", false, "the daemon runs without --redis: a rule that needs Redis (mode hybrid or global, split: auto) is an error")
	if err := noPositional(fs, args); err != nil {
		return err
	}
	if *config == "" {
		return fmt.Errorf("%w: --config is required", errUsage)
	}
	set, err := rules.Load(*config)
	if err != nil {
		return err
	}
	if err := limiter.CheckModes(set, false); err != nil {
		if *noRedis {
			return err
		}
		fmt.Fprintf(stderr, "note: %v (a daemon started without --redis refuses this file; --no-redis makes this an error)\n", err)
	}
	ws := set.Warnings() // rules that can never have an effect: reported, not fatal
	for _, w := range ws {
		fmt.Fprintf(stderr, "warning: %v\n", w)
	}
	fmt.Fprintf(stdout, "%s: %s, version %s, %s\n", *config, plural.Count(len(set.Rules), "rule"), set.Version, plural.Count(len(ws), "warning"))
	return nil
}

// oneLine returns err's text on one line, for a STATUS= notification.
func oneLine(err error) string {
	if err == nil {
		return "no error"
	}
	return strings.ReplaceAll(err.Error(), "\n", "; ")
}

// A bound on a flag's value, checked before anything starts: a value out of range
// would start a daemon that refuses every check (--max-frame 10) or panics later
// (--sync-interval 0s, in a ticker), after it has said it is listening.
type bound interface{ check() error }

type intAtLeast struct {
	name   string
	v, min int
}

func (b intAtLeast) check() error {
	if b.v < b.min {
		return fmt.Errorf("--%s %d: at least %d", b.name, b.v, b.min)
	}
	return nil
}

// intAtMost: --max-frame past what a frame's 4-byte length can say would promise frames
// no client can send.
// maxTopK bounds --top-k: each rule's sketch holds up to K clients, each a series of
// rlsidecar_top_rejected, and once full a refused newcomer is O(log K) under the
// rule's lock. Before, any value was taken: --top-k 1000000000 (a typo) took 23 GB before
// the daemon said it was listening, ignoring SIGTERM meanwhile.
const maxTopK = 10000

type intAtMost struct {
	name   string
	v, max int
}

func (b intAtMost) check() error {
	if b.v > b.max {
		return fmt.Errorf("--%s %d: at most %d", b.name, b.v, b.max)
	}
	return nil
}

type positive struct {
	name string
	v    time.Duration
}

func (b positive) check() error {
	if b.v <= 0 {
		return fmt.Errorf("--%s %v: must be more than 0", b.name, b.v)
	}
	return nil
}

type notNegative struct {
	name string
	v    time.Duration
}

func (b notNegative) check() error {
	if b.v < 0 {
		return fmt.Errorf("--%s %v: must not be negative (0: off)", b.name, b.v)
	}
	return nil
}

// checkBounds returns the first bound a flag's value is out of, or nil.
func checkBounds(bs ...bound) error {
	for _, b := range bs {
		if err := b.check(); err != nil {
			return err
		}
	}
	return nil
}

// defaultDaemonID names a daemon started without --daemon-id: its host, its pid and a
// random part. Host and pid alone repeat: containers that share the host's network (and
// so its hostname) each run their daemon as pid 1, and two live daemons under one name
// count as one in Redis and take each other's use of a key for their own, so each gets
// credit on keys they share and together they admit past the limit.
func defaultDaemonID(host string, pid int) string {
	var b [3]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%x", host, pid, b)
}

// openMasters counts the Redis masters (by address) whose breaker is open in any of sets.
func openMasters(sets ...*rlsync.Masters) int {
	open := map[string]bool{}
	for _, s := range sets {
		for _, m := range s.List() {
			if m.Breaker().Open() {
				open[m.Addr] = true
			}
		}
	}
	return len(open)
}

// breakerWatch logs the Redis circuit breakers' state changes: a warning when masters'
// breakers open (their keys' hybrid and global rules then follow their failure
// policies), and when more open; an info line when all are closed again.
type breakerWatch struct {
	open   int    // masters with a breaker open, last seen
	opened uint64 // openings counted, last seen
}

func (w *breakerWatch) observe(log *slog.Logger, open int, opened uint64) {
	switch {
	case open > 0 && (open > w.open || opened > w.opened && w.open == 0):
		log.Warn("redis circuit breaker open: calls to Redis keep failing, so hybrid and global rules of the masters concerned follow their failure policies (on_store_failure) until a probe succeeds",
			"masters_open", open, "openings", opened)
	case open == 0 && w.open > 0:
		log.Info("redis circuit breakers closed: Redis answers again", "openings", opened)
	case open == 0 && opened > w.opened:
		log.Warn("redis circuit breaker opened and closed again since the last look: calls to Redis failed for a while, and hybrid and global rules followed their failure policies",
			"openings", opened)
	}
	w.open, w.opened = open, opened
}

// warnExposed warns of each TCP listener, the admin endpoint (admin) and the Envoy API
// (envoyRLS), given an address beyond loopback: neither has authentication. An empty
// address (off), a unix: socket (its file's mode and group guard it) and an address that
// is not one (its listener's error says so) are not warned of.
func warnExposed(log *slog.Logger, admin, envoyRLS string) {
	if admin != "" && isHostPort(admin) && !loopbackAddr(admin) {
		// What is exposed: every GET route, to anyone who addresses the host by IP (the
		// Host check stops only browsers led here by DNS rebinding); DELETE /bans is
		// refused to any peer but loopback, whatever the Host.
		log.Warn("the admin endpoint listens beyond this host, with no authentication: anyone who reaches it reads /metrics, /rules, /top (the most-rejected clients) and /bans (lifting a ban is refused but from loopback); bind it to 127.0.0.1, or firewall it to the scrapers", "admin", admin)
	}
	if envoyRLS != "" && !strings.HasPrefix(envoyRLS, "unix:") && isHostPort(envoyRLS) && !loopbackAddr(envoyRLS) {
		log.Warn("the Envoy rate limit service listens beyond this host, with no authentication: anyone who reaches it can spend any client's budget, and so have that client refused; bind it to 127.0.0.1 or a unix: socket, or firewall it to the gateways", "envoy_rls", envoyRLS)
	}
}

func isHostPort(addr string) bool {
	_, _, err := net.SplitHostPort(addr)
	return err == nil
}

// warnOpenSockets warns of each Unix socket of the daemon that every local user may
// connect to: the check socket (socket) and a unix: Envoy listener (envoyRLS). The daemon
// gives a socket it creates mode (--socket-mode); a socket systemd passed (activated,
// envoyActivated) keeps its .socket unit's SocketMode=, so its file's own mode is the
// one looked at, and --socket-mode, which does not apply to it, is not.
func warnOpenSockets(log *slog.Logger, mode os.FileMode, socket string, activated bool, envoyRLS string, envoyActivated bool) {
	warn := func(path string, activated bool) {
		if !activated {
			if mode&0o002 != 0 {
				log.Warn("the socket mode lets every local user ask the daemon; prefer a group (--socket-group)", "socket", path, "socket_mode", fmt.Sprintf("%#o", uint32(mode)))
			}
			return
		}
		fi, err := os.Stat(path)
		if err != nil {
			return // not in this mount namespace, or an abstract socket: nothing to look at
		}
		if m := fi.Mode().Perm(); m&0o002 != 0 {
			log.Warn("the socket systemd passed lets every local user ask the daemon; prefer SocketMode=0660 and a SocketGroup= in its .socket unit", "socket", path, "socket_mode", fmt.Sprintf("%#o", uint32(m)))
		}
	}
	warn(socket, activated)
	if path, ok := strings.CutPrefix(envoyRLS, "unix:"); ok && path != "" {
		warn(path, envoyActivated)
	}
}

// fileLimitSpare is the descriptors a daemon uses besides its clients' and Redis
// connections: the rules' files and their watches, the listeners, the log.
const fileLimitSpare = 64

// warnFileLimit warns when the open-file limit (its soft limit, which Go raises to the
// hard one at start) is below what the connection caps take: --max-conns on the socket,
// 64 on the admin endpoint, 1,024 on the Envoy listener, the Redis clients' pools
// (redisConns: three clients, each up to 16 + 10 connections a node), and
// fileLimitSpare. Past the limit a connection cannot be accepted at all, so instead of
// being answered too_many_connections a client waits in the listen backlog, unanswered
// (with `ulimit -n 200` and the default --max-conns, seen by the hostile-client audit),
// and the daemon only logs that accept failed. The systemd unit sets LimitNOFILE=65536.
func warnFileLimit(log *slog.Logger, maxConns, redisConns int, admin, envoy bool) {
	var r syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r) != nil {
		return
	}
	need := uint64(maxConns) + uint64(redisConns) + fileLimitSpare
	if admin {
		need += 64
	}
	if envoy {
		need += 1024
	}
	if r.Cur < need {
		log.Warn("the open-file limit is below what the connection caps take: clients past it wait unanswered, not told too_many_connections; raise it (LimitNOFILE=, ulimit -n) or lower --max-conns",
			"limit", r.Cur, "needed", need, "max_conns", maxConns)
	}
}

// loopbackAddr reports whether the listen address addr (host:port) binds loopback only:
// a loopback IP or "localhost"; an empty host (every interface) or any other is not.
func loopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// warnReadableSecrets warns of each secret file (flag name, path) that every local user
// can read, as ssh does of a private key, or that the socket file's group can, unless
// that is root: the gateways join that group to reach the socket, and a gateway holding
// the Redis password could rewrite any client's counters or lift bans in Redis directly,
// one holding the labels' salt could hash every IPv4 address and name the clients in
// rlsidecar_top_rejected (docs/operations.md). Before, only a world-readable password
// file was warned of: not the salt file, nor a password file root:rlsidecar 0640, the
// group every gateway of the package joins.
func warnReadableSecrets(log *slog.Logger, socket string, files ...[2]string) {
	sockGid := -1
	if fi, err := os.Stat(socket); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Gid != 0 {
			sockGid = int(st.Gid)
		}
	}
	for _, f := range files {
		flagName, path := f[0], f[1]
		if path == "" {
			continue
		}
		fi, err := os.Stat(path)
		if err != nil {
			continue
		}
		perm := fi.Mode().Perm()
		what := "the Redis password file"
		if flagName != "redis-password-file" {
			what = "the --" + flagName
		}
		st, _ := fi.Sys().(*syscall.Stat_t)
		switch {
		case perm&0o004 != 0:
			log.Warn(what+" can be read by every local user; chmod o-r it", "file", path, "mode", fmt.Sprintf("%04o", perm))
		case perm&0o040 != 0 && st != nil && sockGid >= 0 && int(st.Gid) == sockGid:
			log.Warn(what+" can be read by the socket's group, which the gateways join to reach the socket; make it the daemon's user's alone (chown that user, chmod 0400)", "file", path, "mode", fmt.Sprintf("%04o", perm), "gid", sockGid)
		}
	}
}

// startWatching starts the rules file's watcher (watch) and returns its kick, or, when
// it cannot start (the inotify instances of the daemon's user used up on a crowded
// host), logs why and serves without it: the rules in force are good, and SIGHUP
// (systemctl reload) still reloads them. Before, the daemon refused to start, so a
// rate limiter went down over a convenience.
func startWatching(log *slog.Logger, watch func() (func(), error)) (kick func(), watching bool) {
	kick, err := watch()
	if err != nil {
		log.Error("not watching the rules file: changes are read on SIGHUP (systemctl reload) only", "err", err)
		return func() {}, false
	}
	return kick, true
}

// skipsVerify reports whether the standalone URL s is rediss:// with skip_verify=true
// (go-redis's option: TLS without checking the server's certificate). Before, it was
// taken without a word; a Cluster URL refuses options.
func skipsVerify(s string) bool {
	u, err := url.Parse(s)
	if err != nil || u.Scheme != "rediss" {
		return false
	}
	v := u.Query().Get("skip_verify") // as go-redis reads it
	return v == "true" || v == "1"
}

// urlHasPassword reports whether the URL s names a password (redis://:pw@host). An
// empty one (redis://user:@host) is none, as the Redis config takes it (the password
// then comes from the file or the environment): it was warned of as a password ps shows.
func urlHasPassword(s string) bool {
	u, err := url.Parse(s)
	if err != nil || u.User == nil {
		return false
	}
	p, ok := u.User.Password()
	return ok && p != ""
}

// checkDaemonID refuses a --daemon-id that Redis's records cannot hold: the hybrid
// scripts keep a key's last user and the reservation of its credit as space-separated
// fields ("id/N epoch", "id units until"), and a name with a space in them parsed as
// no daemon at all (the key never counted as shared, its credit never reserved: two
// daemons each admitting on credit).
func checkDaemonID(id string) error {
	if i := strings.IndexFunc(id, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }); i >= 0 {
		return fmt.Errorf("%w: --daemon-id %q: a space or control character at byte %d (Redis records the id in space-separated fields)", errUsage, id, i)
	}
	return nil
}
