package limiter

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// banCountGate runs before once, before the second command of its client that names a
// ban key (a global penalty check sends two: the check's script call, which reads the
// ban, then ban.lua, which counts the refusal).
type banCountGate struct {
	seen   int
	before func()
}

func (g *banCountGate) DialHook(next redis.DialHook) redis.DialHook { return next }

func (g *banCountGate) gate(cmds []redis.Cmder) {
	for _, c := range cmds {
		for _, a := range c.Args() {
			if s, ok := a.(string); ok && strings.Contains(s, "@ban:") {
				if g.seen++; g.seen == 2 && g.before != nil {
					g.before()
				}
				return
			}
		}
	}
}

func (g *banCountGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, c redis.Cmder) error {
		g.gate([]redis.Cmder{c})
		return next(ctx, c)
	}
}

func (g *banCountGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		g.gate(cmds)
		return next(ctx, cmds)
	}
}

// Two daemons refuse one client at once, in global mode, the refusal of one of them the
// `after`-th: it starts the ban. The other daemon's check read no ban (its script call
// came first), and its refusal, counted after the ban started, finds the ban in force
// (ban.lua answers it, not started). That answer is banned, but did not start the ban:
// before, every such refusal answered BanStarted, and each daemon counted the ban in
// rlsidecar_bans_total (a client flooding several daemons at once counted once per
// racing refusal).
func TestSharedBanGlobalStartedOnce(t *testing.T) {
	yaml := loginRule(1, "30s", "global", "after: 2, within: 1m, ban: 10m")
	srv, rdbA := realRedisServer(t, 5*time.Second)
	rdbB, err := rlsync.Open(rlsync.Config{URL: "redis://" + srv.Addr, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdbB.Close() })
	gate := &banCountGate{}
	rdbA.AddHook(gate)
	a, b := sharedLimiter(t, rdbA, yaml), sharedLimiter(t, rdbB, yaml)
	in := &Input{Attrs: attrs("ip=1.1.1.1"), Cost: 1}
	check := func(l *Limiter) Result {
		t.Helper()
		var d Decision
		if err := l.Check(time.Now().UnixNano(), in, &d); err != nil {
			t.Fatal(err)
		}
		if d.Degraded {
			t.Fatalf("degraded: %+v", d.Results)
		}
		return d.Results[0]
	}
	if r := check(b); !r.Allowed {
		t.Fatalf("first check: %+v, want allowed", r)
	}
	if r := check(b); r.Allowed || r.Banned {
		t.Fatalf("refusal 1: %+v, want refused, not banned", r)
	}
	// Daemon a's refusal: between its check and its count, daemon b's refusal 2 starts
	// the ban.
	var byB Result
	gate.before = func() { byB = check(b) }
	r := check(a)
	if gate.seen < 2 {
		t.Fatalf("daemon a sent %d commands naming the ban key, want 2", gate.seen)
	}
	if !byB.Banned || !byB.BanStarted {
		t.Fatalf("daemon b's refusal 2: %+v, want the ban started", byB)
	}
	if r.Allowed || !r.Banned || r.BanStarted || r.RetryAfter < 9*time.Minute {
		t.Fatalf("daemon a's refusal, counted once the ban had started: allowed %v banned %v started %v retry %v, want banned for the ban's ~10m, not started",
			r.Allowed, r.Banned, r.BanStarted, r.RetryAfter)
	}
}
