package daemon

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// skewedClock is the daemon's clock on a host whose wall clock is off by skew.
type skewedClock struct {
	sys  *SystemClock
	skew int64
}

func (c skewedClock) Now() (mono, wall int64) {
	mono, wall = c.sys.Now()
	return mono + c.skew, wall + c.skew
}

// TestAdminBansClockSkew: two daemons sharing a global penalty rule's bans on one real
// Redis, their wall clocks 2 minutes behind and 2 minutes ahead of real time, each
// learning the bans every 20 ms (RunSharedBans) as serve does. A ban of 30 s raised on the
// one behind is listed by GET /bans on both with the time it has left by real time.
// Before, the bans were decided on the daemons' clocks: the one ahead never listed the
// ban (it had ended 4 minutes before by its clock), and one raised on it would have been
// listed with 4m30s left by the one behind.
func TestAdminBansClockSkew(t *testing.T) {
	const yaml = `
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 1s }
    mode: global
    penalty: { after: 2, within: 1m, ban: 30s }
`
	const ban = 30 * time.Second
	srv := redistest.StartStandalone(t)
	rdb, err := rlsync.Open(rlsync.Config{URL: "redis://" + srv.Addr, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	set, err := rules.Parse("test.yaml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	type daemon struct {
		lim   *limiter.Limiter
		clock skewedClock
		admin string
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	var ds []daemon
	for _, skew := range []time.Duration{-2 * time.Minute, 2 * time.Minute} {
		bans, err := rlsync.NewBans(rdb, rlsync.DefaultPrefix)
		if err != nil {
			t.Fatal(err)
		}
		d := daemon{clock: skewedClock{NewSystemClock(), int64(skew)}}
		d.lim = limiter.New(set, localbucket.NewStore(localbucket.Options{})).
			WithGlobal(rlsync.NewGlobal(rdb), 5*time.Second).WithSharedBans(bans, 5*time.Second)
		mono, wall := d.clock.Now()
		d.lim.Store().SetWallOffset(wall - mono)
		now := func() int64 { mono, _ := d.clock.Now(); return mono }
		if err := d.lim.LearnSharedBans(ctx, now()); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); d.lim.RunSharedBans(ctx, 20*time.Millisecond, now, nil) }()
		d.admin = startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10), Limiter: d.lim, Now: now})
		ds = append(ds, d)
	}
	// Two refusals, one per daemon; the second, on the daemon behind, starts the ban.
	start := time.Now()
	for i := range ds {
		d := &ds[len(ds)-1-i]
		for n := 0; ; n++ {
			if n > 50 {
				t.Fatalf("daemon %d never refused", i)
			}
			var dec limiter.Decision
			mono, _ := d.clock.Now()
			if err := d.lim.Check(mono, &limiter.Input{Attrs: []rules.Attr{{Name: "ip", Value: "1.2.3.4"}}, Cost: 1}, &dec); err != nil {
				t.Fatal(err)
			}
			if !dec.Allowed {
				break
			}
		}
	}
	for i, d := range ds {
		deadline := time.Now().Add(20 * time.Second)
		for {
			_, body := get(t, d.admin+"/bans")
			var got []banDoc
			if err := json.Unmarshal([]byte(body), &got); err != nil {
				t.Fatalf("daemon %d: /bans: %v: %s", i, err, body)
			}
			if len(got) == 1 {
				left := time.Duration(got[0].LeftMs) * time.Millisecond
				if got[0].Rule != "login" || left > ban || left < ban-time.Since(start)-time.Second {
					t.Fatalf("daemon %d (clock %v) lists %+v %v after the ban's start, want login's ban with about %v left",
						i, time.Duration(d.clock.skew), got, time.Since(start), ban-time.Since(start))
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("daemon %d (clock %v) lists %s, want the ban", i, time.Duration(d.clock.skew), body)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}
