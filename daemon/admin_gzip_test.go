package daemon

import (
	"compress/gzip"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// A scrape that accepts gzip, as Prometheus's does, gets /metrics compressed: with 2,000
// rules it is a tenth of the text or less, and decompresses to the exposition a scrape
// without gzip gets. Before, every scrape took the whole text (about 7 MB for 20,000
// rules).
func TestMetricsGzip(t *testing.T) {
	var src strings.Builder
	src.WriteString("rules:\n")
	for i := range 2000 {
		fmt.Fprintf(&src, "  - { name: rule-%d, key: user, limit: { requests: 10, per: 1m } }\n", i)
	}
	set, err := rules.Parse("test.yaml", []byte(src.String()))
	if err != nil {
		t.Fatal(err)
	}
	m := NewMetrics("test", 10)
	m.SetRules(set, time.Now())
	base := startAdmin(t, AdminDeps{Metrics: m, Limiter: limiter.New(set, localbucket.NewStore(localbucket.Options{}))})
	scrape := func(acceptEncoding string) (*http.Response, []byte) {
		t.Helper()
		req, _ := http.NewRequest("GET", base+"/metrics", nil)
		if acceptEncoding != "" {
			req.Header.Set("Accept-Encoding", acceptEncoding) // set: the transport then leaves the body as sent
		}
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("Accept-Encoding %q: %d, %v", acceptEncoding, resp.StatusCode, err)
		}
		return resp, b
	}
	plainResp, plain := scrape("identity")
	if enc := plainResp.Header.Get("Content-Encoding"); enc != "" || !strings.Contains(string(plain), `rlsidecar_checks_total{rule="rule-1999"`) {
		t.Fatalf("identity: Content-Encoding %q, %d bytes", enc, len(plain))
	}
	for _, ae := range []string{"gzip", "deflate, gzip;q=0.8", "GZIP", "br;q=1.0, gzip", "gzip; q=0.5; x=y"} {
		resp, zipped := scrape(ae)
		if enc := resp.Header.Get("Content-Encoding"); enc != "gzip" {
			t.Fatalf("Accept-Encoding %q: Content-Encoding %q", ae, enc)
		}
		if len(zipped)*10 > len(plain) {
			t.Fatalf("Accept-Encoding %q: %d bytes gzipped of %d", ae, len(zipped), len(plain))
		}
		zr, err := gzip.NewReader(strings.NewReader(string(zipped)))
		if err != nil {
			t.Fatal(err)
		}
		text, err := io.ReadAll(zr)
		if err != nil {
			t.Fatal(err)
		}
		if len(text) < len(plain)*9/10 || !strings.Contains(string(text), `rlsidecar_checks_total{rule="rule-1999"`) {
			t.Fatalf("Accept-Encoding %q: %d bytes of text, want about %d", ae, len(text), len(plain))
		}
	}
	for _, ae := range []string{"gzip;q=0", "deflate", "gzipx", "gzip;q=0.000"} {
		if resp, _ := scrape(ae); resp.Header.Get("Content-Encoding") != "" {
			t.Fatalf("Accept-Encoding %q: Content-Encoding %q", ae, resp.Header.Get("Content-Encoding"))
		}
	}
}
