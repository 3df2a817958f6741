// Package bench measures rlsidecar over its real socket, beside a do-nothing server that
// speaks the same framing (floorserver), in the same run, and reports ratios: the
// machines these run on are shared and noisy, so absolute figures vary and ratios carry
// the claim.
//
//	go test ./bench -run '^$' -bench . -benchtime 100000x
package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	rlclient "github.com/rlsidecar/rlsidecar/clients/go"
	"github.com/rlsidecar/rlsidecar/proto"
)

var binDir string

func TestMain(m *testing.M) {
	if socket := os.Getenv(goodClientEnv); socket != "" {
		os.Exit(goodClientMain(socket))
	}
	dir, err := os.MkdirTemp("", "rlsbench")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	for _, pkg := range []string{"../cmd/rlsidecar", "./floorserver", "./grpcfloor", "./h2floor"} {
		args := []string{"build", "-o", dir}
		if tags := os.Getenv("RLSIDECAR_BENCH_TAGS"); tags != "" && pkg == "../cmd/rlsidecar" {
			// A measurement build of the daemon, e.g. rlsidecar_nostore (limiter/applylocal_nostore.go).
			args = append(args, "-tags", tags)
		}
		out, err := exec.Command("go", append(args, pkg)...).CombinedOutput()
		if err != nil {
			fmt.Fprintf(os.Stderr, "building %s: %v\n%s", pkg, err, out)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// server is a benchmarked process listening on a socket.
type server struct {
	name     string
	socket   string
	envoy    string // the Envoy rate limit service's socket, when served
	cmd      *exec.Cmd
	stopOnce sync.Once
}

func startServer(tb testing.TB, name string, args ...string) *server {
	tb.Helper()
	return startServerAt(tb, name, name+".sock", args...)
}

// startServerAt is startServer on the socket sockName, for two servers of one binary.
func startServerAt(tb testing.TB, name, sockName string, args ...string) *server {
	tb.Helper()
	socket := filepath.Join(binDir, sockName)
	cmd := exec.Command(filepath.Join(binDir, name), append(args, "--socket", socket)...)
	if name == "rlsidecar" || name == vsName {
		if prof := os.Getenv("RLSIDECAR_BENCH_CPUPROFILE"); prof != "" && name == "rlsidecar" {
			args = append(args, "--cpuprofile", prof) // profile the daemon under the benchmark's load
		}
		cmd = exec.Command(filepath.Join(binDir, name), append([]string{"serve", "--socket", socket, "--admin=", "--log-level", "warn"}, args...)...)
		if n := os.Getenv("RLSIDECAR_BENCH_NICE"); n != "" {
			// Run the daemon at this niceness (negative: priority over the load
			// generators and other jobs, as systemd Nice= would give it; needs root).
			cmd = exec.Command("nice", append([]string{"-n", n}, cmd.Args...)...)
		}
	}
	// The benchmark's own settings are not the daemon's (it would warn that no flag
	// takes them).
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "RLSIDECAR_BENCH_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	br := bufio.NewReader(stdout)
	line, _ := br.ReadString('\n')
	if !strings.Contains(line, "listening") {
		cmd.Process.Kill()
		tb.Fatalf("%s did not start: %q", name, line)
	}
	go io.Copy(io.Discard, br)
	s := &server{name: name, socket: socket, cmd: cmd}
	tb.Cleanup(s.stop)
	return s
}

// stop ends the server with SIGTERM (which lets a CPU profile be written), or SIGKILL
// after 5 s, and waits for it. It may be called more than once.
func (s *server) stop() {
	s.stopOnce.Do(func() {
		s.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { s.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			s.cmd.Process.Kill()
			<-done
		}
	})
}

// selfCPU returns the CPU time, user and system, this process (the load generator) has
// used.
func selfCPU(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// readsWrites returns the read and the write system calls the server has made, apart.
func (s *server) readsWrites(tb testing.TB) (reads, writes float64) {
	return readsWrites(tb, s.cmd.Process.Pid)
}

// readsWrites returns the read and the write system calls process pid has made
// (/proc/PID/io: syscr, syscw).
func readsWrites(tb testing.TB, pid int) (reads, writes float64) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		tb.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		v, _ := strconv.ParseFloat(strings.TrimSpace(line[min(6, len(line)):]), 64)
		switch {
		case strings.HasPrefix(line, "syscr:"):
			reads = v
		case strings.HasPrefix(line, "syscw:"):
			writes = v
		}
	}
	return reads, writes
}

// cpuSeconds returns the CPU time, user and system, the server has used (/proc/PID/stat,
// in clock ticks of 10 ms).
func (s *server) cpuSeconds(tb testing.TB) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", s.cmd.Process.Pid))
	if err != nil {
		tb.Fatal(err)
	}
	// The fields after the command name, which is in parentheses and may hold spaces:
	// utime and stime are the 12th and 13th.
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+1:]))
	utime, _ := strconv.ParseFloat(f[11], 64)
	stime, _ := strconv.ParseFloat(f[12], 64)
	return (utime + stime) / 100 // USER_HZ is 100 on Linux
}

