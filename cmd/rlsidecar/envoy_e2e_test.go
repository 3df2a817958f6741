package main

import (
	"context"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	rlclient "github.com/rlsidecar/rlsidecar/clients/go"
	"github.com/rlsidecar/rlsidecar/envoyrls"
)

// envoyRules are what import-envoy writes for envoyproxy/ratelimit's README examples
// (messaging, unlimited, shadow, replaces, a block list), plus a token bucket.
const envoyRules = `
rules:
  - name: marketing
    match: { domain: messaging, descriptor: "message_type,to_number", message_type: marketing }
    key: [domain, message_type, to_number]
    algorithm: fixed_window
    limit: { requests: 2, per: 1d }
  - name: per-number
    match: { domain: messaging, descriptor: to_number }
    key: [domain, to_number]
    algorithm: fixed_window
    limit: { requests: 3, per: 1d }
  - name: ldap
    match: { domain: internal, descriptor: ldap }
    key: [domain, ldap]
    limit: unlimited
  - name: user-a
    match: { domain: example6, descriptor: "service,user", user: user-a }
    key: [domain, service, user]
    algorithm: fixed_window
    limit: { requests: 1, per: 1s }
    shadow: true
  - name: specific_limit
    match: { domain: example7, descriptor: "key_1,user", key_1: value_1, user: bkthomps }
    key: [domain, key_1, user]
    algorithm: fixed_window
    limit: { requests: 1, per: 1h }
  - name: wider
    match: { domain: example7, descriptor: "key_2,user", key_2: value_2, user: bkthomps }
    key: [domain, key_2, user]
    algorithm: fixed_window
    limit: { requests: 2, per: 1h }
    replaces: [specific_limit]
  - name: blocked
    match: { domain: edge, descriptor: remote_address, remote_address: 50.0.0.5 }
    key: [domain, remote_address]
    limit: deny
  - name: per-ip
    match: { domain: edge, descriptor: remote_address, remote_address: { not: 50.0.0.5 } }
    key: [domain, remote_address]
    limit: { requests: 3, per: 30s }
    warn_at: 0.6
  - name: monthly
    match: { domain: quota, descriptor: tenant }
    key: [domain, tenant]
    limit: { requests: 3, per: month, tz: Europe/Paris }
`

type rlsFixture struct {
	d   *daemonProc
	rls rlsv3.RateLimitServiceClient
	hc  healthpb.HealthClient
}

func startEnvoyDaemon(t *testing.T, rulesYAML string, extra ...string) *rlsFixture {
	t.Helper()
	dir := shortTempDir(t)
	sock := filepath.Join(dir, "rls.sock")
	d := startDaemon(t, append([]string{"--config", writeFile(t, dir, "rules.yaml", rulesYAML), "--envoy-rls", "unix:" + sock}, extra...)...)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &rlsFixture{d: d, rls: rlsv3.NewRateLimitServiceClient(conn), hc: healthpb.NewHealthClient(conn)}
}

// desc builds a descriptor from "key=value" entries.
func desc(kv ...string) *commonrl.RateLimitDescriptor {
	d := &commonrl.RateLimitDescriptor{}
	for _, s := range kv {
		k, v, _ := strings.Cut(s, "=")
		d.Entries = append(d.Entries, &commonrl.RateLimitDescriptor_Entry{Key: k, Value: v})
	}
	return d
}

func (f *rlsFixture) call(t *testing.T, domain string, hits uint32, ds ...*commonrl.RateLimitDescriptor) *rlsv3.RateLimitResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := f.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: domain, Descriptors: ds, HitsAddend: hits})
	if err != nil {
		t.Fatalf("ShouldRateLimit(%s): %v", domain, err)
	}
	if len(resp.Statuses) != len(ds) {
		t.Fatalf("%d statuses for %d descriptors", len(resp.Statuses), len(ds))
	}
	return resp
}

type wantStatus struct {
	code      rlsv3.RateLimitResponse_Code
	name      string // "" with limit false: no current_limit
	limit     bool
	rpu       uint32
	unit      rlsv3.RateLimitResponse_RateLimit_Unit
	remaining uint32
}

