package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rlsidecar/rlsidecar/envoyrls"
	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// Envoy's calls through restarts under socket activation: systemd-socket-activate holds
// both sockets, the daemon is stopped (SIGTERM) three times while 8 gRPC connections
// with 4 calls each in flight ask a global rule on one Redis, and the next daemon takes
// the sockets' backlogs. Every call is answered OK, none fails, and Redis counts exactly
// the calls answered OK: none admitted is lost, none counted twice, across the
// handovers.
func TestE2EEnvoySocketActivationHandover(t *testing.T) {
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) { testE2EEnvoySocketActivationHandover(t, tr) })
	}
}

func testE2EEnvoySocketActivationHandover(t *testing.T, transport string) {
	const restarts, limit = 3, 1000000
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	sock, envoySock := filepath.Join(dir, "s.sock"), filepath.Join(dir, "envoy.sock")
	rulesFile := writeFile(t, dir, "rules.yaml", fmt.Sprintf(`
rules:
  - name: per-tenant
    match: { domain: d, descriptor: tenant }
    key: [domain, tenant]
    algorithm: fixed_window
    mode: global
    on_store_failure: closed
    limit: { requests: %d, per: 1h }
`, limit))
	n := listenNotify(t)
	t.Setenv("NOTIFY_SOCKET", n.path)
	// systemd sets LISTEN_PID to the pid of the service process it forks; so does this
	// loop. A generous --global-timeout: a slow Redis on a busy machine would otherwise
	// refuse by the rule's policy, which is not what this test is about.
	loop := `for i in $(seq 0 "$1"); do (export LISTEN_PID=$BASHPID; exec "$0" serve --admin= --config "$2" --watch=false --drain-timeout 5s --redis "$3" --global-timeout 5s --redis-timeout 5s --envoy-rls-transport "$4"); done`
	startActivator(t, []string{"-l", sock, "-l", envoySock, "--fdname=rlsidecar:" + envoyFDName, "-E", "NOTIFY_SOCKET"},
		[]string{sock, envoySock}, "bash", "-c", loop, binary, strconv.Itoa(restarts), rulesFile, "redis://"+srv.Addr, transport)

	var answered, refused, failed atomic.Int64
	var stop atomic.Bool
	var wg sync.WaitGroup
	var errMu sync.Mutex
	var firstErr error
	call := func(c rlsv3.RateLimitServiceClient) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		r, err := c.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*commonrl.RateLimitDescriptor{desc("tenant=t")}})
		switch {
		case err != nil:
			failed.Add(1)
			errMu.Lock()
			if firstErr == nil {
				firstErr = fmt.Errorf("%v: %s", status.Code(err), status.Convert(err).Message())
			}
			errMu.Unlock()
		case r.OverallCode == rlsv3.RateLimitResponse_OK:
			answered.Add(1)
		default:
			refused.Add(1)
		}
	}
	for range 8 {
		conn, err := grpc.NewClient("unix://"+envoySock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		c := rlsv3.NewRateLimitServiceClient(conn)
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for !stop.Load() {
					call(c)
				}
			}()
		}
	}
	t.Cleanup(func() { stop.Store(true); wg.Wait() })
	pids := map[int]bool{}
	for i := 0; i <= restarts; i++ {
		m := n.waitFor(t, "READY", 20*time.Second)
		if pids[m.pid] {
			t.Fatalf("READY=1 twice from pid %d", m.pid)
		}
		pids[m.pid] = true
		from := answered.Load()
		deadline := time.Now().Add(20 * time.Second)
		for answered.Load() < from+300 {
			if time.Now().After(deadline) {
				t.Fatalf("daemon %d (pid %d) answered %d calls in 20s", i, m.pid, answered.Load()-from)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if i == restarts {
			break
		}
		if err := syscall.Kill(m.pid, syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		n.waitFor(t, "STOPPING", 10*time.Second)
	}
	stop.Store(true)
	wg.Wait()
	if failed.Load() > 0 || refused.Load() > 0 {
		t.Fatalf("%d calls failed (the first: %v), %d refused, %d answered OK", failed.Load(), firstErr, refused.Load(), answered.Load())
	}
	// What Redis counted: a last call that asks without consuming.
	conn, err := grpc.NewClient("unix://"+envoySock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	d := desc("tenant=t")
	d.HitsAddend = wrapperspb.UInt64(0) // asks without consuming
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r, err := rlsv3.NewRateLimitServiceClient(conn).ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*commonrl.RateLimitDescriptor{d}})
	if err != nil {
		t.Fatal(err)
	}
	counted := int64(limit) - int64(r.Statuses[0].LimitRemaining)
	if counted != answered.Load() {
		t.Fatalf("Redis counted %d calls, %d were answered OK", counted, answered.Load())
	}
	t.Logf("%d daemons, %d calls answered OK, as many counted in Redis, none failed", len(pids), answered.Load())
}
