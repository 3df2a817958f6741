//go:build rlsidecar_nostore

package limiter

import (
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// NoStore: this is a measurement build, never one to run. It answers every local check
// as the first request of a fresh token bucket would be answered, without reading or
// writing the store: `RLSIDECAR_BENCH_TAGS=rlsidecar_nostore go test -bench 4x32 ./bench`
// measures what the rest of the check path costs under load, and so bounds what any
// store could reach (docs/performance.md). serve logs an error when it starts.
const NoStore = true

func applyLocal(_ *localbucket.Store, now int64, ops []localbucket.Op) bool {
	for i := range ops {
		l := ops[i].Limit
		per := l.Window() / time.Duration(max(l.Requests(), 1))
		ops[i].Result = localbucket.Result{Allowed: true, Limit: l.Requests(), Remaining: l.Capacity() - min(ops[i].Cost, l.Capacity()),
			Reset: int64(per), Expires: now + int64(per)}
	}
	return true
}
