package rules

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// topPlan is a plan defined once at the top level of a rules file and applied to every
// rule that does not define a plan of that name itself:
//
//	plans:
//	  partner: 10x                  # every rule's limit × 10 (burst keeps its ratio)
//	  internal: unlimited           # exempt from every rule
//	  gold: { holds-per-account: 500, "*": 5x }   # per rule; "*" for the others
//
// A new tenant tier is one line. A rule's own plans: map wins for the names it lists.
type topPlan struct {
	name    string
	file    string
	line    int
	all     *planValue            // applies to every rule (nil: only the listed ones)
	perRule map[string]*planValue // rule name → value
	nodes   map[string]*yaml.Node // rule name → where it was written (errors)
}

// starPlan is the error of a plan named "*", which would apply only to requests whose
// plan attribute is "*": in a top-level plan's map of rules, "*" stands for the rules it
// does not name, and a plan of that name was taken without a word.
const starPlan = `"*" is not a plan name: it stands for "every other rule" inside a top-level plan's map of rules (gold: { holds-per-account: 500, "*": 5x })`

// maxMultiplier is the largest multiplier a top-level plan may give (1000000x).
const maxMultiplier = 1e6

// planValue is unlimited, a multiplier of the rule's requests, or a number of requests.
type planValue struct {
	unlimited bool
	mult      float64
	requests  uint64
}

func (p *parser) topPlans(n *yaml.Node) {
	pairs, ok := p.pairs(n, "plans")
	if !ok {
		return
	}
	if p.top == nil {
		p.top = map[string]*topPlan{}
	}
	for _, kv := range pairs {
		field := "plans." + kv.key
		if kv.key == "" {
			p.errorf(kv.keyNode, "plans", "a plan name must not be empty")
			continue
		}
		if kv.key == "*" {
			p.errorf(kv.keyNode, "plans", starPlan)
			continue
		}
		tp := &topPlan{name: kv.key, file: p.file, line: kv.keyNode.Line}
		v := deref(kv.val)
		if v.Kind == yaml.MappingNode {
			rulePairs, ok := p.pairs(v, field)
			if !ok {
				continue
			}
			tp.perRule, tp.nodes = map[string]*planValue{}, map[string]*yaml.Node{}
			for _, rv := range rulePairs {
				pv := p.planValue(rv.val, field+"."+rv.key)
				if pv == nil {
					continue
				}
				if rv.key == "*" {
					tp.all = pv
					continue
				}
				tp.perRule[rv.key] = pv
				tp.nodes[rv.key] = rv.keyNode
			}
		} else if pv := p.planValue(v, field); pv != nil {
			tp.all = pv
		} else {
			continue
		}
		p.top[kv.key] = tp
	}
}

func (p *parser) planValue(v *yaml.Node, field string) *planValue {
	v = deref(v)
	if v.Kind == yaml.ScalarNode && v.ShortTag() == "!!str" {
		if v.Value == "unlimited" {
			return &planValue{unlimited: true}
		}
		if m, ok := strings.CutSuffix(v.Value, "x"); ok {
			f, err := strconv.ParseFloat(m, 64)
			if err == nil && f > 0 && f <= maxMultiplier {
				return &planValue{mult: f}
			}
			if err == nil || errors.Is(err, strconv.ErrRange) {
				// A number, but not one a multiplier may be (0x, -2x, 3000000x): say so,
				// rather than ask for the multiplier it is written as.
				p.errorf(v, field, "multiplier %s is out of range: above 0x and at most %dx", quote(v.Value), int(maxMultiplier))
				return nil
			}
		}
		p.errorf(v, field, "expected a multiplier like 10x or 0.5x, a number of requests, or unlimited; got %s", describe(v))
		return nil
	}
	n, ok := p.count(v, field, " (or a multiplier like 10x, or unlimited)")
	if !ok {
		return nil
	}
	return &planValue{requests: n}
}

