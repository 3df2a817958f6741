package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rlsidecar/rlsidecar/daemon"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"

	"github.com/redis/go-redis/v9"
)

// octalMode is a flag holding a file mode written in octal, like 0660.
type octalMode os.FileMode

func (m *octalMode) String() string { return fmt.Sprintf("%#o", os.FileMode(*m)) }
func (m *octalMode) Set(s string) error {
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil || v > 0o777 {
		return fmt.Errorf("%q is not an octal permission like 0660", s)
	}
	*m = octalMode(v)
	return nil
}

func serve(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("serve", stderr)
	config := fs.String("config", "", "rules file (YAML); empty: the built-in example rules")
	socket := fs.String("socket", daemon.DefaultSocketPath(), "Unix socket path")
	mode := octalMode(0o660)
	fs.Var(&mode, "socket-mode", "permission bits of the socket file (octal)")
	maxFrame := fs.Int("max-frame", 65536, "largest request frame accepted, in bytes")
	maxConns := fs.Int("max-conns", 1024, "connections served at once")
	maxSyncKeys := fs.Int("hybrid-max-sync-keys", 100_000, "hybrid mode: keys one periodic sync carries at most; the rest wait for the next (rlsidecar_hybrid_sync_backlog)")
	maxKeys := fs.Int("max-keys", 4_000_000, "client keys held in memory; past it, the least informative states are evicted (never a limited client before one that is not)")
	maxAttrs := fs.Int("max-attrs", 64, "attributes per request")
	maxAttrLen := fs.Int("max-attr-len", 4096, "bytes per attribute value")
	frameTimeout := fs.Duration("frame-timeout", 5*time.Second, "time a client has to finish sending a frame it has begun")
	idleTimeout := fs.Duration("idle-timeout", 0, "close connections idle this long (0: never)")
	drainTimeout := fs.Duration("drain-timeout", 5*time.Second, "on SIGTERM, time to answer what is in flight")
	sweepEvery := fs.Duration("sweep-interval", 5*time.Second, "how often state that carries no information is dropped")
	logFormat := fs.String("log-format", "text", "log format: text or json")
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn, error")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile to this file until exit (a debugging aid)")
	admin := fs.String("admin", "127.0.0.1:9464", "admin HTTP endpoint (/metrics /healthz /readyz /rules /top); empty: off")
	topK := fs.Int("top-k", 10, "clients kept per rule in the most-rejected sketch (/top, rlsidecar_top_rejected)")
	shadowAll := fs.Bool("shadow", false, "make every rule a shadow rule: counted and reported, never rejecting")
	watch := fs.Bool("watch", true, "reload the rules file when it changes (SIGHUP reloads too)")
	redisURL := fs.String("redis", "", "standalone Redis: redis://host:port[/db] or rediss:// (TLS); turns on hybrid mode, the default for rules that name no mode")
	redisCluster := fs.String("redis-cluster", "", "Redis Cluster seed nodes: host:port,host:port (or redis[s]://host:port,host:port)")
	redisPassFile := fs.String("redis-password-file", "", "file holding the Redis password (else $"+rlsync.PasswordEnv+"; a password in the URL shows in ps)")
	redisTimeout := fs.Duration("redis-timeout", 50*time.Millisecond, "bound on every Redis call")
	syncInterval := fs.Duration("sync-interval", 100*time.Millisecond, "hybrid mode: how often admitted counts are flushed to Redis and the global view read back")
	daemonID := fs.String("daemon-id", "", "this daemon's name in Redis heartbeats (default: hostname-pid)")
	globalTimeout := fs.Duration("global-timeout", 10*time.Millisecond, "global mode: how long a check waits for Redis before the rule's on_store_failure decides")
	breakerFailures := fs.Int("breaker-failures", 3, "consecutive failed Redis calls that open the circuit breaker (no call waits on Redis while it is open)")
	breakerCooldown := fs.Duration("breaker-cooldown", time.Second, "how long the breaker stays open before one probe is let through")
	if err := noPositional(fs, args); err != nil {
		return err
	}
	log, err := newLogger(stderr, *logFormat, *logLevel)
	if err != nil {
		return fmt.Errorf("%w: %v", errUsage, err)
	}

	haveRedis := *redisURL != "" || *redisCluster != ""
	id := *daemonID
	if id == "" {
		host, _ := os.Hostname()
		id = fmt.Sprintf("%s-%d", host, os.Getpid())
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
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	store := localbucket.NewStore(localbucket.Options{MaxKeys: *maxKeys})
	lim := limiter.New(set, store)
	lim.SetShadowAll(*shadowAll)
	metrics := daemon.NewMetrics(version, *topK)
	metrics.SetRules(set, time.Now())
	// Checks are counted only when someone can read the counts.
	recorded := metrics
	if *admin == "" {
		recorded = nil
	}
	var hybrid *rlsync.Hybrid
	modeDesc := "local mode"
	if haveRedis {
		cfg := rlsync.Config{URL: *redisURL, PasswordFile: *redisPassFile, Timeout: *redisTimeout}
		where := rlsync.Redact(*redisURL)
		if *redisCluster != "" {
			cfg.Cluster = []string{*redisCluster}
			where = "cluster " + rlsync.Redact(*redisCluster)
		}
		// Two clients (two connection pools) and two breakers: global checks wait
		// milliseconds, hybrid syncs longer; a Redis too slow for the first, whose
		// timeouts close connections, must not make the second look down.
		rdb, err := rlsync.Open(cfg)
		if err != nil {
			return err
		}
		defer rdb.Close()
		rdbChecks, err := rlsync.Open(cfg)
		if err != nil {
			return err
		}
		defer rdbChecks.Close()
		redis.SetLogger(redisLog{log})
		syncBreaker := rlsync.NewBreaker(*breakerFailures, *breakerCooldown)
		checkBreaker := rlsync.NewBreaker(*breakerFailures, *breakerCooldown)
		hybrid = rlsync.NewHybrid(rdb, rlsync.HybridOptions{Interval: *syncInterval, MaxKeys: *maxKeys, MaxSyncKeys: *maxSyncKeys, ID: id,
			FetchWait: max(*globalTimeout, 25*time.Millisecond)}).
			WithBreaker(syncBreaker).WithObserver(metrics.ObserveStore).WithSyncObserver(metrics.HybridSynced)
		lim.WithHybrid(hybrid).WithGlobal(rlsync.NewGlobal(rdbChecks).WithBreaker(checkBreaker).WithObserver(metrics.ObserveStore), *globalTimeout)
		metrics.GaugeFunc("rlsidecar_breaker_open", "1 while a Redis circuit breaker (hybrid syncs or global checks) is open.", func() float64 {
			if syncBreaker.Open() || checkBreaker.Open() {
				return 1
			}
			return 0
		})
		modeDesc = "hybrid mode by default, Redis " + where
	}
	srv, err := daemon.New(daemon.Config{
		Socket:       *socket,
		SocketMode:   os.FileMode(mode),
		MaxFrame:     *maxFrame,
		MaxConns:     *maxConns,
		MaxAttrs:     *maxAttrs,
		MaxAttrLen:   *maxAttrLen,
		FrameTimeout: *frameTimeout,
		IdleTimeout:  *idleTimeout,
		DrainTimeout: *drainTimeout,
		Version:      version,
		Logger:       log,
		Metrics:      recorded,
	}, lim)
	if err != nil {
		return err
	}
	if err := srv.Listen(); err != nil {
		return err
	}
	ruleSource := set.Source
	if *config == "" {
		ruleSource = "built-in example rules"
	}
	fmt.Fprintf(stdout, "rlsidecar %s listening on %s (%d rules from %s, %s)\n", version, *socket, len(set.Rules), ruleSource, modeDesc)
	log.Info("serving", "socket", *socket, "rules", len(set.Rules), "source", ruleSource, "version", set.Version)

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the janitor: drops state that carries no information
		defer wg.Done()
		t := time.NewTicker(*sweepEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				lim.Sweep(time.Now().UnixNano())
			}
		}
	}()

	// The hybrid sync: flushes every interval, and once more after the server has drained,
	// so what was admitted before a shutdown reaches Redis.
	syncCtx, stopSync := context.WithCancel(context.Background())
	defer stopSync()
	var syncWG sync.WaitGroup
	if hybrid != nil {
		var lastLog time.Time
		syncWG.Add(1)
		go func() {
			defer syncWG.Done()
			hybrid.Run(syncCtx, id, func() int64 { return time.Now().UnixNano() }, max(*redisTimeout, *syncInterval), func(err error) {
				if time.Since(lastLog) > 10*time.Second { // one line per 10 s while Redis is away
					lastLog = time.Now()
					log.Warn("redis sync failed; deciding from local allowances", "err", err)
				}
			})
		}()
	}

	// Reloads, from SIGHUP or the file watcher: the whole new set is validated, then
	// swapped in one step; a broken file never replaces the rules in force.
	var reloadMu sync.Mutex
	reload := func(why string) {
		reloadMu.Lock()
		defer reloadMu.Unlock()
		if *config == "" {
			log.Info("built-in rules: nothing to reload", "trigger", why)
			return
		}
		newSet, err := load()
		metrics.Reloaded(err)
		if err != nil {
			log.Error("reload failed; keeping the rules in force", "trigger", why, "err", err)
			return
		}
		if newSet.Version == lim.Rules().Version {
			return // touched, not changed
		}
		lim.SetRules(newSet)
		metrics.SetRules(newSet, time.Now())
		log.Info("rules reloaded", "trigger", why, "rules", len(newSet.Rules), "version", newSet.Version)
	}
	if *watch && *config != "" {
		if err := watchConfig(ctx, *config, 100*time.Millisecond, func() { reload("file change") },
			func(err error) { log.Warn("watching the rules file", "err", err) }); err != nil {
			return err
		}
	}

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
	if hybrid != nil {
		metrics.GaugeFunc("rlsidecar_hybrid_sync_backlog", "Hybrid keys that needed a sync and were left for the next one (a sync carries at most --hybrid-max-sync-keys).",
			func() float64 { return float64(hybrid.Backlog()) })
		metrics.CounterFunc("rlsidecar_hybrid_dropped_units_total", "Admitted units lost before they reached Redis because the key cap evicted their key while Redis was away.",
			func() float64 { return float64(hybrid.Dropped()) })
	}
	if *admin != "" {
		deps := daemon.AdminDeps{Metrics: metrics, Limiter: lim}
		if hybrid != nil {
			deps.StoreReachable = func() bool { return hybrid.Healthy(time.Now().UnixNano()) }
		}
		adm, err := daemon.NewAdmin(*admin, deps)
		if err != nil {
			return err
		}
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

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer signal.Stop(sigs)
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve() }()

	for {
		select {
		case err := <-serveErr:
			stop()
			wg.Wait()
			stopSync()
			syncWG.Wait()
			return err
		case sig := <-sigs:
			if sig == syscall.SIGHUP {
				reload("SIGHUP")
				continue
			}
			log.Info("draining", "signal", sig.String())
			go func() {
				for s := range sigs {
					if s == syscall.SIGINT {
						log.Warn("second SIGINT: exiting now")
						os.Exit(exitFailure)
					}
				}
			}()
			err := srv.Shutdown(context.Background())
			<-serveErr
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
	}
}

// redisLog sends go-redis's own log lines (pool dial failures, …) through slog at debug
// level: the daemon reports Redis trouble itself, once per 10 s, at warn.
type redisLog struct{ log *slog.Logger }

func (l redisLog) Printf(ctx context.Context, format string, v ...any) {
	l.log.Debug("go-redis: " + fmt.Sprintf(format, v...))
}

func newLogger(w io.Writer, format, level string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: use debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch strings.ToLower(format) {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: use text or json", format)
}

func validate(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("validate", stderr)
	config := fs.String("config", "", "rules file to check (required)")
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
	fmt.Fprintf(stdout, "%s: %d rules, version %s\n", *config, len(set.Rules), set.Version)
	return nil
}

var _ = errors.New
var _ = flag.ErrHelp
