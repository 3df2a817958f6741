package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// commandFlags returns the flags of every rlsidecar command, as their --help lists them.
func commandFlags(t *testing.T) map[string]bool {
	t.Helper()
	flags := map[string]bool{}
	line := regexp.MustCompile(`(?m)^  -([a-z][a-z0-9-]*)`)
	for _, cmd := range []string{"serve", "check", "validate", "reload", "replay", "import-envoy"} {
		_, help, code := runInProcess(cmd, "--help")
		if code != exitOK {
			t.Fatalf("%s --help: exit %d", cmd, code)
		}
		n := 0
		for _, m := range line.FindAllStringSubmatch(help, -1) {
			flags[m[1]] = true
			n++
		}
		if n == 0 {
			t.Fatalf("%s --help lists no flags:\n%s", cmd, help)
		}
	}
	return flags
}

// The flags the operator's documents name are flags of rlsidecar: a flag renamed or
// removed must take its documentation with it, or an operator copying a command line
// from the README or docs/operations.md gets "flag provided but not defined". The same
// for the settings of /etc/default/rlsidecar, each RLSIDECAR_<FLAG> of serve's flags.
func TestDocsNameOnlyRealFlags(t *testing.T) {
	flags := commandFlags(t)
	// Flags of the other programs the documents show: redis-server and redis-cli, curl,
	// journalctl, dpkg.
	others := map[string]bool{"port": true, "tls-port": true, "tls-cert-file": true, "tls-key-file": true,
		"tls-ca-cert-file": true, "tls-auth-clients": true, "cluster": true, "cluster-replace": true,
		"latency": true, "http2-prior-knowledge": true, "since": true, "purge": true, "help": true}
	flagRef := regexp.MustCompile("(?:^|[ `(])--([a-z][a-z0-9-]*[a-z0-9])(-\\*)?")
	hasPrefix := func(prefix string) bool { // a family of flags, "--redis-tls-*"
		for f := range flags {
			if strings.HasPrefix(f, prefix+"-") {
				return true
			}
		}
		return false
	}
	for _, doc := range []string{"../../README.md", "../../docs/operations.md"} {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for i, l := range strings.Split(string(b), "\n") {
			for _, m := range flagRef.FindAllStringSubmatch(l, -1) {
				if name := m[1]; m[2] != "" && !hasPrefix(name) || m[2] == "" && !flags[name] && !others[name] {
					t.Errorf("%s:%d: %s is no flag of rlsidecar (nor of the other programs this test knows)", doc, i+1, strings.TrimLeft(m[0], " `("))
				}
			}
		}
	}

	// /etc/default/rlsidecar: every setting it shows, commented out or not.
	b, err := os.ReadFile("../../deploy/debian/default")
	if err != nil {
		t.Fatal(err)
	}
	setting := regexp.MustCompile(`(?m)^#?(RLSIDECAR_[A-Z0-9_]+)=`)
	n := 0
	for _, m := range setting.FindAllStringSubmatch(string(b), -1) {
		n++
		name := strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(m[1], "RLSIDECAR_")), "_", "-")
		if !flags[name] {
			t.Errorf("deploy/debian/default: %s is no flag's variable (--%s)", m[1], name)
		}
	}
	if n < 10 {
		t.Errorf("found %d settings in deploy/debian/default; the test reads it wrong", n)
	}
}

