package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

var metricName = regexp.MustCompile(`rlsidecar_[a-z_]+`)

// family maps a sample name to its metric family (histogram series to the histogram).
func family(name string) string {
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if strings.HasSuffix(name, suf) && name != "rlsidecar_config_info" {
			return strings.TrimSuffix(name, suf)
		}
	}
	return name
}

// Every metric the Grafana dashboard and the alerting rules query exists, with a type,
// in a scrape of a running daemon (with Redis, after traffic).
func TestDashboardsQueryRealMetrics(t *testing.T) {
	var exprs []string
	var alerts struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	data, err := os.ReadFile("../../deploy/prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, &alerts); err != nil {
		t.Fatal(err)
	}
	for _, g := range alerts.Groups {
		for _, r := range g.Rules {
			exprs = append(exprs, r.Expr)
		}
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	data, err = os.ReadFile("../../deploy/grafana/rlsidecar.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatal(err)
	}
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			exprs = append(exprs, tg.Expr)
		}
	}
	if len(exprs) < 10 {
		t.Fatalf("only %d expressions found", len(exprs))
	}

	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: shared
    key: user
    limit: { requests: 2, per: 1h }
  - name: exact
    match: { path: /otp }
    key: user
    limit: { requests: 1, per: 1h }
    mode: global
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--admin", "127.0.0.1:0", "--sync-interval", "50ms")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	for i := 0; i < 5; i++ {
		c.check(uint64(i+1), 1, "user=u", "path=/otp")
	}
	time.Sleep(200 * time.Millisecond) // a few syncs and heartbeats
	types, _ := scrape(t, base)
	// promtool's own check of the exposition, where it is installed (scripts/test-ops
	// installs it and sets RLSIDECAR_PROMTOOL=1, which makes it required).
	if path, err := exec.LookPath("promtool"); err == nil || os.Getenv("RLSIDECAR_PROMTOOL") == "1" {
		_, body := httpGet(t, base+"/metrics")
		cmd := exec.Command(path, "check", "metrics")
		cmd.Stdin = strings.NewReader(body)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool check metrics: %v\n%s", err, out)
		}
	}
	// Every metric the daemon promises, with its type.
	for name, typ := range map[string]string{
		"rlsidecar_checks_total":                 "counter",
		"rlsidecar_check_duration_seconds":       "histogram",
		"rlsidecar_store_requests_total":         "counter",
		"rlsidecar_store_duration_seconds":       "histogram",
		"rlsidecar_sync_flushes_total":           "counter",
		"rlsidecar_keys":                         "gauge",
		"rlsidecar_evictions_total":              "counter",
		"rlsidecar_degraded_decisions_total":     "counter",
		"rlsidecar_breaker_open":                 "gauge",
		"rlsidecar_breaker_open_masters":         "gauge",
		"rlsidecar_config_reloads_total":         "counter",
		"rlsidecar_config_info":                  "gauge",
		"rlsidecar_connections":                  "gauge",
		"rlsidecar_build_info":                   "gauge",
		"rlsidecar_top_rejected":                 "gauge",
		"rlsidecar_hybrid_dropped_units_total":   "counter",
		"rlsidecar_lease_giveback_dropped_total": "counter",
		"rlsidecar_global_refund_errors_total":   "counter",
		"rlsidecar_hybrid_sync_backlog":          "gauge",
		"rlsidecar_hybrid_sync_duration_seconds": "histogram",
	} {
		if types[name] != typ {
			t.Errorf("%s: type %q, want %q", name, types[name], typ)
		}
	}
	seen := map[string]bool{}
	for _, e := range exprs {
		for _, name := range metricName.FindAllString(e, -1) {
			f := family(name)
			if seen[f] {
				continue
			}
			seen[f] = true
			if types[f] == "" {
				t.Errorf("%q queries %s, which a running daemon does not export", e, f)
			}
		}
	}
	t.Logf("%d metric families queried, all exported", len(seen))

	// A daemon without Redis exports none of the Redis series: zeros there read as a
	// Redis never called.
	localCfg := writeFile(t, dir, "local.yaml", "rules:\n  - name: shared\n    key: user\n    limit: { requests: 2, per: 1h }\n")
	local := startDaemon(t, "--config", localCfg, "--admin", "127.0.0.1:0")
	dialRaw(t, local.socket).check(1, 1, "user=u")
	types, _ = scrape(t, "http://"+adminAddr(t, local))
	for _, name := range []string{"rlsidecar_store_requests_total", "rlsidecar_store_duration_seconds", "rlsidecar_sync_flushes_total",
		"rlsidecar_breaker_open", "rlsidecar_hybrid_sync_duration_seconds", "rlsidecar_lease_giveback_dropped_total",
		"rlsidecar_global_refund_errors_total"} {
		if types[name] != "" {
			t.Errorf("without --redis: %s exported", name)
		}
	}
}

// rangeWindow matches a PromQL range selector's window: [1m], [$__rate_interval].
var rangeWindow = regexp.MustCompile(`\[([^\]:]+)\]`)

// The dashboard's rates hold two scrapes at any scrape interval up to 1m (Prometheus's
// own default, for which the alerts are written too): each window is Grafana's
// $__rate_interval (four scrape intervals at least) or 2m and more. Its panels used
// rate(...[1m]), which a Prometheus scraping every minute answers with nothing: a 1m
// window holds one sample (promtool: `rate(rlsidecar_checks_total[1m])` over series 1m
// apart is empty), so the checks, latency, Redis and sync panels were blank.
func TestDashboardRateWindows(t *testing.T) {
	data, err := os.ReadFile("../../deploy/grafana/rlsidecar.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatal(err)
	}
	windows := 0
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			for _, m := range rangeWindow.FindAllStringSubmatch(tg.Expr, -1) {
				windows++
				if m[1] == "$__rate_interval" {
					continue
				}
				d, err := time.ParseDuration(m[1])
				if err != nil || d < 2*time.Minute {
					t.Errorf("%q: window %s holds a single scrape at 1m scrape intervals; use $__rate_interval", tg.Expr, m[1])
				}
			}
		}
	}
	if windows == 0 {
		t.Fatal("no range windows found in the dashboard")
	}
}
