package sync

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// A call made as soon as Redis is back dials it and is answered, however many dials
// failed while it was away. Before (noDialGate), go-redis's pool stopped dialling once as
// many dials as it holds connections had failed, and failed every call at once with the
// last dial error ("connection refused", from a Redis that was listening) until its
// background dial, once a second, got through: a breaker's probe in that second failed
// and the breaker waited another cool-down.
func TestOpenDialsAsSoonAsRedisIsBack(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ping := func() error { return rdb.Ping(ctx).Err() }
	// Pipelines (exact syncs, batched global checks) take their connections from a
	// pool of their own.
	pipelinedPing := func() error {
		var cmd *redis.StatusCmd
		_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			cmd = p.Ping(ctx)
			return nil
		})
		return cmd.Err()
	}
	for _, call := range []func() error{ping, pipelinedPing} {
		if err := call(); err != nil {
			t.Fatal(err)
		}
	}

	srv.Stop()
	// Twice as many failed calls as the main pool holds connections (the pipeline
	// pool holds fewer): at least that many refused dials on each.
	// Their errors are the dials' as go-redis gave them (the address dialled included).
	for i := 0; i < 2*defaultPoolSize; i++ {
		for _, call := range []func() error{ping, pipelinedPing} {
			err := call()
			var op *net.OpError
			if !errors.As(err, &op) || op.Op != "dial" || !strings.Contains(err.Error(), "dial tcp "+srv.Addr) {
				t.Fatalf("a call to a stopped Redis: %v, want its dial's error", err)
			}
		}
	}
	srv.Restart(t) // returns once Redis answers PING

	for name, call := range map[string]func() error{"PING": ping, "pipelined PING": pipelinedPing} {
		if err := call(); err != nil {
			t.Errorf("%s just after Redis answered again: %v", name, err)
		}
	}
}

// The same on a Cluster, where each node has its own pools: a master back from a stop is
// dialled by the first call that needs it. The calls after the restart are PINGs to
// that master (through its client in the cluster client, so through the pools the
// calls on its keys use): a restarted master answers CLUSTERDOWN to every key for its
// first 2 s (Redis's CLUSTER_WRITABLE_DELAY), by which time go-redis's background dial
// would have opened the pools' gates again.
func TestOpenClusterDialsAsSoonAsAMasterIsBack(t *testing.T) {
	// A node timeout longer than the test: the other masters never mark the stopped
	// one failed.
	cl := redistest.StartCluster(t, redistest.WithClusterNodeTimeout(time.Minute))
	rdb, err := Open(Config{Cluster: cl.Addrs, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	cc := rdb.(*redis.ClusterClient)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const key = "rl:dialgate:{k}"
	master, err := cc.MasterForKey(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	srv := node(t, cl, master.Options().Addr)
	// Calls on the key as the daemon sends them: each once (noRetry), alone or in a
	// pipeline.
	get := func() error {
		cmd := redis.NewCmd(ctx, "get", key)
		_ = cc.Process(ctx, noRetry{cmd})
		return cmd.Err()
	}
	pipelinedGet := func() error {
		cmd := redis.NewCmd(ctx, "get", key)
		pipe := cc.Pipeline()
		_ = pipe.Process(ctx, noRetry{cmd})
		_, _ = pipe.Exec(ctx)
		return cmd.Err()
	}
	for _, call := range []func() error{get, pipelinedGet} {
		if err := call(); err != nil && err != redis.Nil {
			t.Fatal(err)
		}
	}

	srv.Stop()
	// Their errors are the dials' as go-redis gave them (the address dialled included).
	check := func(err error) {
		t.Helper()
		var op *net.OpError
		if !errors.As(err, &op) || op.Op != "dial" || !strings.Contains(err.Error(), "dial tcp "+srv.Addr) {
			t.Fatalf("a call to a stopped master: %v, want its dial's error", err)
		}
	}
	// Pipelines until the master's pipeline pool has missed twice as many connections
	// as it holds (a cluster pipeline that gets no connection tries again, MaxRedirects
	// times, tens of ms apart); then twice as many calls as its main pool holds
	// connections, one dial each. The pipelines first: each of their tries dials the
	// main pool too when the pipeline pool's dial fails (go-redis spills the pipeline to
	// it), so both gates would close in them, and the calls after the restart come some
	// 0.3 s later, well within the second before go-redis's background dial would open
	// either.
	start := master.PoolStats().PipelineStats.Misses
	for master.PoolStats().PipelineStats.Misses < start+2*redis.DefaultPipelinePoolSize {
		check(pipelinedGet())
	}
	for i := 0; i < 2*defaultPoolSize; i++ {
		check(get())
	}
	srv.Restart(t) // returns once the master answers PING

	ping := func() error { return master.Ping(ctx).Err() }
	pipelinedPing := func() error {
		var cmd *redis.StatusCmd
		_, _ = master.Pipelined(ctx, func(p redis.Pipeliner) error {
			cmd = p.Ping(ctx)
			return nil
		})
		return cmd.Err()
	}
	for name, call := range map[string]func() error{"PING": ping, "pipelined PING": pipelinedPing} {
		if err := call(); err != nil {
			t.Errorf("%s just after the master answered again: %v", name, err)
		}
	}
}