func checkStatuses(t *testing.T, resp *rlsv3.RateLimitResponse, overall rlsv3.RateLimitResponse_Code, want ...wantStatus) {
	t.Helper()
	if resp.OverallCode != overall {
		t.Errorf("overall %v, want %v", resp.OverallCode, overall)
	}
	for i, w := range want {
		st := resp.Statuses[i]
		got := wantStatus{code: st.Code, limit: st.CurrentLimit != nil, remaining: st.LimitRemaining}
		if st.CurrentLimit != nil {
			got.name, got.rpu, got.unit = st.CurrentLimit.Name, st.CurrentLimit.RequestsPerUnit, st.CurrentLimit.Unit
			if st.DurationUntilReset == nil {
				t.Errorf("status %d: no duration_until_reset", i)
			}
		}
		if got != w {
			t.Errorf("status %d: %+v, want %+v", i, got, w)
		}
	}
}

const (
	ok   = rlsv3.RateLimitResponse_OK
	over = rlsv3.RateLimitResponse_OVER_LIMIT
	day  = rlsv3.RateLimitResponse_RateLimit_DAY
)

// The Envoy rate limit service against the real daemon: statuses in order, hits_addend,
// overrides, unknown domains, unlimited, shadow, replaces, all-or-nothing, deny, health.
func TestE2EEnvoyRLS(t *testing.T) {
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) { testE2EEnvoyRLS(t, tr) })
	}
}

