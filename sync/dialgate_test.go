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
