package main

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// TestE2EReloadModeFlipKeysSwept: through the real daemon on a real Redis, the keys of a
// hybrid rule reloaded to global and back to hybrid (which forgets their views) are
// dropped from memory once unused, as any idle key is: rlsidecar_keys comes back to 0.
// Before, each such key stayed for as long as the daemon ran (a 17-minute soak, rules
// reloaded every few seconds, left 216,324 keys on an idle daemon, Redis holding 1).
func TestE2EReloadModeFlipKeysSwept(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	rulesIn := func(mode string) string {
		return fmt.Sprintf("rules:\n  - name: per-user\n    key: user\n    limit: { requests: 5, per: 1s }\n    mode: %s\n", mode)
	}
	cfg := writeFile(t, dir, "rules.yaml", rulesIn("hybrid"))
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0", "--redis", "redis://"+srv.Addr,
		"--sweep-interval", "200ms", "--global-timeout", "3s", "--redis-timeout", "3s")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	const users = 50
	for i := range users {
		if r := c.check(uint64(i+1), 1, fmt.Sprint("user=u", i)); !r.Allowed || r.Degraded {
			t.Fatalf("user %d: %+v", i, r)
		}
	}
	if n := scrapeSamples(t, base)["rlsidecar_keys"]; n < users {
		t.Fatalf("rlsidecar_keys %v after %d users' checks", n, users)
	}
	v := rulesVersion(t, base)
	for _, mode := range []string{"global", "hybrid"} {
		if err := os.WriteFile(cfg, []byte(rulesIn(mode)), 0o644); err != nil {
			t.Fatal(err)
		}
		v = waitReload(t, base, v)
	}
	// Idle keys go after the keep-alive (10 s) once full again (a second): wait for it,
	// with room for a loaded machine.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		n := scrapeSamples(t, base)["rlsidecar_keys"]
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("rlsidecar_keys %v two minutes after the last check; want 0 (every key idle)", n)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
