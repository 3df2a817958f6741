package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

func find(rows []Row, sys string, conns, depth int, load string) (Row, bool) {
	for _, r := range rows {
		if r.System == sys && r.Conns == conns && r.Depth == depth && r.Load == load {
			return r, true
		}
	}
	return Row{}, false
}

// ratios are the targets, computed from this run's rows.
func ratios(rows []Row) []string {
	var out []string
	rl1, ok := find(rows, "rlsidecar", 1, 1, "closed")
	if !ok {
		return nil
	}
	for _, peer := range []string{"gubernator", "envoy-ratelimit"} {
		if p, ok := find(rows, peer, 1, 1, "closed"); ok && rl1.P50us > 0 {
			out = append(out, fmt.Sprintf("p50 at 1 conn: %s / rlsidecar = %.1fx", peer, p.P50us/rl1.P50us))
		}
	}
	// rlsidecar's Envoy API beside envoyproxy/ratelimit: the same gRPC client and load.
	if re1, ok := find(rows, "rlsidecar-envoy", 1, 1, "closed"); ok && re1.P50us > 0 {
		if p, ok := find(rows, "envoy-ratelimit", 1, 1, "closed"); ok {
			out = append(out, fmt.Sprintf("p50 at 1 conn over Envoy's gRPC API: envoy-ratelimit / rlsidecar-envoy = %.1fx", p.P50us/re1.P50us))
		}
	}
	if re64, ok := find(rows, "rlsidecar-envoy", 64, 1, "closed"); ok {
		if p, ok := find(rows, "envoy-ratelimit", 64, 1, "closed"); ok && p.OpsPerS > 0 {
			out = append(out, fmt.Sprintf("throughput at 64 conns over Envoy's gRPC API: rlsidecar-envoy / envoy-ratelimit = %.1fx", re64.OpsPerS/p.OpsPerS))
		}
	}
	if rl64, ok := find(rows, "rlsidecar", 64, 1, "closed"); ok {
		if g, ok := find(rows, "gubernator", 64, 1, "closed"); ok && g.OpsPerS > 0 {
			out = append(out, fmt.Sprintf("throughput at 64 conns: rlsidecar / gubernator = %.1fx", rl64.OpsPerS/g.OpsPerS))
		}
		if f, ok := find(rows, "floor", 64, 1, "closed"); ok && f.OpsPerS > 0 {
			out = append(out, fmt.Sprintf("throughput at 64 conns: rlsidecar / floor = %.2fx", rl64.OpsPerS/f.OpsPerS))
		}
	}
	if rp, ok := find(rows, "rlsidecar", 4, 32, "closed"); ok {
		out = append(out, fmt.Sprintf("pipelined 4 x 32: rlsidecar %.0f checks/s", rp.OpsPerS))
		if fp, ok := find(rows, "floor", 4, 32, "closed"); ok && fp.OpsPerS > 0 {
			out = append(out, fmt.Sprintf("pipelined 4 x 32: rlsidecar / floor = %.2fx", rp.OpsPerS/fp.OpsPerS))
		}
	}
	return out
}

