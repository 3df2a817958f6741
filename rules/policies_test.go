package rules

import (
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

func TestPoliciesParse(t *testing.T) {
	const head = "rules:\n  - name: r\n    key: ip\n"
	tests := []struct {
		name, yaml string
		warnAt     float64
		delay      time.Duration
		mode       Mode
		err        string // substring; "" for valid
	}{
		{"warn_at fraction", head + "    limit: { requests: 10, per: 1m }\n    warn_at: 0.8\n", 0.8, 0, ModeDefault, ""},
		{"warn_at one", head + "    limit: { requests: 10, per: 1m }\n    warn_at: 1\n", 1, 0, ModeDefault, ""},
		{"warn_at zero", head + "    limit: { requests: 10, per: 1m }\n    warn_at: 0\n", 0, 0, 0, "rules[0].warn_at: 0 is not in (0, 1]"},
		{"warn_at above one", head + "    limit: { requests: 10, per: 1m }\n    warn_at: 1.5\n", 0, 0, 0, "1.5 is not in (0, 1]"},
		{"warn_at negative", head + "    limit: { requests: 10, per: 1m }\n    warn_at: -0.5\n", 0, 0, 0, "-0.5 is not in (0, 1]"},
		{"warn_at NaN", head + "    limit: { requests: 10, per: 1m }\n    warn_at: .nan\n", 0, 0, 0, "is not in (0, 1]"},
		{"warn_at string", head + "    limit: { requests: 10, per: 1m }\n    warn_at: 80%\n", 0, 0, 0, "expected a fraction"},
		{"warn_at on deny", head + "    limit: deny\n    warn_at: 0.5\n", 0, 0, 0, "no limit to warn about"},
		{"delay", head + "    limit: { requests: 1, per: 1s }\n    delay: 5s\n", 0, 5 * time.Second, ModeDefault, ""},
		{"delay mode local", head + "    limit: { requests: 1, per: 1s }\n    delay: 500ms\n    mode: local\n", 0, 500 * time.Millisecond, ModeLocal, ""},
		{"delay mode global", head + "    limit: { requests: 1, per: 1s }\n    delay: 5s\n    mode: global\n", 0, 5 * time.Second, ModeGlobal, ""},
		{"delay mode hybrid", head + "    limit: { requests: 1, per: 1s }\n    delay: 5s\n    mode: hybrid\n", 0, 5 * time.Second, ModeHybrid, ""},
		{"delay on a window", head + "    algorithm: fixed_window\n    limit: { requests: 1, per: 1s }\n    delay: 5s\n", 0, 0, 0, "delay applies to token_bucket only"},
		{"delay on concurrency", head + "    concurrency: { max: 2 }\n    delay: 5s\n", 0, 0, 0, "a concurrency rule holds leases, it has no tokens to delay"},
		{"warn_at on concurrency", head + "    concurrency: { max: 2 }\n    warn_at: 0.5\n", 0.5, 0, ModeDefault, ""},
		{"delay too long", head + "    limit: { requests: 1, per: 1s }\n    delay: 2h\n", 0, 0, 0, "longer than the maximum of 1h"},
		{"delay not a duration", head + "    limit: { requests: 1, per: 1s }\n    delay: soon\n", 0, 0, 0, `"soon" is not a duration`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			set, err := Parse("p.yaml", []byte(tt.yaml))
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("error %v, want one containing %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			r := set.Rules[0]
			if r.WarnAt != tt.warnAt || r.Delay != tt.delay || r.Mode != tt.mode {
				t.Fatalf("warn_at %v delay %v mode %v, want %v %v %v", r.WarnAt, r.Delay, r.Mode, tt.warnAt, tt.delay, tt.mode)
			}
			lim, _ := r.LimitFor("", false)
			if lim.Delay() != int64(tt.delay) {
				t.Fatalf("the limit's delay is %v, want %v", time.Duration(lim.Delay()), tt.delay)
			}
		})
	}
}

func TestDelayReachesPlansAndSplits(t *testing.T) {
	set, err := Parse("p.yaml", []byte("rules:\n  - name: r\n    key: ip\n    limit: { requests: 10, per: 1s }\n    plans: { gold: 100 }\n    split: 2\n    delay: 3s\n"))
	if err != nil {
		t.Fatal(err)
	}
	r := set.Rules[0]
	for _, plan := range []string{"", "gold"} {
		lim, _ := r.LimitFor(plan, plan != "")
		split, _ := r.SplitLimitFor(plan, plan != "", 2)
		if lim.Delay() != int64(3*time.Second) || split.Delay() != int64(3*time.Second) {
			t.Fatalf("plan %q: delay %v, split %v; want 3s", plan, time.Duration(lim.Delay()), time.Duration(split.Delay()))
		}
	}
}

func TestWarnThreshold(t *testing.T) {
	tests := []struct {
		at       float64
		capacity uint64
		want     uint64
	}{
		{0, 10, 0},
		{0.8, 10, 8},
		{0.7, 10, 7}, // 7.000000000000001 in binary
		{0.75, 10, 8},
		{0.01, 10, 1},
		{1e-9, 3, 1},
		{1, 5, 5},
		{0.1, 3, 1},
		{0.9, 4_294_967_295, 3_865_470_566}, // ⌈3865470565.5⌉
	}
	for _, tt := range tests {
		r := &Rule{WarnAt: tt.at}
		if got := r.WarnThreshold(tt.capacity); got != tt.want {
			t.Errorf("WarnThreshold(%v of %d) = %d, want %d", tt.at, tt.capacity, got, tt.want)
		}
	}
}

func TestCalendarParse(t *testing.T) {
	const head = "rules:\n  - name: r\n    key: ip\n"
	tests := []struct {
		name, yaml string
		unit       localbucket.Calendar
		zone       string
		err        string
	}{
		{"month in a zone", head + "    limit: { requests: 100000, per: month, tz: America/Sao_Paulo }\n", localbucket.Month, "America/Sao_Paulo", ""},
		{"day defaults to UTC", head + "    limit: { requests: 10, per: day }\n", localbucket.Day, "UTC", ""},
		{"week, fixed_window written", head + "    algorithm: fixed_window\n    limit: { requests: 10, per: week, tz: Europe/Paris }\n", localbucket.Week, "Europe/Paris", ""},
		{"unknown zone", head + "    limit: { requests: 10, per: day, tz: Mars/Olympus }\n", 0, "", `rules[0].limit.tz: unknown time zone "Mars/Olympus"`},
		{"Local is not a zone", head + "    limit: { requests: 10, per: day, tz: Local }\n", 0, "", "is not an IANA time zone"},
		{"tz with a duration", head + "    limit: { requests: 10, per: 1d, tz: UTC }\n", 0, "", "a time zone applies to per: day, week or month"},
		{"calendar with token_bucket", head + "    algorithm: token_bucket\n    limit: { requests: 10, per: day }\n", 0, "", "is a calendar window, counted by fixed_window"},
		{"calendar with burst", head + "    limit: { requests: 10, per: day, burst: 20 }\n", 0, "", "only token_bucket has a burst"},
		{"calendar in global mode", head + "    limit: { requests: 10, per: day }\n    mode: global\n", localbucket.Day, "UTC", ""},
		{"calendar in hybrid mode", head + "    limit: { requests: 10, per: day }\n    mode: hybrid\n", localbucket.Day, "UTC", ""},
		{"not a unit", head + "    limit: { requests: 10, per: fortnight }\n", 0, "", `"fortnight" is not a duration`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			set, err := Parse("c.yaml", []byte(tt.yaml))
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("error %v, want one containing %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			r := set.Rules[0]
			lim, _ := r.LimitFor("", false)
			unit, loc := lim.Calendar()
			if r.Calendar != tt.unit || unit != tt.unit || loc.String() != tt.zone || r.Algorithm != localbucket.FixedWindow {
				t.Fatalf("calendar %v/%v zone %v mode %v algorithm %v", r.Calendar, unit, loc, r.Mode, r.Algorithm)
			}
		})
	}
}

func TestCalendarPlansAndSplit(t *testing.T) {
	set, err := Parse("c.yaml", []byte("rules:\n  - name: r\n    key: ip\n    limit: { requests: 100, per: month, tz: Asia/Tokyo }\n    plans: { gold: 1000 }\n    split: 4\n"))
	if err != nil {
		t.Fatal(err)
	}
	r := set.Rules[0]
	gold, _ := r.LimitFor("gold", true)
	part, _ := r.SplitLimitFor("gold", true, 4)
	for _, l := range []*localbucket.Limit{gold, part} {
		if u, loc := l.Calendar(); u != localbucket.Month || loc.String() != "Asia/Tokyo" {
			t.Fatalf("a plan or split limit lost the calendar: %v %v", u, loc)
		}
	}
	if gold.Requests() != 1000 || part.Requests() != 250 {
		t.Fatalf("requests %d and %d, want 1000 and 250", gold.Requests(), part.Requests())
	}
}

func TestPenaltyParse(t *testing.T) {
	const head = "rules:\n  - name: r\n    key: ip\n    limit: { requests: 5, per: 1m }\n"
	tests := []struct {
		name, yaml string
		want       *Penalty
		err        string
	}{
		{"full", head + "    penalty: { after: 5, within: 1m, ban: 10m, factor: 3, max: 6h }\n",
			&Penalty{After: 5, Within: time.Minute, Ban: 10 * time.Minute, Factor: 3, Max: 6 * time.Hour}, ""},
		{"defaults", head + "    penalty: { after: 5, within: 1m, ban: 10m }\n",
			&Penalty{After: 5, Within: time.Minute, Ban: 10 * time.Minute, Factor: 2, Max: 160 * time.Minute}, ""},
		{"missing ban", head + "    penalty: { after: 5, within: 1m }\n", nil, "rules[0].penalty.ban: missing"},
		{"after 0", head + "    penalty: { after: 0, within: 1m, ban: 1m }\n", nil, "rules[0].penalty.after: must be at least 1"},
		{"factor below 1", head + "    penalty: { after: 1, within: 1m, ban: 1m, factor: 0.5 }\n", nil, "0.5 is not in [1, 1000]"},
		{"max below ban", head + "    penalty: { after: 1, within: 1m, ban: 1h, max: 1m }\n", nil, "shorter than ban"},
		{"unknown field", head + "    penalty: { after: 1, within: 1m, ban: 1m, forever: true }\n", nil, `unknown field "forever"`},
		{"ban too long", head + "    penalty: { after: 1, within: 1m, ban: 400d }\n", nil, "longer than the maximum of 366 days"},
		{"global mode", head + "    mode: global\n    penalty: { after: 1, within: 1m, ban: 1m }\n", &Penalty{After: 1, Within: time.Minute, Ban: time.Minute, Factor: 2, Max: 16 * time.Minute}, ""},
		{"on deny", "rules:\n  - name: r\n    key: ip\n    limit: deny\n    penalty: { after: 1, within: 1m, ban: 1m }\n", nil, "no penalty"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			set, err := Parse("p.yaml", []byte(tt.yaml))
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("error %v, want one containing %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := set.Rules[0].Penalty; *got != *tt.want {
				t.Fatalf("penalty %+v, want %+v", *got, *tt.want)
			}
		})
	}
}

