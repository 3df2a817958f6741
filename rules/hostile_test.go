package rules

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// loadWithin is Load(path), failing the test when it takes longer than d. A Load that
// blocks on a named pipe would never return, and one reading /dev/zero would take the
// machine's memory before a test timeout: past d, the whole test process stops.
func loadWithin(t *testing.T, path string, d time.Duration) (*Set, error) {
	t.Helper()
	stop := time.AfterFunc(d, func() {
		panic(fmt.Sprintf("Load(%s) still running after %v: it blocks, or reads without end", path, d))
	})
	defer stop.Stop()
	return Load(path)
}

// wantRefused checks that err is an Errors naming path with a message containing want.
func wantRefused(t *testing.T, err error, path, want string) {
	t.Helper()
	var es Errors
	if !errors.As(err, &es) || len(es) != 1 {
		t.Fatalf("error %v (%T), want one *Error", err, err)
	}
	if es[0].File != path || !strings.Contains(es[0].Error(), want) {
		t.Fatalf("error %q, want one naming %s and containing %q", es[0], path, want)
	}
}

// A named pipe as the rules file is refused at once: opening it for reading used to wait
// for a writer, and a reload with it, and every reload after, waited forever.
func TestLoadRefusesNamedPipe(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "rules.yaml")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	_, err := loadWithin(t, fifo, 5*time.Second)
	wantRefused(t, err, fifo, "rules.yaml: not a regular file (a named pipe)")

	// The same in a directory of rules files.
	writeRules(t, dir, "a.yaml", "rules: []\n")
	_, err = loadWithin(t, dir, 5*time.Second)
	wantRefused(t, err, fifo, "not a regular file (a named pipe)")
}

// A symlink to a device is refused, and the error names what the link names.
func TestLoadRefusesDevice(t *testing.T) {
	link := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.Symlink("/dev/zero", link); err != nil {
		t.Fatal(err)
	}
	_, err := loadWithin(t, link, 5*time.Second)
	wantRefused(t, err, link, "not a regular file (/dev/zero, a character device)")
}

// A symlink to a regular file is read through: operators deploy by symlink swap.
func TestLoadFollowsSymlink(t *testing.T) {
	dir := t.TempDir()
	target := writeRules(t, dir, "v1.yaml", "rules:\n  - name: a\n    key: user\n    limit: { requests: 1, per: 1s }\n")
	link := filepath.Join(dir, "rules.yaml")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if set, err := Load(link); err != nil || len(set.Rules) != 1 {
		t.Fatalf("Load(link to a rules file) = %v", err)
	}
}

// A file past maxFileSize is refused before it is read; one at it is read (and parsed:
// these zero bytes are not YAML).
func TestLoadRefusesLargeFile(t *testing.T) {
	dir := t.TempDir()
	sparse := func(name string, size int64) string {
		path := filepath.Join(dir, name)
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
		return path
	}
	big := sparse("big.yaml", maxFileSize+1)
	_, err := loadWithin(t, big, 5*time.Second)
	wantRefused(t, err, big, fmt.Sprintf("too large for a rules file: at most %d bytes (8 MiB), this one holds %d", maxFileSize, maxFileSize+1))

	at := sparse("at.yaml", maxFileSize)
	_, err = loadWithin(t, at, 5*time.Second)
	if err == nil || strings.Contains(err.Error(), "too large") {
		t.Fatalf("Load(a file of exactly %d bytes) = %v, want a YAML error", maxFileSize, err)
	}
}

// planAliasFile is n rules, the first anchoring a plans map of n entries that the others
// alias: a file of n lines per rule that aliases expand to about 2n² nodes.
func planAliasFile(n int) string {
	var b strings.Builder
	b.WriteString("rules:\n  - name: r0\n    key: user\n    limit: { requests: 10, per: 1m }\n    plans: &p {")
	for i := range n {
		fmt.Fprintf(&b, " p%d: 20,", i)
	}
	b.WriteString(" }\n")
	for i := 1; i < n; i++ {
		fmt.Fprintf(&b, "  - name: r%d\n    key: user\n    limit: { requests: 10, per: 1m }\n    plans: *p\n", i)
	}
	return b.String()
}

