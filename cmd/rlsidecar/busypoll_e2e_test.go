package main

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// TestE2EBusyPoll: a daemon run with --busy-poll answers sequential checks on several
// connections at once exactly as without it (one connection at a time polls; the others
// wait in the netpoller), including a check that comes long after the poll gave up.
func TestE2EBusyPoll(t *testing.T) {
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: per-user
    key: user
    limit: { requests: 50, per: 1h }
`)
	d := startDaemon(t, "--config", cfg, "--busy-poll", "500us")
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := dialRaw(t, d.socket)
			user := fmt.Sprint("user=u", g)
			for i := range 60 {
				r := c.check(uint64(i+1), 1, user)
				if want := i < 50; r.Allowed != want {
					t.Errorf("%s check %d: allowed %v, want %v", user, i+1, r.Allowed, want)
					return
				}
				if i == 30 {
					time.Sleep(20 * time.Millisecond) // past the poll: the netpoller wakes it
				}
			}
		}()
	}
	wg.Wait()
}
