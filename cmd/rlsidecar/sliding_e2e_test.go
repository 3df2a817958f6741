package main

import (
	"context"
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
	end := time.Now().Add(4 * time.Second) // four window ends, each one a chance to overshoot
	for id := uint64(1); time.Now().Before(end); id++ {
		if r := c.check(id, 1, "user=hot"); r.Allowed {
			admitted++
		}
	}
	close(stop)
	m := <-maxN
	t.Logf("admitted %d in 4 s; the largest window count Redis held: %d", admitted, m)
	if m > 20 {
		t.Fatalf("a window of a sliding limit of 20 counted %d", m)
	}
	if admitted > 20*5+2 { // the first window's 20, at most 20 a second after, a margin
		t.Fatalf("admitted %d in 4 s against 20 a second", admitted)
	}
}