func (s *server) rssMB(tb testing.TB) float64 { return s.statusMB(tb, "VmRSS:") }

// anonMB is the part of the RSS that is the process's own memory (heap, stacks), not
// pages of its executable, which the kernel shares and can drop.
func (s *server) anonMB(tb testing.TB) float64 { return s.statusMB(tb, "RssAnon:") }

// statusMB reads a kB field of the server's /proc/PID/status, in MB.
func (s *server) statusMB(tb testing.TB, field string) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	if err != nil {
		tb.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, field) {
			kb, _ := strconv.Atoi(strings.Fields(line)[1])
			return float64(kb) / 1024
		}
	}
	tb.Fatalf("no %s in /proc/PID/status", field)
	return 0
}

// frames returns n pre-encoded two-rule check requests over distinct users and ips.
func frames(n int, distinct int) [][]byte {
	out := make([][]byte, n)
	enc := proto.NewEncoder()
	for i := range out {
		enc.Reset()
		u := i % distinct
		enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
			{Name: "method", Value: "POST"},
			{Name: "path", Value: "/v1/events/" + strconv.Itoa(u%97) + "/holds"},
			{Name: "user", Value: "user-" + strconv.Itoa(u)},
			{Name: "ip", Value: "10.0." + strconv.Itoa(u/256%256) + "." + strconv.Itoa(u%256)},
		}})
		out[i] = append([]byte(nil), enc.Bytes()...)
	}
	return out
}

type client struct {
	c   net.Conn
	br  *bufio.Reader
	buf []byte
	out []byte
	// at is where in its frames the next pipelined run starts: each run goes on from
	// the last, so that a load of many runs walks all of its frames (and clients), not
	// the first run's share again and again.
	at int
	// verify, when set, checks every answer read.
	verify func(body []byte) error
}

func dial(tb testing.TB, socket string) *client {
	c, err := net.Dial("unix", socket)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close() })
	return &client{c: c, br: bufio.NewReaderSize(c, 64<<10)}
}

func (c *client) readOne() error {
	var err error
	c.buf, err = proto.ReadFrame(c.br, c.buf, 1<<20)
	if err == nil && c.verify != nil {
		err = c.verify(c.buf)
	}
	return err
}

// roundTrips sends n requests one at a time and returns each round trip's duration.
func (c *client) roundTrips(fr [][]byte, n int, lat []time.Duration) ([]time.Duration, error) {
	for i := 0; i < n; i++ {
		f := fr[i%len(fr)]
		start := time.Now()
		if _, err := c.c.Write(f); err != nil {
			return lat, err
		}
		if err := c.readOne(); err != nil {
			return lat, err
		}
		lat = append(lat, time.Since(start))
	}
	return lat, nil
}

