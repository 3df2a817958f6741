package limiter

import (
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
)

// A request that a local rate rule refuses holds no local concurrency slot, not even
// while the rate rule is being decided: a check of the slot by another client at that
// moment finds it free. Before, the slot was taken first and given back after the
// rate rule refused, and a fresh user's check of a free slot was refused meanwhile.
func TestLeaseNotHeldWhileLocalRateRefuses(t *testing.T) {
	l := newLimiter(t, `
rules:
  - { name: conc, key: acct, concurrency: { max: 1, lease: 1h } }
  - { name: rate, key: user, limit: { requests: 1, per: 1h } }
`)
	check := func(user string) *Decision {
		d := new(Decision)
		if err := l.Check(t0, &Input{Attrs: attrs("acct=a", "user="+user), Cost: 1}, d); err != nil {
			t.Error(err)
		}
		return d
	}
	if d := check("spent"); !d.Allowed || !l.ReleaseLease(l.Leases().Token(d.Lease), t0) {
		t.Fatalf("user spent's first check: %+v", d)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				if d := check("spent"); d.Allowed {
					t.Errorf("user spent admitted: %+v", d.Results)
					return
				}
			}
		}()
	}
	refused := 0
	const users = 20000
	for i := range users {
		d := check("u" + strconv.Itoa(i))
		if !d.Allowed {
			refused++
			continue
		}
		if !l.ReleaseLease(l.Leases().Token(d.Lease), t0) {
			t.Fatalf("user %d's lease not released", i)
		}
	}
	stop.Store(true)
	wg.Wait()
	if refused > 0 {
		t.Fatalf("%d of %d fresh users refused the free slot (held for a moment by checks the rate rule refused)", refused, users)
	}
}
