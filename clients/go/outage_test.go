package rlclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// logLines collects what a JSON slog handler writes.
type logLines struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logLines) lines(t *testing.T) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, s := range strings.Split(strings.TrimSpace(l.buf.String()), "\n") {
		if s == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			t.Fatalf("%q: %v", s, err)
		}
		out = append(out, m)
	}
	return out
}

// fakeClock is a settable clock for the outage log.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (f *fakeClock) now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.t
}

func (f *fakeClock) add(d time.Duration) {
	f.mu.Lock()
	f.t = f.t.Add(d)
	f.mu.Unlock()
}

// loggedClient is a client of o logging to the returned lines, its outage log on the
// returned clock. A test whose stand-in sidecar must answer gives o a Timeout of
// seconds: a check that misses the default 50 ms (a loaded machine, -race) is logged
// "unreachable", and these tests count the lines.
func loggedClient(t *testing.T, o Options) (*Client, *logLines, *fakeClock) {
	t.Helper()
	l := &logLines{}
	o.Logger = slog.New(slog.NewJSONHandler(l, nil))
	c := newClient(t, o)
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	c.outage.now = clock.now
	return c, l, clock
}

// An unreachable sidecar (here: the socket path has a typo) is logged: the first check
// decided by the Policy at once, then one line per OutageLogInterval with the count of
// checks decided since the line before, then one line when the sidecar answers again.
func TestUnreachableSidecarIsLogged(t *testing.T) {
	for _, p := range []Policy{FailOpen, FailClosed} {
		t.Run(p.String(), func(t *testing.T) {
			path := socketPath(t)
			c, l, clock := loggedClient(t, Options{Socket: path, Policy: p, Timeout: 10 * time.Second})
			ctx := context.Background()
			for i := 0; i < 5; i++ {
				if d, _ := c.Check(ctx, map[string]string{"user": "a"}, nil); !d.Unreachable {
					t.Fatalf("check %d: %+v", i, d)
				}
			}
			lines := l.lines(t)
			if len(lines) != 1 {
				t.Fatalf("after 5 failed checks: %d lines: %v", len(lines), lines)
			}
			first := lines[0]
			want := "requests pass without rate limiting (fail-open)"
			if p == FailClosed {
				want = "requests are refused (fail-closed)"
			}
			if first["level"] != "WARN" || !strings.Contains(first["msg"].(string), "rlsidecar unreachable") ||
				!strings.Contains(first["msg"].(string), want) || first["socket"] != path ||
				first["policy"] != p.String() || first["decided_by_policy"] != 1.0 || first["error"] == "" {
				t.Fatalf("first line %v", first)
			}

			clock.add(OutageLogInterval - time.Millisecond)
			c.Check(ctx, nil, nil)
			if n := len(l.lines(t)); n != 1 {
				t.Fatalf("a line before the interval passed: %d lines", n)
			}
			clock.add(time.Millisecond)
			c.Check(ctx, nil, nil)
			lines = l.lines(t)
			if len(lines) != 2 || !strings.Contains(lines[1]["msg"].(string), "still unreachable") ||
				lines[1]["decided_by_policy"] != 6.0 {
				t.Fatalf("after the interval: %v", lines)
			}

			f := startFake(t, path, nil)
			defer f.stop()
			eventually(t, "an answer", func() bool {
				clock.add(time.Millisecond)
				d, _ := c.Check(ctx, map[string]string{"user": "a"}, nil)
				return !d.Unreachable
			})
			lines = l.lines(t)
			if len(lines) != 3 || !strings.Contains(lines[2]["msg"].(string), "answers again") || lines[2]["level"] != "WARN" {
				t.Fatalf("recovery: %v", lines)
			}
			for i := 0; i < 100; i++ {
				c.Check(ctx, map[string]string{"user": "a"}, nil)
			}
			if n := len(l.lines(t)); n != len(lines) {
				t.Fatalf("lines while the sidecar answers: %v", l.lines(t)[len(lines):])
			}
		})
	}
}

// A sidecar that fails one check and answers the next, over and over, writes no more
// than a failure line and a recovery line per OutageLogInterval.
func TestFlappingSidecarDoesNotFloodTheLog(t *testing.T) {
	path := socketPath(t)
	fail := true
	c, l, clock := loggedClient(t, Options{Socket: path, Timeout: 10 * time.Second})
	f := startFake(t, path, nil)
	defer f.stop()
	ctx := context.Background()
	for i := 0; i < 200; i++ {
		fail = !fail
		clock.add(10 * time.Millisecond) // 200 checks: 2 s
		if fail {
			c.unreachable(errTimeout) // as a check that timed out
		} else if d, _ := c.Check(ctx, map[string]string{"user": "a"}, nil); d.Unreachable {
			t.Fatalf("check %d: %+v", i, d)
		}
	}
	if lines := l.lines(t); len(lines) != 2 {
		t.Fatalf("%d lines in 2 s of a flapping sidecar: %v", len(lines), lines)
	}
	clock.add(OutageLogInterval)
	c.unreachable(errTimeout)
	lines := l.lines(t)
	if len(lines) != 3 || lines[2]["decided_by_policy"] != 100.0 {
		t.Fatalf("the next line does not count the unlogged failures: %v", lines)
	}
}

// A check whose caller went away (its context canceled) says nothing of the sidecar.
func TestCanceledCheckIsNotLogged(t *testing.T) {
	c, l, _ := loggedClient(t, Options{Socket: socketPath(t)})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if d, _ := c.Check(ctx, nil, nil); !d.Unreachable {
		t.Fatalf("%+v", d)
	}
	if lines := l.lines(t); len(lines) != 0 {
		t.Fatalf("%v", lines)
	}
}

// Without Options.Logger the lines go to slog's default logger, and the Middleware's
// fail-open requests are among the checks counted.
func TestUnreachableSidecarLogsToSlogDefault(t *testing.T) {
	l := &logLines{}
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewJSONHandler(l, nil)))
	defer slog.SetDefault(old)
	c := newClient(t, Options{Socket: socketPath(t)})
	called := 0
	h := Middleware(c, MiddlewareOptions{})(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { called++ }))
	for i := 0; i < 3; i++ {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
		if rec.Code != 200 {
			t.Fatalf("status %d", rec.Code)
		}
	}
	lines := l.lines(t)
	if called != 3 || len(lines) != 1 || !strings.Contains(lines[0]["msg"].(string), "rlsidecar unreachable") {
		t.Fatalf("next called %d times, lines %v", called, lines)
	}
}

// A check whose caller's deadline had passed before it was made (a request that waited
// past its own deadline, under load) was not sent: it says nothing of the sidecar, which
// answers the other checks. Before, it was logged "rlsidecar unreachable; requests pass
// without rate limiting", then "answers again" at the next check, while the sidecar
// answered all along.
func TestExpiredCheckIsNotLogged(t *testing.T) {
	path := socketPath(t)
	startFake(t, path, nil)
	c, l, _ := loggedClient(t, Options{Socket: path, Timeout: 10 * time.Second})
	if d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil); err != nil || d.Unreachable {
		t.Fatalf("%+v %v", d, err)
	}
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	if d, _ := c.Check(ctx, map[string]string{"user": "u"}, nil); !d.Unreachable || !errors.Is(d.Cause, ErrUnreachable) {
		t.Fatalf("%+v", d)
	}
	if d, err := c.Check(context.Background(), map[string]string{"user": "u"}, nil); err != nil || d.Unreachable {
		t.Fatalf("%+v %v", d, err)
	}
	if lines := l.lines(t); len(lines) != 0 {
		t.Fatalf("%v", lines)
	}
}