// pipelined sends n requests keeping up to inflight outstanding, writing as many new
// requests as it has read answers, in one write.
func (c *client) pipelined(fr [][]byte, n, inflight int) error {
	sent, recvd := 0, 0
	defer func() { c.at = (c.at + sent) % len(fr) }()
	for recvd < n {
		c.out = c.out[:0]
		for sent < n && sent-recvd < inflight {
			c.out = append(c.out, fr[(c.at+sent)%len(fr)]...)
			sent++
		}
		if len(c.out) > 0 {
			if _, err := c.c.Write(c.out); err != nil {
				return err
			}
		}
		if err := c.readOne(); err != nil {
			return err
		}
		recvd++
		for recvd < n && c.br.Buffered() >= proto.HeaderSize {
			if int(proto.FrameLength(mustPeek(c.br))) > c.br.Buffered()-proto.HeaderSize {
				break
			}
			if err := c.readOne(); err != nil {
				return err
			}
			recvd++
		}
	}
	return nil
}

// runPipelined sends n requests spread over cs, each connection keeping inflight
// requests outstanding, and returns the wall time.
func runPipelined(b *testing.B, cs []*client, fr [][]byte, n, inflight int) time.Duration {
	return runParts(b, cs, func(i int) [][]byte { return fr[i*7%len(fr):] }, n, inflight)
}

// runParts is runPipelined with connection i sending part(i), in a loop.
func runParts(b *testing.B, cs []*client, part func(i int) [][]byte, n, inflight int) time.Duration {
	var wg sync.WaitGroup
	start := time.Now()
	per := n / len(cs)
	for i, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.pipelined(part(i), per, inflight); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
	return time.Since(start)
}

func mustPeek(br *bufio.Reader) []byte {
	b, _ := br.Peek(proto.HeaderSize)
	return b
}

func percentile(d []time.Duration, p float64) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[int(float64(len(s)-1)*p)]
}

// benchEnvCount reads a count ≥ 1 from the environment variable name, def if unset.
func benchEnvCount(tb testing.TB, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		tb.Fatalf("%s=%q: want a count ≥ 1", name, v)
	}
	return n
}

// benchEnvDuration reads a duration > 0 from the environment variable name, def if unset.
func benchEnvDuration(tb testing.TB, name string, def time.Duration) time.Duration {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		tb.Fatalf("%s=%q: want a duration > 0", name, v)
	}
	return d
}

// vsName is the name, in binDir, of the rlsidecar binary RLSIDECAR_BENCH_VS names.
const vsName = "rlsidecar-vs"

// installVS copies the binary RLSIDECAR_BENCH_VS names into binDir as vsName, for
// startServer; false when it is not set.
func installVS(tb testing.TB) bool {
	vs := os.Getenv("RLSIDECAR_BENCH_VS")
	if vs == "" {
		return false
	}
	bin, err := os.ReadFile(vs)
	if err == nil {
		err = os.WriteFile(filepath.Join(binDir, vsName), bin, 0o755)
	}
	if err != nil {
		tb.Fatalf("RLSIDECAR_BENCH_VS: %v", err)
	}
	return true
}

// startPair starts the floor server and rlsidecar. With RLSIDECAR_BENCH_VS set to the path
// of another rlsidecar binary (a build of main, say), that daemon takes the floor's place,
// with the same flags as rlsidecar (and RLSIDECAR_BENCH_VS_ARGS's): the floor-* figures
// are then its, and the ratios compare two builds of the daemon in the same run.
//
//	git archive main | tar -x -C /tmp/main && (cd /tmp/main && go build -o /tmp/rls-main ./cmd/rlsidecar)
//	RLSIDECAR_BENCH_VS=/tmp/rls-main go test ./bench -run '^$' -bench 'SocketThroughput4x32$' -benchtime 600000x -count 5
func startPair(b *testing.B) (floor, rls *server) {
	if installVS(b) {
		// RLSIDECAR_BENCH_VS_ARGS: flags for that daemon alone, e.g. --prefetch-from=0 to
		// compare this build with itself, not fetching ahead.
		vsArgs := append([]string{"--config", "rules.yaml"}, strings.Fields(os.Getenv("RLSIDECAR_BENCH_VS_ARGS"))...)
		return startServer(b, vsName, vsArgs...), startServer(b, "rlsidecar", "--config", "rules.yaml")
	}
	return startServer(b, "floorserver"), startServer(b, "rlsidecar", "--config", "rules.yaml")
}

