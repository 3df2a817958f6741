//go:build peers

package main

import (
	"os"
	"path/filepath"
	"testing"
)

// TestDifferential runs the differential phase alone (scripts/compare -quick runs it in
// CI): envoyproxy/ratelimit, installed from the module proxy (the build cache makes later
// runs quick), and this repository's daemon answer the battery, and every difference is
// one the README names. RLSIDECAR_DIFF_ROOT names another checkout whose daemon to
// compare (default: this repository).
func TestDifferential(t *testing.T) {
	if testing.Short() {
		t.Skip("builds envoyproxy/ratelimit")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "peers")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	root := "../.."
	if r := os.Getenv("RLSIDECAR_DIFF_ROOT"); r != "" {
		root = r
	}
	if err := buildOurs(root, dir); err != nil {
		t.Fatal(err)
	}
	if err := goInstall(bin, envoyRLPkg); err != nil {
		t.Fatal(err)
	}
	d, err := differential(dir, bin)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range d.Unexpected {
		t.Errorf("%s: envoy-ratelimit %s, rlsidecar %s: %s", c.Call, c.Envoy, c.Rlsidecar, c.Why)
	}
	if d.Calls < 60 || d.Same+len(d.Documented)+len(d.Unexpected) != d.Calls {
		t.Errorf("%d calls, %d alike, %d documented, %d unexpected", d.Calls, d.Same, len(d.Documented), len(d.Unexpected))
	}
	t.Logf("%d calls: %d alike, %d as documented", d.Calls, d.Same, len(d.Documented))
}
