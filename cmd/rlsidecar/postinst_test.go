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
	calls, _ := runPostinstWith(t, "", enabled, args...)
	return calls
}

// runPostinstWith is runPostinst with settings as /etc/default/rlsidecar (none when
// empty) and the daemon built for these tests as /usr/bin/rlsidecar; it also returns
// what the script printed.
func runPostinstWith(t *testing.T, settings string, enabled []string, args ...string) (calls []string, out string) {
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
	defaults := filepath.Join(dir, "no-such-settings-file")
	if settings != "" {
		defaults = writeFile(t, dir, "settings", settings)
	}
	s = strings.ReplaceAll(s, "/etc/default/rlsidecar", defaults)
	s = strings.ReplaceAll(s, "/usr/bin/rlsidecar", binary)
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
		// `systemctl show` prints $POSTINST_TEST_SHOW: the unit's properties a test gives.
		"systemctl": "#!/bin/sh\necho \"$*\" >>" + log + "\n" +
			"case \"$*\" in *is-enabled*) " + isEnabled + " ;; show*) printf '%s\\n' \"$POSTINST_TEST_SHOW\" ;; esac\nexit 0\n",
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
	o, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("postinst %v: %v\n%s", args, err, o)
	}
	b, err := os.ReadFile(log)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(b)), "\n"), string(o)
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

// An upgrade does not restart the daemon onto a rules file it would refuse: a running
// daemon keeps the rules in force through a broken edit (RlsidecarConfigReloadErrors),
// but a new one refuses the file and stops, so systemd restarts it until it gives up, and
// every gateway decides by its failure policy meanwhile. Before, postinst ran `systemctl
// try-restart rlsidecar.service` whatever the file held, so `apt upgrade` turned a broken
// edit into an outage. The operator is told why, and a file the daemon takes (quoted or
// not, as EnvironmentFile= allows) or no file named still restarts it.
func TestPostinstRestartsOnlyOntoRulesItTakes(t *testing.T) {
	dir := shortTempDir(t)
	broken := writeFile(t, dir, "broken.yaml", "rules:\n  - name: per-user\n    key: user\n    limit: { requests: many, per: 1h }\n")
	good := writeFile(t, dir, "good.yaml", rulesWithLimit(5))
	restarted := func(calls []string) bool { return slices.Contains(calls, "try-restart rlsidecar.service") }
	socket := []string{"rlsidecar.socket"}

	calls, out := runPostinstWith(t, "# settings\n#RLSIDECAR_CONFIG=/nowhere\nRLSIDECAR_CONFIG="+broken+"\n", socket, "configure", "0.1.0")
	if restarted(calls) {
		t.Errorf("upgrade with a rules file the daemon refuses: restarted anyway; systemctl calls: %q\n%s", calls, out)
	}
	if !strings.Contains(out, "not restarting rlsidecar.service") || !strings.Contains(out, "broken.yaml:4") {
		t.Errorf("upgrade with a broken rules file: the output does not say why it did not restart:\n%s", out)
	}
	if !slices.Contains(calls, "start rlsidecar.socket") {
		t.Errorf("upgrade with a broken rules file: the socket is not started; systemctl calls: %q", calls)
	}
	for _, settings := range []string{"RLSIDECAR_CONFIG=" + good + "\n", "  RLSIDECAR_CONFIG=\"" + good + "\"\n", "RLSIDECAR_LOG_LEVEL=info\n", ""} {
		if calls, out := runPostinstWith(t, settings, socket, "configure", "0.1.0"); !restarted(calls) {
			t.Errorf("upgrade with settings %q: not restarted; systemctl calls: %q\n%s", settings, calls, out)
		}
	}
}