// Aliases that expand a file past maxAliasNodes or maxAliasBytes are refused at the alias
// that crosses the bound, before the parser follows them: 1,000 rules aliasing a map of
// 1,000 plans took 2 s and 250 MB to load (3,000: 17 s and 1.8 GB).
func TestAliasBombRefused(t *testing.T) {
	for _, tc := range []struct{ name, src, want string }{
		{"plans", planAliasFile(1000),
			fmt.Sprintf("a.yaml:%d: aliases expand this file by more than %d nodes (*p here repeats 2001)", 5+4*(maxAliasNodes/2001+1), maxAliasNodes)}, // rule k says *p on line 5+4k
		{"text", "rules:\n  - name: x\n    limit: { requests: 1, per: 1s }\n    key: [&s " + strings.Repeat("a", 100_000) + strings.Repeat(", *s", 200) + "]\n",
			fmt.Sprintf("a.yaml:4: aliases expand this file by more than %d bytes of text (*s here repeats 100000)", maxAliasBytes)},
		{"laughs", "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n" +
			"d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\nrules: []\n",
			"a.yaml:6: aliases expand this file by more than"},
		{"cycle", "rules: &r [*r]\n", "a.yaml:1: alias *r is inside the value it names"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			_, err := Parse("a.yaml", []byte(tc.src))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Parse = %v, want an error containing %q", err, tc.want)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("refused after %v", d)
			}
		})
	}
}

// Aliases a person writes, a few shared blocks across a few hundred rules, load, and mean
// what they say.
func TestAliasesWithinBoundLoad(t *testing.T) {
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range 500 {
		fmt.Fprintf(&b, "  - name: r%d\n    limit: { requests: %d, per: 1m }\n", i, 10+i)
		if i == 0 {
			b.WriteString("    key: &k [user, ip]\n    match: &m { method: [GET, HEAD], path: [")
			for j := range 50 {
				fmt.Fprintf(&b, "/api/v1/resource%d/**, ", j)
			}
			b.WriteString("] }\n    plans: &p {")
			for j := range 20 {
				fmt.Fprintf(&b, " tier%d: %d,", j, 100+j)
			}
			b.WriteString(" }\n")
			continue
		}
		b.WriteString("    key: *k\n    match: *m\n    plans: *p\n")
	}
	set, err := Parse("a.yaml", []byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	last := set.Rules[len(set.Rules)-1]
	if len(last.Key) != 2 || len(last.Plans()) != 20 || !last.Matches([]Attr{{"method", "GET"}, {"path", "/api/v1/resource49/x"}}) {
		t.Errorf("the last rule does not have what the aliases name: key %v, %d plans", last.Key, len(last.Plans()))
	}
}

// Top-level plans that would give the rules more than maxPlanLimits plan limits are
// refused before any is built: 3,000 one-line plans and 3,000 rules, a 235 KB file
// without an alias, took 15 s and 1.3 GB to load.
func TestTopLevelPlansBounded(t *testing.T) {
	const plans, rules = 1001, 1000 // just past maxPlanLimits
	var b strings.Builder
	b.WriteString("plans:\n")
	for i := range plans {
		fmt.Fprintf(&b, "  p%04d: 2x\n", i)
	}
	b.WriteString("rules:\n")
	for i := range rules {
		fmt.Fprintf(&b, "  - name: r%d\n    key: user\n    limit: { requests: 10, per: 1m }\n", i)
	}
	start := time.Now()
	_, err := Parse("a.yaml", []byte(b.String()))
	want := fmt.Sprintf("a.yaml:%d: plans.p1000: the top-level plans give the rules more than %d plan limits in all (1001 plans, 1000 rules)", plans+1, maxPlanLimits)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("Parse = %v, want an error containing %q", err, want)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("refused after %v", d)
	}
}

// A large file without aliases loads: 10,000 rules, the size the daemon is measured at.
func TestManyRulesLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("10,000 rules")
	}
	var b strings.Builder
	b.WriteString("plans:\n  partner: 10x\n  internal: unlimited\nrules:\n")
	for i := range 10_000 {
		fmt.Fprintf(&b, "  - name: r%d\n    match: { path: \"/p%d/**\" }\n    key: user\n    limit: { requests: 10, per: 1m }\n", i, i)
	}
	set, err := Parse("a.yaml", []byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	if len(set.Rules) != 10_000 || len(set.Rules[9999].Plans()) != 2 {
		t.Fatalf("%d rules", len(set.Rules))
	}
}

func writeRules(t *testing.T, dir, name, src string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}
