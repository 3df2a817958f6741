// Command compare measures rlsidecar beside the transport floor (a do-nothing server on
// the same socket framing), golang.org/x/time/rate in process, and — when built with the
// "peers" tag — gubernator and envoyproxy/ratelimit, each driven through its own client API
// by the same load generator with one rule per request, in one run on one machine. It
// writes DIR/report.json, DIR/report.md and PNG charts. Run it through scripts/compare.
//
// It is its own Go module so the peers' dependencies never enter the daemon's go.mod.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// Report is report.json.
type Report struct {
	Started time.Time   `json:"started"`
	Machine string      `json:"machine"`
	Command string      `json:"command"`
	Latency []Row       `json:"latency"`
	Memory  []MemoryRow `json:"memory"`
	// RedisCost and Accuracy are the Redis phase (redis.go).
	RedisCost []CostRow     `json:"redis_cost"`
	Accuracy  []AccuracyRow `json:"accuracy"`
	// Differential is envoyproxy/ratelimit's answers beside rlsidecar's Envoy API's
	// (differential.go); nil when envoyproxy/ratelimit was not built.
	Differential *DiffReport `json:"differential"`
	Notes        []string    `json:"notes"`
}

// MemoryRow is the memory a system holds per active key.
type MemoryRow struct {
	System      string  `json:"system"`
	Keys        int     `json:"keys"`
	BytesPerKey float64 `json:"bytes_per_key"`
	Measure     string  `json:"measure"` // what was measured: the server's RSS, or Redis used_memory
}

type config struct {
	quick, smoke bool
	root         string
	phase        time.Duration // one closed-loop or pipelined measurement
	open         time.Duration // one open-loop measurement
	rounds       int           // rlsidecar/floor alternations
	memKeys      []int
	costChecks   int // checks per Redis cost measurement
}

func main() {
	quick := flag.Bool("quick", false, "a CI-sized run (under 5 minutes)")
	smoke := flag.Bool("smoke", false, "a seconds-long run of the harness itself, without peers")
	out := flag.String("out", "", "directory for report.json, report.md and the charts (required)")
	root := flag.String("root", "../..", "the rlsidecar repository whose daemon is measured")
	flag.Parse()
	if *out == "" {
		fmt.Fprintln(os.Stderr, "compare: -out DIR is required")
		os.Exit(2)
	}
	cfg := config{phase: 5 * time.Second, open: 4 * time.Second, rounds: 3, memKeys: []int{100_000, 1_000_000}, costChecks: 50_000}
	switch {
	case *smoke:
		cfg = config{smoke: true, phase: 300 * time.Millisecond, open: 300 * time.Millisecond, rounds: 1, memKeys: []int{10_000}, costChecks: 2_000}
	case *quick:
		cfg = config{quick: true, phase: 1500 * time.Millisecond, open: time.Second, rounds: 2, memKeys: []int{100_000}, costChecks: 10_000}
	}
	cfg.root = *root
	if err := run(cfg, *out); err != nil {
		fmt.Fprintln(os.Stderr, "\ncompare:", err)
		os.Exit(1)
	}
}

// command is how this run was started, as scripts/compare (which adds -root) was called.
func command() string {
	args := []string{"scripts/compare"}
	for i := 1; i < len(os.Args); i++ {
		if os.Args[i] == "-root" {
			i++
			continue
		}
		args = append(args, os.Args[i])
	}
	return strings.Join(args, " ")
}