func testE2EEnvoyRLS(t *testing.T, transport string) {
	f := startEnvoyDaemon(t, envoyRules, "--envoy-rls-transport", transport)
	// The subtests count against fixed windows of a minute (an override), an hour, a day
	// and a calendar month: none may turn while they run.
	clearOfWindowEnd(t, time.Minute, 5*time.Second)

	t.Run("health", func(t *testing.T) {
		for _, svc := range []string{"", "envoy.service.ratelimit.v3.RateLimitService"} {
			r, err := f.hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
			if err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
				t.Errorf("health %q: %v %v", svc, r, err)
			}
		}
	})

	t.Run("order, no match, all-or-nothing", func(t *testing.T) {
		mk := desc("message_type=marketing", "to_number=111")
		num := desc("to_number=111")
		none := desc("message_type=other", "to_number=111") // no rule: OK, no current_limit
		resp := f.call(t, "messaging", 0, mk, none, num)
		checkStatuses(t, resp, ok,
			wantStatus{code: ok, limit: true, name: "marketing", rpu: 2, unit: day, remaining: 1},
			wantStatus{code: ok},
			wantStatus{code: ok, limit: true, name: "per-number", rpu: 3, unit: day, remaining: 2})
		f.call(t, "messaging", 0, mk, num)
		// marketing is spent: rejected, and per-number is not charged for it.
		resp = f.call(t, "messaging", 0, mk, num)
		checkStatuses(t, resp, over,
			wantStatus{code: over, limit: true, name: "marketing", rpu: 2, unit: day},
			wantStatus{code: ok, limit: true, name: "per-number", rpu: 3, unit: day, remaining: 1})
		resp = f.call(t, "messaging", 0, num)
		checkStatuses(t, resp, ok, wantStatus{code: ok, limit: true, name: "per-number", rpu: 3, unit: day, remaining: 0})
	})

	t.Run("hits_addend", func(t *testing.T) {
		resp := f.call(t, "messaging", 2, desc("to_number=222"))
		checkStatuses(t, resp, ok, wantStatus{code: ok, limit: true, name: "per-number", rpu: 3, unit: day, remaining: 1})
		peek := desc("to_number=222")
		peek.HitsAddend = wrapperspb.UInt64(0) // the descriptor's own, 0: asks without consuming
		resp = f.call(t, "messaging", 5, peek)
		checkStatuses(t, resp, ok, wantStatus{code: ok, limit: true, name: "per-number", rpu: 3, unit: day, remaining: 1})
		two := desc("to_number=222")
		two.HitsAddend = wrapperspb.UInt64(2) // wins over the call's 1
		resp = f.call(t, "messaging", 1, two)
		checkStatuses(t, resp, over, wantStatus{code: over, limit: true, name: "per-number", rpu: 3, unit: day, remaining: 1})
	})

	t.Run("override", func(t *testing.T) {
		o := desc("to_number=333")
		o.Limit = &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1, Unit: typev3.RateLimitUnit_MINUTE}
		w := wantStatus{code: ok, limit: true, rpu: 1, unit: rlsv3.RateLimitResponse_RateLimit_MINUTE}
		checkStatuses(t, f.call(t, "messaging", 0, o), ok, w)
		w.code = over
		checkStatuses(t, f.call(t, "messaging", 0, o), over, w)
		// The rule itself was not charged.
		checkStatuses(t, f.call(t, "messaging", 0, desc("to_number=333")), ok,
			wantStatus{code: ok, limit: true, name: "per-number", rpu: 3, unit: day, remaining: 2})
		// The override's name, shown to the end client in the headers and the body, is
		// the domain and the descriptor's keys: not its values, nor the key's NUL bytes.
		resp := f.call(t, "messaging", 0, o)
		var policy string
		for _, h := range resp.ResponseHeadersToAdd {
			if h.Key == "RateLimit-Policy" {
				policy = h.Value
			}
		}
		if !strings.HasPrefix(policy, `"messaging.to_number.override";q=1;w=60`) {
			t.Errorf("RateLimit-Policy %q, want the override named messaging.to_number.override", policy)
		}
		if body := string(resp.RawBody); !strings.Contains(body, `"messaging.to_number.override"`) || strings.Contains(body, "333") || strings.Contains(body, `\u0000`) {
			t.Errorf("refusal body %s names the override by its key", body)
		}
	})

	t.Run("override of 0", func(t *testing.T) {
		// requests_per_unit 0 refuses the call, as envoyproxy/ratelimit does, whatever
		// its hits_addend; the other descriptor is not charged.
		z := desc("to_number=444")
		z.Limit = &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 0, Unit: typev3.RateLimitUnit_HOUR}
		for _, hits := range []uint64{0, 1, 5} {
			z.HitsAddend = wrapperspb.UInt64(hits)
			resp := f.call(t, "messaging", 0, z, desc("to_number=445"))
			checkStatuses(t, resp, over, wantStatus{code: over, limit: true, rpu: 0, unit: rlsv3.RateLimitResponse_RateLimit_HOUR},
				wantStatus{code: ok, limit: true, name: "per-number", rpu: 3, unit: day, remaining: 3})
			if r := resp.Statuses[0].DurationUntilReset.AsDuration(); r <= 0 || r > time.Hour {
				t.Errorf("reset %v, want the rest of the hour", r)
			}
			if h := headerMap(resp); h["Retry-After"] != "" || !strings.Contains(string(resp.RawBody), "can never pass") {
				t.Errorf("override of 0: headers %v body %s", h, resp.RawBody)
			}
		}
	})

	t.Run("calendar month", func(t *testing.T) {
		// 3 per calendar month is Envoy's 3 per MONTH, not 35 per YEAR (its nominal 31
		// days' rate).
		checkStatuses(t, f.call(t, "quota", 0, desc("tenant=acme")), ok,
			wantStatus{code: ok, limit: true, name: "monthly", rpu: 3, unit: rlsv3.RateLimitResponse_RateLimit_MONTH, remaining: 2})
	})

	t.Run("unknown domain", func(t *testing.T) {
		checkStatuses(t, f.call(t, "nobody", 0, desc("to_number=111"), desc("a=b")), ok, wantStatus{code: ok}, wantStatus{code: ok})
	})

	t.Run("unlimited", func(t *testing.T) {
		for range 3 {
			checkStatuses(t, f.call(t, "internal", 0, desc("ldap=x")), ok, wantStatus{code: ok, remaining: math.MaxUint32})
		}
	})

	t.Run("shadow", func(t *testing.T) {
		for range 3 {
			resp := f.call(t, "example6", 0, desc("service=auth", "user=user-a"))
			if resp.OverallCode != ok || resp.Statuses[0].Code != ok || resp.Statuses[0].CurrentLimit.GetName() != "user-a" {
				t.Fatalf("shadow: %v", resp)
			}
		}
	})

	t.Run("replaces", func(t *testing.T) {
		a := desc("key_1=value_1", "user=bkthomps")
		b := desc("key_2=value_2", "user=bkthomps")
		for i := range 2 {
			resp := f.call(t, "example7", 0, a, b)
			checkStatuses(t, resp, ok, wantStatus{code: ok},
				wantStatus{code: ok, limit: true, name: "wider", rpu: 2, unit: rlsv3.RateLimitResponse_RateLimit_HOUR, remaining: uint32(1 - i)})
		}
		// specific_limit was untouched while replaced.
		checkStatuses(t, f.call(t, "example7", 0, a), ok,
			wantStatus{code: ok, limit: true, name: "specific_limit", rpu: 1, unit: rlsv3.RateLimitResponse_RateLimit_HOUR})
	})

	t.Run("deny and a window with no Envoy unit", func(t *testing.T) {
		resp := f.call(t, "edge", 0, desc("remote_address=50.0.0.5"))
		checkStatuses(t, resp, over, wantStatus{code: over, limit: true, name: "blocked", rpu: 0, unit: rlsv3.RateLimitResponse_RateLimit_SECOND})
		if h := headerMap(resp); h["Retry-After"] != "" || !strings.Contains(string(resp.RawBody), "can never pass") {
			t.Errorf("deny: headers %v body %s", h, resp.RawBody)
		}
		// 3 per 30s is 6 per minute.
		checkStatuses(t, f.call(t, "edge", 0, desc("remote_address=50.0.0.6")), ok,
			wantStatus{code: ok, limit: true, name: "per-ip", rpu: 6, unit: rlsv3.RateLimitResponse_RateLimit_MINUTE, remaining: 2})
	})

	t.Run("bad input", func(t *testing.T) {
		for _, req := range []*rlsv3.RateLimitRequest{
			{Domain: "", Descriptors: []*commonrl.RateLimitDescriptor{desc("a=b")}},
			{Domain: "edge"},
			{Domain: "edge", Descriptors: []*commonrl.RateLimitDescriptor{desc("=b")}},
			{Domain: "edge", Descriptors: []*commonrl.RateLimitDescriptor{{Entries: desc("a=b").Entries,
				Limit: &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1, Unit: typev3.RateLimitUnit_UNKNOWN}}}},
		} {
			_, err := f.rls.ShouldRateLimit(context.Background(), req)
			if status.Code(err) != codes.InvalidArgument {
				t.Errorf("%v: %v, want InvalidArgument", req, err)
			}
		}
	})
}

