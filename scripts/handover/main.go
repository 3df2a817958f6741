// Command handover drives steady load through the Go client while the daemon is handed
// over (blue/green, SIGTERM under socket activation, SIGKILL under socket activation),
// and counts what the handover cost: checks answered by the failure policy, checks that
// errored, leases lost (more than max in flight) or leaked, and units of a hybrid and a
// global rule admitted beyond (or short of) their limits.
//
//	go run ./scripts/handover -bin /tmp/rls -scenario bluegreen -clients node,aio,blocking
//
// Run from the repository's root (the other clients' drivers, load.js and load_aio.py,
// are found from there; clients/node needs its node_modules: npm ci there). Each client
// has its own keys, so each one's figures stand alone; a rule's limit is per client.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	rlclient "github.com/rlsidecar/rlsidecar/clients/go"
)

var (
	bin      = flag.String("bin", "", "the rlsidecar binary")
	scenario = flag.String("scenario", "bluegreen", "none | bluegreen | restart | kill")
	overlap  = flag.Duration("overlap", 0, "bluegreen: how long both daemons serve before blue gets SIGTERM")
	after    = flag.Duration("after", 12*time.Second, "how long the load goes on after the handover")
	hybLimit = flag.Int("hybrid", 2000, "the hybrid rule's limit per hour")
	globLim  = flag.Int("global", 2000, "the global rule's limit per hour")
	conc     = flag.Int("max", 4, "the global concurrency rule's max")
	timeout  = flag.Duration("timeout", time.Second, "the client's timeout")
	others   = flag.String("clients", "", "other clients to drive beside Go, comma-separated: node, aio (Python AsyncClient), blocking (Python Client); run from the repository's root")
	redisTO  = flag.Duration("redis-timeout", 500*time.Millisecond, "the daemon's --redis-timeout and --global-timeout (a busy host needs more than the defaults)")
)

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func waitFor(what string, d time.Duration, f func() bool) {
	end := time.Now().Add(d)
	for !f() {
		if time.Now().After(end) {
			must(fmt.Errorf("timed out waiting for %s", what))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func dials(path string) bool {
	c, err := net.Dial("unix", path)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

type counts struct {
	checks, policy, errs             atomic.Int64
	hybAllowed, hybDegraded          atomic.Int64
	globAllowed, globDegraded        atomic.Int64
	leases, inflight, lost, relFails atomic.Int64
	maxInflight                      atomic.Int64
}

func main() {
	flag.Parse()
	dir, err := os.MkdirTemp("", "hov")
	must(err)
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s.sock")

	port := freePort()
	redis := exec.Command("redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	redis.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	must(redis.Start())
	defer redis.Process.Kill()
	waitFor("redis", 10*time.Second, func() bool {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			c.Close()
		}
		return err == nil
	})

	rules := fmt.Sprintf(`rules:
  - name: rate
    match: { kind: rate }
    key: [client, u]
    limit: { requests: 1000000, per: 1s }
    mode: local
  - name: hyb
    match: { kind: hyb }
    key: client
    limit: { requests: %d, per: 1h }
    mode: hybrid
    on_store_failure: local
  - name: glob
    match: { kind: glob }
    key: client
    limit: { requests: %d, per: 1h }
    mode: global
    on_store_failure: closed
  - name: conc
    match: { kind: lease }
    key: client
    concurrency: { max: %d, lease: 30s }
    mode: global
    on_store_failure: closed
`, *hybLimit, *globLim, *conc)
	cfg := filepath.Join(dir, "rules.yaml")
	must(os.WriteFile(cfg, []byte(rules), 0o644))
	serve := []string{"serve", "--admin=", "--watch=false", "--config", cfg, "--redis", fmt.Sprintf("redis://127.0.0.1:%d", port),
		"--redis-timeout", redisTO.String(), "--global-timeout", redisTO.String()}
	logf, err := os.Create(filepath.Join(os.TempDir(), "handover-"+*scenario+".log"))
	must(err)

	var (
		blue     *exec.Cmd
		pidFile  = filepath.Join(dir, "pid")
		stopFile = filepath.Join(dir, "stop")
		act      *exec.Cmd
	)
	start := func(path string) *exec.Cmd {
		c := exec.Command(*bin, append(serve, "--socket", path)...)
		c.Stdout, c.Stderr = logf, logf
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		must(c.Start())
		waitFor("daemon on "+path, 20*time.Second, func() bool { return dials(path) })
		return c
	}
	readPid := func() int {
		b, _ := os.ReadFile(pidFile)
		p, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		return p
	}
	switch *scenario {
	case "none", "bluegreen":
		blue = start(sock)
	case "restart", "kill":
		loop := `while [ ! -e "$1" ]; do (export LISTEN_PID=$BASHPID; echo $BASHPID > "$2"; exec "$0" "${@:3}"); done`
		act = exec.Command("systemd-socket-activate", append([]string{"-l", sock, "bash", "-c", loop, *bin, stopFile, pidFile}, serve...)...)
		act.Stdout, act.Stderr = logf, logf
		act.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		must(act.Start())
		waitFor("socket", 10*time.Second, func() bool { _, err := os.Stat(sock); return err == nil })
		dials(sock) // systemd-socket-activate starts the command at the first connection
		waitFor("pid", 10*time.Second, func() bool { return readPid() > 0 })
	default:
		must(fmt.Errorf("unknown scenario %q", *scenario))
	}

	type other struct {
		name  string
		cmd   *exec.Cmd
		stdin interface{ Close() error }
		out   strings.Builder
	}
	var extras []*other
	for _, name := range strings.Split(*others, ",") {
		var cmd *exec.Cmd
		switch name {
		case "":
			continue
		case "node":
			cmd = exec.Command("node", "scripts/handover/load.js")
		case "aio", "blocking":
			cmd = exec.Command("/usr/bin/python3", "scripts/handover/load_aio.py")
		default:
			must(fmt.Errorf("unknown client %q", name))
		}
		o := &other{name: name, cmd: cmd}
		cmd.Env = append(os.Environ(), "SOCKET="+sock, "CLIENT="+name, "KIND="+name, "MAX="+strconv.Itoa(*conc),
			"TIMEOUT_MS="+strconv.FormatInt(timeout.Milliseconds(), 10), "TIMEOUT="+strconv.FormatFloat(timeout.Seconds(), 'f', -1, 64))
		cmd.Stdout, cmd.Stderr = &o.out, os.Stderr
		in, err := cmd.StdinPipe()
		must(err)
		o.stdin = in
		must(cmd.Start())
		extras = append(extras, o)
	}

	cl, err := rlclient.New(rlclient.Options{Socket: sock, Timeout: *timeout})
	must(err)
	var n counts
	stop := make(chan struct{})
	var wg sync.WaitGroup
	ctx := context.Background()
	paced := func(every time.Duration, f func(i int)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(every)
			defer t.Stop()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-t.C:
				}
				f(i)
			}
		}()
	}
	check := func(attrs map[string]string) (rlclient.Decision, bool) {
		n.checks.Add(1)
		d, err := cl.Check(ctx, attrs, nil)
		if err != nil {
			n.errs.Add(1)
			return d, false
		}
		if d.Unreachable {
			n.policy.Add(1)
			return d, false
		}
		return d, true
	}
	for w := range 4 {
		paced(time.Millisecond, func(i int) {
			check(map[string]string{"client": "go", "kind": "rate", "u": strconv.Itoa(w*1000 + i%1000)})
		})
	}
	for range 2 {
		paced(2*time.Millisecond, func(int) {
			if d, ok := check(map[string]string{"client": "go", "kind": "hyb"}); ok && d.Allowed {
				if d.Degraded {
					n.hybDegraded.Add(1)
				} else {
					n.hybAllowed.Add(1)
				}
			}
		})
		paced(2*time.Millisecond, func(int) {
			if d, ok := check(map[string]string{"client": "go", "kind": "glob"}); ok && d.Allowed {
				if d.Degraded {
					n.globDegraded.Add(1)
				} else {
					n.globAllowed.Add(1)
				}
			}
		})
	}
	for range 2 * *conc {
		paced(5*time.Millisecond, func(int) {
			d, ok := check(map[string]string{"client": "go", "kind": "lease"})
			if !ok || !d.Allowed || d.Lease == "" {
				return
			}
			n.leases.Add(1)
			if v := n.inflight.Add(1); v > int64(*conc) {
				n.lost.Add(1)
			} else if v > n.maxInflight.Load() {
				n.maxInflight.Store(v)
			}
			time.Sleep(20 * time.Millisecond)
			n.inflight.Add(-1)
			if ok, err := d.Release(ctx); err != nil || !ok {
				n.relFails.Add(1)
				fmt.Fprintf(os.Stderr, "release: %v %v\n", ok, err)
			}
		})
	}

	time.Sleep(3 * time.Second)
	began := time.Now()
	switch *scenario {
	case "bluegreen":
		green := sock + ".green"
		g := start(green)
		must(os.Rename(green, sock))
		time.Sleep(*overlap) // blue serves its open connections meanwhile, green the new ones
		must(blue.Process.Signal(syscall.SIGTERM))
		must(blue.Wait())
		blue = g
	case "restart", "kill":
		old := readPid()
		sig := syscall.SIGTERM
		if *scenario == "kill" {
			sig = syscall.SIGKILL
		}
		must(syscall.Kill(old, sig))
		waitFor("the next daemon", 20*time.Second, func() bool { p := readPid(); return p > 0 && p != old })
	}
	fmt.Printf("handover took %v\n", time.Since(began).Round(time.Millisecond))
	time.Sleep(*after)
	close(stop)
	wg.Wait()
	for _, o := range extras {
		o.stdin.Close()
	}

	// Leaked: slots still held with every request ended.
	free := 0
	var probe []rlclient.Decision
	for range *conc + 1 {
		d, err := cl.Check(ctx, map[string]string{"client": "go", "kind": "lease"}, nil)
		if err == nil && d.Allowed && !d.Degraded {
			free++
			probe = append(probe, d)
		}
	}
	for _, d := range probe {
		d.Release(ctx)
	}
	cl.Close()
	fmt.Printf("scenario=%s client=go checks=%d policy=%d errors=%d\n", *scenario, n.checks.Load(), n.policy.Load(), n.errs.Load())
	fmt.Printf("  hybrid: admitted %d of %d (+%d degraded)   global: admitted %d of %d (+%d degraded)\n",
		n.hybAllowed.Load(), *hybLimit, n.hybDegraded.Load(), n.globAllowed.Load(), *globLim, n.globDegraded.Load())
	fmt.Printf("  leases: %d taken, lost %d (max in flight seen %d of %d), release failures %d, leaked %d (free after: %d of %d)\n",
		n.leases.Load(), n.lost.Load(), n.maxInflight.Load(), *conc, n.relFails.Load(), max(0, *conc-free), free, *conc)

	for _, o := range extras {
		if err := o.cmd.Wait(); err != nil {
			fmt.Printf("client=%s: %v\n", o.name, err)
			continue
		}
		var m map[string]int64
		if err := json.Unmarshal([]byte(o.out.String()), &m); err != nil {
			fmt.Printf("client=%s: %q: %v\n", o.name, o.out.String(), err)
			continue
		}
		fmt.Printf("scenario=%s client=%s checks=%d policy=%d errors=%d\n", *scenario, o.name, m["checks"], m["policy"], m["errors"])
		fmt.Printf("  hybrid: admitted %d of %d (+%d degraded)   global: admitted %d of %d (+%d degraded)\n",
			m["hyb"], *hybLimit, m["hybDegraded"], m["glob"], *globLim, m["globDegraded"])
		fmt.Printf("  leases: %d taken, lost %d (max in flight seen %d of %d), release failures %d, leaked %d (free after: %d of %d)\n",
			m["leases"], m["lost"], m["maxInflight"], *conc, m["relFails"], max(0, int64(*conc)-m["free"]), m["free"], *conc)
	}

	switch *scenario {
	case "restart", "kill":
		os.WriteFile(stopFile, nil, 0o644)
		syscall.Kill(readPid(), syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- act.Wait() }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			syscall.Kill(-act.Process.Pid, syscall.SIGKILL)
		}
	default:
		blue.Process.Signal(syscall.SIGTERM)
		blue.Wait()
	}
}
