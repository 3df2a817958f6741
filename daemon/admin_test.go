package daemon

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

func startAdmin(t *testing.T, deps AdminDeps) string {
	t.Helper()
	a, err := NewAdmin("127.0.0.1:0", deps)
	if err != nil {
		t.Fatal(err)
	}
	go a.Serve()
	t.Cleanup(func() { _ = a.Shutdown(context.Background()) })
	return "http://" + a.Addr()
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// With Redis down the daemon still answers every check by its rules' failure policies,
// closed ones included: it is ready. An orchestrator must not mark every gateway unready
// at once; degradation shows as rlsidecar_store_unreachable and its alert instead.
func TestReadyWhileStoreDown(t *testing.T) {
	set, err := rules.Parse("test.yaml", []byte(`
rules:
  - name: login
    key: user
    mode: global
    on_store_failure: closed
    limit: { requests: 5, per: 1m }
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		reachable bool
		gauge     string
	}{
		{"reachable", true, "rlsidecar_store_unreachable 0"},
		{"down", false, "rlsidecar_store_unreachable 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := NewMetrics("test", 10)
			base := startAdmin(t, AdminDeps{Metrics: m, Limiter: limiter.New(set, localbucket.NewStore(localbucket.Options{})),
				StoreReachable: func() bool { return tc.reachable }})
			if code, body := get(t, base+"/readyz"); code != 200 {
				t.Fatalf("/readyz: %d %s", code, body)
			}
			if _, body := get(t, base+"/metrics"); !strings.Contains(body, tc.gauge+"\n") {
				t.Fatalf("/metrics lacks %q:\n%s", tc.gauge, body)
			}
		})
	}
}