func headerMap(resp *rlsv3.RateLimitResponse) map[string]string {
	h := map[string]string{}
	for _, hv := range resp.ResponseHeadersToAdd {
		h[hv.Key] = hv.Value
	}
	return h
}

// The same rules asked over the msgpack socket and over gRPC give the same decisions, and
// the same headers and problem body as the Go client writes.
func TestE2EEnvoyRLSMatchesSocket(t *testing.T) {
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) { testE2EEnvoyRLSMatchesSocket(t, tr) })
	}
}

func testE2EEnvoyRLSMatchesSocket(t *testing.T, transport string) {
	f := startEnvoyDaemon(t, envoyRules, "--envoy-rls-transport", transport)
	c, err := rlclient.New(rlclient.Options{Socket: f.d.socket, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	// Identical at a time that does not cross a second boundary between the two asks
	// (headers carry whole seconds): try a few fresh keys.
	var mismatch string
	warned := false // per-ip's warn_at 0.6: the 2nd and 3rd checks of a key warn
	for attempt := range 5 {
		viaSocket := "10.0.0." + string(rune('1'+attempt))
		viaGRPC := "10.0.1." + string(rune('1'+attempt))
		mismatch = ""
		for i := range 5 {
			dec, err := c.Check(context.Background(), map[string]string{"domain": "edge", "descriptor": "remote_address", "remote_address": viaSocket}, nil)
			if err != nil {
				t.Fatal(err)
			}
			resp := f.call(t, "edge", 0, desc("remote_address="+viaGRPC))
			st := resp.Statuses[0]
			if dec.Allowed != (resp.OverallCode == ok) || uint64(st.LimitRemaining) != dec.Remaining {
				t.Fatalf("check %d: socket %+v, gRPC %v", i, dec, resp)
			}
			want := rlclient.Headers(&dec)
			rec := httptest.NewRecorder()
			if !dec.Allowed {
				rlclient.WriteRejection(rec, &dec)
				want = rec.Header()
				want.Del("Content-Length")
			}
			got := http.Header{}
			for k, v := range headerMap(resp) {
				got.Set(k, v)
			}
			warned = warned || got.Get("RateLimit-Warning") == `"per-ip"`
			if !reflect.DeepEqual(got, want) {
				mismatch = "headers: gRPC " + strings.Join(flat(got), "; ") + " | client " + strings.Join(flat(want), "; ")
			}
			if !dec.Allowed && rec.Body.String() != string(resp.RawBody) {
				mismatch = "body: gRPC " + string(resp.RawBody) + " | client " + rec.Body.String()
			}
			if dec.Allowed && len(resp.RawBody) != 0 {
				t.Fatalf("allowed with a body: %s", resp.RawBody)
			}
		}
		if mismatch == "" {
			if !warned {
				t.Fatal("no RateLimit-Warning over gRPC")
			}
			return
		}
	}
	t.Fatal(mismatch)
}

func flat(h http.Header) []string {
	var out []string
	for k, v := range h {
		out = append(out, k+": "+strings.Join(v, ","))
	}
	return out
}

// import-envoy converts every README example, and what it writes passes validate and
// serves; a bad file is an error naming file:line:field, with nothing on stdout.
func TestImportEnvoyCLI(t *testing.T) {
	dir := t.TempDir()
	examples, _ := filepath.Glob("../../envoyrls/testdata/readme/ex*.yaml")
	var inputs []string
	for _, p := range examples {
		if !strings.HasSuffix(p, ".rules.yaml") && !strings.Contains(p, "ex4a") && !strings.Contains(p, "ex9b") && !strings.Contains(p, "ex9c") {
			inputs = append(inputs, p) // one file per domain, as Envoy requires
		}
	}
	out, errOut, code := runInProcess(append([]string{"import-envoy", "--algorithm", "sliding_window"}, inputs...)...)
	if code != exitOK {
		t.Fatalf("import-envoy: code %d\n%s", code, errOut)
	}
	if !strings.Contains(out, "algorithm: sliding_window") || strings.Count(out, "- name:") < 15 {
		t.Fatalf("output:\n%s", out)
	}
	rulesFile := writeFile(t, dir, "converted.yaml", out)
	if vout, verr, code := runInProcess("validate", "--config", rulesFile); code != exitOK {
		t.Fatalf("validate: %s %s", vout, verr)
	}

	bad := writeFile(t, dir, "bad.yaml", "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n")
	out, errOut, code = runInProcess("import-envoy", bad)
	if code != exitFailure || out != "" || !strings.Contains(errOut, "bad.yaml:5: descriptors[0].rate_limit.unit") {
		t.Fatalf("bad file: code %d out %q err %q", code, out, errOut)
	}
	if _, _, code := runInProcess("import-envoy"); code != exitUsage {
		t.Fatalf("no files: code %d", code)
	}
	if _, _, code := runInProcess("import-envoy", "--algorithm", "leaky_bucket", bad); code != exitUsage {
		t.Fatalf("bad --algorithm: code %d", code)
	}
	out, errOut, code = runInProcess("import-envoy", "--mode", "global", inputs[0])
	if code != exitOK || !strings.Contains(out, "    mode: global\n") {
		t.Fatalf("--mode global: code %d %s\n%s", code, errOut, out)
	}
	if _, _, code := runInProcess("import-envoy", "--mode", "exact", inputs[0]); code != exitUsage {
		t.Fatalf("bad --mode: code %d", code)
	}
	// A '*' inside a value: a wildcard by default (envoyproxy/ratelimit since #1085); under
	// --wildcards trailing a literal character, which rlsidecar cannot match in path.
	mid := "../../envoyrls/testdata/readme/ex9b.yaml"
	out, errOut, code = runInProcess("import-envoy", mid)
	if code != exitOK || !strings.Contains(out, `path: { glob: "/api/*/action" }`) {
		t.Fatalf("middle wildcard: code %d %s\n%s", code, errOut, out)
	}
	if _, errOut, code := runInProcess("import-envoy", "--wildcards", "trailing", mid); code != exitFailure || !strings.Contains(errOut, "matches only this exact value") {
		t.Fatalf("--wildcards trailing: code %d %s", code, errOut)
	}
	if _, _, code := runInProcess("import-envoy", "--wildcards", "middle", mid); code != exitUsage {
		t.Fatalf("bad --wildcards: code %d", code)
	}
}

// SIGTERM with the Envoy listener: both sockets removed, exit 0, no call cut.
func TestE2EEnvoyRLSSigterm(t *testing.T) {
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) { testE2EEnvoyRLSSigterm(t, tr) })
	}
}

