package main

import (
	"bufio"
	"errors"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/rlsidecar/rlsidecar/envoyrls"
)

// The Envoy API under socket activation: systemd-socket-activate passes the msgpack
// socket and the Envoy one, named as the units name them (FileDescriptorName=rlsidecar,
// =envoy); the daemon serves Envoy's API on the one named envoy, in place of the
// --envoy-rls it was given (with a warning), says so in STATUS=, and leaves both socket
// files, which are not its own, in place when it stops.
func TestE2ESocketActivationEnvoy(t *testing.T) {
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) { testE2ESocketActivationEnvoy(t, tr) })
	}
}

func testE2ESocketActivationEnvoy(t *testing.T, transport string) {
	dir := shortTempDir(t)
	sock, envoySock, elsewhere := filepath.Join(dir, "s.sock"), filepath.Join(dir, "envoy.sock"), filepath.Join(dir, "elsewhere.sock")
	rulesFile := writeFile(t, dir, "rules.yaml", envoyRules)
	n := listenNotify(t)
	t.Setenv("NOTIFY_SOCKET", n.path)
	a := startActivator(t, []string{"-l", sock, "-l", envoySock, "--fdname=rlsidecar:" + envoyFDName, "-E", "NOTIFY_SOCKET"},
		[]string{sock, envoySock}, binary, "serve", "--admin=", "--config", rulesFile, "--watch=false",
		"--envoy-rls", "unix:"+elsewhere, "--envoy-rls-transport", transport)

	// Envoy's first call starts the daemon.
	conn, err := grpc.NewClient("unix://"+envoySock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	f := &rlsFixture{rls: rlsv3.NewRateLimitServiceClient(conn), hc: healthpb.NewHealthClient(conn)}
	checkStatuses(t, f.call(t, "edge", 0, desc("remote_address=1.2.3.4")), ok,
		wantStatus{code: ok, name: "per-ip", limit: true, rpu: 6, unit: rlsv3.RateLimitResponse_RateLimit_MINUTE, remaining: 2})
	ready := n.waitFor(t, "READY", 10*time.Second)
	if st := ready.fields["STATUS"]; !strings.Contains(st, "on "+sock) || !strings.Contains(st, "Envoy API on unix:"+envoySock) {
		t.Errorf("STATUS=%q: want both sockets", st)
	}
	if r := dialRaw(t, sock).check(1, 1, "user=a"); !r.Allowed {
		t.Fatalf("the msgpack socket: %+v", r)
	}
	if !strings.Contains(a.out.String(), "ignoring --envoy-rls") {
		t.Errorf("no warning that --envoy-rls gave way to the passed socket:\n%s", a.out.String())
	}
	if _, err := os.Lstat(elsewhere); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the daemon bound --envoy-rls as well: %v", err)
	}

	a.sigterm(t)
	for _, p := range []string{sock, envoySock} {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("the daemon removed %s, which systemd owns: %v", p, err)
		}
	}
}

// Passed sockets the daemon cannot tell apart are refused at start, before READY=1: two
// that are not named envoy, or two that are. Two named rlsidecar are what a drop-in
// makes that sets ListenStream= to move the socket, as docs/operations.md said to
// (`systemctl edit rlsidecar.socket` to change ListenStream=): it adds a socket to the
// unit's, and the daemon refused to start. The error names both paths and the fix (an
// empty ListenStream= first); before, it said only that 2 sockets were passed.
func TestE2ESocketActivationNames(t *testing.T) {
	for _, tt := range []struct {
		names string
		want  []string // "" stands for the sockets' paths, "1.sock, 2.sock" in full
	}{
		{"rlsidecar:other", []string{"2 sockets passed (LISTEN_FDS) besides any named \"envoy\""}},
		{"rlsidecar:rlsidecar", []string{"2 sockets passed (LISTEN_FDS) besides any named \"envoy\"", "",
			"begin the drop-in with an empty ListenStream= line"}},
		{"envoy:envoy", []string{"two sockets named \"envoy\" passed"}},
	} {
		t.Run(tt.names, func(t *testing.T) {
			dir := shortTempDir(t)
			s1, s2 := filepath.Join(dir, "1.sock"), filepath.Join(dir, "2.sock")
			n := listenNotify(t)
			t.Setenv("NOTIFY_SOCKET", n.path)
			a := startActivator(t, []string{"-l", s1, "-l", s2, "--fdname=" + tt.names, "-E", "NOTIFY_SOCKET"}, []string{s1, s2},
				binary, "serve", "--admin=", "--watch=false")
			a.connectThenExit(t, s1)
			if code := a.cmd.ProcessState.ExitCode(); code != exitFailure {
				t.Fatalf("exit %d, want %d:\n%s", code, exitFailure, a.out.String())
			}
			for _, want := range tt.want {
				if want == "" {
					want = s1 + ", " + s2
				}
				if !strings.Contains(a.out.String(), want) {
					t.Errorf("the error does not say %q:\n%s", want, a.out.String())
				}
			}
			select {
			case m := <-n.msgs:
				t.Errorf("a notification from a daemon that refused its sockets: %v", m.fields)
			default:
			}
		})
	}
}

