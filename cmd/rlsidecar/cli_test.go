package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func runInProcess(args ...string) (stdout, stderr string, code int) {
	var o, e bytes.Buffer
	code = run(args, &o, &e)
	return o.String(), e.String(), code
}

func TestValidate(t *testing.T) {
	if out, errOut, code := runInProcess("validate", "--config", "../../proto/testdata/rules.yaml"); code != exitOK || !strings.Contains(out, "3 rules") {
		t.Fatalf("good file: code %d out %q err %q", code, out, errOut)
	}
	dir := t.TempDir()
	bad := writeFile(t, dir, "bad.yaml", "rules:\n  - name: a\n    key: user\n    limit: { requests: 5, per: 60x }\n")
	_, errOut, code := runInProcess("validate", "--config", bad)
	if code != exitFailure || !strings.Contains(errOut, "bad.yaml:4") || !strings.Contains(errOut, "limit.per") {
		t.Fatalf("bad file: code %d, stderr %q", code, errOut)
	}
	if _, _, code := runInProcess("validate"); code != exitUsage {
		t.Fatalf("no --config: code %d", code)
	}
	if _, _, code := runInProcess("validate", "--config", filepath.Join(dir, "missing.yaml")); code != exitFailure {
		t.Fatalf("missing file: code %d", code)
	}
	// A rule that needs Redis: a note (the daemon may have Redis), an error with
	// --no-redis, as serve without --redis refuses it.
	global := writeFile(t, dir, "global.yaml", "rules:\n  - name: g\n    key: user\n    limit: { requests: 1, per: 1s }\n    mode: global\n")
	if _, errOut, code := runInProcess("validate", "--config", global); code != exitOK || !strings.Contains(errOut, "note: ") || !strings.Contains(errOut, "mode global needs a Redis store") {
		t.Fatalf("global rule: code %d, stderr %q", code, errOut)
	}
	if _, errOut, code := runInProcess("validate", "--no-redis", "--config", global); code != exitFailure || !strings.Contains(errOut, "global.yaml:2") {
		t.Fatalf("global rule, --no-redis: code %d, stderr %q", code, errOut)
	}
	// No rules: valid, and warned of (every request allowed).
	empty := writeFile(t, dir, "none.yaml", "rules: []\n")
	if out, errOut, code := runInProcess("validate", "--config", empty); code != exitOK || !strings.Contains(errOut, "no rules: every request is allowed") || !strings.Contains(out, "1 warning\n") {
		t.Fatalf("no rules: code %d, stdout %q, stderr %q", code, out, errOut)
	}
}

// serve refuses a broken rules file, and a rule whose mode needs Redis, before it listens.
func TestServeRefusesBadConfig(t *testing.T) {
	dir := shortTempDir(t)
	for name, body := range map[string]string{
		"broken.yaml": "rules:\n  - name: a\n    kee: user\n",
		"global.yaml": "rules:\n  - name: g\n    key: user\n    limit: { requests: 1, per: 1s }\n    mode: global\n",
	} {
		cfg := writeFile(t, dir, name, body)
		out, err := runCLI(t, "serve", "--config", cfg, "--socket", filepath.Join(dir, "s.sock"))
		if err == nil || !strings.Contains(out, name+":") {
			t.Errorf("%s: err=%v out=%s", name, err, out)
		}
	}
}

// The boundary trace of the design brief: limit 10 per 1 s, 10 requests at t = 0.99 s
// and 10 at t = 1.01 s. A fixed window admits 20, a sliding window counter 11, a token
// bucket 10.
func TestReplayBoundaryTrace(t *testing.T) {
	dir := t.TempDir()
	var trace strings.Builder
	for _, tms := range []int{990, 1010} {
		for i := 0; i < 10; i++ {
			fmt.Fprintf(&trace, `{"t_ms": %d, "attrs": {"user": "u1"}}`+"\n", tms)
		}
	}
	tracePath := writeFile(t, dir, "trace.jsonl", trace.String())
	for alg, want := range map[string]uint64{"fixed_window": 20, "sliding_window": 11, "token_bucket": 10} {
		cfg := writeFile(t, dir, alg+".yaml", fmt.Sprintf("rules:\n  - name: r\n    key: user\n    algorithm: %s\n    limit: { requests: 10, per: 1s }\n", alg))
		out, errOut, code := runInProcess("replay", "--config", cfg, "--trace", tracePath)
		if code != exitOK {
			t.Fatalf("%s: code %d: %s", alg, code, errOut)
		}
		var sum replaySummary
		if err := json.Unmarshal([]byte(out), &sum); err != nil {
			t.Fatal(err)
		}
		if sum.Requests != 20 || sum.Allowed != want || sum.Rejected != 20-want || sum.Rules[0].Rejected != 20-want || sum.DurationMs != 20 {
			t.Errorf("%s: %+v (rule %+v), want %d allowed", alg, sum, *sum.Rules[0], want)
		}
	}
}

