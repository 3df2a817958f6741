package limiter

import (
	"context"
	"fmt"
	gosync "sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// Reloads that move a rule between hybrid, global and local mode and change its limit,
// every few milliseconds while eight goroutines check one client: Redis counts exactly
// the units admitted in hybrid and global mode (the two share the key, and a hybrid
// grant left when the rule went global or local is settled by the next sync or the
// last), and none admitted in local mode. Fixed window of 366 days: no window boundary
// inside the test.
func TestReloadsKeepRedisCountExact(t *testing.T) {
	rdb := realRedis(t)
	prefix := "rc:"
	rule := func(mode string, n int) string {
		return fmt.Sprintf("rules:\n  - name: orders\n    key: user\n    algorithm: fixed_window\n    limit: { requests: %d, per: 366d }\n    mode: %s\n", n, mode)
	}
	sets := []*rules.Set{
		mustRules(t, rule("hybrid", 1000000)),
		mustRules(t, rule("hybrid", 2000000)),
		mustRules(t, rule("global", 1000000)),
		mustRules(t, rule("local", 1000000)),
		mustRules(t, rule("hybrid", 1500000)),
	}
	h := rlsync.NewHybrid(rdb, rlsync.HybridOptions{Prefix: prefix, Interval: 5 * time.Millisecond, FetchWait: time.Second})
	l := New(sets[0], localbucket.NewStore(localbucket.Options{})).WithGlobal(rlsync.NewGlobal(rdb), 5*time.Second).WithHybrid(h)
	if err := l.SetRedisPrefix(prefix); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.Run(ctx, "test", func() int64 { return time.Now().UnixNano() }, 5*time.Second, func(err error) { t.Log(err) })
	}()
	stop := make(chan struct{})
	var rwg gosync.WaitGroup
	rwg.Add(1)
	go func() {
		defer rwg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(i%7) * time.Millisecond):
			}
			l.SetRules(sets[i%len(sets)])
		}
	}()
	var counted, local, degraded atomic.Int64
	var wg gosync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var d Decision
			in := Input{Attrs: attrs("user=u"), Cost: 1}
			for i := 0; i < 3000; i++ {
				if err := l.Check(time.Now().UnixNano(), &in, &d); err != nil {
					t.Error(err)
					return
				}
				if !d.Allowed {
					continue
				}
				r := d.Results[0]
				switch {
				case r.Degraded:
					degraded.Add(1)
				case l.ModeOf(r.Rule) == rules.ModeLocal:
					local.Add(1)
				default:
					counted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	rwg.Wait()
	cancel()
	<-done
	n, _ := rdb.HGet(context.Background(), prefix+"orders~fw366d:{user=u}", "n").Int64()
	if n != counted.Load() || degraded.Load() != 0 {
		t.Errorf("Redis counts %d, admitted in hybrid and global mode %d (%d in local mode, %d degraded)",
			n, counted.Load(), local.Load(), degraded.Load())
	}
}