// maxPlanLimits bounds the plan limits of a rule set: for each rule, one per plan that
// applies to it. Each costs about 160 bytes and a microsecond to build; a million is
// 10,000 rules with 100 plans each.
const maxPlanLimits = 1_000_000

// applyPlans gives every rule the top-level plans it does not define itself.
func (p *parser) applyPlans(rules []*Rule, plans map[string]*topPlan) {
	if len(plans) == 0 {
		return
	}
	byName := map[string]bool{}
	limited := 0 // rules a plan can apply to
	for _, r := range rules {
		byName[r.Name] = true
		if !r.Unlimited && !r.Deny {
			limited++
		}
	}
	names := make([]string, 0, len(plans))
	for name := range plans {
		names = append(names, name)
	}
	sort.Strings(names)
	// Each rule holds its own limit for each plan that applies to it, so plans × rules
	// limits are built: bounded before any is, since that product grows with the square
	// of a file's size (3,000 plans of one line and 3,000 rules, a 235 KB file, cost 15 s
	// and 1.3 GB).
	planned := 0
	for _, r := range rules {
		planned += len(r.plans)
	}
	for _, name := range names {
		tp := plans[name]
		if tp.all != nil {
			planned += limited
		} else {
			planned += len(tp.perRule)
		}
		if planned > maxPlanLimits {
			p.errs = append(p.errs, &Error{File: tp.file, Line: tp.line, Field: "plans." + name,
				Msg: fmt.Sprintf("the top-level plans give the rules more than %d plan limits in all (%d plans, %d rules); define fewer plans, or list in each the rules it applies to", maxPlanLimits, len(plans), len(rules))})
			return
		}
	}
	for _, name := range names {
		tp := plans[name]
		for rn, node := range tp.nodes {
			if !byName[rn] {
				p.errs = append(p.errs, &Error{File: tp.file, Line: node.Line, Field: "plans." + name + "." + rn,
					Msg: fmt.Sprintf("plan %q names rule %q, which no rules file defines", name, rn)})
			}
		}
		for _, r := range rules {
			if _, own := r.plans[name]; own || r.Unlimited || r.Deny {
				continue
			}
			pv := tp.perRule[r.Name]
			if pv == nil {
				pv = tp.all
			}
			if pv == nil {
				continue
			}
			pl, err := planFor(r, pv)
			if err != nil {
				p.errs = append(p.errs, &Error{File: tp.file, Line: tp.line, Field: "plans." + name,
					Msg: fmt.Sprintf("for rule %q: %v", r.Name, err)})
				continue
			}
			if r.plans == nil {
				r.plans = map[string]*planLimit{}
			}
			r.plans[name] = pl
		}
	}
}

func planFor(r *Rule, pv *planValue) (*planLimit, error) {
	if pv.unlimited {
		return &planLimit{unlimited: true}, nil
	}
	reqs := pv.requests
	if pv.mult > 0 {
		f := math.Ceil(float64(r.Requests) * pv.mult)
		if f > math.MaxUint32 {
			return nil, fmt.Errorf("%v × %d requests is too many", pv.mult, r.Requests)
		}
		reqs = max(1, uint64(f))
	}
	burst, ok := scaleBurst(r.Burst, reqs, r.Requests)
	if !ok {
		return nil, fmt.Errorf("burst %d scaled to %d requests is too large", r.Burst, reqs)
	}
	lim, err := r.limit.WithRequests(reqs, burst) // the rule's window, calendar and delay
	if err != nil {
		return nil, err
	}
	return &planLimit{limit: lim}, nil
}

// IsRulesFile reports whether a directory's file named name (its base name) is one of
// its rules files: *.yaml or *.yml, not hidden (editors' swap files, a ConfigMap's ..data
// entries).
func IsRulesFile(name string) bool {
	ext := filepath.Ext(name)
	return (ext == ".yaml" || ext == ".yml") && !strings.HasPrefix(name, ".")
}