func TestReplayReportsBadLines(t *testing.T) {
	dir := t.TempDir()
	tracePath := writeFile(t, dir, "trace.jsonl", `{"t_ms": 1, "attrs": {"ip": "a"}}`+"\n"+`{"t_ms": "x"}`+"\n")
	_, errOut, code := runInProcess("replay", "--trace", tracePath)
	if code != exitFailure || !strings.Contains(errOut, "trace.jsonl:2") {
		t.Fatalf("code %d stderr %q", code, errOut)
	}
	tracePath = writeFile(t, dir, "nots.jsonl", `{"attrs": {"ip": "a"}}`+"\n")
	if _, errOut, code := runInProcess("replay", "--trace", tracePath); code != exitFailure || !strings.Contains(errOut, "t_ms is required") {
		t.Fatalf("code %d stderr %q", code, errOut)
	}
}

// A trace merged from several gateways' logs is not quite in order: a line earlier than
// the one before it is replayed at the latest time seen, as the daemon's clock would have
// seen it, and counted. Before, it was decided at its own time, in a window the key had
// left: a fixed window of 1 a second admitted a second request 600 ms after the first.
func TestReplayOutOfOrderLines(t *testing.T) {
	dir := t.TempDir()
	cfg := writeFile(t, dir, "r.yaml", "rules:\n  - name: r\n    key: user\n    algorithm: fixed_window\n    limit: { requests: 1, per: 1s }\n")
	trace := `{"t_ms": 1500, "attrs": {"user": "u"}}` + "\n" + `{"t_ms": 900, "attrs": {"user": "u"}}` + "\n" + `{"t_ms": 1600, "attrs": {"user": "u"}}` + "\n"
	out, errOut, code := runInProcess("replay", "--config", cfg, "--trace", writeFile(t, dir, "t.jsonl", trace))
	if code != exitOK {
		t.Fatal(errOut)
	}
	var sum replaySummary
	if err := json.Unmarshal([]byte(out), &sum); err != nil {
		t.Fatal(err)
	}
	if sum.Allowed != 1 || sum.Rejected != 2 || sum.OutOfOrder != 1 || sum.MaxLateMs != 600 || sum.DurationMs != 700 {
		t.Fatalf("%s", out)
	}
}

// Shadow rules are counted as shadow rejections in a replay, never as rejections.
func TestReplayShadow(t *testing.T) {
	dir := t.TempDir()
	cfg := writeFile(t, dir, "r.yaml", "rules:\n  - name: dark\n    key: ip\n    limit: { requests: 2, per: 1h }\n    shadow: true\n")
	var trace strings.Builder
	for i := 0; i < 5; i++ {
		fmt.Fprintf(&trace, `{"t_ms": %d, "attrs": {"ip": "x"}}`+"\n", i)
	}
	out, errOut, code := runInProcess("replay", "--config", cfg, "--trace", writeFile(t, dir, "t.jsonl", trace.String()))
	if code != exitOK {
		t.Fatal(errOut)
	}
	var sum replaySummary
	_ = json.Unmarshal([]byte(out), &sum)
	if sum.Allowed != 5 || sum.Rules[0].ShadowRejected != 3 || sum.Rules[0].Allowed != 2 {
		t.Fatalf("%s", out)
	}
}

func TestUsage(t *testing.T) {
	if _, _, code := runInProcess(); code != exitUsage {
		t.Fatal(code)
	}
	if _, _, code := runInProcess("frob"); code != exitUsage {
		t.Fatal(code)
	}
	if out, _, code := runInProcess("version"); code != exitOK || !strings.HasPrefix(out, "rlsidecar ") {
		t.Fatal(out)
	}
	if out, _, code := runInProcess("version", "--bogus"); code != exitUsage || out != "" {
		t.Fatalf("version with an argument: exit %d, %q; want a usage error", code, out)
	}
	// The usage says `Run "rlsidecar COMMAND --help" for a command's flags`: version's
	// --help answers too, rather than a usage error.
	for _, h := range []string{"--help", "-h"} {
		if out, errOut, code := runInProcess("version", h); code != exitOK || !strings.Contains(out, "Usage of rlsidecar version") {
			t.Errorf("version %s: exit %d, %q %q; want its usage, exit 0", h, code, out, errOut)
		}
	}
	if _, _, code := runInProcess("check", "novalue"); code != exitUsage {
		t.Fatal(code)
	}
	// A bad flag value: the usage once, the error once, last (it was printed twice).
	_, errOut, code := runInProcess("check", "--cost", "abc")
	if code != exitUsage || strings.Count(errOut, `invalid value "abc"`) != 1 || strings.Count(errOut, "Usage of rlsidecar check") != 1 ||
		!strings.HasSuffix(errOut, "rlsidecar check: usage: invalid value \"abc\" for flag -cost: parse error\n") {
		t.Fatalf("check --cost abc: exit %d\n%s", code, errOut)
	}
}