// The shipped units, emulated: the daemon runs as a user of its own that can write
// nothing in the sockets' directory (root's, 0755, as the socket units' DirectoryMode=
// makes it, and mounted read-only, as ProtectSystem=strict has /run), the sockets belong
// to root and the units' group with the units' SocketMode=. Binding --envoy-rls there
// itself fails, as the outside tester found (read-only file system, then a restart
// loop), and the error says what to do instead; with the Envoy socket passed, as
// rlsidecar-envoy.socket does, a member of the group asks both sockets, a user outside
// it reaches neither, and both sockets outlive the daemon. Needs root (users, a mount
// namespace), setpriv, unshare and curl.
func TestE2EEnvoySocketUnderTheUnitsSandbox(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: runs the daemon and the gateways as other users")
	}
	for _, tool := range []string{"setpriv", "unshare", "curl"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s", tool)
		}
	}
	// Ids of no one in particular: the daemon's user, the units' group, a gateway's user
	// in that group, a user outside it.
	const daemonID, group, gateway, outsider = "54324", "54321", "54322", "54323"
	base := shortTempDir(t)
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	run := filepath.Join(base, "run")
	if err := os.Mkdir(run, 0o755); err != nil { // DirectoryMode=0755, root's
		t.Fatal(err)
	}
	if out, err := exec.Command("unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
		`mount --bind -o ro "$1" "$1"`, "sh", run).CombinedOutput(); err != nil {
		t.Skipf("cannot make a read-only mount in a mount namespace here: %v %s", err, out)
	}
	bin := filepath.Join(base, "rlsidecar")
	data, err := os.ReadFile(binary)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	rulesFile := writeFile(t, base, "rules.yaml", envoyRules)
	if err := os.Chmod(rulesFile, 0o644); err != nil {
		t.Fatal(err)
	}
	// sandboxed runs `rlsidecar serve args…` as the unit would: the run directory
	// read-only, as the daemon's user, with no other group.
	sandboxed := func(args ...string) []string {
		return append([]string{"unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
			`mount --bind -o ro "$1" "$1" && shift && exec setpriv --reuid=` + daemonID + ` --regid=` + daemonID + ` --clear-groups -- "$@"`,
			"sh", run, bin, "serve", "--admin=", "--config", rulesFile, "--watch=false"}, args...)
	}
	// asUnit gives a socket the owner, group and mode its unit gives it.
	asUnit := func(path, unit string) {
		t.Helper()
		mode, err := strconv.ParseUint(readUnit(t, unit)["Socket.SocketMode"][0], 8, 32)
		if err != nil {
			t.Fatal(err)
		}
		gid, _ := strconv.Atoi(group)
		if err := os.Chown(path, 0, gid); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(path, os.FileMode(mode)); err != nil {
			t.Fatal(err)
		}
	}
	sock := filepath.Join(run, "rlsidecar.sock")
	envoySock := filepath.Join(run, "envoy.sock")

	t.Run("binding --envoy-rls itself fails", func(t *testing.T) {
		a := startActivator(t, []string{"-l", sock, "--fdname=rlsidecar"}, []string{sock},
			sandboxed("--envoy-rls", "unix:"+envoySock)...)
		asUnit(sock, "rlsidecar.socket")
		a.connectThenExit(t, sock)
		out := a.out.String()
		if a.cmd.ProcessState.ExitCode() != exitFailure || !strings.Contains(out, "read-only file system") {
			t.Fatalf("exit %d, want %d and a read-only file system:\n%s", a.cmd.ProcessState.ExitCode(), exitFailure, out)
		}
		if !strings.Contains(out, "enable rlsidecar-envoy.socket") {
			t.Errorf("the error does not say to enable rlsidecar-envoy.socket:\n%s", out)
		}
		os.Remove(sock)
	})

	t.Run("the socket passed", func(t *testing.T) {
		a := startActivator(t, []string{"-l", sock, "-l", envoySock, "--fdname=rlsidecar:" + envoyFDName},
			[]string{sock, envoySock}, sandboxed()...)
		asUnit(sock, "rlsidecar.socket")
		asUnit(envoySock, "rlsidecar-envoy.socket")
		body := filepath.Join(base, "health-check") // a gRPC frame: uncompressed, empty message
		if err := os.WriteFile(body, make([]byte, 5), 0o644); err != nil {
			t.Fatal(err)
		}
		// curlHealth asks the Envoy socket's Health/Check as uid:gid; it returns the HTTP
		// status and curl's exit code.
		curlHealth := func(uid, gid string) (string, int) {
			cmd := exec.Command("setpriv", "--reuid="+uid, "--regid="+gid, "--clear-groups", "--",
				"curl", "-sS", "--max-time", "10", "--http2-prior-knowledge", "--unix-socket", envoySock,
				"-H", "content-type: application/grpc", "-H", "te: trailers", "--data-binary", "@"+body,
				"-o", "/dev/null", "-w", "%{http_code}", "http://localhost/grpc.health.v1.Health/Check")
			out, err := cmd.Output()
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				return string(out), ee.ExitCode()
			}
			if err != nil {
				t.Fatal(err)
			}
			return string(out), 0
		}
		// The gateway's first call starts the daemon.
		if code, exit := curlHealth(gateway, group); code != "200" || exit != 0 {
			t.Fatalf("a member of the group asking the Envoy socket: HTTP %q, curl exit %d\n%s", code, exit, a.out.String())
		}
		if st, err := os.ReadFile("/proc/" + strconv.Itoa(a.cmd.Process.Pid) + "/status"); err != nil ||
			!regexp.MustCompile(`(?m)^Uid:\s+`+daemonID+`\s`).Match(st) {
			t.Fatalf("the daemon does not run as %s: %v\n%s", daemonID, err, st)
		}
		check := func(uid, gid string) (string, error) {
			out, err := exec.Command("setpriv", "--reuid="+uid, "--regid="+gid, "--clear-groups", "--",
				bin, "check", "--socket", sock, "ip=192.0.2.1").CombinedOutput()
			return string(out), err
		}
		if out, err := check(gateway, group); err != nil || !strings.Contains(out, `"allowed": true`) {
			t.Fatalf("a member of the group asking the msgpack socket: %v\n%s", err, out)
		}
		if _, exit := curlHealth(outsider, outsider); exit != 7 { // curl: couldn't connect
			t.Errorf("a user outside the group reached the Envoy socket (curl exit %d)", exit)
		}
		if out, err := check(outsider, outsider); err == nil || !strings.Contains(out, "permission denied") {
			t.Errorf("a user outside the group reached the msgpack socket: %v\n%s", err, out)
		}
		a.sigterm(t)
		for _, p := range []string{sock, envoySock} {
			if _, err := os.Lstat(p); err != nil {
				t.Errorf("%s did not outlive the daemon: %v", p, err)
			}
		}
	})
}

