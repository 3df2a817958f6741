package conformance

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// TestConformanceRedisModes runs the whole Python suite once per mode and topology. A
// failing case fails the subtest, with pytest's report in the log.
func TestConformanceRedisModes(t *testing.T) {
	if os.Getenv("RLSIDECAR_CONFORMANCE_REDIS") != "1" {
		t.Skip("set RLSIDECAR_CONFORMANCE_REDIS=1 (scripts/test-clients does) to run the conformance suite against Redis")
	}
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatalf("repository root: %v", err)
	}
	bin := os.Getenv("RLSIDECAR_BIN")
	if bin == "" {
		bin = filepath.Join(t.TempDir(), "rlsidecar")
		cmd := exec.Command("go", "build", "-o", bin, "./cmd/rlsidecar")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build ./cmd/rlsidecar: %v\n%s", err, out)
		}
	}

	topologies := []struct {
		name  string
		store func(t *testing.T) string // the serve flags naming the Redis it starts
	}{
		{"standalone", func(t *testing.T) string {
			return "--redis redis://" + redistest.StartStandalone(t).Addr
		}},
		{"cluster", func(t *testing.T) string {
			return "--redis-cluster " + strings.Join(redistest.StartCluster(t).Addrs, ",")
		}},
	}
	for _, topo := range topologies {
		t.Run(topo.name, func(t *testing.T) {
			store := topo.store(t)
			for _, mode := range []string{"global", "hybrid"} {
				t.Run(mode, func(t *testing.T) {
					// A prefix per run: the two modes' keys on one Redis never meet. The
					// suite asserts that a healthy store never lets a failure policy decide:
					// --global-timeout 250ms, not the default 20 ms, which a loaded
					// 2-core CI machine (Redis on the same cores) can overrun now and then.
					args := store + " --redis-prefix conf-" + mode + ": --global-timeout 250ms"
					cmd := exec.Command("/usr/bin/python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "proto/conformance")
					cmd.Dir = root
					cmd.Env = append(os.Environ(),
						"RLSIDECAR_BIN="+bin,
						"RLSIDECAR_CONFORMANCE_ARGS="+args,
						"RLSIDECAR_CONFORMANCE_MODE="+mode)
					out, err := cmd.CombinedOutput()
					if err != nil {
						t.Errorf("conformance suite, %s mode, %s (%s): %v\n%s", mode, topo.name, args, err, out)
						return
					}
					lines := strings.Split(strings.TrimSpace(string(out)), "\n")
					t.Logf("%s mode, %s: %s", mode, topo.name, lines[len(lines)-1])
				})
			}
		})
	}
}