func writeReport(rep *Report, out string) error {
	if err := writeJSON(filepath.Join(out, "report.json"), rep); err != nil {
		return err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# rlsidecar beside its peers\n\nCommand: `%s`  \nMachine: %s  \nStarted: %s\n\n",
		rep.Command, rep.Machine, rep.Started.Format("2006-01-02 15:04 UTC"))
	b.WriteString("Closed loop: each connection sends its next check when the last is answered. " +
		"Open loop: checks arrive at a fixed rate and latency counts from when each was due. " +
		"rlsidecar and the floor alternate round by round; each figure is the median of the rounds.\n\n")
	b.WriteString("## Ratios\n\n")
	for _, r := range ratios(rep.Latency) {
		fmt.Fprintf(&b, "- %s\n", r)
	}
	b.WriteString("\n## Latency and throughput\n\n| system | conns | depth | load | p50 µs | p99 µs | p99.9 µs | checks/s |\n|---|---:|---:|---|---:|---:|---:|---:|\n")
	for _, r := range rep.Latency {
		fmt.Fprintf(&b, "| %s | %d | %d | %s | %.1f | %.1f | %.1f | %.0f |\n", r.System, r.Conns, r.Depth, r.Load, r.P50us, r.P99us, r.P999us, r.OpsPerS)
	}
	if len(rep.Memory) > 0 {
		b.WriteString("\n## Memory per active key\n\n| system | keys | bytes/key | measured |\n|---|---:|---:|---|\n")
		for _, m := range rep.Memory {
			fmt.Fprintf(&b, "| %s | %d | %.0f | %s |\n", m.System, m.Keys, m.BytesPerKey, m.Measure)
		}
	}
	if len(rep.RedisCost) > 0 {
		b.WriteString("\n## Redis cost per check\n\nThe system's own Redis, INFO before and after the checks (syncs and heartbeats included): " +
			"commands from commandstats, which counts the commands a Lua script runs beside the EVALSHA; CPU from used_cpu_user + used_cpu_sys.\n\n" +
			"| system | keys | checks | degraded | Redis commands/check | Redis CPU µs/check | commands/check |\n|---|---|---:|---:|---:|---:|---|\n")
		for _, r := range rep.RedisCost {
			names := make([]string, 0, len(r.Commands))
			for c := range r.Commands {
				names = append(names, c)
			}
			sort.Strings(names)
			var parts []string
			for _, c := range names {
				if r.Commands[c] >= 0.0005 { // heartbeats and such, under a thousandth: in report.json
					parts = append(parts, fmt.Sprintf("%s %.3f", c, r.Commands[c]))
				}
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %d | %.3f | %.2f | %s |\n", r.System, r.Keys, r.Checks, r.Degraded, r.CommandsPerCheck, r.CPUUsecPerCheck, strings.Join(parts, ", "))
		}
	}
	if len(rep.Accuracy) > 0 {
		b.WriteString("\n## Accuracy of a shared limit\n\nEach key checked three times its limit over 16 connections spread across the instances: " +
			"hot, one key limited to 1,000 an hour; sparse, 300 keys limited to 10 an hour each, their checks interleaved.\n\n" +
			"| system | instances | keys | limit per key | sent | degraded | admitted | admitted ÷ limit |\n|---|---:|---|---:|---:|---:|---:|---:|\n")
		for _, r := range rep.Accuracy {
			fmt.Fprintf(&b, "| %s | %d | %s | %d | %d | %d | %d | %.3f |\n", r.System, r.Instances, r.Keys, r.Limit, r.Sent, r.Degraded, r.Admitted, r.Ratio)
		}
	}
	if d := rep.Differential; d != nil {
		fmt.Fprintf(&b, "\n## envoyproxy/ratelimit beside rlsidecar's Envoy API\n\nOne envoyproxy/ratelimit configuration (rlsidecar's through import-envoy), the same %d calls: "+
			"%d answered alike, %d differently as the README says, %d differently otherwise.\n\n", d.Calls, d.Same, len(d.Documented), len(d.Unexpected))
		if len(d.Documented)+len(d.Unexpected) > 0 {
			b.WriteString("| call | envoy-ratelimit | rlsidecar | why |\n|---|---|---|---|\n")
			for _, c := range append(append([]DiffCase{}, d.Unexpected...), d.Documented...) {
				fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", c.Call, c.Envoy, c.Rlsidecar, c.Why)
			}
		}
	}
	if len(rep.Notes) > 0 {
		b.WriteString("\n## Notes\n\n")
		for _, n := range rep.Notes {
			fmt.Fprintf(&b, "- %s\n", n)
		}
	}
	b.WriteString("\n![p50 latency](latency.png)\n![throughput](throughput.png)\n![open loop](openloop.png)\n")
	if err := os.WriteFile(filepath.Join(out, "report.md"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	return charts(rep, out)
}

// systemsOrder is the charts' order. x-time-rate (in process, no socket) is in the tables
// only: a thousand times faster, it would flatten every other bar.
var systemsOrder = []string{"floor", "rlsidecar", "gubernator", "gubernator-global", "envoy-ratelimit", "rlsidecar-envoy"}

// plainTicks labels an axis with whole numbers (gonum's default prints 5000000.00).
type plainTicks struct{}

func (plainTicks) Ticks(min, max float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(min, max)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = strconv.FormatFloat(ts[i].Value, 'f', -1, 64)
		}
	}
	return ts
}

func charts(rep *Report, out string) error {
	// p50 latency by connections, one bar group per system.
	lat := plot.New()
	lat.Title.Text = "p50 latency, closed loop (µs, lower is better)"
	lat.Y.Label.Text = "µs"
	thr := plot.New()
	thr.Title.Text = "throughput (checks/s)"
	thr.Y.Label.Text = "checks/s"
	var names []string
	for _, s := range systemsOrder {
		for _, r := range rep.Latency {
			if r.System == s {
				names = append(names, s)
				break
			}
		}
	}
	w := vg.Points(10)
	shapes := []struct {
		conns, depth int
		label        string
	}{{1, 1, "1 conn"}, {16, 1, "16 conns"}, {64, 1, "64 conns"}, {4, 32, "4 x 32 pipelined"}}
	for i, sh := range shapes {
		lv, tv := make(plotter.Values, len(names)), make(plotter.Values, len(names))
		for j, s := range names {
			if r, ok := find(rep.Latency, s, sh.conns, sh.depth, "closed"); ok {
				lv[j], tv[j] = r.P50us, r.OpsPerS
			}
		}
		if i < 3 {
			bl, err := plotter.NewBarChart(lv, w)
			if err != nil {
				return err
			}
			bl.Color = plotutil.Color(i)
			bl.Offset = vg.Length(i-1) * w
			lat.Add(bl)
			lat.Legend.Add(sh.label, bl)
		}
		bt, err := plotter.NewBarChart(tv, w)
		if err != nil {
			return err
		}
		bt.Color = plotutil.Color(i)
		bt.Offset = vg.Length(i-2) * w
		thr.Add(bt)
		thr.Legend.Add(sh.label, bt)
	}
	lat.NominalX(names...)
	thr.NominalX(names...)
	lat.Legend.Top, lat.Legend.Left = true, true
	thr.Legend.Top = true
	lat.Y.Tick.Marker, thr.Y.Tick.Marker = plainTicks{}, plainTicks{}
	if err := lat.Save(8*vg.Inch, 4*vg.Inch, filepath.Join(out, "latency.png")); err != nil {
		return err
	}
	if err := thr.Save(8*vg.Inch, 4*vg.Inch, filepath.Join(out, "throughput.png")); err != nil {
		return err
	}

	// Open loop: p99 at 50/80/95% of each system's maximum.
	op := plot.New()
	op.Title.Text = "open loop p99 at a fixed arrival rate (µs)"
	op.X.Label.Text = "% of the system's measured maximum"
	op.Y.Label.Text = "p99 µs"
	op.Y.Scale = plot.LogScale{}
	op.Y.Tick.Marker = plot.LogTicks{}
	i := 0
	for _, s := range names {
		var pts plotter.XYs
		for _, f := range []int{50, 80, 95} {
			if r, ok := find(rep.Latency, s, 64, 1, fmt.Sprintf("open@%d%%", f)); ok && r.P99us > 0 {
				pts = append(pts, plotter.XY{X: float64(f), Y: r.P99us})
			}
		}
		if len(pts) == 0 {
			continue
		}
		l, p, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		l.Color, p.Color = plotutil.Color(i), plotutil.Color(i)
		op.Add(l, p)
		op.Legend.Add(s, l)
		i++
	}
	op.Legend.Top = true
	op.Legend.Left = true
	return op.Save(8*vg.Inch, 4*vg.Inch, filepath.Join(out, "openloop.png"))
}

// DiffCase is one call whose answers differ.
type DiffCase struct {
	Call      string `json:"call"`
	Envoy     string `json:"envoy_ratelimit"`
	Rlsidecar string `json:"rlsidecar"`
	// Why: the README's difference it is, or what was expected instead.
	Why string `json:"why"`
}

// DiffReport is the differential phase's result.
type DiffReport struct {
	Calls      int        `json:"calls"`
	Same       int        `json:"same"`
	Documented []DiffCase `json:"documented"`
	Unexpected []DiffCase `json:"unexpected"`
}