// The units hold together: Envoy's socket unit names its socket as the daemon expects,
// activates rlsidecar.service and, enabled, is wanted by it; each socket unit lists one socket (a unit's
// FileDescriptorName= names all of its sockets); both sockets are their group's and no
// one else's; the service makes no RuntimeDirectory=, which systemd would empty, sockets
// and all, each time the service stops; and the README and docs/operations.md point
// Envoy at the socket the unit makes.
func TestSystemdUnitsServeEnvoy(t *testing.T) {
	sock, envoy, svc := readUnit(t, "rlsidecar.socket"), readUnit(t, "rlsidecar-envoy.socket"), readUnit(t, "rlsidecar.service")
	one := func(u map[string][]string, unit, key string) string {
		t.Helper()
		if len(u[key]) != 1 {
			t.Fatalf("%s: %s set %d times, want once", unit, key, len(u[key]))
		}
		return u[key][0]
	}
	if got := one(envoy, "rlsidecar-envoy.socket", "Socket.FileDescriptorName"); got != envoyFDName {
		t.Errorf("rlsidecar-envoy.socket: FileDescriptorName=%s, want %s", got, envoyFDName)
	}
	if got := one(envoy, "rlsidecar-envoy.socket", "Socket.Service"); got != "rlsidecar.service" {
		t.Errorf("rlsidecar-envoy.socket: Service=%s", got)
	}
	if !slices.Contains(strings.Fields(strings.Join(envoy["Install.WantedBy"], " ")), "rlsidecar.service") {
		t.Errorf("rlsidecar-envoy.socket: WantedBy=%q: enabled, it must be wanted by rlsidecar.service, so that restarting the service starts it (systemd starts no socket beside its running service)", envoy["Install.WantedBy"])
	}
	if got := one(sock, "rlsidecar.socket", "Socket.FileDescriptorName"); got == envoyFDName {
		t.Errorf("rlsidecar.socket: FileDescriptorName=%s is the Envoy socket's name", got)
	}
	envoyPath := one(envoy, "rlsidecar-envoy.socket", "Socket.ListenStream")
	sockPath := one(sock, "rlsidecar.socket", "Socket.ListenStream")
	for unit, u := range map[string]map[string][]string{"rlsidecar.socket": sock, "rlsidecar-envoy.socket": envoy} {
		mode, err := strconv.ParseUint(one(u, unit, "Socket.SocketMode"), 8, 32)
		if err != nil || mode&0o060 != 0o060 || mode&0o007 != 0 {
			t.Errorf("%s: SocketMode=%s: want the group's read and write, nothing for others", unit, u["Socket.SocketMode"])
		}
		if g := one(u, unit, "Socket.SocketGroup"); g == "" || g == "root" {
			t.Errorf("%s: SocketGroup=%q: want the gateways' group", unit, g)
		}
		if len(u["Socket.Accept"]) > 0 && u["Socket.Accept"][0] != "no" {
			t.Errorf("%s: Accept=%s: the daemon takes the listening socket", unit, u["Socket.Accept"][0])
		}
	}
	if filepath.Dir(envoyPath) != filepath.Dir(sockPath) || !filepath.IsAbs(envoyPath) {
		t.Errorf("the Envoy socket %s is not beside %s", envoyPath, sockPath)
	}
	if rd := svc["Service.RuntimeDirectory"]; len(rd) > 0 {
		t.Errorf("rlsidecar.service: RuntimeDirectory=%q: systemd removes it, and the sockets in it, when the service stops", rd)
	}

	pipe := regexp.MustCompile(`pipe: \{ path: ([^ }]+) \}`)
	for _, doc := range []string{"../../README.md", "../../docs/operations.md"} {
		data, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		text := string(data)
		if !strings.Contains(text, "rlsidecar-envoy.socket") {
			t.Errorf("%s does not tell Envoy users about rlsidecar-envoy.socket", doc)
		}
		for _, m := range pipe.FindAllStringSubmatch(text, -1) {
			if m[1] != envoyPath {
				t.Errorf("%s points Envoy at %s; the unit makes %s", doc, m[1], envoyPath)
			}
		}
	}
}

