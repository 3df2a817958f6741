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
	var hybrid *rlsync.Hybrid
	modeDesc := "local mode"
	if haveRedis {
		cfg := rlsync.Config{URL: *redisURL, PasswordFile: *redisPassFile, Timeout: *redisTimeout}
		where := rlsync.Redact(*redisURL)
		if *redisCluster != "" {
			cfg.Cluster = []string{*redisCluster}
			where = "cluster " + rlsync.Redact(*redisCluster)
		}
		rdb, err := rlsync.Open(cfg)
		if err != nil {
			return err
		}
		defer rdb.Close()
		breaker := rlsync.NewBreaker(*breakerFailures, *breakerCooldown)
		hybrid = rlsync.NewHybrid(rdb, rlsync.HybridOptions{Interval: *syncInterval, MaxKeys: *maxKeys}).WithBreaker(breaker)
		lim.WithHybrid(hybrid).WithGlobal(rlsync.NewGlobal(rdb).WithBreaker(breaker), *globalTimeout)
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
		id := *daemonID
		if id == "" {
			host, _ := os.Hostname()
			id = fmt.Sprintf("%s-%d", host, os.Getpid())
		}
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
				if *config == "" {
					log.Info("SIGHUP: built-in rules; nothing to reload")
					continue
				}
				newSet, err := load()
				if err != nil {
					log.Error("reload failed; keeping the rules in force", "err", err)
					continue
				}
				lim.SetRules(newSet)
				log.Info("rules reloaded", "rules", len(newSet.Rules), "version", newSet.Version)
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
