package main

import (
	"strings"
	"testing"
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
