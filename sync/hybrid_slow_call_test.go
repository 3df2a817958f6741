package sync

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// stallHook holds back every pipeline that names key (in any argument) until its
// context ends, so Redis does not answer it within its wait, and calls during() first:
// a call Redis answers meanwhile. Other pipelines go at once.
type stallHook struct {
	key    string
	during func()
}

func (stallHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (stallHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (s stallHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			for _, a := range c.Args() {
				if strings.Contains(fmt.Sprint(a), s.key) {
					if s.during != nil {
						s.during()
					}
					<-ctx.Done()
					return next(ctx, cmds) // fails: its wait is over
				}
			}
		}
		return next(ctx, cmds)
	}
}

// A sync Redis did not answer within its wait says Redis is not answering only if
// nothing else was answered while it waited. Before, a sync's failure counted from when
// the daemon saw it fail, so an answer that came while it waited (a heartbeat, another
// sync) did not count: one slow call made every key only Redis could decide follow its
// rule's policy, degraded, until the next answer, while Redis answered. A loaded 2-core
// host, 3 daemons and their Redis: 13 of 97 such failures came with an answer inside
// their wait (one 0.1 ms before the failure), each followed by 2 to 45 ms of degraded
// answers. A Redis that answers nothing still degrades them at once (beside: false).
func TestHybridSlowCallBesideAnAnswerIsNoOutage(t *testing.T) {
	for _, exact := range []bool{true, false} {
		for _, beside := range []bool{true, false} {
			t.Run(fmt.Sprintf("exact=%v/answered_beside=%v", exact, beside), func(t *testing.T) {
				rdb := standalone(t)
				var h *Hybrid
				rdb.AddHook(stallHook{key: "{slow}", during: func() {
					if beside {
						if _, err := h.Heartbeat(context.Background(), "a", time.Minute); err != nil {
							t.Error(err)
						}
					}
				}})
				h = NewHybrid(rdb, HybridOptions{ID: "a", FetchWait: 100 * time.Millisecond})
				lim := mustLimit(t, localbucket.TokenBucket, 1_000_000, time.Hour)
				now := time.Now().UnixNano()
				if !take(h, now, "rl:sc:{warm}", lim, 1).Allowed {
					t.Fatal("a new key's first unit (its credit) was refused")
				}
				syncAll(t, now, h) // Redis answers
				const slow = "rl:sc:{slow}"
				if !take(h, now, slow, lim, 1).Allowed {
					t.Fatal("a new key's first unit (its credit) was refused")
				}
				if exact {
					// The second unit needs an exact sync, which Redis does not answer in time.
					ops := []HybridOp{{Key: []byte(slow), Limit: lim, Cost: 1}}
					if h.Take(now, ops) || !ops[0].Unreachable {
						t.Fatalf("a request whose exact sync got no answer: allowed or not Unreachable: %+v", ops[0])
					}
				} else {
					// The periodic sync (of the slow key alone) gets no answer in time.
					ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
					err := h.Flush(ctx, now)
					cancel()
					if err == nil {
						t.Fatal("the stalled sync succeeded")
					}
				}
				ops := []HybridOp{{Key: []byte("rl:sc:{fresh}"), Limit: lim, Cost: 1}}
				ok := h.Take(now, ops)
				switch {
				case beside && (!ok || ops[0].Unreachable):
					t.Fatalf("Redis answered a heartbeat while the sync waited, yet a new key is decided as if it did not answer: allowed %v, unreachable %v", ok, ops[0].Unreachable)
				case !beside && (ok || !ops[0].Unreachable):
					t.Fatalf("Redis answered nothing since the sync that failed was sent, yet a new key was not left to its policy: allowed %v, unreachable %v", ok, ops[0].Unreachable)
				}
			})
		}
	}
}
