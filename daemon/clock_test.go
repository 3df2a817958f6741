package daemon

import (
	"bufio"
	"context"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// fakeClock is a Clock whose wall reading can step apart from its monotonic one.
type fakeClock struct {
	mu         sync.Mutex
	mono, wall int64
}

func (c *fakeClock) Now() (int64, int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.mono, c.wall
}

// advance moves both clocks by d; step moves the wall clock alone (NTP, a VM resumed).
func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.mono += int64(d)
	c.wall += int64(d)
	c.mu.Unlock()
}

func (c *fakeClock) step(d time.Duration) {
	c.mu.Lock()
	c.wall += int64(d)
	c.mu.Unlock()
}

const clockRules = `
rules:
  - name: token
    match: { path: /token }
    key: user
    limit: { requests: 10, per: 10s }
  - name: sliding
    match: { path: /sliding }
    key: user
    algorithm: sliding_window
    limit: { requests: 10, per: 10s }
  - name: fixed
    match: { path: /fixed }
    key: user
    algorithm: fixed_window
    limit: { requests: 10, per: 1m }
`

// Token buckets and sliding windows are decided on the monotonic clock: a backward wall
// step does not reject active clients, a forward one does not refill them. Fixed windows
// align to wall time, so a forward step starts a new window for them.
func TestWallClockSteps(t *testing.T) {
	const t0 = int64(1_800_000_000) * int64(time.Second) // a minute boundary
	for _, tc := range []struct {
		name    string
		path    string
		taken   int           // requests taken before the step
		step    time.Duration // wall clock step
		allowed bool          // the next request
		remain  uint64        // and what it reports remaining
	}{
		{"token/backward", "/token", 5, -time.Hour, true, 4},
		{"token/forward", "/token", 10, time.Hour, false, 0},
		{"sliding/backward", "/sliding", 5, -time.Hour, true, 4},
		{"sliding/forward", "/sliding", 10, time.Hour, false, 0},
		{"fixed/forward_new_wall_window", "/fixed", 10, time.Hour, true, 9},
		{"fixed/backward_same_count", "/fixed", 5, -time.Hour, true, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := &fakeClock{mono: t0, wall: t0}
			dir, err := os.MkdirTemp("", "rlsc")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			set, err := rules.Parse("clock.yaml", []byte(clockRules))
			if err != nil {
				t.Fatal(err)
			}
			s, err := New(Config{Socket: filepath.Join(dir, "s.sock"), Clock: clk}, limiter.New(set, localbucket.NewStore(localbucket.Options{})))
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Listen(); err != nil {
				t.Fatal(err)
			}
			go s.Serve()
			defer s.Shutdown(context.Background())
			c, err := net.Dial("unix", s.cfg.Socket)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			br := bufio.NewReader(c)
			req := &proto.Request{Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "path", Value: tc.path}, {Name: "user", Value: "u"}}}
			for i := 0; i < tc.taken; i++ {
				req.ID = uint64(i + 1)
				if r := roundTrip(t, c, br, req); !r.Allowed {
					t.Fatalf("request %d rejected: %+v", i, r)
				}
				clk.advance(time.Millisecond)
			}
			clk.step(tc.step)
			clk.advance(time.Millisecond)
			req.ID = 100
			r := roundTrip(t, c, br, req)
			if r.Allowed != tc.allowed || r.Remaining != tc.remain {
				t.Fatalf("after a wall step of %v: allowed %v remaining %d, want %v %d (%+v)", tc.step, r.Allowed, r.Remaining, tc.allowed, tc.remain, r)
			}
		})
	}
}