// RulesFiles lists dir's rules files (IsRulesFile), in name order.
func RulesFiles(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var paths []string
	for _, e := range ents {
		if IsRulesFile(e.Name()) {
			paths = append(paths, filepath.Join(dir, e.Name()))
		}
	}
	sort.Strings(paths)
	return paths, nil
}

// LoadDir reads every *.yaml and *.yml file of dir, in name order, as one rule set: rules
// from all files (a name used twice is an error naming both files), plans defined once at
// the top level of any file and applied to the rules of all of them. A file may hold only
// plans. (*.yml was skipped without a word before: a rules file so named never applied.)
func LoadDir(dir string) (*Set, error) {
	paths, err := RulesFiles(dir)
	if err != nil {
		return nil, err
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("%s: no *.yaml or *.yml rules files", dir)
	}
	var errs Errors
	var all []*Rule
	plans := map[string]*topPlan{}
	firstRule := map[string]*Rule{}
	h := sha256.New()
	var skipped Errors // dangling links, said in Warnings
	read := 0
	for _, path := range paths {
		data, err := readFile(path)
		if err != nil {
			// A file gone since the directory was listed is not one of the set; nor is
			// a symlink whose target does not exist (a link left behind when its file
			// was deleted, a ConfigMap key removed while the links are being swapped):
			// skipped, as a deleted file is, and said. Before, it failed every reload
			// (the rules in force kept, every later edit of the other files refused)
			// and the daemon's start.
			var dl *danglingLink
			if errors.As(err, &dl) {
				skipped = append(skipped, &Error{File: path, Msg: fmt.Sprintf("a symlink to %s, which does not exist: skipped, as a deleted file would be (restore its target, or remove the link)", dl.target)})
				// In the version too: a link added (or pointed elsewhere) while nothing
				// else changed is a new version, so the reload logs its warning rather
				// than taking the rules as unchanged, saying nothing.
				h.Write([]byte(filepath.Base(path)))
				h.Write([]byte{0, 0xff})
				h.Write([]byte(dl.target))
				h.Write([]byte{0})
				continue
			}
			if errors.Is(err, fs.ErrNotExist) {
				if _, lerr := os.Lstat(path); errors.Is(lerr, fs.ErrNotExist) {
					continue
				}
			}
			return nil, err
		}
		read++
		h.Write([]byte(filepath.Base(path)))
		h.Write([]byte{0})
		h.Write(data)
		h.Write([]byte{0})
		p := &parser{file: path, inDir: true}
		rules := p.parse(data)
		errs = append(errs, p.errs...)
		for _, r := range rules {
			if first := firstRule[r.Name]; first != nil {
				errs = append(errs, &Error{File: r.File, Line: r.Line, Field: "name",
					Msg: fmt.Sprintf("duplicate rule name %q (also in %s:%d)", r.Name, first.File, first.Line)})
				continue
			}
			firstRule[r.Name] = r
			r.Index = len(all)
			all = append(all, r)
		}
		for name, tp := range p.top {
			if first := plans[name]; first != nil {
				errs = append(errs, &Error{File: tp.file, Line: tp.line, Field: "plans." + name,
					Msg: fmt.Sprintf("plan %q defined twice (also in %s:%d)", name, first.file, first.line)})
				continue
			}
			plans[name] = tp
		}
	}
	if read == 0 {
		return nil, append(Errors{{File: dir, Msg: "no *.yaml or *.yml rules files to read: every one is a symlink to a missing file, or gone"}}, skipped...)
	}
	if len(errs) == 0 {
		p := &parser{}
		p.applyPlans(all, plans)
		errs = append(errs, p.errs...)
		errs = append(errs, resolveReplaces(all)...)
	}
	if len(errs) > 0 {
		slices.SortStableFunc(errs, func(a, b *Error) int {
			if c := strings.Compare(a.File, b.File); c != 0 {
				return c
			}
			return a.Line - b.Line
		})
		return nil, errs
	}
	set := newSet(all, dir, hex.EncodeToString(h.Sum(nil))[:12])
	set.skipped = skipped
	return set, nil
}
