package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// runPostinst runs deploy/debian/postinst with args as if systemd ran (its
// /run/systemd/system test pointed at a directory that exists), with systemctl,
// deb-systemd-helper and getent replaced by stubs, and returns the systemctl calls it
// made, one a line. `systemctl is-enabled UNIT` says yes for the units in enabled only.
func runPostinst(t *testing.T, enabled []string, args ...string) []string {
	t.Helper()
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("needs sh")
	}
	dir := t.TempDir()
	script, err := os.ReadFile("../../deploy/debian/postinst")
	if err != nil {
		t.Fatal(err)
	}
	run := filepath.Join(dir, "run-systemd-system")
	if err := os.Mkdir(run, 0o755); err != nil {
		t.Fatal(err)
	}
	s := strings.ReplaceAll(string(script), "/run/systemd/system", run)
	s = strings.ReplaceAll(s, "/etc/rlsidecar/redis-password", filepath.Join(dir, "no-such-password-file"))
	if err := os.WriteFile(filepath.Join(dir, "postinst"), []byte(s), 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(dir, "systemctl.log")
	isEnabled := "exit 1"
	for _, u := range enabled {
		isEnabled = "case \"$*\" in *\" " + u + "\") exit 0 ;; esac; " + isEnabled
	}
	stubs := map[string]string{
		"systemctl": "#!/bin/sh\necho \"$*\" >>" + log + "\n" +
			"case \"$*\" in *is-enabled*) " + isEnabled + " ;; esac\nexit 0\n",
		"deb-systemd-helper": "#!/bin/sh\nexit 0\n",
		"getent":             "#!/bin/sh\nexit 0\n", // the user and group exist
	}
	for name, body := range stubs {
		if err := os.WriteFile(filepath.Join(bin, name), []byte(body), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(sh, append([]string{filepath.Join(dir, "postinst")}, args...)...)
	cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("postinst %v: %v\n%s", args, err, out)
	}
	b, err := os.ReadFile(log)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

// The package installed again after `dpkg -r` (not a purge) is configured as an upgrade
// from the removed version ("configure 0.1.0"), with the socket its prerm stopped: the
// postinst starts the socket again when it is enabled. Before, it only ran `systemctl
// try-restart rlsidecar.service`, which does nothing for a stopped service: the socket
// stayed down, and every gateway was refused (no such file) until a reboot or a
// `systemctl start rlsidecar.socket` by hand. A fresh install starts it too, an upgrade
// restarts the service behind it, and a socket the operator disabled is left stopped.
func TestPostinstStartsTheSocket(t *testing.T) {
	has := func(calls []string, want string) bool {
		for _, c := range calls {
			if strings.Contains(c, want) {
				return true
			}
		}
		return false
	}
	if calls := runPostinst(t, []string{"rlsidecar.socket"}, "configure", ""); !has(calls, "start rlsidecar.socket") {
		t.Errorf("fresh install: the socket is not started; systemctl calls: %q", calls)
	}
	calls := runPostinst(t, []string{"rlsidecar.socket"}, "configure", "0.1.0")
	if !has(calls, "start rlsidecar.socket") {
		t.Errorf("installed again after a remove (configure 0.1.0): the stopped socket is not started; systemctl calls: %q", calls)
	}
	if !has(calls, "try-restart rlsidecar.service") {
		t.Errorf("upgrade: the service is not restarted; systemctl calls: %q", calls)
	}
	if calls := runPostinst(t, nil, "configure", "0.1.0"); has(calls, "start rlsidecar.socket") {
		t.Errorf("upgrade with the socket disabled by the operator: it is started anyway; systemctl calls: %q", calls)
	}
}

// Envoy's socket, enabled by the operator (docs/operations.md), is started again too when
// the package is installed again after `dpkg -r`, whose prerm stopped it. Before, only
// rlsidecar.socket was: the Envoy socket stayed down, its file removed (RemoveOnStop=),
// and on a host whose only gateway is Envoy nothing started the service, whose Wants=
// would have started it: every rate limit call Envoy made failed until a reboot or a
// `systemctl start rlsidecar-envoy.socket` by hand. Left stopped when not enabled.
func TestPostinstStartsTheEnvoySocket(t *testing.T) {
	has := func(calls []string, want string) bool {
		return slices.ContainsFunc(calls, func(c string) bool { return strings.HasSuffix(c, want) })
	}
	calls := runPostinst(t, []string{"rlsidecar.socket", "rlsidecar-envoy.socket"}, "configure", "0.1.0")
	if !has(calls, "start rlsidecar-envoy.socket") {
		t.Errorf("installed again after a remove, Envoy's socket enabled: it is not started; systemctl calls: %q", calls)
	}
	if !has(calls, "start rlsidecar.socket") {
		t.Errorf("installed again after a remove: rlsidecar.socket is not started; systemctl calls: %q", calls)
	}
	if calls := runPostinst(t, []string{"rlsidecar.socket"}, "configure", "0.1.0"); has(calls, "start rlsidecar-envoy.socket") {
		t.Errorf("Envoy's socket not enabled: it is started anyway; systemctl calls: %q", calls)
	}
}
