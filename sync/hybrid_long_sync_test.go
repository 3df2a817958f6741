package sync

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// A periodic sync of many keys (a flood of new ones) goes in pipelines, one after
// another; each one answered is Redis answering, now, not once the whole sync is done.
// Before, the master's last answer was recorded only when the sync ended: a sync longer
// than StaleAfter (2 s by default) made the daemon unhealthy while Redis answered every
// pipeline, and every check then went to the rules' failure policies, degraded (a
// scratch run, 300,000 new keys in 5.6 s on a loaded machine: syncs of 7,168 keys took
// 2.3-2.9 s, and the daemon was unhealthy on and off for 3.4 s). On the daemon's clock
// (HybridOptions.Clock): the last answer before the sync 1 s before it starts, Redis
// frozen once a pipeline of the sync has been answered, and the clock 1.5 s on.
func TestHybridLongSyncAnswersAsItGoes(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	ctl := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { ctl.Close() })
	t0 := time.Now().UnixNano()
	var clock atomic.Int64
	clock.Store(t0 - int64(time.Second))
	h := NewHybrid(rdb, HybridOptions{ID: "d", Clock: clock.Load}) // lastOK: t0 - 1 s
	clock.Store(t0)
	lim := mustLimit(t, localbucket.TokenBucket, 600, time.Minute)
	const keys = 100_000 // about 200 pipelines of 512
	for i := range keys {
		if r := take(h, t0, fmt.Sprintf("rl:u:{user=%d}", i), lim, 1); !r.Allowed {
			t.Fatalf("key %d: a first request refused: %+v", i, r)
		}
	}
	ctx := context.Background()
	if err := hybridScript.Load(ctx, ctl).Err(); err != nil {
		t.Fatal(err)
	}
	last := h.single.lastOK.Load()
	done := make(chan error, 1)
	go func() {
		c, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		done <- h.Flush(c, t0)
	}()
	// More keys in Redis than one pipeline carries: the first pipeline was answered.
	for {
		n, err := ctl.DBSize(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		if n > 3*callKeys*pipeCalls {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("the sync of %d keys ended (%v) before %d of them reached Redis", keys, err, 3*callKeys*pipeCalls)
		default:
		}
	}
	srv.Freeze()
	defer srv.Thaw()
	// Its reply read (or, recorded only at the end, not while Redis is frozen).
	for deadline := time.Now().Add(3 * time.Second); h.single.lastOK.Load() == last && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	now := t0 + int64(1500*time.Millisecond)
	clock.Store(now)
	healthy := h.Healthy(now)
	srv.Thaw()
	<-done
	if !healthy {
		t.Fatalf("unhealthy 1.5 s (daemon clock) into a sync whose first pipelines Redis answered at once: its last answer is %v old, from before the sync",
			time.Duration(now-last))
	}
}