func testE2EEnvoyRLSSigterm(t *testing.T, transport string) {
	f := startEnvoyDaemon(t, envoyRules, "--envoy-rls-transport", transport)
	f.call(t, "edge", 0, desc("remote_address=1.2.3.4"))
	sock := strings.TrimPrefix(argAfter(f.d, "--envoy-rls"), "unix:")
	if err := f.d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-f.d.done:
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, f.d.stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no exit within 10s of SIGTERM")
	}
	for _, p := range []string{f.d.socket, sock} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s left behind: %v", p, err)
		}
	}
}

// A second daemon cannot take a live Envoy socket; it says so and exits.
func TestE2EEnvoyRLSAddressInUse(t *testing.T) {
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) { testE2EEnvoyRLSAddressInUse(t, tr) })
	}
}

func testE2EEnvoyRLSAddressInUse(t *testing.T, transport string) {
	f := startEnvoyDaemon(t, envoyRules, "--envoy-rls-transport", transport)
	sock := argAfter(f.d, "--envoy-rls")
	dir := shortTempDir(t)
	out, err := runCLI(t, "serve", "--admin=", "--socket", filepath.Join(dir, "s.sock"), "--envoy-rls", sock)
	if err == nil || !strings.Contains(out, "another server is serving this socket") {
		t.Fatalf("err=%v out=%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "s.sock")); !os.IsNotExist(err) {
		t.Errorf("the msgpack socket was left behind: %v", err)
	}
}

func argAfter(d *daemonProc, flag string) string {
	for i, a := range d.cmd.Args {
		if a == flag && i+1 < len(d.cmd.Args) {
			return d.cmd.Args[i+1]
		}
	}
	return ""
}

// Decisions asked over gRPC are counted like the socket's: a shadow rule's rejections as
// shadow_rejected, a real one's as rejected; and every call is observed in the check
// latency histogram.
func TestE2EEnvoyRLSMetrics(t *testing.T) {
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) { testE2EEnvoyRLSMetrics(t, tr) })
	}
}

