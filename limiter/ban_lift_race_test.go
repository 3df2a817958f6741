package limiter

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// indexGate holds the first pipeline that adds to the ban index (the daemon's round
// indexing the bans it started) until released.
type indexGate struct {
	index   string
	reached chan struct{}
	release chan struct{}
	held    bool
}

func (g *indexGate) DialHook(next redis.DialHook) redis.DialHook { return next }
func (g *indexGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return next
}

func (g *indexGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			if a := c.Args(); !g.held && len(a) > 1 && strings.EqualFold(c.Name(), "zadd") && a[1] == g.index {
				g.held = true
				close(g.reached)
				<-g.release
			}
		}
		return next(ctx, cmds)
	}
}

// An operator lifts a shared ban while the daemon that started it is indexing it (its
// round took the ban from its list of bans to index before the lift, and writes it to
// the index after): the ban stays lifted, on every daemon. Before, the round wrote the
// index's member back after the lift had deleted it, and every daemon learned the ban
// again at its next read of the index and enforced it for its whole 10 minutes, though
// the lift had answered that it was lifted.
func TestSharedBanLiftedWhileIndexed(t *testing.T) {
	yaml := loginRule(1, "30s", "global", "after: 1, within: 1m, ban: 10m")
	rdb := realRedis(t)
	gate := &indexGate{index: "rl:~bans", reached: make(chan struct{}), release: make(chan struct{})}
	rdb.AddHook(gate)
	a, b := sharedLimiter(t, rdb, yaml), sharedLimiter(t, rdb, yaml)
	in := &Input{Attrs: attrs("ip=1.1.1.1"), Cost: 1}
	now := time.Now().UnixNano()
	var d Decision
	for i := range 2 {
		if err := a.Check(now, in, &d); err != nil {
			t.Fatal(err)
		}
		if i == 1 && (d.Allowed || !d.Results[0].BanStarted) {
			t.Fatalf("second check: %+v, want refused, a ban started", d.Results[0])
		}
	}
	bans := a.Bans(now)
	if len(bans) != 1 {
		t.Fatalf("bans %+v, want 1", bans)
	}
	ctx := context.Background()
	done := make(chan error, 1)
	go func() { done <- a.shared.round(ctx, now, true) }()
	select {
	case <-gate.reached:
	case <-time.After(30 * time.Second):
		t.Fatal("the round did not index the ban")
	}
	if !a.LiftBan(bans[0].Key, now) {
		t.Fatal("LiftBan: false")
	}
	close(gate.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for _, l := range []*Limiter{a, b} {
		if err := l.shared.round(ctx, now, true); err != nil {
			t.Fatal(err)
		}
	}
	if got := b.Bans(now); len(got) != 0 {
		t.Errorf("the other daemon's bans after the lift: %+v, want none", got)
	}
	if got := a.Bans(now); len(got) != 0 {
		t.Errorf("the lifting daemon's bans after the lift: %+v, want none", got)
	}
}
