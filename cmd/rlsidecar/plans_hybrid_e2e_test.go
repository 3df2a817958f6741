package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// README, `plans`: a client whose plan changes keeps the units it used. Through real
// hybrid daemons (their own syncs, every 100 ms), a client of the partner plan (30 per
// hour) uses its 30, sends one check without the plan (3 per hour: refused, or a
// question of cost 0), then 30 more as partner: none is admitted, as the local and
// global modes admit none. Before, the lower plan's sync cut the key to that plan's
// burst and its units were read back as 3 used: 19 to 27 more admitted over two or
// three daemons; keeping the cut's units in Redis, 6 or 7 through one daemon alone, its
// view raised with the limit over the cut, and a share of that given as credit
// (sync:TestHybridPlanFlappingKeepsUnits).
func TestE2EHybridPlanFlappingKeepsUnits(t *testing.T) {
	srv := redistest.StartStandalone(t)
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: hybrid
    key: user
    limit: { requests: 3, per: 1h }
    plans: { partner: 30 }
    mode: hybrid
`)
	for _, daemons := range []int{1, 3} {
		for _, cost := range []uint64{1, 0} {
			t.Run(fmt.Sprintf("daemons-%d/lower-plan-cost-%d", daemons, cost), func(t *testing.T) {
				var cs []*rawConn
				for range daemons {
					// Redis's answers are waited for as long as a loaded machine takes:
					// a check is failed below when one is degraded.
					d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr,
						"--redis-timeout", "3s", "--global-timeout", "3s")
					cs = append(cs, dialRaw(t, d.socket))
				}
				user := fmt.Sprintf("user=flap-%d-%d", daemons, cost)
				id := uint64(0)
				check := func(cost uint64, attrs ...string) bool {
					t.Helper()
					id++
					r := cs[int(id)%len(cs)].check(id, cost, attrs...)
					if r.IsError() || r.Degraded {
						t.Fatalf("check %d: %+v, want an answer of the hybrid rule, not degraded", id, r)
					}
					time.Sleep(5 * time.Millisecond) // a few checks per sync
					return r.Allowed
				}
				used := 0
				for try := 0; used < 30; try++ {
					if try == 400 {
						t.Fatalf("%d of 30 admitted as partner in 400 checks on a fresh key", used)
					}
					if check(1, user, "plan=partner") {
						used++
					}
				}
				time.Sleep(300 * time.Millisecond) // the daemons' syncs
				if check(cost, user) {
					t.Fatalf("a check of cost %d without the plan after 30 used: allowed", cost)
				}
				time.Sleep(300 * time.Millisecond)
				more := 0
				for range 30 {
					if check(1, user, "plan=partner") {
						more++
					}
				}
				if more > 0 {
					t.Fatalf("as partner again after its 30 used: %d more admitted, want 0", more)
				}
			})
		}
	}
}
