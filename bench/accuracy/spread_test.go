package accuracy

import (
	"bytes"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSpreadTableAndChart(t *testing.T) {
	rows := []SpreadRow{
		{Clients: 500, Daemons: 2, Limit: "5/1m", Offered: 5000, Global: 3791, Hybrid: 3727},
		{Clients: 500, Daemons: 5, Limit: "5/1m", Offered: 5000, Global: 3750, Hybrid: 3578},
		{Clients: 500, Daemons: 20, Limit: "5/1m", Offered: 5000, Global: 3700, Hybrid: 3700, Degraded: 0.02},
	}
	for _, c := range []struct {
		row  SpreadRow
		met  bool
		want string
	}{{rows[0], true, "**0.983**"}, {rows[1], false, "**0.954**"}, {rows[2], false, "**1.000**"}} {
		if c.row.Met() != c.met {
			t.Errorf("%+v: Met() = %v, want %v", c.row, !c.met, c.met)
		}
		var b bytes.Buffer
		if err := WriteSpreadTable(&b, []SpreadRow{c.row}); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(b.String(), c.want) || strings.Contains(b.String(), "not met") == c.met {
			t.Errorf("table row %q: want %s and not met = %v", b.String(), c.want, !c.met)
		}
	}
	path := filepath.Join(t.TempDir(), "spread.png")
	if err := SpreadChart(path, "test", rows); err != nil {
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
