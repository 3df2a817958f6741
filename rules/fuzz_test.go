package rules

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// FuzzParse checks that Parse never panics, reports errors as Errors naming the file, and
// gives rules whose per-request methods work on any attributes. Seeds: the fixtures and
// testdata/fuzz/FuzzParse.
func FuzzParse(f *testing.F) {
	for _, dir := range []string{"testdata/good", "testdata/bad"} {
		files, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
		for _, path := range files {
			data, err := os.ReadFile(path)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(data)
		}
	}
	f.Add([]byte(DefaultYAML))
	attrs := []Attr{{"method", "POST"}, {"path", "/v1/a/b"}, {"ip", "1.2.3.4"}, {"user", "a|{}"}, {"plan", "partner"}}
	f.Fuzz(func(t *testing.T, data []byte) {
		set, err := Parse("f.yaml", data)
		if err != nil {
			var es Errors
			if !errors.As(err, &es) || len(es) == 0 {
				t.Fatalf("error %T %v is not a non-empty Errors", err, err)
			}
			for _, e := range es {
				if !strings.HasPrefix(e.Error(), "f.yaml") {
					t.Fatalf("error %q does not name the file", e)
				}
			}
			return
		}
		if len(set.Version) != 12 {
			t.Fatalf("Version %q", set.Version)
		}
		buf := make([]byte, 0, 64)
		for _, r := range set.Rules {
			r.Matches(attrs)
			r.Matches(nil)
			var ok bool
			if buf, ok = r.AppendKey(buf[:0], attrs); ok {
				if name, _, err := decodeKey(string(buf)); err != nil || name != r.Name {
					t.Fatalf("key %q does not decode: %v", buf, err)
				}
			}
			for _, plan := range []string{"", "partner", "internal"} {
				if lim, unl := r.LimitFor(plan, true); !unl && (lim == nil || lim.Requests() == 0) {
					t.Fatalf("rule %s plan %q: no limit", r.Name, plan)
				}
			}
		}
	})
}