// BenchmarkSocketLatency: one connection, one request at a time; b.N round trips per
// server, alternating in chunks so both see the same machine.
func BenchmarkSocketLatency(b *testing.B) {
	floor, rls := startPair(b)
	fr := frames(4096, 4096)
	cf, cr := dial(b, floor.socket), dial(b, rls.socket)
	var lf, lr []time.Duration
	// Warm up both.
	cf.roundTrips(fr, 2000, nil)
	cr.roundTrips(fr, 2000, nil)
	b.ResetTimer()
	const chunk = 1000
	for done := 0; done < b.N; done += chunk {
		n := min(chunk, b.N-done)
		var err error
		if lf, err = cf.roundTrips(fr, n, lf); err != nil {
			b.Fatal(err)
		}
		if lr, err = cr.roundTrips(fr, n, lr); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	pf, pr := percentile(lf, 0.5), percentile(lr, 0.5)
	b.ReportMetric(float64(pf.Nanoseconds())/1e3, "floor-p50-µs")
	b.ReportMetric(float64(pr.Nanoseconds())/1e3, "rlsidecar-p50-µs")
	b.ReportMetric(float64(percentile(lr, 0.99).Nanoseconds())/1e3, "rlsidecar-p99-µs")
	b.ReportMetric(float64(pr)/float64(pf), "p50-ratio")
}

func throughput(b *testing.B, conns, inflight int) {
	floor, rls := startPair(b)
	// The load: 8,192 users (two keys each), every connection walking all of them a few
	// frames apart, so a key is checked on several connections within microseconds. Two
	// settings change its shape, to see what a figure depends on:
	// RLSIDECAR_BENCH_USERS=N checks N users; RLSIDECAR_BENCH_SPLIT=1 gives each
	// connection its own share of them, so that no key is checked on two connections.
	users := 8192
	if v := os.Getenv("RLSIDECAR_BENCH_USERS"); v != "" {
		var err error
		if users, err = strconv.Atoi(v); err != nil || users < 1 {
			b.Fatalf("RLSIDECAR_BENCH_USERS=%q: want a count of users", v)
		}
	}
	fr := frames(max(8192, users), users)
	sameAnswerSize(b, floor, rls, fr)
	part := func(i int) [][]byte { return fr[i*7%len(fr):] }
	if os.Getenv("RLSIDECAR_BENCH_SPLIT") == "1" {
		if users < conns {
			b.Fatalf("RLSIDECAR_BENCH_SPLIT: %d users cannot be split between %d connections", users, conns)
		}
		parts := make([][][]byte, conns)
		for j, f := range fr { // frame j is user j % users's (see frames)
			i := j % users * conns / users
			parts[i] = append(parts[i], f)
		}
		part = func(i int) [][]byte { return parts[i] }
	}
	// Each run carries a profiler label naming its server, so that go test -cpuprofile
	// separates the load generator's own work on each (go tool pprof -tagfocus
	// server=rlsidecar); what no label covers is its runtime waiting and waking.
	run := func(s *server, cs []*client, n int) (d time.Duration) {
		pprof.Do(context.Background(), pprof.Labels("server", s.name), func(context.Context) {
			d = runParts(b, cs, part, n, inflight)
		})
		return d
	}
	var cf, cr []*client
	for i := 0; i < conns; i++ {
		cf = append(cf, dial(b, floor.socket))
		cr = append(cr, dial(b, rls.socket))
	}
	run(floor, cf, conns*2000)
	run(rls, cr, conns*2000)
	b.ResetTimer()
	var tf, tr time.Duration
	var total int
	rdF, wrF := floor.readsWrites(b)
	rdR, wrR := rls.readsWrites(b)
	cpuF, cpuR := floor.cpuSeconds(b), rls.cpuSeconds(b)
	// The load generator's CPU while it drives each server: the same per request for
	// both when it does the same work (same requests, same answer sizes).
	var genF, genR time.Duration
	var crF, crR float64 // and its reads
	chunk := max(conns*inflight*50, 20000)
	for total < b.N {
		n := min(chunk, b.N-total)
		n = max(n/conns, 1) * conns
		g := selfCPU(b)
		r0, _ := readsWrites(b, os.Getpid())
		tf += run(floor, cf, n)
		g2 := selfCPU(b)
		r1, _ := readsWrites(b, os.Getpid())
		tr += run(rls, cr, n)
		r2, _ := readsWrites(b, os.Getpid())
		crF += r1 - r0
		crR += r2 - r1
		genF, genR = genF+g2-g, genR+selfCPU(b)-g2
		total += n
	}
	b.StopTimer()
	// Its read system calls per request: the same for both, where its CPU is not: it
	// waits more often for the slower server, and waiting costs (the scheduler polls
	// and sleeps: ~30% of the generator's CPU, under go test -cpuprofile).
	b.ReportMetric(crF/float64(total), "floor-client-reads/req")
	b.ReportMetric(crR/float64(total), "rlsidecar-client-reads/req")
	b.ReportMetric(genF.Seconds()/float64(total)*1e6, "floor-client-cpu-µs/req")
	b.ReportMetric(genR.Seconds()/float64(total)*1e6, "rlsidecar-client-cpu-µs/req")
	rdF2, wrF2 := floor.readsWrites(b)
	rdR2, wrR2 := rls.readsWrites(b)
	cpuF, cpuR = floor.cpuSeconds(b)-cpuF, rls.cpuSeconds(b)-cpuR
	b.ReportMetric((rdF2-rdF+wrF2-wrF)/float64(total), "floor-syscalls/req")
	b.ReportMetric((rdR2-rdR+wrR2-wrR)/float64(total), "rlsidecar-syscalls/req")
	// Reads per write: above 1 when a read finds the socket empty (EAGAIN) before the
	// netpoller wakes the connection for its next batch.
	b.ReportMetric((rdF2-rdF)/(wrF2-wrF), "floor-reads/write")
	b.ReportMetric((rdR2-rdR)/(wrR2-wrR), "rlsidecar-reads/write")
	// Requests per write: the mean batch answered with one write.
	b.ReportMetric(float64(total)/(wrF2-wrF), "floor-req/write")
	b.ReportMetric(float64(total)/(wrR2-wrR), "rlsidecar-req/write")
	// Each server's own CPU per request: unlike the rates, it hardly depends on what else
	// the machine runs (10 ms ticks: run ≥ 100,000 requests for a figure to ±10%).
	b.ReportMetric(cpuF/float64(total)*1e6, "floor-cpu-µs/req")
	b.ReportMetric(cpuR/float64(total)*1e6, "rlsidecar-cpu-µs/req")
	rf, rr := float64(total)/tf.Seconds(), float64(total)/tr.Seconds()
	b.ReportMetric(rf, "floor-req/s")
	b.ReportMetric(rr, "rlsidecar-req/s")
	b.ReportMetric(rr/rf, "throughput-ratio")
}

// sameAnswerSize fails b unless the floor answers fr's frames with as many bytes as
// rlsidecar does: the load generator then does the same work for both (it reads and
// copies every answer), and the ratio measures the servers alone.
func sameAnswerSize(b *testing.B, floor, rls *server, fr [][]byte) {
	cf, cr := dial(b, floor.socket), dial(b, rls.socket)
	for _, f := range fr[:16] {
		var n [2]int
		for i, c := range []*client{cf, cr} {
			if _, err := c.c.Write(f); err != nil {
				b.Fatal(err)
			}
			if err := c.readOne(); err != nil {
				b.Fatal(err)
			}
			n[i] = len(c.buf)
		}
		if n[0] != n[1] {
			b.Fatalf("the floor answers with %d bytes, rlsidecar with %d: the load generator would not do the same work for both (see floorserver's canned answer)", n[0], n[1])
		}
	}
}

// BenchmarkSocketThroughput4x32: 4 connections, 32 requests in flight on each.
func BenchmarkSocketThroughput4x32(b *testing.B) { throughput(b, 4, 32) }

// BenchmarkSocketThroughput64: 64 connections, 4 requests in flight on each.
func BenchmarkSocketThroughput64(b *testing.B) { throughput(b, 64, 4) }

// BenchmarkMemory1MKeys: the daemon's RSS after 1,000,000 distinct clients each made a
// request (two keys each would double it; this is one rule's worth: per-user).
func BenchmarkMemory1MKeys(b *testing.B) {
	dir := b.TempDir()
	cfg := filepath.Join(dir, "rules.yaml")
	os.WriteFile(cfg, []byte("rules:\n  - name: per-user\n    key: user\n    limit: { requests: 100, per: 1h }\n"), 0o644)
	rls := startServer(b, "rlsidecar", "--config", cfg)
	const keys = 1_000_000
	const conns = 4
	before, beforeAnon := rls.rssMB(b), rls.anonMB(b)
	b.ResetTimer()
	var wg sync.WaitGroup
	for c := 0; c < conns; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cl := dial(b, rls.socket)
			enc := proto.NewEncoder()
			var fr [][]byte
			for i := c; i < keys; i += conns {
				enc.Reset()
				enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "user-" + strconv.Itoa(i)}}})
				fr = append(fr, append([]byte(nil), enc.Bytes()...))
			}
			if err := cl.pipelined(fr, len(fr), 256); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(before, "idle-RSS-MB")
	b.ReportMetric(rls.rssMB(b), "RSS-MB-1M-keys")
	// Of which the daemon's own memory: the rest is its executable's pages.
	b.ReportMetric(beforeAnon, "idle-anon-MB")
	b.ReportMetric(rls.anonMB(b), "anon-MB-1M-keys")
}