func testE2EEnvoyRLSMetrics(t *testing.T, transport string) {
	f := startEnvoyDaemon(t, envoyRules, "--envoy-rls-transport", transport, "--admin", "127.0.0.1:0")
	base := "http://" + adminAddr(t, f.d)
	// user-a is a fixed window of 1 per second, aligned to the second: start just after
	// a second turns, so that the three calls fall in one window (a fresh-clone CI run
	// crossed a second and counted 2 allowed).
	time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second + 20*time.Millisecond)))
	for range 3 {
		f.call(t, "example6", 0, desc("service=auth", "user=user-a"))
		f.call(t, "edge", 0, desc("remote_address=50.0.0.5"))
	}
	_, samples := scrape(t, base)
	for name, want := range map[string]float64{
		`rlsidecar_checks_total{rule="user-a",result="allowed"}`:         1,
		`rlsidecar_checks_total{rule="user-a",result="shadow_rejected"}`: 2,
		`rlsidecar_checks_total{rule="blocked",result="rejected"}`:       3,
		`rlsidecar_check_duration_seconds_count`:                         6,
	} {
		if samples[name] != want {
			t.Errorf("%s = %v, want %v", name, samples[name], want)
		}
	}
}

// An unknown --envoy-rls-transport is a usage error, from the flag or the environment.
func TestEnvoyRLSTransportFlag(t *testing.T) {
	out, errOut, code := runInProcess("serve", "--admin=", "--envoy-rls-transport", "http3")
	if code != exitUsage || !strings.Contains(errOut, "--envoy-rls-transport") {
		t.Fatalf("code %d out %q err %q", code, out, errOut)
	}
	t.Setenv("RLSIDECAR_ENVOY_RLS_TRANSPORT", "quic")
	if _, errOut, code := runInProcess("serve", "--admin="); code != exitUsage || !strings.Contains(errOut, "quic") {
		t.Fatalf("from the environment: code %d err %q", code, errOut)
	}
}