func TestBanFor(t *testing.T) {
	p := &Penalty{Ban: time.Minute, Factor: 2, Max: 10 * time.Minute}
	want := []time.Duration{time.Minute, 2 * time.Minute, 4 * time.Minute, 8 * time.Minute, 10 * time.Minute, 10 * time.Minute}
	for n, w := range want {
		if got := p.BanFor(uint32(n)); got != w {
			t.Errorf("BanFor(%d) = %v, want %v", n, got, w)
		}
	}
	if got := p.BanFor(1 << 31); got != 10*time.Minute {
		t.Errorf("BanFor(2^31) = %v, want the max", got)
	}
	flat := &Penalty{Ban: time.Minute, Factor: 1, Max: time.Hour}
	if got := flat.BanFor(1<<32 - 1); got != time.Minute {
		t.Errorf("factor 1: BanFor(2^32-1) = %v, want 1m", got)
	}
}

// TestPoliciesAreNotShadowed: validate's "never has an effect" warning must not name a
// rule that differs from an earlier one only by a calendar zone or a policy.
func TestPoliciesAreNotShadowed(t *testing.T) {
	for _, second := range []string{
		"    limit: { requests: 5, per: day, tz: Europe/Paris }\n",
		"    limit: { requests: 5, per: day }\n    warn_at: 0.5\n",
		"    limit: { requests: 5, per: day }\n    penalty: { after: 1, within: 1m, ban: 1m }\n",
	} {
		set, err := Parse("s.yaml", []byte("rules:\n  - name: a\n    key: ip\n    limit: { requests: 5, per: day }\n  - name: b\n    key: ip\n"+second))
		if err != nil {
			t.Fatal(err)
		}
		if w := set.Warnings(); len(w) != 0 {
			t.Errorf("rule b (%s) reported: %v", strings.TrimSpace(second), w)
		}
	}
	set, err := Parse("s.yaml", []byte("rules:\n  - name: a\n    key: ip\n    limit: { requests: 5, per: day }\n  - name: b\n    key: ip\n    limit: { requests: 5, per: day }\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(set.Warnings()) != 1 {
		t.Error("two identical calendar rules: no warning")
	}
}

// TestCalendarZoneIgnoresHostZoneinfo: a rule's tz comes from the zone database built
// into the binary, not the host's ($ZONEINFO, /usr/share/zoneinfo), so daemons on hosts
// with different tzdata count one calendar window (time.LoadLocation read the host's
// first: a host whose America/Sao_Paulo said UTC-2 keyed December 2026 an hour apart
// from one whose said UTC-3, and each admitted the whole limit). The parse runs in a
// child process whose $ZONEINFO holds a forged America/Sao_Paulo at UTC+5.
func TestCalendarZoneIgnoresHostZoneinfo(t *testing.T) {
	if os.Getenv("RLSIDECAR_TEST_ZONE_CHILD") == "1" {
		set, err := Parse("c.yaml", []byte("rules:\n  - name: r\n    key: ip\n    limit: { requests: 10, per: day, tz: America/Sao_Paulo }\n"))
		if err != nil {
			t.Fatal(err)
		}
		lim, _ := set.Rules[0].LimitFor("", false)
		_, loc := lim.Calendar()
		if _, off := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC).In(loc).Zone(); off != -3*3600 {
			t.Fatalf("America/Sao_Paulo is UTC-3 in December 2026, got an offset of %d s: the host's zoneinfo was read", off)
		}
		return
	}
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "America"), 0o755); err != nil {
		t.Fatal(err)
	}
	// A TZif file, version 0, of one zone type (UTC+5, "XYZ") and no transitions.
	tzif := append([]byte("TZif"), make([]byte, 16)...)
	for _, n := range []uint32{0, 0, 0, 0, 1, 4} { // isut, isstd, leap, time, type, char counts
		tzif = binary.BigEndian.AppendUint32(tzif, n)
	}
	tzif = binary.BigEndian.AppendUint32(tzif, 5*3600)
	tzif = append(tzif, 0, 0, 'X', 'Y', 'Z', 0)
	if err := os.WriteFile(filepath.Join(dir, "America", "Sao_Paulo"), tzif, 0o644); err != nil {
		t.Fatal(err)
	}
	if l, err := time.LoadLocationFromTZData("x", tzif); err != nil {
		t.Fatalf("the forged zone does not load: %v", err)
	} else if _, off := time.Unix(0, 0).In(l).Zone(); off != 5*3600 {
		t.Fatalf("the forged zone's offset is %d", off)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestCalendarZoneIgnoresHostZoneinfo$", "-test.count=1")
	cmd.Env = append(os.Environ(), "RLSIDECAR_TEST_ZONE_CHILD=1", "ZONEINFO="+dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}
