package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	rlclient "github.com/rlsidecar/rlsidecar/clients/go"
	"github.com/rlsidecar/rlsidecar/proto"
)

// zipfUsers returns n users: a tenth of them three hot users, the rest Zipf-distributed
// (s = 1.1) over a million, from a fixed seed so every client checks the same sequence.
func zipfUsers(n int) []string {
	r := rand.New(rand.NewPCG(12, 0xa))
	z := rand.NewZipf(r, 1.1, 1, 1_000_000-1)
	us := make([]string, n)
	for i := range us {
		if r.IntN(10) == 0 {
			us[i] = "hot-" + strconv.Itoa(r.IntN(3))
		} else {
			us[i] = strconv.FormatUint(z.Uint64(), 10)
		}
	}
	return us
}

// seqDriver is a client in another language running its sequential loop (seq.py, seq.js):
// each line written to it asks for that many checks, and it answers with the nanoseconds
// they took.
type seqDriver struct {
	name string
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Reader
}

func startDriver(b *testing.B, name string, cmd *exec.Cmd) *seqDriver {
	b.Helper()
	in, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatalf("starting the %s client's loop: %v", name, err)
	}
	b.Cleanup(func() {
		in.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	return &seqDriver{name: name, cmd: cmd, in: in, out: bufio.NewReader(out)}
}

// run makes the driver check n times in a row and returns the time it took and the CPU
// time its process spent, as the driver measured them (its start and the pipe are outside).
func (d *seqDriver) run(b *testing.B, n int) sample {
	if _, err := fmt.Fprintln(d.in, n); err != nil {
		b.Fatalf("%s client: %v", d.name, err)
	}
	line, err := d.out.ReadString('\n')
	if err != nil {
		b.Fatalf("%s client's loop ended: %v", d.name, err)
	}
	var wall, cpu int64
	if _, err := fmt.Sscan(line, &wall, &cpu); err != nil {
		b.Fatalf("%s client: %q: %v", d.name, line, err)
	}
	return sample{time.Duration(wall), time.Duration(cpu)}
}

// sample is one round of one client: wall-clock time, and CPU time of the client's process.
type sample struct{ wall, cpu time.Duration }

// cpuTime returns the CPU time (user + system) this process has used.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// BenchmarkClientsSequential: one check at a time, each awaited before the next, through
// the Go client (in this process), the Python client (clients/python, Debian's
// /usr/bin/python3) and the Node client (clients/node, after npm ci there), over one daemon
// with bench/rules.yaml (two rules match each check). Users follow a Zipf law over a
// million beside three hot ones, the same sequence for every client. The three loops take
// turns in rounds of b.N/rounds checks (rounds: $RLSIDECAR_CLIENTS_ROUNDS, default 9), so
// they share the machine's moments; each client's figure is its median round, and the
// ratios (python-vs-go, node-vs-go) are medians of the per-round ratios. The targets are
// Python ≤ 4× and Node ≤ 3× the Go client's time per check. Each client's own CPU time
// per check (*-cpu-ns/check: its process's user + system time) is reported beside.
func BenchmarkClientsSequential(b *testing.B) {
	root, err := filepath.Abs("..")
	if err != nil {
		b.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "clients/node/node_modules/@msgpack/msgpack")); err != nil {
		// The Node client's pinned dependencies (package-lock.json), as scripts/test-clients installs them.
		npm := exec.Command("npm", "ci", "--no-audit", "--no-fund", "--loglevel=error")
		npm.Dir = filepath.Join(root, "clients/node")
		if out, err := npm.CombinedOutput(); err != nil {
			b.Fatalf("npm ci in clients/node: %v\n%s", err, out)
		}
	}
	rls := startServer(b, "rlsidecar", "--config", "rules.yaml")
	keys := filepath.Join(b.TempDir(), "users")
	users := zipfUsers(50_000)
	if err := os.WriteFile(keys, []byte(strings.Join(users, "\n")+"\n"), 0o600); err != nil {
		b.Fatal(err)
	}
	py := startDriver(b, "Python", exec.Command("/usr/bin/python3", filepath.Join(root, "clients/python/bench/seq.py"), rls.socket, keys))
	node := startDriver(b, "Node", exec.Command("node", filepath.Join(root, "clients/node/bench/seq.js"), rls.socket, keys))

	c, err := rlclient.New(rlclient.Options{Socket: rls.socket, Conns: 1, Timeout: 5 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	attrs := make([][]proto.Attr, len(users))
	for i, u := range users {
		attrs[i] = []proto.Attr{{Name: "ip", Value: fmt.Sprintf("10.1.%d.%d", i/250%250, i%250)}, {Name: "method", Value: "POST"},
			{Name: "path", Value: "/v1/events/" + u + "/holds"}, {Name: "user", Value: "user-" + u}}
	}
	next := 0
	goRun := func(n int) sample {
		ctx := context.Background()
		start, cpu := time.Now(), cpuTime(b)
		for range n {
			d, err := c.CheckAttrs(ctx, attrs[next], nil)
			if err != nil || !d.Allowed || d.Degraded {
				b.Fatalf("Go client: %v %+v", err, d)
			}
			if next++; next == len(attrs) {
				next = 0
			}
		}
		return sample{time.Since(start), cpuTime(b) - cpu}
	}

	rounds := 9
	if s := os.Getenv("RLSIDECAR_CLIENTS_ROUNDS"); s != "" {
		if rounds, err = strconv.Atoi(s); err != nil || rounds < 1 {
			b.Fatalf("RLSIDECAR_CLIENTS_ROUNDS=%q: want a whole number ≥ 1", s)
		}
	}
	chunk := max(b.N/rounds, 1)
	// Warm up: connections, JITs, the daemon's keys.
	warm := min(chunk, 2000)
	goRun(warm)
	py.run(b, warm)
	node.run(b, warm)

	b.ResetTimer()
	var goNs, pyNs, nodeNs, pyRatio, nodeRatio, goCPU, pyCPU, nodeCPU []float64
	for r := range rounds {
		// Rotate who goes first, so no client always follows the same one.
		var tg, tp, tn sample
		switch r % 3 {
		case 0:
			tg, tp, tn = goRun(chunk), py.run(b, chunk), node.run(b, chunk)
		case 1:
			tp, tn, tg = py.run(b, chunk), node.run(b, chunk), goRun(chunk)
		default:
			tn, tg, tp = node.run(b, chunk), goRun(chunk), py.run(b, chunk)
		}
		per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(chunk) }
		goNs, pyNs, nodeNs = append(goNs, per(tg.wall)), append(pyNs, per(tp.wall)), append(nodeNs, per(tn.wall))
		pyRatio, nodeRatio = append(pyRatio, per(tp.wall)/per(tg.wall)), append(nodeRatio, per(tn.wall)/per(tg.wall))
		goCPU, pyCPU, nodeCPU = append(goCPU, per(tg.cpu)), append(pyCPU, per(tp.cpu)), append(nodeCPU, per(tn.cpu))
	}
	b.StopTimer()
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(median(goNs), "go-ns/check")
	b.ReportMetric(median(pyNs), "python-ns/check")
	b.ReportMetric(median(nodeNs), "node-ns/check")
	b.ReportMetric(median(pyRatio), "python-vs-go")
	b.ReportMetric(median(nodeRatio), "node-vs-go")
	// The client's own CPU per check (its process: encode, syscalls, decode, runtime),
	// which the machine's load does not inflate as it does wall-clock time.
	b.ReportMetric(median(goCPU), "go-cpu-ns/check")
	b.ReportMetric(median(pyCPU), "python-cpu-ns/check")
	b.ReportMetric(median(nodeCPU), "node-cpu-ns/check")
}
