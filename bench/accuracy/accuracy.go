// Package accuracy turns the runs of the accuracy benchmark (bench.BenchmarkAccuracy:
// many daemons, one Redis, one client offering ten times its limit) into the published
// figures: a markdown table of admitted ÷ ideal per mode and traffic distribution, a CSV
// of admitted per second, and PNG charts of admitted per second over time against the
// limit (gonum.org/v1/plot).
//
// It does no measuring itself: a Run is what the benchmark recorded.
package accuracy

import (
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Run is one (mode, distribution) run of the accuracy benchmark.
type Run struct {
	Mode    string // local, local-split, hybrid, global
	Dist    string // even, skewed
	Daemons int
	Skipped string // why the run did not happen; "" when it did

	Rate  float64 // the limit, requests per second
	Burst float64 // the token bucket's capacity

	// Elapsed is the load's duration: from its start to its last check sent.
	Elapsed time.Duration
	// Offered is the number of checks sent, all answered.
	Offered int
	// Admitted holds, for every admitted check, when it was sent (since the load began).
	Admitted []time.Duration

	// RedisCalls is the commands the daemons sent to Redis per check (EVALSHA and the
	// like: one per key per sync in hybrid mode); RedisCmds counts every command Redis
	// ran, those run inside scripts included. Both NaN when not measured.
	RedisCalls, RedisCmds float64
}

// Ideal is what a perfect limiter admits over the run: burst + rate × elapsed.
func (r *Run) Ideal() float64 { return r.Burst + r.Rate*r.Elapsed.Seconds() }

// Ratio is admitted ÷ ideal: 1 is exact, above 1 is over-admission.
func (r *Run) Ratio() float64 { return float64(len(r.Admitted)) / r.Ideal() }

// Name is the run's metric prefix, e.g. "hybrid-even".
func (r *Run) Name() string { return r.Mode + "-" + r.Dist }

// Target is the README's target for the run's mode, and whether the run meets it; ok is
// true with an empty target for modes that have none.
func (r *Run) Target() (target string, ok bool) {
	switch r.Mode {
	case "global":
		// Timing slack: the load's clock and Redis's disagree by a few milliseconds at the
		// start and end; 50 ms of refill (one global timeout) covers it.
		slack := r.Rate * 0.050
		return "≤ 1.00 (+ 50 ms of refill)", float64(len(r.Admitted)) <= r.Ideal()+slack
	case "hybrid":
		x := r.Ratio()
		return "0.98 – 1.02", x >= 0.98 && x <= 1.02
	}
	return "", true
}

// HybridCostTarget is the README's target for BenchmarkHybridCost's sparse and Zipf
// loads, at most 0.1 script calls per check and Redis process CPU (INFO cpu) per check
// at most 0.5× global's, and whether calls and procRatio meet it.
func HybridCostTarget(calls, procRatio float64) (target string, ok bool) {
	return "≤ 0.1 calls, Redis process CPU ≤ 0.5× global's", calls <= 0.1 && procRatio <= 0.5
}

// HotKeysTarget is the README's target for BenchmarkHybridHotKeys, at most 0.001 Redis
// calls (scripts run) per check, and whether calls per check meets it.
func HotKeysTarget(calls float64) (target string, ok bool) {
	return "≤ 0.001 Redis calls per check", calls <= 0.001
}

// PerSecond returns admitted per second in the whole buckets of width bucket that fit in
// [0, span): element i counts the admissions in [i·bucket, (i+1)·bucket). A partial last
// bucket is left out, as its rate would read low.
func PerSecond(admitted []time.Duration, bucket, span time.Duration) []float64 {
	n := int(span / bucket)
	out := make([]float64, n)
	for _, t := range admitted {
		if i := int(t / bucket); i >= 0 && i < n {
			out[i]++
		}
	}
	for i := range out {
		out[i] /= bucket.Seconds()
	}
	return out
}

// WriteTable writes the markdown table of runs to w: one row per run, then the targets.
func WriteTable(w io.Writer, runs []*Run) error {
	var b strings.Builder
	b.WriteString("| mode | traffic | daemons | offered | admitted | ideal | admitted ÷ ideal | Redis calls / check | Redis commands / check | target |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, r := range runs {
		if r.Skipped != "" {
			fmt.Fprintf(&b, "| %s | %s | %d | | | | not run: %s | | | |\n", r.Mode, r.Dist, r.Daemons, r.Skipped)
			continue
		}
		target, ok := r.Target()
		if target != "" {
			if ok {
				target += " ✓"
			} else {
				target += " ✗ not met"
			}
		}
		fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %.0f | **%.3f** | %s | %s | %s |\n",
			r.Mode, r.Dist, r.Daemons, r.Offered, len(r.Admitted), r.Ideal(), r.Ratio(),
			num(r.RedisCalls), num(r.RedisCmds), target)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func num(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("%.3f", v)
}

// WriteCSV writes admitted per second, one row per bucket and one column per run:
// "t_s" (the bucket's start, seconds), then one column named by Run.Name.
func WriteCSV(w io.Writer, runs []*Run, bucket time.Duration) error {
	var cols [][]float64
	var names []string
	rows := 0
	for _, r := range runs {
		if r.Skipped != "" {
			continue
		}
		s := PerSecond(r.Admitted, bucket, r.Elapsed)
		cols = append(cols, s)
		names = append(names, r.Name())
		rows = max(rows, len(s))
	}
	var b strings.Builder
	b.WriteString("t_s," + strings.Join(names, ",") + "\n")
	for i := 0; i < rows; i++ {
		fmt.Fprintf(&b, "%g", (time.Duration(i) * bucket).Seconds())
		for _, c := range cols {
			if i < len(c) {
				fmt.Fprintf(&b, ",%g", c[i])
			} else {
				b.WriteString(",")
			}
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// styles: one color per mode, so the even and skewed charts read alike.
var styles = map[string]struct {
	c      color.Color
	dashes []vg.Length
}{
	"local":       {color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, nil},
	"local-split": {color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}, []vg.Length{vg.Points(6), vg.Points(3)}},
	"hybrid":      {color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, nil},
	"global":      {color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}, []vg.Length{vg.Points(2), vg.Points(2)}},
}

// Chart writes to path an 800×450 PNG of admitted per second (in buckets of bucket) over
// time for runs, one line per run, against the limit, on a logarithmic axis so that the
// local mode's many-fold over-admission and the shared modes' closeness to the limit
// show in one picture.
func Chart(path, title string, runs []*Run, bucket time.Duration) error {
	p := plot.New()
	// The y axis is named in the title: plot v0.17 centres an axis label on the
	// arithmetic middle of the range, which on a log axis pushes the plot down.
	p.Title.Text = title + fmt.Sprintf("\nadmitted per second (log scale, %v buckets)", bucket)
	p.X.Label.Text = "seconds since the load began"
	p.Y.Scale = plot.LogScale{}
	p.Y.Min, p.Y.Max = 20, 3000
	var ticks []plot.Tick
	for _, v := range []float64{20, 50, 100, 200, 500, 1000, 2000} {
		ticks = append(ticks, plot.Tick{Value: v, Label: fmt.Sprint(v)})
	}
	p.Y.Tick.Marker = plot.ConstantTicks(ticks)
	p.Legend.Top, p.Legend.Left = false, true // the bottom left stays empty: nothing admits < 20/s
	p.Legend.XOffs, p.Legend.YOffs = vg.Points(8), vg.Points(8)
	p.Add(plotter.NewGrid())

	var span time.Duration
	var rate float64
	for _, r := range runs {
		if r.Skipped != "" {
			continue
		}
		span = max(span, r.Elapsed)
		rate = r.Rate
		s := PerSecond(r.Admitted, bucket, r.Elapsed)
		xys := make(plotter.XYs, len(s))
		for i, v := range s {
			xys[i].X = (time.Duration(i)*bucket + bucket/2).Seconds()
			xys[i].Y = max(v, p.Y.Min) // a log axis has no 0: an empty bucket sits on the floor
		}
		l, err := plotter.NewLine(xys)
		if err != nil {
			return fmt.Errorf("chart %s: %s: %w", path, r.Name(), err)
		}
		st := styles[r.Mode]
		l.Color, l.Dashes, l.Width = st.c, st.dashes, vg.Points(2)
		p.Add(l)
		p.Legend.Add(fmt.Sprintf("%s (%.2f× ideal)", r.Mode, r.Ratio()), l)
	}
	limit, err := plotter.NewLine(plotter.XYs{{X: 0, Y: rate}, {X: span.Seconds(), Y: rate}})
	if err != nil {
		return fmt.Errorf("chart %s: %w", path, err)
	}
	limit.Color, limit.Width, limit.Dashes = color.Black, vg.Points(1), []vg.Length{vg.Points(4), vg.Points(4)}
	p.Add(limit)
	p.Legend.Add(fmt.Sprintf("limit (%g/s)", rate), limit)
	p.X.Min, p.X.Max = 0, span.Seconds()
	var xticks []plot.Tick
	for s := 0; float64(s) <= span.Seconds(); s++ {
		xticks = append(xticks, plot.Tick{Value: float64(s), Label: fmt.Sprint(s)})
	}
	p.X.Tick.Marker = plot.ConstantTicks(xticks)

	c := vgimg.NewWith(vgimg.UseWH(800*vg.Inch/96, 450*vg.Inch/96), vgimg.UseDPI(96))
	p.Draw(draw.New(c))
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	if _, err := (vgimg.PngCanvas{Canvas: c}).WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("chart %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("chart %s: %w", path, err)
	}
	return nil
}
