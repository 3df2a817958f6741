package main

import (
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// A daemon with Redis exports rlsidecar_store_requests_total at 0 for every op and
// result before its first call, so that the first failed calls of an outage show as an
// increase. Before, a series was born at its first call: Redis stopped for 4 s under
// checks of global rules gave rlsidecar_store_requests_total{op="global_check",
// result="error"} born at 8, where it stayed (the breaker opened on the third failure
// and the rest were decided without a call), and rate() over it, the dashboard's Redis
// calls panel, showed no error at all. Real redis-server, real daemon.
func TestStoreRequestSeriesExistBeforeTheFirstCall(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: exact
    key: user
    mode: global
    on_store_failure: open
    limit: { requests: 100, per: 1h }
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	_, before := scrape(t, base)
	for _, op := range []string{"global_check", "hybrid_sync", "hybrid_fetch", "heartbeat", "ping", "lease_acquire", "lease_release"} {
		for _, result := range []string{"success", "error"} {
			name := `rlsidecar_store_requests_total{op="` + op + `",result="` + result + `"}`
			v, ok := before[name]
			if !ok {
				t.Errorf("no %s before any call of it", name)
			}
			if result == "error" && v != 0 {
				t.Errorf("%s = %g before any failure", name, v)
			}
		}
	}

	// Redis goes away: the errors add to the series that was there at 0.
	c := dialRaw(t, d.socket)
	if r := c.check(1, 1, "user=u"); !r.Allowed || r.Degraded {
		t.Fatalf("with Redis up: %+v", r)
	}
	srv.Stop()
	const failed = `rlsidecar_store_requests_total{op="global_check",result="error"}`
	id := uint64(2)
	waitFor(t, 30*time.Second, "failed global_check counted", func() bool {
		if r := c.check(id, 1, "user=u"); !r.Allowed {
			t.Fatalf("on_store_failure: open refused: %+v", r)
		}
		id++
		_, s := scrape(t, base)
		return s[failed] > 0
	})
}