// Every metric the README and docs/operations.md name (`rlsidecar_...` in backticks; a
// family such as rlsidecar_hybrid_* by its prefix) is exported by a daemon with Redis,
// Envoy's API and rules of every kind: a metric renamed must take its documentation,
// which operators' dashboards and alerts are written from, with it.
func TestDocsNameOnlyRealMetrics(t *testing.T) {
	named := map[string]string{} // metric → where
	ref := regexp.MustCompile("`(rlsidecar_[a-z_]+)")
	for _, doc := range []string{"../../README.md", "../../docs/operations.md"} {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for i, l := range strings.Split(string(b), "\n") {
			for _, m := range ref.FindAllStringSubmatch(l, -1) {
				if _, ok := named[m[1]]; !ok {
					named[m[1]] = fmt.Sprintf("%s:%d", doc, i+1)
				}
			}
		}
	}
	if len(named) < 25 {
		t.Fatalf("found %d metrics named in the documents; the test reads them wrong", len(named))
	}

	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: rate
    key: user
    limit: { requests: 2, per: 1h }
    warn_at: 0.5
  - name: exports
    key: user
    concurrency: { max: 2, lease: 30s }
  - name: login
    match: { path: /login }
    key: ip
    limit: { requests: 1, per: 1m }
    penalty: { after: 2, within: 1m, ban: 10m }
  - name: smooth
    key: ip
    mode: local
    limit: { requests: 1, per: 1s }
    delay: 5s
`)
	d := startDaemon(t, "--config", cfg, "--redis", "redis://"+srv.Addr, "--admin", "127.0.0.1:0",
		"--envoy-rls", "unix:"+filepath.Join(dir, "envoy.sock"))
	// A check, so that a hybrid sync has something to carry: the histogram of hybrid
	// syncs has its first sample then.
	dialRaw(t, d.socket).check(1, 1, "user=u", "ip=192.0.2.1", "path=/login")
	base := "http://" + adminAddr(t, d)
	missing := func() []string {
		types, _ := scrape(t, base)
		var out []string
		for name, where := range named {
			found := types[name] != ""
			if strings.HasSuffix(name, "_") { // a family: rlsidecar_hybrid_*
				for f := range types {
					found = found || strings.HasPrefix(f, name)
				}
			}
			if !found {
				out = append(out, where+": "+name)
			}
		}
		return out
	}
	// The first sync is due 100 ms after the check: wait for it, generously, before judging.
	deadline := time.Now().Add(10 * time.Second)
	m := missing()
	for len(m) > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		m = missing()
	}
	for _, w := range m {
		t.Errorf("%s is not exported by a running daemon", w)
	}
}

// Every Go test, benchmark and fuzz target the documents cite (TestX, or a prefix of
// several in a -run pattern) is one: the documents point readers at tests as proof of
// a claim, and a test renamed or removed must take its citations with it. (None of the
// 397 names cited was stale when this was written, but nothing kept them so.)
func TestDocsNameOnlyRealTests(t *testing.T) {
	defined := map[string]bool{}
	def := regexp.MustCompile(`(?m)^func ((?:Test|Benchmark|Fuzz)\w*)\(`)
	err := filepath.WalkDir("../..", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) && path != "../.." {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, "_test.go") {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for _, m := range def.FindAllSubmatch(b, -1) {
				defined[string(m[1])] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(defined) < 500 {
		t.Fatalf("found %d Go tests in the tree; the test reads it wrong", len(defined))
	}
	exists := func(name string) bool {
		if defined[name] {
			return true
		}
		for d := range defined {
			if strings.HasPrefix(d, name) {
				return true
			}
		}
		return false
	}
	docs, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	clients, err := filepath.Glob("../../clients/*/README.md")
	if err != nil {
		t.Fatal(err)
	}
	docs = append(append(docs, clients...), "../../README.md", "../../proto/PROTOCOL.md")
	ref := regexp.MustCompile(`\b(?:Test|Benchmark|Fuzz)[A-Z0-9]\w*`)
	cited := 0
	for _, doc := range docs {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for i, l := range strings.Split(string(b), "\n") {
			for _, name := range ref.FindAllString(l, -1) {
				cited++
				if !exists(name) {
					t.Errorf("%s:%d: %s is no Go test, benchmark or fuzz target in the tree (nor the start of one's name)", doc, i+1, name)
				}
			}
		}
	}
	if cited < 300 {
		t.Fatalf("found %d tests cited in the documents; the test reads them wrong", cited)
	}
}
