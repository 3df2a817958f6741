package daemon

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/rules"
)

// rlsidecar_top_rejected never carries a client's key unless asked to (--top-labels raw):
// by default a keyed hash, the one /top shows beside the raw key; off exports nothing.
func TestTopLabels(t *testing.T) {
	const secret = "api_key=sk_live_51Hx"
	salt := []byte("fixed salt for the test")
	hashed := ClientLabel(salt, secret)
	if !strings.HasPrefix(hashed, "h:") || len(hashed) != 14 || strings.Contains(hashed, "sk_live") {
		t.Fatalf("label %q: want h: and 12 hex digits", hashed)
	}
	if ClientLabel([]byte("another salt"), secret) == hashed {
		t.Fatal("the label does not depend on the salt")
	}
	for _, tc := range []struct {
		mode       string
		wantMetric string // "" when no series
	}{
		{"hashed", `rlsidecar_top_rejected{rule="~inline",client="` + hashed + `"} 2`},
		{"raw", `rlsidecar_top_rejected{rule="~inline",client="` + secret + `"} 2`},
		{"off", ""},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			mode, err := ParseTopLabels(tc.mode)
			if err != nil {
				t.Fatal(err)
			}
			m := NewMetrics("test", 10)
			m.SetTopLabels(mode, salt)
			m.SetRules(rules.Default(), time.Now())
			d := &limiter.Decision{Deciding: 0, Results: []limiter.Result{{Name: "acme", Key: []byte("~inline/token_bucket/1/1000/1:{" + secret + "}")}}}
			m.Record(d)
			m.Record(d)
			var buf bytes.Buffer
			m.WritePrometheus(&buf)
			out := buf.String()
			if tc.wantMetric != "" && !strings.Contains(out, tc.wantMetric+"\n") {
				t.Errorf("want %s in:\n%s", tc.wantMetric, out)
			}
			if tc.mode != "raw" && strings.Contains(out, "sk_live") {
				t.Errorf("the key leaks into the metrics:\n%s", out)
			}
			if tc.mode == "off" && strings.Contains(out, "rlsidecar_top_rejected{") {
				t.Errorf("off exports a series:\n%s", out)
			}
			top := m.Top()["~inline"]
			if len(top) != 1 || top[0].Client != secret {
				t.Fatalf("/top: %+v, want the raw key", top)
			}
			if tc.mode == "hashed" && top[0].Label != hashed {
				t.Errorf("/top label %q, want %q", top[0].Label, hashed)
			}
		})
	}
	if _, err := ParseTopLabels("plain"); err == nil {
		t.Error("ParseTopLabels accepted plain")
	}
}
