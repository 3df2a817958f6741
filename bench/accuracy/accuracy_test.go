package accuracy

import (
	"bytes"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func ms(v ...int) []time.Duration {
	out := make([]time.Duration, len(v))
	for i, x := range v {
		out[i] = time.Duration(x) * time.Millisecond
	}
	return out
}

func TestPerSecond(t *testing.T) {
	// Buckets of 500 ms over 1.7 s: three whole ones; the partial fourth is left out.
	got := PerSecond(ms(0, 10, 499, 500, 1499, 1600), 500*time.Millisecond, 1700*time.Millisecond)
	want := []float64{6, 2, 2}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] || got[2] != want[2] {
		t.Fatalf("PerSecond = %v, want %v", got, want)
	}
}

func TestRatioAndTargets(t *testing.T) {
	for _, tc := range []struct {
		mode     string
		admitted int
		ok       bool
	}{
		// The README's target for hybrid: 0.98 to 1.02 of the ideal.
		{"hybrid", 900, true},
		{"hybrid", 918, true},  // 1.020
		{"hybrid", 882, true},  // 0.980
		{"hybrid", 919, false}, // 1.021
		{"hybrid", 881, false}, // 0.979
		{"hybrid", 944, false}, // 1.049: within the 0.95–1.05 this printed as met before
		{"hybrid", 856, false}, // 0.951
		{"global", 900, true},
		{"global", 905, true}, // within 50 ms of refill (5)
		{"global", 906, false},
		{"local", 8000, true}, // no target
	} {
		r := &Run{Mode: tc.mode, Dist: "even", Rate: 100, Burst: 100, Elapsed: 8 * time.Second,
			Admitted: make([]time.Duration, tc.admitted)}
		if r.Ideal() != 900 {
			t.Fatalf("ideal %v, want 900", r.Ideal())
		}
		if got := r.Ratio(); math.Abs(got-float64(tc.admitted)/900) > 1e-12 {
			t.Fatalf("ratio %v", got)
		}
		if _, ok := r.Target(); ok != tc.ok {
			t.Errorf("%s admitting %d: target met %v, want %v", tc.mode, tc.admitted, ok, tc.ok)
		}
	}
}

func TestOutputs(t *testing.T) {
	runs := []*Run{
		{Mode: "hybrid", Dist: "even", Daemons: 3, Rate: 100, Burst: 100, Elapsed: 2 * time.Second, Offered: 2000,
			Admitted: ms(0, 100, 600, 1200, 1900), RedisCalls: 0.1, RedisCmds: 0.5},
		{Mode: "local-split", Dist: "even", Daemons: 3, Skipped: "split not accepted"},
		{Mode: "global", Dist: "even", Daemons: 3, Rate: 100, Burst: 100, Elapsed: 2 * time.Second, Offered: 2000,
			Admitted: ms(0, 1), RedisCalls: math.NaN(), RedisCmds: math.NaN()},
	}
	var tbl bytes.Buffer
	if err := WriteTable(&tbl, runs); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| hybrid | even | 3 | 2000 | 5 | 300 | **0.017** | 0.100 | 0.500 | 0.98 – 1.02 ✗ not met |",
		"not run: split not accepted", "| – | – |"} {
		if !strings.Contains(tbl.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, tbl.String())
		}
	}
	var csv bytes.Buffer
	if err := WriteCSV(&csv, runs, time.Second); err != nil {
		t.Fatal(err)
	}
	if want := "t_s,hybrid-even,global-even\n0,3,2\n1,2,0\n"; csv.String() != want {
		t.Errorf("csv:\n%s\nwant:\n%s", csv.String(), want)
	}
	path := filepath.Join(t.TempDir(), "c.png")
	if err := Chart(path, "test", runs, 500*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() != 800 || b.Dy() != 450 {
		t.Fatalf("chart is %v, want 800×450", b)
	}
}

func TestHotKeysTarget(t *testing.T) {
	// The README's target for BenchmarkHybridHotKeys: at most 0.001 Redis calls (scripts
	// run) per check. 0.005 met the 0.01 Redis commands per check printed before.
	for _, tc := range []struct {
		calls float64
		ok    bool
	}{
		{0.00004, true},
		{0.001, true},
		{0.0011, false},
		{0.005, false},
	} {
		target, ok := HotKeysTarget(tc.calls)
		if ok != tc.ok {
			t.Errorf("%g calls per check: target %q met %v, want %v", tc.calls, target, ok, tc.ok)
		}
		if target != "≤ 0.001 Redis calls per check" {
			t.Errorf("target %q", target)
		}
	}
}

func TestHybridCostTarget(t *testing.T) {
	// The README's targets for BenchmarkHybridCost: at most 0.1 script calls per check and
	// Redis process CPU (INFO cpu) at most 0.5× global's, the figure the README gives.
	for _, tc := range []struct {
		calls, procRatio float64
		ok               bool
	}{
		{0.011, 0.25, true},
		{0.1, 0.5, true},
		{0.11, 0.25, false},
		{0.011, 0.6, false}, // process CPU over the target: met before, on script time alone
	} {
		if _, ok := HybridCostTarget(tc.calls, tc.procRatio); ok != tc.ok {
			t.Errorf("%g calls, process CPU %g× global's: target met %v, want %v", tc.calls, tc.procRatio, ok, tc.ok)
		}
	}
}
