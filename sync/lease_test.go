package sync

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// TestLeaseAcquireRelease runs the lease script on a real standalone Redis (one call, and
// grouped by slot) and a real 3-master Cluster: max slots then a refusal, release frees
// one, a second release is false, renew, expiry, and all-or-nothing across hash slots.
func TestLeaseAcquireRelease(t *testing.T) {
	ctx := context.Background()
	for _, b := range globalBackends(t) {
		t.Run(b.name, func(t *testing.T) {
			g := b.g
			key := "rl:lease-test:{user=" + b.name + "}"
			acq := func(id string, ops ...LeaseOp) bool {
				t.Helper()
				ok, err := g.Acquire(ctx, id, ops)
				if err != nil {
					t.Fatal(err)
				}
				return ok
			}
			op := func(k string, part int, max uint64, lease time.Duration) LeaseOp {
				return LeaseOp{Key: k, Part: part, Max: max, Lease: lease, Take: true}
			}
			for i := range 3 {
				o := []LeaseOp{op(key, 0, 3, time.Minute)}
				if !acq(fmt.Sprint("L", i), o...) {
					t.Fatalf("lease %d refused", i)
				}
				if o[0].Remaining != uint64(2-i) {
					t.Fatalf("lease %d: remaining %d, want %d", i, o[0].Remaining, 2-i)
				}
			}
			o := []LeaseOp{op(key, 0, 3, time.Minute)}
			if acq("L3", o...) || o[0].Allowed || o[0].RetryAfter <= 0 || o[0].RetryAfter > time.Second {
				t.Fatalf("4th lease: %+v, want refused with a retry hint in (0, 1s]", o[0])
			}
			parts := []LeasePart{{Key: key, Part: 0, Lease: time.Minute}}
			if ok, err := g.Release(ctx, "L1", parts); err != nil || !ok {
				t.Fatalf("release: %v %v, want true", ok, err)
			}
			if ok, err := g.Release(ctx, "L1", parts); err != nil || ok {
				t.Fatalf("second release: %v %v, want false", ok, err)
			}
			if ok, err := g.Release(ctx, "nope", parts); err != nil || ok {
				t.Fatalf("unknown release: %v %v, want false", ok, err)
			}
			if !acq("L4", op(key, 0, 3, time.Minute)) {
				t.Fatal("a released slot is not free")
			}
			ok, in, err := g.Renew(ctx, "L2", []LeasePart{{Key: key, Part: 0, Lease: 2 * time.Minute}})
			if err != nil || !ok || in != 2*time.Minute {
				t.Fatalf("renew: %v %v %v, want true 2m", ok, in, err)
			}
			if ok, _, _ := g.Renew(ctx, "L1", parts); ok {
				t.Fatal("renewed a released lease")
			}

			// Expiry frees a slot, and the expired part stays visible for the grace.
			short := "rl:lease-test:{short=" + b.name + "}"
			if !acq("S0", op(short, 0, 1, 30*time.Millisecond)) {
				t.Fatal("short lease refused")
			}
			if acq("S1", op(short, 0, 1, time.Minute)) {
				t.Fatal("second short lease allowed")
			}
			time.Sleep(60 * time.Millisecond)
			left, present, err := g.LeaseState(ctx, "S0", []LeasePart{{Key: short}})
			if err != nil || !present[0] || left[0] > 0 {
				t.Fatalf("state of an expired lease: %v %v %v, want present, expired", left, present, err)
			}
			if ok, _ := g.Release(ctx, "S0", []LeasePart{{Key: short}}); ok {
				t.Fatal("released an expired lease")
			}
			if !acq("S2", op(short, 0, 1, time.Minute)) {
				t.Fatal("an expired lease still holds its slot")
			}
			if ttl := b.rdb.PTTL(ctx, short).Val(); ttl <= time.Minute || ttl > time.Minute+LeaseGrace {
				t.Fatalf("TTL %v, want the lease plus the grace", ttl)
			}

			// All-or-nothing across keys (and slots): a full key refuses, the other holds nothing.
			full := "rl:lease-test:{full=" + b.name + "}"
			free := "rl:lease-test:{free=" + b.name + "}"
			if !acq("F0", op(full, 0, 1, time.Minute)) {
				t.Fatal("F0 refused")
			}
			ops := []LeaseOp{op(free, 0, 1, time.Minute), op(full, 1, 1, time.Minute)}
			if acq("F1", ops...) {
				t.Fatal("F1 allowed with a full key")
			}
			if !ops[0].Allowed || ops[0].Remaining != 1 || ops[1].Allowed {
				t.Fatalf("F1 results %+v", ops)
			}
			if n := b.rdb.ZCard(ctx, free).Val(); n != 0 {
				t.Fatalf("a refused lease holds %d slots of the free key", n)
			}
			// A shadow part that does not fit refuses nothing and holds nothing.
			sh := []LeaseOp{op(free, 0, 1, time.Minute), op(full, 1, 1, time.Minute)}
			sh[1].Shadow = true
			if !acq("F2", sh...) || sh[1].Allowed {
				t.Fatalf("shadow: %+v", sh)
			}
			if n := b.rdb.ZCard(ctx, full).Val(); n != 1 {
				t.Fatalf("full key holds %d, want 1", n)
			}
		})
	}
}

// Every lease call that the breaker lets through reports back to it: a release (or renew,
// or query) taken as the open breaker's probe closes it when Redis answers, rather than
// leaving the probe out forever and the breaker open.
func TestLeaseCallsReportToBreaker(t *testing.T) {
	b := globalBackends(t)[0]
	ctx := context.Background()
	parts := []LeasePart{{Key: "rl:breaker:{user=x}", Lease: time.Minute}}
	for name, call := range map[string]func(g *Global) error{
		"release": func(g *Global) error { _, err := g.Release(ctx, "id", parts); return err },
		"renew":   func(g *Global) error { _, _, err := g.Renew(ctx, "id", parts); return err },
		"state":   func(g *Global) error { _, _, err := g.LeaseState(ctx, "id", parts); return err },
		"all": func(g *Global) error {
			_, err := g.ReleaseAll(ctx, []string{"id"}, [][]LeasePart{parts})
			return err
		},
	} {
		br := NewBreaker(1, time.Millisecond)
		g := (&Global{rdb: b.g.rdb}).WithBreaker(br)
		br.Failure() // open
		time.Sleep(5 * time.Millisecond)
		if err := call(g); err != nil {
			t.Fatalf("%s as the probe: %v", name, err)
		}
		if br.Open() {
			t.Fatalf("%s: the breaker is still open after a probe Redis answered", name)
		}
	}
}
