package main

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// A hot client alone on one hybrid daemon never gets a sliding window's count in Redis
// (reservations included) above its limit. Before, the share grant of each window's last
// interval was sized by the next window's estimate but counted in this one: every window
// of 20 per second counted 22, and the client got them.
func TestE2EHybridSlidingWindowHoldsItsLimit(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: sw
    key: user
    algorithm: sliding_window
    limit: { requests: 20, per: 1s }
    mode: hybrid
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr)
	c := dialRaw(t, d.socket)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	const key = "rl:sw~sw1s:{user=hot}"

	stop := make(chan struct{})
	maxN := make(chan int, 1)
	go func() { // the window's count, as often as Redis answers
		m := 0
		for {
			select {
			case <-stop:
				maxN <- m
				return
			default:
			}
			if n, err := rdb.HGet(ctx, key, "n").Int(); err == nil && n > m {
				m = n
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	admitted := 0
	start := time.Now()
	end := start.Add(4 * time.Second) // four window ends, each one a chance to overshoot
	for id := uint64(1); time.Now().Before(end); id++ {
		if r := c.check(id, 1, "user=hot"); r.Allowed {
			admitted++
		}
	}
	// The checks spanned this long: the last one may end well past the 4 s on a busy
	// machine (one ran 104 in a 4 s loop at load 10, its last check late).
	took := time.Since(start)
	close(stop)
	m := <-maxN
	t.Logf("admitted %d in %s; the largest window count Redis held: %d", admitted, took, m)
	if m > 20 {
		t.Fatalf("a window of a sliding limit of 20 counted %d", m)
	}
	// The first window's 20, at most 20 a second after, a margin.
	if most := int(math.Ceil(20*(1+took.Seconds()))) + 2; admitted > most {
		t.Fatalf("admitted %d in %s against 20 a second (at most %d)", admitted, took, most)
	}
}