func machine() string {
	model := "unknown cpu"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "model name") {
				model = strings.TrimSpace(strings.SplitN(line, ":", 2)[1])
				break
			}
		}
	}
	return fmt.Sprintf("%s, %d cores, %s %s/%s", model, runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

func run(cfg config, out string) error {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", out, err)
	}
	dir, err := os.MkdirTemp("", "rlscompare")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	rep := &Report{Started: time.Now().UTC(), Machine: machine(), Command: command()}

	bar := newProgress()
	bar.step("building rlsidecar and the floor server")
	if err := buildOurs(cfg.root, dir); err != nil {
		return err
	}
	ks := makeKeys(1<<16, 1_000_000)
	fr := frames(ks)
	rls, rlsSock, err := startRlsidecar(dir)
	if err != nil {
		return err
	}
	defer rls.stop()
	floor, floorSock, err := startFloor(dir)
	if err != nil {
		return err
	}
	defer floor.stop()
	ours := []*system{sockSystem("rlsidecar", rlsSock, fr), sockSystem("floor", floorSock, fr)}

	var peers []*system
	if !cfg.smoke {
		bar.step("building and starting the peers")
		ps, notes, stop := startPeers(dir, ks)
		defer stop()
		peers = ps
		rep.Notes = append(rep.Notes, notes...)
		if _, err := os.Stat(filepath.Join(dir, "peers", "service_cmd")); err == nil {
			bar.step("envoyproxy/ratelimit and rlsidecar's Envoy API: the same calls, answers compared")
			d, err := differential(dir, filepath.Join(dir, "peers"))
			if err != nil {
				rep.Notes = append(rep.Notes, fmt.Sprintf("differential phase: %v", err))
			}
			rep.Differential = d
		}
	}

	conns := []int{1, 16, 64}
	steps := cfg.rounds*len(conns)*2 + cfg.rounds*2 + len(peers)*len(conns) + 2 + (len(ours)+len(peers))*3 + len(cfg.memKeys)*(1+len(peers)) + 2 + 4*4
	bar.total(steps)

	// Closed loop, rlsidecar and the floor alternating round by round.
	best := map[string]float64{}
	var rows []Row
	for r := 0; r < cfg.rounds; r++ {
		for _, c := range conns {
			for _, s := range ours {
				bar.step(fmt.Sprintf("%s, %d conns (round %d)", s.name, c, r+1))
				row, err := closedLoop(s, ks, c, cfg.phase)
				if err != nil {
					return err
				}
				rows = append(rows, row)
			}
		}
		for _, s := range ours {
			bar.step(fmt.Sprintf("%s, pipelined 4 x 32 (round %d)", s.name, r+1))
			start := time.Now()
			n, lat, err := s.pipelined(4, 32, cfg.phase)
			if err != nil {
				return fmt.Errorf("%s pipelined: %w", s.name, err)
			}
			rows = append(rows, makeRow(s.name, 4, 32, "closed", lat, n, 0, time.Since(start)))
		}
	}
	for _, s := range peers {
		for _, c := range conns {
			bar.step(fmt.Sprintf("%s, %d conns", s.name, c))
			row, err := closedLoop(s, ks, c, cfg.phase)
			if err != nil {
				rep.Notes = append(rep.Notes, fmt.Sprintf("%s at %d conns failed: %v", s.name, c, err))
				continue
			}
			rows = append(rows, row)
		}
	}
	bar.step("golang.org/x/time/rate in process")
	rows = append(rows, inProcessRate(ks, 1, cfg.phase), inProcessRate(ks, 64, cfg.phase))
	bar.step("")
	rep.Latency = medians(rows)
	for _, row := range rep.Latency {
		if row.Depth == 1 && row.Load == "closed" && row.OpsPerS > best[row.System] {
			best[row.System] = row.OpsPerS
		}
	}

	// Open loop at 50, 80 and 95% of each system's measured maximum (closed loop, one
	// request in flight per connection), over a pool of 64 connections.
	for _, s := range append(append([]*system{}, ours...), peers...) {
		for _, f := range []float64{0.5, 0.8, 0.95} {
			bar.step(fmt.Sprintf("%s, open loop at %.0f%% of %.0f/s", s.name, f*100, best[s.name]))
			if best[s.name] == 0 {
				continue
			}
			row, err := openLoop(s, ks, 64, f*best[s.name], cfg.open, fmt.Sprintf("open@%.0f%%", f*100))
			if err != nil {
				rep.Notes = append(rep.Notes, fmt.Sprintf("%s open loop: %v", s.name, err))
				continue
			}
			rep.Latency = append(rep.Latency, row)
		}
	}

	// A checkpoint: a later phase that fails or hangs leaves these figures.
	if err := writeReport(rep, out); err != nil {
		return err
	}

	// Memory per active key.
	for _, n := range cfg.memKeys {
		bar.step(fmt.Sprintf("rlsidecar memory at %d keys", n))
		m, err := rlsidecarMemory(dir, n)
		if err != nil {
			return err
		}
		rep.Memory = append(rep.Memory, m)
		for _, s := range peers {
			bar.step(fmt.Sprintf("%s memory at %d keys", s.name, n))
			if s.memory == nil {
				continue
			}
			m, err := s.memory(n)
			if err != nil {
				rep.Notes = append(rep.Notes, fmt.Sprintf("%s memory at %d keys: %v", s.name, n, err))
				continue
			}
			rep.Memory = append(rep.Memory, m)
		}
	}
	if err := writeReport(rep, out); err != nil {
		return err
	}
	if err := redisPhase(cfg, dir, rep, bar); err != nil {
		return err
	}
	bar.done()

	if err := writeReport(rep, out); err != nil {
		return err
	}
	fmt.Printf("wrote %s\n", filepath.Join(out, "report.md"))
	return nil
}