// readUnit reads systemd/NAME: "Section.Key" to its values in order (a key may repeat).
// Comments and blank lines are skipped; no line continuations are expected.
func readUnit(t *testing.T, name string) map[string][]string {
	t.Helper()
	f, err := os.Open(filepath.Join("../../systemd", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	u := map[string][]string{}
	section := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[':
			section = strings.Trim(line, "[]")
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok {
				t.Fatalf("%s: %q is no Key=value", name, line)
			}
			key := section + "." + strings.TrimSpace(k)
			u[key] = append(u[key], strings.TrimSpace(v))
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return u
}

// The service's memory bounds hold together: GOMEMLIMIT (where the Go runtime starts
// collecting harder) sits below MemoryMax (where the kernel stops the daemon), with room
// for what the runtime does not count (stacks of the goroutines aside, the executable's
// pages). docs/operations.md, "Memory", gives the figures they are sized on.
func TestSystemdUnitMemoryBounds(t *testing.T) {
	svc := readUnit(t, "rlsidecar.service")
	if len(svc["Service.MemoryMax"]) != 1 {
		t.Fatalf("rlsidecar.service: MemoryMax set %d times, want once", len(svc["Service.MemoryMax"]))
	}
	max := parseSize(t, svc["Service.MemoryMax"][0], map[string]int64{"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40})
	var limit int64
	var limitSet string
	for _, env := range svc["Service.Environment"] {
		if v, ok := strings.CutPrefix(env, "GOMEMLIMIT="); ok {
			limit, limitSet = parseSize(t, v, map[string]int64{"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}), v
		}
	}
	if limit == 0 {
		t.Fatal("rlsidecar.service: no Environment=GOMEMLIMIT=: the runtime would let the heap grow to twice what it holds before collecting")
	}
	if limit > max*9/10 {
		t.Errorf("GOMEMLIMIT=%d bytes against MemoryMax=%d: want at most 90%%, so that the runtime collects before the kernel stops the daemon", limit, max)
	}
	if doc, err := os.ReadFile("../../docs/operations.md"); err != nil || !strings.Contains(string(doc), "GOMEMLIMIT="+limitSet) || !strings.Contains(string(doc), "MemoryMax="+svc["Service.MemoryMax"][0]) {
		t.Errorf("docs/operations.md does not give the unit's GOMEMLIMIT and MemoryMax (%v)", err)
	}
}

// parseSize reads a number with one of units' suffixes.
func parseSize(t *testing.T, s string, units map[string]int64) int64 {
	t.Helper()
	for u, mul := range units {
		if n, ok := strings.CutSuffix(s, u); ok {
			if v, err := strconv.ParseInt(n, 10, 64); err == nil && v > 0 {
				return v * mul
			}
		}
	}
	t.Fatalf("%q: want a number and one of %v", s, slices.Collect(maps.Keys(units)))
	return 0
}
