package rlclient

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// pathCase is one case of clients/testdata/paths.json: a request target and the path
// attribute every client sends for it.
type pathCase struct {
	Raw  string `json:"raw"`
	Path string `json:"path"`
}

// loadPathCases reads clients/testdata/paths.json. Its paths are bytes written as a JSON
// string, one code point (at most U+00FF) per byte: they are converted back to bytes here.
func loadPathCases(t *testing.T) []pathCase {
	t.Helper()
	b, err := os.ReadFile("../testdata/paths.json")
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Meaning string     `json:"meaning"`
		Cases   []pathCase `json:"cases"`
	}
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		t.Fatalf("paths.json: %v", err)
	}
	if len(f.Cases) < 30 {
		t.Fatalf("paths.json has %d cases", len(f.Cases))
	}
	for i := range f.Cases {
		c := &f.Cases[i]
		c.Raw, c.Path = latin1(t, c.Raw), latin1(t, c.Path)
	}
	return f.Cases
}

// latin1 returns the bytes s stands for, one per code point.
func latin1(t *testing.T, s string) string {
	t.Helper()
	b := make([]byte, 0, len(s))
	for _, r := range s {
		if r > 0xff {
			t.Fatalf("paths.json: %q holds U+%04X, which is no byte", s, r)
		}
		b = append(b, byte(r))
	}
	return string(b)
}

func TestNormalizePathVectors(t *testing.T) {
	for _, c := range loadPathCases(t) {
		if got := NormalizePath(c.Raw); got != c.Path {
			t.Errorf("NormalizePath(%q) = %q, want %q", c.Raw, got, c.Path)
		}
	}
}

// Targets beyond the shared cases: the absolute form (a proxy request), whose path is
// what the server serves, and things that only look like it.
func TestNormalizePathAbsoluteForm(t *testing.T) {
	for raw, want := range map[string]string{
		"http://example.com/f%61st?next=/admin": "/fast",
		"HTTPS://example.com:8443//a/../fast#x": "/fast",
		"http://example.com":                    "/",
		"http://example.com?q=/fast":            "/",
		"h2c+x.y-z://h/fast":                    "/fast",
		"*":                                     "/*",
		"a:b/c":                                 "/a:b/c",
		"/http://example.com/fast":              "/http:/example.com/fast",
		"1http://example.com/fast":              "/1http:/example.com/fast",
	} {
		if got := NormalizePath(raw); got != want {
			t.Errorf("NormalizePath(%q) = %q, want %q", raw, got, want)
		}
	}
}

// The middleware sends the normalized path of the target as net/http read it. Targets that
// net/http refuses (an invalid escape, no leading '/') get a 400 before any handler runs.
// net/http keeps a '#' in the target as part of the path (it escapes it as %23 in
// EscapedPath), so there the attribute keeps it too: what the handler is asked for.
func TestMiddlewareSendsNormalizedPath(t *testing.T) {
	path := socketPath(t)
	var mu sync.Mutex
	var got string
	startFake(t, path, func(req *proto.Request, resp *proto.Response) {
		mu.Lock()
		got = strings.Clone(attr(req, "path"))
		mu.Unlock()
		resp.Allowed = true
	})
	c := newClient(t, Options{Socket: path, Timeout: 5 * time.Second})
	h := Middleware(c, MiddlewareOptions{})(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	cases := append(loadPathCases(t), pathCase{"http://example.com//f%61st/./?x", "/fast/"}, pathCase{"/a/#/../b", "/a/b"})
	hashInPath := map[string]string{"/a#frag": "/a#frag"} // the shared case says /a
	sent := 0
	for _, pc := range cases {
		r, err := http.ReadRequest(bufio.NewReader(strings.NewReader("GET " + pc.Raw + " HTTP/1.1\r\nHost: example.com\r\n\r\n")))
		if err != nil {
			t.Logf("%q: net/http refuses it: %v", pc.Raw, err)
			continue
		}
		want := pc.Path
		if w, ok := hashInPath[pc.Raw]; ok {
			want = w
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		mu.Lock()
		g := got
		mu.Unlock()
		if rec.Code != 200 || g != want {
			t.Errorf("GET %q: status %d, path attribute %q, want %q", pc.Raw, rec.Code, g, want)
		}
		sent++
	}
	if sent < 30 {
		t.Fatalf("only %d targets reached the middleware", sent)
	}
}

func ExampleNormalizePath() {
	for _, target := range []string{"/f%61st", "//fast", "/a/../fast?next=/admin", "/a%2Fb/%2e%2e/c", "/a%2541"} {
		fmt.Println(NormalizePath(target))
	}
	// Output:
	// /fast
	// /fast
	// /fast
	// /a/c
	// /a%41
}