// The log names the port the Envoy API bound where --envoy-rls asked for one (:0), as it
// names the admin endpoint's: before, it said 127.0.0.1:0, which no one can dial.
func TestE2EEnvoyLogsTheBoundPort(t *testing.T) {
	d := startDaemon(t, "--envoy-rls", "127.0.0.1:0")
	re := regexp.MustCompile(`msg="envoy rate limit service" addr=(\S+)`)
	var addr string
	for deadline := time.Now().Add(10 * time.Second); addr == ""; time.Sleep(10 * time.Millisecond) {
		if m := re.FindStringSubmatch(d.stderr.String()); m != nil {
			addr = m[1]
		} else if time.Now().After(deadline) {
			t.Fatalf("no Envoy API address in the log:\n%s", d.stderr.String())
		}
	}
	if strings.HasSuffix(addr, ":0") {
		t.Fatalf("the log names %s, not the port bound", addr)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health check at the logged %s: %v %v", addr, r, err)
	}
}

// Two rules allowing with 1 left each: the limiter names the first listed, per-second,
// and the Envoy answer's RateLimit fields, as the clients' (TestE2EHeadersTieListsLongestResetFirst),
// list first the one with the longest reset, per-day, so that a client reading only the
// first item sees the daily limit. Before, per-second came first.
func TestE2EEnvoyRLSHeadersTieListsLongestResetFirst(t *testing.T) {
	const tieRules = `
rules:
  - name: per-second
    match: { domain: edge, descriptor: ip }
    key: ip
    limit: { requests: 2, per: 1s }
  - name: per-day
    match: { domain: edge, descriptor: ip }
    key: ip
    limit: { requests: 2, per: 24h }
`
	for _, tr := range envoyrls.Transports {
		t.Run(tr, func(t *testing.T) {
			f := startEnvoyDaemon(t, tieRules, "--envoy-rls-transport", tr)
			resp := f.call(t, "edge", 0, desc("ip=192.0.2.44"))
			if resp.OverallCode != ok || resp.Statuses[0].LimitRemaining != 1 {
				t.Fatalf("call: %v, want OK with 1 left", resp)
			}
			h := headerMap(resp)
			if p := h["RateLimit-Policy"]; p != `"per-day";q=2;w=86400, "per-second";q=2;w=1` {
				t.Errorf("RateLimit-Policy %q, want per-day first", p)
			}
			if r := h["RateLimit"]; !strings.HasPrefix(r, `"per-day";r=1;t=`) || !strings.HasSuffix(r, `, "per-second";r=1;t=1`) {
				t.Errorf("RateLimit %q, want per-day first", r)
			}
		})
	}
}
