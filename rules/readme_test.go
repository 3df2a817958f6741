package rules

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// A yaml block of the README, and the line its first line is on.
type docBlock struct {
	line int
	text string
}

// yamlBlocks returns the ```yaml blocks of a Markdown document, each without the
// indentation of its fence (a block inside a list item is indented with it).
func yamlBlocks(t *testing.T, doc string) []docBlock {
	t.Helper()
	var blocks []docBlock
	lines := strings.Split(doc, "\n")
	for i := 0; i < len(lines); i++ {
		trimmed := strings.TrimLeft(lines[i], " ")
		if trimmed != "```yaml" {
			continue
		}
		indent := len(lines[i]) - len(trimmed)
		start := i + 1
		var body []string
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			l := lines[i]
			if len(l) >= indent && strings.TrimSpace(l[:indent]) == "" {
				l = l[indent:]
			}
			body = append(body, l)
		}
		if i == len(lines) {
			t.Fatalf("line %d: a ```yaml block that never ends", start)
		}
		blocks = append(blocks, docBlock{line: start + 1, text: strings.Join(body, "\n") + "\n"})
	}
	return blocks
}

// TestReadmeYAMLBlocks feeds every ```yaml block of the README to the rules parser, as
// an operator copying it into a rules file would: a block that is a rules file must load
// with no error and no warning; a list of rules (an excerpt of a rules: list) is loaded
// under rules:; a top-level plans: block is loaded with the rules of the README's rules
// block before it, which it names. Any other block (Envoy's and Istio's configurations)
// must at least be YAML. A block meant to show an error belongs in a ```text block.
func TestReadmeYAMLBlocks(t *testing.T) {
	doc, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := yamlBlocks(t, string(doc))
	if len(blocks) < 4 {
		t.Fatalf("found %d yaml blocks in README.md; the test reads them wrong", len(blocks))
	}
	var lastRules string // the rules: list of the last rules file met, for a plans: block
	loaded := 0
	for _, b := range blocks {
		name := fmt.Sprintf("README.md:%d", b.line)
		pad := strings.Repeat("\n", b.line-1) // so that errors give the README's lines
		var top any
		if err := yaml.Unmarshal([]byte(b.text), &top); err != nil {
			t.Errorf("%s: not YAML: %v", name, err)
			continue
		}
		var src string
		switch v := top.(type) {
		case []any: // an excerpt of a rules: list
			src = pad[1:] + "rules:\n" + b.text
		case map[string]any:
			if _, ok := v["rules"]; ok {
				src = pad + b.text
				if i := strings.Index(b.text, "rules:\n"); i >= 0 {
					lastRules = b.text[i:]
				}
			} else if _, ok := v["plans"]; ok {
				if lastRules == "" {
					t.Errorf("%s: a plans: block before any rules block", name)
					continue
				}
				src = pad + b.text + lastRules
			}
		}
		if src == "" {
			continue // not a rules file: Envoy's or Istio's configuration
		}
		set, err := Parse("README.md", []byte(src))
		if err != nil {
			t.Errorf("%s: the block does not load as rules: %v", name, err)
			continue
		}
		if ws := set.Warnings(); len(ws) > 0 {
			t.Errorf("%s: the block loads with warnings: %v", name, ws)
		}
		loaded++
	}
	if loaded < 4 {
		t.Errorf("loaded %d rules blocks of README.md, want at least 4 (the schema, top-level plans, a concurrency rule, the policies)", loaded)
	}
}
