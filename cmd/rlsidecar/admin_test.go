package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// adminAddr waits for the daemon's log line naming its admin endpoint.
func adminAddr(t *testing.T, d *daemonProc) string {
	t.Helper()
	re := regexp.MustCompile(`msg="admin endpoint" addr=(\S+)`)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if m := re.FindStringSubmatch(d.stderr.String()); m != nil {
			return m[1]
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no admin endpoint in the log:\n%s", d.stderr.String())
	return ""
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// scrape parses a Prometheus text exposition: metric family → type, and every sample.
func scrape(t *testing.T, base string) (types map[string]string, samples map[string]float64) {
	t.Helper()
	code, body := httpGet(t, base+"/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	types, samples = map[string]string{}, map[string]float64{}
	help := map[string]string{}
	defer func() {
		for f := range types { // Prometheus expects them; promtool check metrics: "no help text"
			if help[f] == "" {
				t.Errorf("/metrics: family %s has no HELP text", f)
			}
		}
	}()
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "# TYPE ") {
			f := strings.Fields(line)
			types[f[2]] = f[3]
			continue
		}
		if rest, ok := strings.CutPrefix(line, "# HELP "); ok {
			name, text, _ := strings.Cut(rest, " ")
			help[name] = strings.TrimSpace(text)
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		var v float64
		if _, err := fmt.Sscan(line[i+1:], &v); err != nil {
			t.Fatalf("bad sample line %q", line)
		}
		samples[line[:i]] = v
	}
	return types, samples
}

const adminRules = `
rules:
  - name: per-user
    key: user
    limit: { requests: 3, per: 1h }
  - name: dark
    key: ip
    limit: { requests: 1, per: 1h }
    shadow: true
`

// The admin endpoint after traffic: every metric the issue names, with its type; /top
// names the heavy offender of a skewed load; /rules and the health endpoints answer.
func TestE2EAdminMetrics(t *testing.T) {
	dir := shortTempDir(t)
	d := startDaemon(t, "--config", writeFile(t, dir, "rules.yaml", adminRules), "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	id := uint64(0)
	for i := 0; i < 40; i++ { // heavy: 40 requests, 37 rejected
		id++
		c.check(id, 1, "user=heavy", "ip=1.1.1.1")
	}
	for u := 0; u < 10; u++ { // light users: within their limit
		id++
		c.check(id, 1, fmt.Sprint("user=light", u), "ip=2.2.2.2")
	}
	types, samples := scrape(t, base)
	for name, typ := range map[string]string{
		"rlsidecar_checks_total":                                 "counter",
		"rlsidecar_check_duration_seconds":                       "histogram",
		"rlsidecar_keys":                                         "gauge",
		"rlsidecar_evictions_total":                              "counter",
		"rlsidecar_untracked_decisions_total":                    "counter",
		"rlsidecar_degraded_decisions_total":                     "counter",
		"rlsidecar_config_reloads_total":                         "counter",
		"rlsidecar_config_info":                                  "gauge",
		"rlsidecar_config_last_reload_successful":                "gauge",
		"rlsidecar_config_last_reload_success_timestamp_seconds": "gauge",
		"rlsidecar_connections":                                  "gauge",
		"rlsidecar_build_info":                                   "gauge",
		"rlsidecar_top_rejected":                                 "gauge",
	} {
		if types[name] != typ {
			t.Errorf("%s: type %q, want %q", name, types[name], typ)
		}
	}
	if v := samples[`rlsidecar_checks_total{rule="per-user",result="rejected"}`]; v != 37 {
		t.Errorf("per-user rejected = %v, want 37", v)
	}
	if v := samples[`rlsidecar_checks_total{rule="per-user",result="allowed"}`]; v != 13 {
		t.Errorf("per-user allowed = %v, want 13", v)
	}
	if v := samples[`rlsidecar_checks_total{rule="dark",result="shadow_rejected"}`]; v != 39+9 {
		t.Errorf("dark shadow_rejected = %v, want 48", v)
	}
	if v := samples[`rlsidecar_check_duration_seconds_count`]; v != 50 {
		t.Errorf("check_duration count = %v, want 50", v)
	}
	if v := samples[`rlsidecar_connections`]; v != 1 {
		t.Errorf("connections = %v", v)
	}
	// The metric names the heavy client by a keyed hash (--top-labels hashed, the
	// default); /top, on loopback, shows the raw key beside that label.
	var top map[string][]struct {
		Client, Label string
		Count         uint64
	}
	if code, body := httpGet(t, base+"/top"); code != 200 || json.Unmarshal([]byte(body), &top) != nil || len(top["per-user"]) == 0 {
		t.Fatalf("/top: %d %s", code, body)
	}
	heavy := top["per-user"][0]
	if heavy.Client != "user=heavy" || !strings.HasPrefix(heavy.Label, "h:") {
		t.Fatalf("/top per-user: %+v, want user=heavy with its h: label", heavy)
	}
	if v := samples[`rlsidecar_top_rejected{rule="per-user",client="`+heavy.Label+`"}`]; v != 37 {
		t.Errorf("top_rejected %s = %v, want 37", heavy.Label, v)
	}
	for s := range samples {
		if strings.Contains(s, "heavy") {
			t.Errorf("a client key shows in a label: %s", s)
		}
	}
	for s := range samples {
		if strings.Contains(s, "light") {
			t.Errorf("a client who was never rejected shows in a label: %s", s)
		}
	}

	code, body := httpGet(t, base+"/rules")
	if code != 200 || !strings.Contains(body, `"name": "per-user"`) || !strings.Contains(body, `"version"`) {
		t.Fatalf("/rules: %d %s", code, body)
	}
	for _, p := range []string{"/healthz", "/readyz"} {
		if code, body := httpGet(t, base+p); code != 200 {
			t.Fatalf("%s: %d %s", p, code, body)
		}
	}
}

// waitVersion polls /rules until its version is not old (or equals want when given).
func waitReload(t *testing.T, base, old string) string {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		_, body := httpGet(t, base+"/rules")
		var doc struct {
			Version string `json:"version"`
		}
		_ = json.Unmarshal([]byte(body), &doc)
		if doc.Version != old {
			return doc.Version
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("rules not reloaded within 3 s (still %s)", old)
	return ""
}

func rulesVersion(t *testing.T, base string) string {
	_, body := httpGet(t, base+"/rules")
	var doc struct {
		Version string `json:"version"`
	}
	_ = json.Unmarshal([]byte(body), &doc)
	return doc.Version
}

func limitOf(t *testing.T, c *rawConn, id uint64) uint64 {
	t.Helper()
	return c.check(id, 0, "user=probe").Limit
}

func rulesWithLimit(n int) string {
	return fmt.Sprintf("rules:\n  - name: per-user\n    key: user\n    limit: { requests: %d, per: 1h }\n", n)
}

// Reloads: in-place write, atomic rename, a broken file that never replaces the rules in
// force, a symlink swap laid out as a Kubernetes ConfigMap volume, and SIGHUP.
func TestE2EReload(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", rulesWithLimit(1))
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	if l := limitOf(t, c, 1); l != 1 {
		t.Fatalf("limit %d", l)
	}

	// In-place write.
	v := rulesVersion(t, base)
	if err := os.WriteFile(cfg, []byte(rulesWithLimit(2)), 0o644); err != nil {
		t.Fatal(err)
	}
	v = waitReload(t, base, v)
	if l := limitOf(t, c, 2); l != 2 {
		t.Fatalf("after an in-place write: limit %d", l)
	}

	// Atomic rename, as editors save.
	tmp := writeFile(t, dir, ".rules.yaml.swp", rulesWithLimit(3))
	if err := os.Rename(tmp, cfg); err != nil {
		t.Fatal(err)
	}
	v = waitReload(t, base, v)
	if l := limitOf(t, c, 3); l != 3 {
		t.Fatalf("after a rename: limit %d", l)
	}

	// A broken file: the rules in force stay, the error is counted.
	if err := os.WriteFile(cfg, []byte("rules:\n  - name: x\n    kee: user\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		_, samples := scrape(t, base)
		if samples[`rlsidecar_config_reloads_total{result="error"}`] >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("broken file: no reload error counted")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if l := limitOf(t, c, 4); l != 3 || rulesVersion(t, base) != v {
		t.Fatalf("a broken file replaced the rules: limit %d", l)
	}

	// A ConfigMap volume: rules.yaml -> ..data/rules.yaml, ..data -> ..v1; an update
	// writes ..v2 and swaps ..data atomically.
	cm := shortTempDir(t)
	os.Mkdir(filepath.Join(cm, "..v1"), 0o755)
	writeFile(t, filepath.Join(cm, "..v1"), "rules.yaml", rulesWithLimit(5))
	must(t, os.Symlink("..v1", filepath.Join(cm, "..data")))
	must(t, os.Symlink("..data/rules.yaml", filepath.Join(cm, "rules.yaml")))
	d2 := startDaemon(t, "--config", filepath.Join(cm, "rules.yaml"), "--admin", "127.0.0.1:0")
	base2 := "http://" + adminAddr(t, d2)
	c2 := dialRaw(t, d2.socket)
	if l := limitOf(t, c2, 1); l != 5 {
		t.Fatalf("ConfigMap: limit %d", l)
	}
	v2 := rulesVersion(t, base2)
	os.Mkdir(filepath.Join(cm, "..v2"), 0o755)
	writeFile(t, filepath.Join(cm, "..v2"), "rules.yaml", rulesWithLimit(6))
	must(t, os.Symlink("..v2", filepath.Join(cm, "..data_tmp")))
	must(t, os.Rename(filepath.Join(cm, "..data_tmp"), filepath.Join(cm, "..data")))
	waitReload(t, base2, v2)
	if l := limitOf(t, c2, 2); l != 6 {
		t.Fatalf("after a symlink swap: limit %d", l)
	}

	// A link to a file in another directory (etc/rules.yaml -> ../real/rules.yaml), the
	// target edited in place, then replaced by rename, then the link pointed elsewhere.
	top := shortTempDir(t)
	etc, real, other := filepath.Join(top, "etc"), filepath.Join(top, "real"), filepath.Join(top, "other")
	for _, d := range []string{etc, real, other} {
		must(t, os.Mkdir(d, 0o755))
	}
	target := writeFile(t, real, "rules.yaml", rulesWithLimit(10))
	must(t, os.Symlink("../real/rules.yaml", filepath.Join(etc, "rules.yaml")))
	dl := startDaemon(t, "--config", filepath.Join(etc, "rules.yaml"), "--admin", "127.0.0.1:0")
	basel := "http://" + adminAddr(t, dl)
	cl := dialRaw(t, dl.socket)
	vl := rulesVersion(t, basel)
	must(t, os.WriteFile(target, []byte(rulesWithLimit(11)), 0o644))
	vl = waitReload(t, basel, vl)
	if l := limitOf(t, cl, 1); l != 11 {
		t.Fatalf("the link's target written in place: limit %d", l)
	}
	must(t, os.Rename(writeFile(t, real, ".rules.yaml.new", rulesWithLimit(12)), target))
	vl = waitReload(t, basel, vl)
	if l := limitOf(t, cl, 2); l != 12 {
		t.Fatalf("the link's target replaced by rename: limit %d", l)
	}
	writeFile(t, other, "rules.yaml", rulesWithLimit(13))
	must(t, os.Symlink("../other/rules.yaml", filepath.Join(etc, ".tmp-link")))
	must(t, os.Rename(filepath.Join(etc, ".tmp-link"), filepath.Join(etc, "rules.yaml")))
	vl = waitReload(t, basel, vl)
	if l := limitOf(t, cl, 3); l != 13 {
		t.Fatalf("the link pointed to another directory: limit %d", l)
	}
	must(t, os.WriteFile(filepath.Join(other, "rules.yaml"), []byte(rulesWithLimit(14)), 0o644))
	waitReload(t, basel, vl)
	if l := limitOf(t, cl, 4); l != 14 {
		t.Fatalf("the new target written in place: limit %d", l)
	}

	// SIGHUP, with the watcher off.
	d3dir := shortTempDir(t)
	cfg3 := writeFile(t, d3dir, "rules.yaml", rulesWithLimit(7))
	d3 := startDaemon(t, "--config", cfg3, "--admin", "127.0.0.1:0", "--watch=false")
	base3 := "http://" + adminAddr(t, d3)
	c3 := dialRaw(t, d3.socket)
	v3 := rulesVersion(t, base3)
	writeFile(t, d3dir, "rules.yaml", rulesWithLimit(8))
	time.Sleep(300 * time.Millisecond)
	if l := limitOf(t, c3, 1); l != 7 {
		t.Fatalf("reloaded without a watch or a signal: limit %d", l)
	}
	d3.cmd.Process.Signal(syscall.SIGHUP)
	waitReload(t, base3, v3)
	if l := limitOf(t, c3, 2); l != 8 {
		t.Fatalf("after SIGHUP: limit %d", l)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// --config DIR: every *.yaml in it, merged; a file added to it is picked up.
func TestE2EConfigDir(t *testing.T) {
	dir := shortTempDir(t)
	writeFile(t, dir, "users.yaml", rulesWithLimit(4))
	writeFile(t, dir, "plans.yaml", "plans:\n  partner: 10x\n")
	d := startDaemon(t, "--config", dir, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	c := dialRaw(t, d.socket)
	if r := c.check(1, 0, "user=p", "plan=partner"); r.Limit != 40 {
		t.Fatalf("plan from another file: limit %d", r.Limit)
	}
	v := rulesVersion(t, base)
	writeFile(t, dir, "ips.yaml", "rules:\n  - name: per-ip\n    key: ip\n    limit: { requests: 9, per: 1m }\n")
	waitReload(t, base, v)
	if r := c.check(2, 0, "ip=1.2.3.4"); r.Rule != "per-ip" || r.Limit != 9 {
		t.Fatalf("a new file's rule: %+v", r)
	}
	// A *.yml file is a rules file too (it was skipped without a word: its rules never
	// applied), and its edits reload them.
	v = rulesVersion(t, base)
	writeFile(t, dir, "keys.yml", "rules:\n  - name: per-key\n    key: api_key\n    limit: { requests: 7, per: 1m }\n")
	waitReload(t, base, v)
	if r := c.check(3, 0, "api_key=k"); r.Rule != "per-key" || r.Limit != 7 {
		t.Fatalf("a *.yml file's rule: %+v", r)
	}
	v = rulesVersion(t, base)
	writeFile(t, dir, "keys.yml", "rules:\n  - name: per-key\n    key: api_key\n    limit: { requests: 6, per: 1m }\n")
	waitReload(t, base, v)
	if r := c.check(4, 0, "api_key=k"); r.Limit != 6 {
		t.Fatalf("a *.yml file's edit: %+v", r)
	}
}

// Daemons side by side with the default admin address (blue/green on one host, or a
// test harness that starts several): none refuses to start. One that finds the default
// address taken serves checks without an admin endpoint, says so, and takes the address
// once it is freed. An address given explicitly must be had (TestServeFailedStartLeavesNoSocket).
func TestDefaultAdminAddressYields(t *testing.T) {
	const addr = "127.0.0.1:9464"
	held, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("%s is in use on this host, so its hand-over cannot be driven here: %v", addr, err)
	}
	defer held.Close()
	taken := regexp.MustCompile(`admin endpoint: the default address is taken`)
	var ds []*daemonProc
	for i := 0; i < 2; i++ {
		d := startServe(t, filepath.Join(shortTempDir(t), "s.sock"), "--config", writeFile(t, shortTempDir(t), "rules.yaml", rulesWithLimit(5)))
		if l := limitOf(t, dialRaw(t, d.socket), 1); l != 5 {
			t.Fatalf("daemon %d, started beside a taken admin address, answers limit %d", i, l)
		}
		if !taken.MatchString(d.stderr.String()) {
			t.Fatalf("daemon %d does not say its admin address is taken:\n%s", i, d.stderr.String())
		}
		ds = append(ds, d)
	}
	// holder waits until one daemon of ds serves the address, and returns it.
	holder := func(ds []*daemonProc) *daemonProc {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			var got []*daemonProc
			for _, d := range ds {
				if strings.Contains(d.stderr.String(), `msg="admin endpoint" addr=`+addr) {
					got = append(got, d)
				}
			}
			if len(got) > 1 {
				t.Fatalf("%d daemons claim %s", len(got), addr)
			}
			if len(got) == 1 {
				if code, body := httpGet(t, "http://"+addr+"/healthz"); code != 200 {
					t.Fatalf("/healthz on the taken-over address: %d %s", code, body)
				}
				return got[0]
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Fatalf("no daemon took %s after it was freed", addr)
		return nil
	}
	held.Close()
	first := holder(ds)
	// The first holder leaves (the old colour of a blue/green upgrade): the other takes over.
	first.cmd.Process.Signal(syscall.SIGTERM)
	if err := <-first.done; err != nil {
		t.Fatalf("the first holder's exit: %v\n%s", err, first.stderr.String())
	}
	var rest []*daemonProc
	for _, d := range ds {
		if d != first {
			rest = append(rest, d)
		}
	}
	holder(rest)
}

// Only the rules' own files reload them: another file of their directory (the daemon's
// log written beside them, an editor's swap file) does not. Before, each write there
// reloaded, and with stderr logged into the rules' directory a broken file's reload
// errors reloaded it again, forever.
func TestE2EReloadIgnoresOtherFiles(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", rulesWithLimit(1))
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	reloads := func() (ok, failed float64) {
		_, s := scrape(t, base)
		return s[`rlsidecar_config_reloads_total{result="success"}`], s[`rlsidecar_config_reloads_total{result="error"}`]
	}
	time.Sleep(300 * time.Millisecond) // past any reload of the start
	ok0, bad0 := reloads()
	for i := range 5 {
		writeFile(t, dir, "rlsidecar.log", strings.Repeat("a line\n", i+1))
		writeFile(t, dir, ".rules.yaml.swp", "x")
		time.Sleep(150 * time.Millisecond) // past the debounce each time
	}
	time.Sleep(300 * time.Millisecond)
	if ok, bad := reloads(); ok != ok0 || bad != bad0 {
		t.Fatalf("writes to other files of the directory reloaded the rules: %v→%v ok, %v→%v failed", ok0, ok, bad0, bad)
	}
	v := rulesVersion(t, base)
	must(t, os.WriteFile(cfg, []byte(rulesWithLimit(2)), 0o644))
	waitReload(t, base, v)
}

// Reloads when the rules' directory itself is replaced: reached through a directory link
// a deploy points elsewhere (current -> releases/r2), for --config FILE and --config
// DIR; renamed over by a new directory, then edited; deleted and made again. Each kept
// being watched as the directory it was at the start, so every later change went unseen.
func TestE2EReloadDirectoryReplaced(t *testing.T) {
	n := 0
	id := 0
	next := func() int { n++; return n }
	check := func(t *testing.T, d *daemonProc, base string, v *string, want int, what string) {
		t.Helper()
		*v = waitReload(t, base, *v)
		id++
		if l := limitOf(t, dialRaw(t, d.socket), uint64(id)); l != uint64(want) {
			t.Fatalf("%s: limit %d, want %d", what, l, want)
		}
	}
	start := func(t *testing.T, config string) (*daemonProc, string, string) {
		d := startDaemon(t, "--config", config, "--admin", "127.0.0.1:0")
		base := "http://" + adminAddr(t, d)
		return d, base, rulesVersion(t, base)
	}

	t.Run("deploy link", func(t *testing.T) {
		for _, asDir := range []bool{false, true} {
			top := shortTempDir(t)
			r1, r2 := filepath.Join(top, "releases", "r1"), filepath.Join(top, "releases", "r2")
			must(t, os.MkdirAll(r1, 0o755))
			must(t, os.MkdirAll(r2, 0o755))
			writeFile(t, r1, "rules.yaml", rulesWithLimit(next()))
			must(t, os.Symlink("releases/r1", filepath.Join(top, "current")))
			config := filepath.Join(top, "current", "rules.yaml")
			if asDir {
				config = filepath.Join(top, "current")
			}
			d, base, v := start(t, config)
			want := next()
			writeFile(t, r2, "rules.yaml", rulesWithLimit(want))
			must(t, os.Symlink("releases/r2", filepath.Join(top, "current.tmp")))
			must(t, os.Rename(filepath.Join(top, "current.tmp"), filepath.Join(top, "current")))
			check(t, d, base, &v, want, "after the deploy link's swap")
			want = next()
			must(t, os.WriteFile(filepath.Join(r2, "rules.yaml"), []byte(rulesWithLimit(want)), 0o644))
			check(t, d, base, &v, want, "the new release's file written")
		}
	})

	// The same deploy link met inside the target of a link the config path names
	// (etc/rules.yaml -> app/current/rules.yaml; etc/rules.d -> app/current/rules.d):
	// the directory holding current was not watched, no swap was seen, and after a
	// SIGHUP the next was missed again.
	t.Run("deploy link inside a link's target", func(t *testing.T) {
		for _, asDir := range []bool{false, true} {
			top := shortTempDir(t)
			etc := filepath.Join(top, "etc")
			must(t, os.MkdirAll(etc, 0o755))
			rel := func(r string) string {
				if asDir {
					return filepath.Join(top, "app", "releases", r, "rules.d")
				}
				return filepath.Join(top, "app", "releases", r)
			}
			for _, r := range []string{"r1", "r2", "r3"} {
				must(t, os.MkdirAll(rel(r), 0o755))
			}
			writeFile(t, rel("r1"), "rules.yaml", rulesWithLimit(next()))
			must(t, os.Symlink("releases/r1", filepath.Join(top, "app", "current")))
			config := filepath.Join(etc, "rules.yaml")
			must(t, os.Symlink(filepath.Join(top, "app", "current", "rules.yaml"), config))
			if asDir {
				config = filepath.Join(etc, "rules.d")
				must(t, os.Symlink(filepath.Join(top, "app", "current", "rules.d"), config))
			}
			d, base, v := start(t, config)
			for _, r := range []string{"r2", "r3"} {
				want := next()
				writeFile(t, rel(r), "rules.yaml", rulesWithLimit(want))
				must(t, os.Symlink(filepath.Join("releases", r), filepath.Join(top, "app", "current.tmp")))
				must(t, os.Rename(filepath.Join(top, "app", "current.tmp"), filepath.Join(top, "app", "current")))
				check(t, d, base, &v, want, "after the swap of current to "+r)
			}
			want := next()
			must(t, os.WriteFile(filepath.Join(rel("r3"), "rules.yaml"), []byte(rulesWithLimit(want)), 0o644))
			check(t, d, base, &v, want, "the new release's file written")
		}
	})

	// inDir starts a daemon on top/rules/rules.yaml.
	inDir := func(t *testing.T) (top, dir string, d *daemonProc, base, v string) {
		top = shortTempDir(t)
		dir = filepath.Join(top, "rules")
		must(t, os.Mkdir(dir, 0o755))
		writeFile(t, dir, "rules.yaml", rulesWithLimit(next()))
		d, base, v = start(t, filepath.Join(dir, "rules.yaml"))
		return top, dir, d, base, v
	}

	t.Run("renamed over", func(t *testing.T) {
		top, dir, d, base, v := inDir(t)
		want := next()
		fresh := filepath.Join(top, "rules.new")
		must(t, os.Mkdir(fresh, 0o755))
		writeFile(t, fresh, "rules.yaml", rulesWithLimit(want))
		must(t, os.Rename(dir, filepath.Join(top, "rules.old")))
		must(t, os.Rename(fresh, dir))
		check(t, d, base, &v, want, "the directory renamed over")
		want = next()
		must(t, os.Rename(writeFile(t, dir, ".t", rulesWithLimit(want)), filepath.Join(dir, "rules.yaml")))
		check(t, d, base, &v, want, "then its file replaced by rename")
		want = next()
		must(t, os.WriteFile(filepath.Join(dir, "rules.yaml"), []byte(rulesWithLimit(want)), 0o644))
		check(t, d, base, &v, want, "then written in place")
	})

	t.Run("deleted and made again", func(t *testing.T) {
		_, dir, d, base, v := inDir(t)
		must(t, os.RemoveAll(dir))
		time.Sleep(300 * time.Millisecond) // the daemon sees it gone (and keeps its rules)
		must(t, os.Mkdir(dir, 0o755))
		want := next()
		writeFile(t, dir, "rules.yaml", rulesWithLimit(want))
		check(t, d, base, &v, want, "the directory made again")
		want = next()
		must(t, os.WriteFile(filepath.Join(dir, "rules.yaml"), []byte(rulesWithLimit(want)), 0o644))
		check(t, d, base, &v, want, "then written in place")
	})

	// A deploy that deletes the tree above the rules' directory and copies the new one
	// in, slower than the watch's debounce: no watched directory could see it come back
	// (the one holding the rules' directory went with it), and the rules in force stayed
	// until a SIGHUP, every later edit unseen.
	t.Run("tree above deleted and made again", func(t *testing.T) {
		top := shortTempDir(t)
		dir := filepath.Join(top, "current", "config")
		must(t, os.MkdirAll(dir, 0o755))
		writeFile(t, dir, "rules.yaml", rulesWithLimit(next()))
		d, base, v := start(t, filepath.Join(dir, "rules.yaml"))
		must(t, os.RemoveAll(filepath.Join(top, "current")))
		time.Sleep(300 * time.Millisecond) // the daemon sees it gone (and keeps its rules)
		must(t, os.MkdirAll(dir, 0o755))
		want := next()
		writeFile(t, dir, "rules.yaml", rulesWithLimit(want))
		check(t, d, base, &v, want, "the tree made again")
		want = next()
		must(t, os.WriteFile(filepath.Join(dir, "rules.yaml"), []byte(rulesWithLimit(want)), 0o644))
		check(t, d, base, &v, want, "then written in place")
	})
}

// serve logs what validate warns of, at start and after a reload: an operator who
// skipped validate still sees a rule set with no rules.
func TestE2EServeLogsRuleWarnings(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", "rules: []\n")
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, d)
	if logs := d.stderr.String(); !strings.Contains(logs, "no rules: every request is allowed") {
		t.Fatalf("no warning at start:\n%s", logs)
	}
	v := rulesVersion(t, base)
	must(t, os.WriteFile(cfg, []byte("rules:\n  - name: r\n    match: { path: \"/v1/{id}\" }\n    key: user\n    limit: { requests: 1, per: 1s }\n"), 0o644))
	waitReload(t, base, v)
	deadline := time.Now().Add(3 * time.Second)
	for !strings.Contains(d.stderr.String(), "matches no request path") {
		if time.Now().After(deadline) {
			t.Fatalf("no warning after the reload:\n%s", d.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A file written in place is empty for a moment (truncated, its bytes not there yet):
// that moment is looked at again, not reported as a broken file (a reload error, and
// the alert on it for ten minutes), as long as the bytes come within half a second.
// The same for a file of a --config directory (before, the look again applied to a
// --config file only: a directory's file written in place counted a failed reload).
func TestE2EReloadEmptyWhileWritten(t *testing.T) {
	for _, asDir := range []bool{false, true} {
		t.Run(map[bool]string{false: "file", true: "directory"}[asDir], func(t *testing.T) {
			dir := shortTempDir(t)
			file := writeFile(t, dir, "rules.yaml", rulesWithLimit(1))
			cfg := file
			if asDir {
				cfg = dir
			}
			d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0")
			base := "http://" + adminAddr(t, d)
			v := rulesVersion(t, base)
			f, err := os.OpenFile(file, os.O_WRONLY|os.O_TRUNC, 0)
			must(t, err)
			// The writer pauses past the watcher's debounce (100 ms): it fires on the
			// truncation and finds the file empty. The daemon looks again for 5 more
			// debounces before it reports an empty file broken; at 250 ms, a writer slowed
			// by a loaded machine outlasted that once (load 5).
			time.Sleep(150 * time.Millisecond)
			_, err = f.WriteString(rulesWithLimit(2))
			must(t, err)
			must(t, f.Close())
			waitReload(t, base, v)
			if l := limitOf(t, dialRaw(t, d.socket), 1); l != 2 {
				t.Fatalf("limit %d", l)
			}
			if _, samples := scrape(t, base); samples[`rlsidecar_config_reloads_total{result="error"}`] != 0 {
				t.Fatalf("the empty moment counted as a reload error:\n%s", d.stderr.String())
			}
		})
	}
}