// BenchmarkSocketGoClient4x32: the same 4 × 32 load through the Go client (clients/go),
// as a Go gateway would send it: 4 pooled connections, 128 goroutines each with one
// check in flight, every answer decoded.
func BenchmarkSocketGoClient4x32(b *testing.B) {
	floor, rls := startPair(b)
	const conns, inflight = 4, 32
	newClient := func(s *server) *rlclient.Client {
		c, err := rlclient.New(rlclient.Options{Socket: s.socket, Conns: conns, Timeout: 5 * time.Second})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close() })
		return c
	}
	attrs := make([][]proto.Attr, conns*inflight)
	for i := range attrs {
		u := strconv.Itoa(i * 61)
		attrs[i] = []proto.Attr{{Name: "ip", Value: "10.1.0." + strconv.Itoa(i)}, {Name: "method", Value: "POST"},
			{Name: "path", Value: "/v1/events/" + u + "/holds"}, {Name: "user", Value: "user-" + u}}
	}
	run := func(c *rlclient.Client, n int) time.Duration {
		var wg sync.WaitGroup
		start := time.Now()
		for g := range attrs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx := context.Background()
				for i := 0; i < n/len(attrs); i++ {
					d, err := c.CheckAttrs(ctx, attrs[g], nil)
					if err != nil || d.Unreachable {
						b.Errorf("check: %v %+v", err, d)
						return
					}
				}
			}()
		}
		wg.Wait()
		return time.Since(start)
	}
	cf, cr := newClient(floor), newClient(rls)
	run(cf, 20000)
	run(cr, 20000)
	b.ResetTimer()
	var tf, tr time.Duration
	total := 0
	for total < b.N {
		n := max(min(50000, b.N-total)/len(attrs), 1) * len(attrs)
		tf += run(cf, n)
		tr += run(cr, n)
		total += n
	}
	b.StopTimer()
	rf, rr := float64(total)/tf.Seconds(), float64(total)/tr.Seconds()
	b.ReportMetric(rf, "floor-req/s")
	b.ReportMetric(rr, "rlsidecar-req/s")
	b.ReportMetric(rr/rf, "throughput-ratio")
}
