package rules

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestTopLevelPlans(t *testing.T) {
	set, err := Parse("plans.yaml", []byte(`
plans:
  partner: 10x
  internal: unlimited
  gold: { r1: 500, "*": 2x }
rules:
  - name: r1
    key: user
    limit: { requests: 100, per: 1m, burst: 150 }
  - name: r2
    key: ip
    limit: { requests: 10, per: 1s }
    plans: { partner: 7 }
`))
	if err != nil {
		t.Fatal(err)
	}
	r1, r2 := set.Rules[0], set.Rules[1]
	for _, tc := range []struct {
		r               *Rule
		plan            string
		requests, burst uint64
		unlimited       bool
	}{
		{r1, "partner", 1000, 1500, false},
		{r1, "gold", 500, 750, false},
		{r1, "internal", 0, 0, true},
		{r1, "free", 100, 150, false}, // not a plan: the default
		{r2, "partner", 7, 7, false},  // the rule's own plan wins
		{r2, "gold", 20, 20, false},   // "*": 2x
		{r2, "internal", 0, 0, true},
	} {
		lim, unlimited := tc.r.LimitFor(tc.plan, true)
		if unlimited != tc.unlimited || !unlimited && (lim.Requests() != tc.requests || lim.Burst() != tc.burst) {
			t.Errorf("%s/%s: %v %v", tc.r.Name, tc.plan, lim, unlimited)
		}
	}
}

func TestLoadDir(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a.yaml", "rules:\n  - name: a\n    key: user\n    limit: { requests: 10, per: 1m }\n")
	write("b.yaml", "rules:\n  - name: b\n    key: ip\n    limit: { requests: 5, per: 1s }\n")
	write("plans.yaml", "plans:\n  partner: 3x\n")
	write(".swap.yaml", "this is not yaml: [")
	write("notes.txt", "ignored")
	set, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(set.Rules) != 2 || set.Rules[0].Name != "a" || set.Rules[1].Name != "b" || set.Source != dir {
		t.Fatalf("%+v", set)
	}
	if lim, _ := set.Rules[1].LimitFor("partner", true); lim.Requests() != 15 {
		t.Fatalf("plan from another file: %d", lim.Requests())
	}
	v := set.Version

	write("c.yaml", "rules:\n  - name: a\n    key: ip\n    limit: { requests: 1, per: 1m }\n")
	_, err = Load(dir)
	if err == nil || !strings.Contains(err.Error(), `c.yaml:2: name: duplicate rule name "a" (also in `+filepath.Join(dir, "a.yaml")+`:2)`) {
		t.Fatalf("duplicate across files: %v", err)
	}
	os.Remove(filepath.Join(dir, "c.yaml"))
	write("more.yaml", "plans:\n  partner: 2x\n")
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), `plan "partner" defined twice`) {
		t.Fatalf("plan twice: %v", err)
	}
	os.Remove(filepath.Join(dir, "more.yaml"))
	if set, err := Load(dir); err != nil || set.Version != v {
		t.Fatalf("same files, different version: %v", err)
	}
	if _, err := Load(t.TempDir()); err == nil || !strings.Contains(err.Error(), "no *.yaml or *.yml") {
		t.Fatalf("empty dir: %v", err)
	}
	// *.yml files are rules files too, in name order with the others; hidden ones are not.
	write("c.yml", "rules:\n  - name: c\n    key: api_key\n    limit: { requests: 2, per: 1m }\n")
	write(".c.yml", "this is not yaml: [")
	if set, err := Load(dir); err != nil || len(set.Rules) != 3 || set.Rules[2].Name != "c" || set.Version == v {
		t.Fatalf("with c.yml: %v %+v", err, set)
	}
}

// Rule.Plans lists a rule's own plans and the top-level ones it takes, by name, with
// multipliers resolved; a concurrency rule's plans are its max.
func TestRulePlansList(t *testing.T) {
	set, err := Parse("plans.yaml", []byte(`
plans:
  partner: 10x
  internal: unlimited
rules:
  - name: r1
    key: user
    limit: { requests: 100, per: 1m }
    plans: { partner: 7, bronze: 50 }
  - name: exports
    key: user
    concurrency: { max: 2 }
  - name: open
    key: user
    limit: unlimited
`))
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range [][]PlanLimit{
		{{Name: "bronze", Requests: 50}, {Name: "internal", Unlimited: true}, {Name: "partner", Requests: 7}},
		{{Name: "internal", Unlimited: true}, {Name: "partner", Requests: 20}},
		nil,
	} {
		if got := set.Rules[i].Plans(); !reflect.DeepEqual(got, want) {
			t.Errorf("%s: Plans() = %+v; want %+v", set.Rules[i].Name, got, want)
		}
	}
}

// A --config DIR's rules file that is a symlink to a missing file (a link left behind when
// its file was deleted) is skipped, as a deleted file is, and said in Warnings: the other
// files still load. Before, the whole directory failed to load ("open b.yaml: no such file
// or directory"): the daemon did not start, and every reload kept the old rules.
func TestLoadDirDanglingLink(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "a.yaml"), []byte("rules:\n  - name: a\n    key: user\n    limit: { requests: 10, per: 1m }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	withoutLink, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	gone := filepath.Join(dir, "gone", "b.yaml")
	link := filepath.Join(dir, "b.yaml")
	if err := os.Symlink(gone, link); err != nil {
		t.Fatal(err)
	}
	set, err := Load(dir)
	if err != nil {
		t.Fatalf("a dangling link failed the directory: %v", err)
	}
	// Another version (the reload then logs its warning), the same rules.
	if len(set.Rules) != 1 || set.Rules[0].Name != "a" || set.Version == withoutLink.Version {
		t.Fatalf("rules %d, version %s (without the link: %s)", len(set.Rules), set.Version, withoutLink.Version)
	}
	ws := set.Warnings()
	if len(ws) != 1 || !strings.Contains(ws[0].Error(), link+": a symlink to "+gone+", which does not exist: skipped") {
		t.Fatalf("warnings: %v", ws)
	}
	// Its target back: read.
	os.Mkdir(filepath.Dir(gone), 0o755)
	if err := os.WriteFile(gone, []byte("rules:\n  - name: b\n    key: ip\n    limit: { requests: 1, per: 1m }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if set, err := Load(dir); err != nil || len(set.Rules) != 2 || len(set.Warnings()) != 0 {
		t.Fatalf("target restored: %v %+v", err, set)
	}
	os.Remove(gone)
	// Nothing else to read: an error, naming the link.
	os.Remove(filepath.Join(dir, "a.yaml"))
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), "no *.yaml or *.yml rules files to read") || !strings.Contains(err.Error(), link+": a symlink to "+gone) {
		t.Fatalf("only a dangling link: %v", err)
	}
	// A rules file named directly that is a dangling link: an error that says so.
	if _, err := Load(link); err == nil || !strings.Contains(err.Error(), link+" is a symlink to "+gone+", which does not exist") {
		t.Fatalf("--config a dangling link: %v", err)
	}
}
