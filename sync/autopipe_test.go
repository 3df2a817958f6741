package sync

import (
	"context"
	"fmt"
	gosync "sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/localbucket"
)

// Concurrent checks through the auto-pipeline are decided as without it: exactly the
// limit is admitted, every call answered, none lost in a batch.
func TestGlobalAutoPipeline(t *testing.T) {
	srv := redistest.StartStandalone(t)
	rdb, err := Open(Config{URL: "redis://" + srv.Addr, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	g := NewGlobal(rdb).WithAutoPipeline()
	lim := globalLimit(t, localbucket.FixedWindow, 500, time.Hour, 0)
	var mu gosync.Mutex
	allowed, errs := 0, []error{}
	var wg gosync.WaitGroup
	for w := 0; w < 32; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				ops := []GlobalOp{{Key: "rl:ap:{shared}", Limit: lim, Cost: 1}, {Key: fmt.Sprintf("rl:ap2:{w%d}", w), Limit: lim, Cost: 1}}
				ok, err := g.Check(ctx, ops)
				cancel()
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else if ok {
					allowed++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d errors, first: %v", len(errs), errs[0])
	}
	if allowed != 500 {
		t.Errorf("%d of 1600 admitted by a limit of 500", allowed)
	}
}
