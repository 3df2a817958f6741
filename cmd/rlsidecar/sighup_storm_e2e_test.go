package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestE2ESigtermAfterSighupStorm: SIGHUPs sent while a slow reload runs (a config
// manager, `systemctl reload` in a loop), then SIGTERM: the daemon drains and exits 0.
// Before, SIGHUP and SIGTERM shared one channel of 4, which os/signal does not wait on:
// the SIGHUPs filled it while the serving loop reloaded, the SIGTERM was dropped, and
// the daemon went on serving after its queued reloads (still running 90 s later with
// 40,000 rules; systemd would have killed it at TimeoutStopSec, no drain, no last sync).
func TestE2ESigtermAfterSighupStorm(t *testing.T) {
	dir := shortTempDir(t)
	// Enough rules that a reload lasts while the storm is sent (0.2–2 s for 20,000).
	var b strings.Builder
	b.WriteString("rules:\n")
	for i := range 20000 {
		fmt.Fprintf(&b, "  - {name: r%d, key: user, match: {path: /p%d}, limit: {requests: 5, per: 1s}}\n", i, i)
	}
	cfg := writeFile(t, dir, "rules.yaml", b.String())
	n := listenNotify(t) // RELOADING=1 says when the reload has begun, with no polling
	t.Setenv("NOTIFY_SOCKET", n.path)
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0", "--watch=false")
	base := "http://" + adminAddr(t, d)
	n.waitFor(t, "READY", time.Minute)
	// reloads reads the reload counts; ok false when /rules did not answer them: the
	// daemon has begun to drain (its reload over and the SIGTERM taken), and the exit
	// awaited below says the rest. Before, that was a fatal "unexpected end of JSON
	// input" on a loaded machine, where the reload can end before the read.
	reloads := func() (begun, ended uint64, ok bool) {
		resp, err := http.Get(base + "/rules")
		if err != nil {
			return 0, 0, false
		}
		defer resp.Body.Close()
		var doc struct {
			Begun uint64 `json:"reloads_begun"`
			Ended uint64 `json:"reloads"`
		}
		if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&doc) != nil {
			return 0, 0, false
		}
		return doc.Begun, doc.Ended, true
	}

	must(t, d.cmd.Process.Signal(syscall.SIGHUP))
	n.waitFor(t, "RELOADING", time.Minute)
	// The serving loop is reloading. Each SIGHUP apart from the last (the runtime
	// merges a signal sent again before it is handed on), then SIGTERM.
	for range 8 {
		must(t, d.cmd.Process.Signal(syscall.SIGHUP))
		time.Sleep(5 * time.Millisecond)
	}
	must(t, d.cmd.Process.Signal(syscall.SIGTERM))
	if _, ended, ok := reloads(); ok && ended != 0 {
		t.Skipf("the first reload ended before the SIGTERM was sent: this machine reloads too fast for the test")
	}
	select {
	case err := <-d.done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, d.stderr.String())
		}
	case <-time.After(2 * time.Minute):
		begun, ended, _ := reloads()
		t.Fatalf("SIGTERM lost: still serving 2 minutes after it, %d reloads begun, %d ended\n%s", begun, ended, lastLines(d.stderr.String()))
	}
	if !strings.Contains(d.stderr.String(), `msg=draining signal=terminated`) {
		t.Fatalf("no drain in the log:\n%s", lastLines(d.stderr.String()))
	}
}

// lastLines returns the last 10 lines of log.
func lastLines(log string) string {
	lines := strings.Split(strings.TrimSpace(log), "\n")
	return strings.Join(lines[max(0, len(lines)-10):], "\n")
}