// A daemon given no Redis refuses at start a rule that needs one (mode: global), where
// `rlsidecar validate` alone only notes it and exits 0: before, postinst asked validate
// without --no-redis, so on a host with no Redis whose running daemon had refused such an
// edit (RlsidecarConfigReloadErrors), an upgrade restarted it onto the file, and the new
// daemon stopped at start. Redis is counted as given when the settings file sets it, or
// the unit does (a drop-in's Environment= or ExecStart=, as `systemctl show` prints
// them); the rules that need it then restart the daemon as before.
func TestPostinstRestartsOnlyOntoRulesItTakesWithoutRedis(t *testing.T) {
	dir := shortTempDir(t)
	global := writeFile(t, dir, "global.yaml", "rules:\n  - name: login\n    key: ip\n    limit: { requests: 5, per: 1m }\n    mode: global\n")
	restarted := func(calls []string) bool { return slices.Contains(calls, "try-restart rlsidecar.service") }
	socket := []string{"rlsidecar.socket"}

	t.Setenv("POSTINST_TEST_SHOW", "Environment=GOMEMLIMIT=2560MiB\nExecStart={ path=/usr/bin/rlsidecar ; argv[]=/usr/bin/rlsidecar serve --redis-timeout 50ms ; ignore_errors=no }")
	calls, out := runPostinstWith(t, "RLSIDECAR_CONFIG="+global+"\n#RLSIDECAR_REDIS=redis://redis.internal:6379/0\nRLSIDECAR_REDIS_CLUSTER=\n", socket, "configure", "0.1.0")
	if restarted(calls) {
		t.Errorf("upgrade with a mode: global rule and no Redis: restarted anyway; systemctl calls: %q\n%s", calls, out)
	}
	if !strings.Contains(out, "not restarting rlsidecar.service") || !strings.Contains(out, "needs a Redis store") {
		t.Errorf("upgrade with a mode: global rule and no Redis: the output does not say why it did not restart:\n%s", out)
	}

	for _, c := range []struct{ settings, show string }{
		{"RLSIDECAR_CONFIG=" + global + "\nRLSIDECAR_REDIS=redis://redis.internal:6379/0\n", ""},
		{"RLSIDECAR_CONFIG=" + global + "\nRLSIDECAR_REDIS_CLUSTER='10.0.0.5:6379,10.0.0.6:6379'\n", ""},
		{"RLSIDECAR_CONFIG=" + global + "\n", "Environment=GOMEMLIMIT=2560MiB RLSIDECAR_REDIS=redis://redis.internal:6379/0"},
		{"RLSIDECAR_CONFIG=" + global + "\n", "ExecStart={ path=/usr/bin/rlsidecar ; argv[]=/usr/bin/rlsidecar serve --redis redis://redis.internal:6379/0 ; ignore_errors=no }"},
		{"RLSIDECAR_CONFIG=" + global + "\n", "ExecStart={ path=/usr/bin/rlsidecar ; argv[]=/usr/bin/rlsidecar serve --redis-cluster=10.0.0.5:6379 ; ignore_errors=no }"},
	} {
		t.Setenv("POSTINST_TEST_SHOW", c.show)
		if calls, out := runPostinstWith(t, c.settings, socket, "configure", "0.1.0"); !restarted(calls) {
			t.Errorf("upgrade with Redis given (settings %q, unit %q): not restarted; systemctl calls: %q\n%s", c.settings, c.show, calls, out)
		}
	}
}

// runPostrm runs deploy/debian/postrm with args, /etc/rlsidecar pointed at etc, as if
// systemd did not run (the purge of the files does not depend on it), with
// deb-systemd-helper and systemctl replaced by stubs that do nothing.
func runPostrm(t *testing.T, etc string, args ...string) {
	t.Helper()
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("needs sh")
	}
	script, err := os.ReadFile("../../deploy/debian/postrm")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	s := strings.ReplaceAll(string(script), "/etc/rlsidecar", etc)
	s = strings.ReplaceAll(s, "/run/systemd/system", filepath.Join(dir, "no-systemd"))
	path := filepath.Join(dir, "postrm")
	if err := os.WriteFile(path, []byte(s), 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"deb-systemd-helper", "systemctl"} {
		if err := os.WriteFile(filepath.Join(bin, name), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(sh, append([]string{path}, args...)...)
	cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("postrm %v: %v\n%s", args, err, out)
	}
}

// `dpkg --purge rlsidecar` removes everything but the user (docs/operations.md), but the
// Redis password file the operator made as the docs say (/etc/rlsidecar/redis-password,
// kept the service user's by postinst) is no file of the package's: dpkg left it, a
// credential, and /etc/rlsidecar with it. postrm removes it on purge, and the directory
// when nothing else is in it; a remove (not a purge) keeps it, and other files an
// operator put there (a TLS key) stay, as dpkg says.
func TestPostrmPurgeRemovesThePassword(t *testing.T) {
	for _, c := range []struct {
		action  string
		others  []string
		keepPW  bool
		keepDir bool
	}{
		{"purge", nil, false, false},
		{"purge", []string{"redis-tls.key"}, false, true},
		{"remove", nil, true, true},
	} {
		etc := filepath.Join(t.TempDir(), "rlsidecar")
		if err := os.Mkdir(etc, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, f := range append([]string{"redis-password"}, c.others...) {
			if err := os.WriteFile(filepath.Join(etc, f), []byte("secret"), 0o400); err != nil {
				t.Fatal(err)
			}
		}
		runPostrm(t, etc, c.action)
		_, err := os.Stat(filepath.Join(etc, "redis-password"))
		if kept := err == nil; kept != c.keepPW {
			t.Errorf("postrm %s with %q beside it: the password file kept: %v, want %v", c.action, c.others, kept, c.keepPW)
		}
		_, err = os.Stat(etc)
		if kept := err == nil; kept != c.keepDir {
			t.Errorf("postrm %s with %q beside it: the directory kept: %v, want %v", c.action, c.others, kept, c.keepDir)
		}
		for _, f := range c.others {
			if _, err := os.Stat(filepath.Join(etc, f)); err != nil {
				t.Errorf("postrm %s removed the operator's %s: %v", c.action, f, err)
			}
		}
	}
}