// medians folds the rounds of each (system, conns, depth, load) into one row holding each
// column's median: the machine is shared, so one round can be slowed by a neighbour.
func medians(rows []Row) []Row {
	type key struct {
		sys          string
		conns, depth int
		load         string
	}
	groups := map[key][]Row{}
	var order []key
	for _, r := range rows {
		k := key{r.System, r.Conns, r.Depth, r.Load}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], r)
	}
	var out []Row
	for _, k := range order {
		g := groups[k]
		col := func(f func(Row) float64) float64 {
			v := make([]float64, len(g))
			for i, r := range g {
				v[i] = f(r)
			}
			return median(v)
		}
		var errs int64
		for _, r := range g {
			errs += r.Errors
		}
		out = append(out, Row{System: k.sys, Conns: k.conns, Depth: k.depth, Load: k.load,
			P50us: col(func(r Row) float64 { return r.P50us }), P99us: col(func(r Row) float64 { return r.P99us }),
			P999us: col(func(r Row) float64 { return r.P999us }), OpsPerS: col(func(r Row) float64 { return r.OpsPerS }), Errors: errs})
	}
	return out
}

func median(v []float64) float64 {
	for i := 1; i < len(v); i++ {
		for j := i; j > 0 && v[j] < v[j-1]; j-- {
			v[j], v[j-1] = v[j-1], v[j]
		}
	}
	if len(v) == 0 {
		return 0
	}
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// progress is a one-line progress bar on stderr when stderr is a terminal, and one line
// per step otherwise (a CI log keeps no carriage returns or escape codes).
type progress struct {
	n, of int
	start time.Time
	tty   bool
}

func newProgress() *progress {
	fi, err := os.Stderr.Stat()
	return &progress{start: time.Now(), tty: err == nil && fi.Mode()&os.ModeCharDevice != 0}
}

func (p *progress) total(n int) { p.of = p.n + n }

func (p *progress) step(what string) {
	p.n++
	of := max(p.of, p.n)
	const width = 30
	fill := p.n * width / of
	if !p.tty {
		fmt.Fprintf(os.Stderr, "%3d/%d %5.0fs %s\n", p.n, of, time.Since(p.start).Seconds(), what)
		return
	}
	fmt.Fprintf(os.Stderr, "\r\033[K[%s%s] %3d/%d %5.0fs %s", strings.Repeat("#", fill), strings.Repeat(".", width-fill),
		p.n, of, time.Since(p.start).Seconds(), what)
}

func (p *progress) done() {
	if !p.tty {
		fmt.Fprintf(os.Stderr, "done in %.0fs\n", time.Since(p.start).Seconds())
		return
	}
	fmt.Fprintf(os.Stderr, "\r\033[Kdone in %.0fs\n", time.Since(p.start).Seconds())
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// redisPhase measures what a check costs Redis (hot and sparse keys) and how closely a
// limit shared by two instances holds, for rlsidecar's hybrid and global modes and the
// peers that apply.
func redisPhase(cfg config, dir string, rep *Report, bar *progress) error {
	bar.step("starting rlsidecar (hybrid and global) on Redis")
	systems, stop, err := startRlsidecarRedis(dir)
	if err != nil {
		return err
	}
	defer stop()
	if !cfg.smoke {
		bar.step("starting the peers of the Redis phase")
		ps, notes, stopPeers := startRedisPeers(dir)
		defer stopPeers()
		systems = append(systems, ps...)
		rep.Notes = append(rep.Notes, notes...)
	}
	for si, s := range systems {
		if s.redisPort != 0 {
			for _, shape := range []string{"hot", "sparse"} {
				bar.step(fmt.Sprintf("%s: Redis cost, %s keys", s.name, shape))
				keys := hotKeys(cfg.costChecks)
				if shape == "sparse" {
					keys = sparseKeys(cfg.costChecks)
				}
				row, err := redisCost(s, shape, keys)
				if err != nil {
					rep.Notes = append(rep.Notes, fmt.Sprintf("Redis cost of %s, %s keys: %s", s.name, shape, firstLine(err)))
					continue
				}
				rep.RedisCost = append(rep.RedisCost, row)
			}
		}
		for ki, shape := range []string{"hot", "sparse"} {
			bar.step(fmt.Sprintf("%s: accuracy, %s keys, %d instances", s.name, shape, s.instances))
			row, err := accuracy(s, shape, 4_000_000_000+(si*2+ki)*1000)
			if err != nil {
				rep.Notes = append(rep.Notes, fmt.Sprintf("accuracy of %s, %s keys: %s", s.name, shape, firstLine(err)))
				continue
			}
			rep.Accuracy = append(rep.Accuracy, row)
		}
	}
	return nil
}

// firstLine is an error's first line (errors.Join of one per connection repeats itself),
// with how many more there were.
func firstLine(err error) string {
	lines := strings.Split(err.Error(), "\n")
	if len(lines) == 1 {
		return lines[0]
	}
	return fmt.Sprintf("%s (and %d more)", lines[0], len(lines)-1)
}
