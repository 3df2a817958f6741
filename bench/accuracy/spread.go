package accuracy

import (
	"fmt"
	"io"
	"os"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// SpreadRow is one row of bench.BenchmarkSpreadClients: clients whose requests rotate
// over the daemons, each offered 3× its limit, admitted by the exact (global) mode and by
// hybrid mode on the same schedule.
type SpreadRow struct {
	Clients, Daemons int
	Limit            string // e.g. "5/10s"
	Offered          int    // per mode (the same schedule)
	Global, Hybrid   int    // admitted
	Degraded         float64
	// Script calls and script time (µs, INFO commandstats) per check, each mode.
	GlobalCalls, HybridCalls, GlobalUsec, HybridUsec float64
	// The Redis process's CPU time (µs, INFO cpu) per check, each mode.
	GlobalProcUsec, HybridProcUsec float64
}

// Ratio is hybrid ÷ global admissions: the target is 0.98–1.05.
func (r SpreadRow) Ratio() float64 { return float64(r.Hybrid) / float64(r.Global) }

// Met reports whether the row meets the target: 0.98–1.05 of exact, < 1% degraded.
func (r SpreadRow) Met() bool {
	x := r.Ratio()
	return x >= 0.98 && x <= 1.05 && r.Degraded < 0.01
}

// WriteSpreadTable writes the markdown table of rows to w.
func WriteSpreadTable(w io.Writer, rows []SpreadRow) error {
	var b strings.Builder
	b.WriteString("| clients | limit | daemons | global admitted | hybrid admitted | hybrid ÷ global | hybrid degraded | script calls / check, global · hybrid | script µs / check, global · hybrid | Redis CPU µs / check, global · hybrid | target |\n")
	b.WriteString("|---:|---|---:|---:|---:|---:|---:|---|---|---|---|\n")
	for _, r := range rows {
		verdict := "0.98–1.05, < 1% ✓"
		if !r.Met() {
			verdict = "0.98–1.05, < 1% ✗ not met"
		}
		fmt.Fprintf(&b, "| %d | %s | %d | %d | %d | **%.3f** | %.2f%% | %.3f · %.3f | %.1f · %.1f | %.1f · %.1f | %s |\n",
			r.Clients, r.Limit, r.Daemons, r.Global, r.Hybrid, r.Ratio(), 100*r.Degraded,
			r.GlobalCalls, r.HybridCalls, r.GlobalUsec, r.HybridUsec, r.GlobalProcUsec, r.HybridProcUsec, verdict)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// SpreadChart writes to path an 800×450 PNG of rows (one limit): per daemon count, the
// admissions of the exact mode and of hybrid mode side by side, each hybrid bar labelled
// with its ratio to exact.
func SpreadChart(path, title string, rows []SpreadRow) error {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = "admitted"
	p.Add(plotter.NewGrid())
	w := vg.Points(40)
	var g, h plotter.Values
	var names []string
	top := 0.0
	for _, r := range rows {
		g = append(g, float64(r.Global))
		h = append(h, float64(r.Hybrid))
		names = append(names, fmt.Sprintf("%d daemons\nhybrid %.3f× exact", r.Daemons, r.Ratio()))
		top = max(top, float64(r.Global), float64(r.Hybrid))
	}
	gb, err := plotter.NewBarChart(g, w)
	if err != nil {
		return fmt.Errorf("chart %s: %w", path, err)
	}
	gb.Color, gb.Offset = styles["global"].c, -w/2
	gb.LineStyle.Width = 0
	hb, err := plotter.NewBarChart(h, w)
	if err != nil {
		return fmt.Errorf("chart %s: %w", path, err)
	}
	hb.Color, hb.Offset = styles["hybrid"].c, w/2
	hb.LineStyle.Width = 0
	p.Add(gb, hb)
	p.Legend.Add("global (exact)", gb)
	p.Legend.Add("hybrid", hb)
	p.Legend.Top = true
	p.Y.Min, p.Y.Max = 0, top*1.25 // room for the legend above the bars
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.7, float64(len(rows))-0.3

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
