package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
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
