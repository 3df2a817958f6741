package main

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// validate reports rules that can never have an effect as warnings on stderr and still
// exits 0; a clean file has none.
func TestValidateWarnings(t *testing.T) {
	dir := t.TempDir()
	cfg := writeFile(t, dir, "rules.yaml", `rules:
  - name: a
    match: { method: [GET, HEAD], path: "/v1/**" }
    key: user
    limit: { requests: 10, per: 1m }
  - name: b
    match: { path: "/v1/**", method: [HEAD, GET] }
    key: user
    limit: { requests: 100, per: 1m }
  - name: c
    match: { path: "/users/{id}" }
    key: user
    limit: { requests: 100, per: 1m }
  - name: d
    match: { method: GET, path: /export }
    key: user
    limit: { requests: 100, per: 1m }
`)
	out, errOut, code := runInProcess("validate", "--config", cfg)
	if code != exitOK || !strings.Contains(out, "4 rules") || !strings.Contains(out, "3 warnings") {
		t.Fatalf("code %d out %q err %q", code, out, errOut)
	}
	lines := strings.Split(strings.TrimSpace(errOut), "\n")
	if len(lines) != 3 ||
		!strings.HasPrefix(lines[0], "warning: "+cfg+`:6: rule "b": never decides: rule "a" (line 2)`) ||
		!strings.HasPrefix(lines[1], "warning: "+cfg+`:10: rule "c" match.path: "/users/{id}" matches no request path`) ||
		!strings.HasPrefix(lines[2], "warning: "+cfg+`:14: rule "d" match.method: GET without HEAD`) {
		t.Fatalf("stderr:\n%s", errOut)
	}
	clean := writeFile(t, dir, "clean.yaml", "rules:\n  - { name: a, key: user, limit: { requests: 1, per: 1s } }\n")
	if out, errOut, code := runInProcess("validate", "--config", clean); code != exitOK || errOut != "" || !strings.Contains(out, "0 warnings") {
		t.Fatalf("clean: code %d out %q err %q", code, out, errOut)
	}
}

// The daemon logs at most maxLoggedWarnings of a rule set's warnings at a load, then how
// many more there are; validate still lists them all. Before, 20,000 rules each with GET
// and not HEAD logged 20,000 warnings at every reload.
func TestServeWarningsCapped(t *testing.T) {
	dir := t.TempDir()
	var b strings.Builder
	b.WriteString("rules:\n")
	const n = 100
	for i := range n {
		fmt.Fprintf(&b, "  - { name: r%d, match: { method: GET, path: /r%d }, key: user, limit: { requests: 10, per: 1m } }\n", i, i)
	}
	cfg := writeFile(t, dir, "rules.yaml", b.String())
	if _, errOut, code := runInProcess("validate", "--config", cfg); code != exitOK || strings.Count(errOut, "GET without HEAD") != n {
		t.Fatalf("validate: code %d, %d warnings listed, want %d", code, strings.Count(errOut, "GET without HEAD"), n)
	}
	d := startDaemon(t, "--config", cfg)
	more := fmt.Sprintf("%d more warnings not logged", n-maxLoggedWarnings)
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(d.stderr.String(), more) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q in the daemon's log:\n%s", more, d.stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := strings.Count(d.stderr.String(), "GET without HEAD"); got != maxLoggedWarnings {
		t.Fatalf("%d warnings logged, want %d", got, maxLoggedWarnings)
	}
}