// A start that fails leaves nothing behind: with the admin port taken, serve exits
// non-zero, never says it is listening, and leaves no socket file for clients to find.
func TestServeFailedStartLeavesNoSocket(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dir := shortTempDir(t)
	sock := filepath.Join(dir, "s.sock")
	out, err := runCLI(t, "serve", "--socket", sock, "--admin", ln.Addr().String())
	if err == nil {
		t.Fatalf("serve with its admin port taken exited 0:\n%s", out)
	}
	if !strings.Contains(out, "address already in use") {
		t.Errorf("the error does not say why:\n%s", out)
	}
	if strings.Contains(out, "listening on") {
		t.Errorf("serve announced a socket it then abandoned:\n%s", out)
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("socket file left behind after a failed start (lstat: %v)", err)
	}
}

// A flag value out of range is refused before anything starts, naming the flag: before,
// --max-frame 10 started a daemon refusing every check, and --sync-interval 0s or
// --sweep-interval 0s panicked in a ticker after the daemon said it was listening,
// leaving its socket behind.
func TestServeRefusesOutOfRangeFlags(t *testing.T) {
	dir := shortTempDir(t)
	sock := filepath.Join(dir, "s.sock")
	for _, c := range [][]string{
		{"--max-frame", "10"}, {"--max-conns", "-5"}, {"--max-keys", "0"}, {"--max-attrs", "0"}, {"--prefetch-from", "-1"},
		{"--top-k", "-1"}, {"--frame-timeout", "0s"}, {"--sweep-interval", "0s"},
		{"--sync-interval", "0s", "--redis", "redis://127.0.0.1:1"}, {"--idle-timeout", "-1s"},
		{"--breaker-failures", "0"}, {"--drain-timeout", "0s"}, {"--max-frame", "4294967296"},
	} {
		out, err := runCLI(t, append([]string{"serve", "--socket", sock, "--admin="}, c...)...)
		if err == nil || !strings.Contains(out, c[0]) || strings.Contains(out, "listening on") || strings.Contains(out, "panic") {
			t.Errorf("serve %s: %v\n%s", strings.Join(c, " "), err, out)
		}
		if _, err := os.Lstat(sock); !os.IsNotExist(err) {
			t.Fatalf("serve %s left its socket (lstat: %v)", strings.Join(c, " "), err)
		}
	}
}

// A CPU profile that cannot be written stops the start with an error naming the flag:
// before, it said only "open /nonexistent/cpu.prof: no such file or directory", which
// under the unit (RLSIDECAR_CPUPROFILE in /etc/default/rlsidecar, a path the sandbox
// cannot write) named no setting to look at.
func TestServeNamesAnUnwritableCPUProfile(t *testing.T) {
	dir := shortTempDir(t)
	out, err := runCLI(t, "serve", "--socket", filepath.Join(dir, "s.sock"), "--admin=", "--cpuprofile", filepath.Join(dir, "no-such-dir", "cpu.prof"))
	if err == nil || !strings.Contains(out, "--cpuprofile: open ") || strings.Contains(out, "listening on") {
		t.Fatalf("serve --cpuprofile in a missing directory: %v\n%s", err, out)
	}
}

func TestLoopbackAddr(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:9464": true, "[::1]:9464": true, "localhost:9464": true, "127.0.0.2:1": true,
		":9464": false, "0.0.0.0:9464": false, "[::]:9464": false, "10.0.0.1:9464": false, "example.com:9464": false, "nonsense": false,
	} {
		if got := loopbackAddr(addr); got != want {
			t.Errorf("loopbackAddr(%q) = %v, want %v", addr, got, want)
		}
	}
}

// --top-k has a ceiling: before, --top-k 1000000000 started a daemon that took 23 GB
// before it listened (and ignored SIGTERM meanwhile).
func TestServeRefusesHugeTopK(t *testing.T) {
	sock := filepath.Join(shortTempDir(t), "s.sock")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, binary, "serve", "--socket", sock, "--admin=", "--top-k", "10001").CombinedOutput()
	if err == nil || ctx.Err() != nil || !strings.Contains(string(out), "--top-k 10001: at most 10000") {
		t.Fatalf("serve --top-k 10001: %v (%v)\n%s", err, ctx.Err(), out)
	}
}
