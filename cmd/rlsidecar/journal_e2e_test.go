package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// journalFile returns a file to give a daemon as its stderr, and the JOURNAL_STREAM
// value systemd sets for a stream it connects to the journal, naming that file.
func journalFile(t *testing.T) (*os.File, string) {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "journal"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return f, fmt.Sprintf("%d:%d", uint64(st.Dev), uint64(st.Ino))
}

// Under systemd, journald files each line a unit writes at the unit's SyslogLevel=
// (info) unless it starts with a "<N>" priority. The daemon wrote none, so `journalctl
// -u rlsidecar -p err` and `-p warning`, which docs/operations.md gives for the alerts
// (a rejected rules file's file:line, Redis errors), showed none of its lines. On the
// journal's stream (JOURNAL_STREAM) each line now starts with its level's priority, in
// text and JSON; a daemon that cannot start files its error, every line of it, at err;
// on any other stderr the lines are as before.
func TestE2ELogPrioritiesInTheJournal(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", rulesWithLimit(5))
	for _, format := range []string{"text", "json"} {
		journal, stream := journalFile(t)
		socket := filepath.Join(dir, format+".sock")
		cmd := exec.Command(binary, "serve", "--config", cfg, "--socket", socket, "--admin=", "--log-format", format, "--redis", "redis://127.0.0.1:1")
		cmd.Env = append(os.Environ(), "JOURNAL_STREAM="+stream)
		cmd.Stderr = journal
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := waitInBackground(t, cmd)
		if line, _ := bufio.NewReader(stdout).ReadString('\n'); !strings.Contains(line, "listening on") {
			t.Fatalf("%s: daemon did not start: %q", format, line)
		}
		// A broken file (an error line); Redis at port 1 is refused (warn lines).
		writeFile(t, dir, "rules.yaml", "rules:\n  - name: per-user\n    kee: user\n")
		deadline := time.Now().Add(30 * time.Second)
		for {
			b, _ := os.ReadFile(journal.Name())
			if strings.Contains(string(b), "reload failed") && strings.Contains(string(b), "redis sync failed") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: no reload failure and Redis warning logged within 30 s:\n%s", format, b)
			}
			time.Sleep(20 * time.Millisecond)
		}
		cmd.Process.Signal(syscall.SIGTERM)
		if err := <-done; err != nil {
			t.Fatalf("%s: drain: %v", format, err)
		}
		writeFile(t, dir, "rules.yaml", rulesWithLimit(5))
		b, err := os.ReadFile(journal.Name())
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
			var want string
			switch {
			case strings.Contains(line, "reload failed"):
				want = "<3>"
			case strings.Contains(line, "redis sync failed"):
				want = "<4>"
			case strings.Contains(line, `msg=serving`), strings.Contains(line, `"msg":"serving"`), strings.Contains(line, "stopped"):
				want = "<6>"
			default:
				if !strings.HasPrefix(line, "<") {
					t.Errorf("%s: a line with no priority: %q", format, line)
				}
				continue
			}
			if !strings.HasPrefix(line, want) {
				t.Errorf("%s: want the line filed at %s: %q", format, want, line)
			}
		}
	}

	// A daemon that cannot start: its error, on three lines, each at err.
	journal, stream := journalFile(t)
	broken := writeFile(t, dir, "broken.yaml", "rules:\n  - name: x\n    limitt: 1\n")
	cmd := exec.Command(binary, "serve", "--config", broken, "--socket", filepath.Join(dir, "b.sock"), "--admin=")
	cmd.Env = append(os.Environ(), "JOURNAL_STREAM="+stream)
	cmd.Stderr = journal
	if err := cmd.Run(); err == nil {
		t.Fatal("serve on a broken file exited 0")
	}
	b, _ := os.ReadFile(journal.Name())
	lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
	if len(lines) < 3 || !strings.HasPrefix(lines[0], "<3>rlsidecar serve: ") {
		t.Fatalf("a failed start's error is not filed at err:\n%s", b)
	}
	for _, l := range lines {
		if !strings.HasPrefix(l, "<3>") {
			t.Errorf("a line of a failed start's error not filed at err: %q", l)
		}
	}

	// Stderr that is not the journal's stream (JOURNAL_STREAM inherited by a process
	// whose stderr goes elsewhere): no prefixes.
	other, _ := journalFile(t)
	cmd = exec.Command(binary, "serve", "--config", broken, "--socket", filepath.Join(dir, "b.sock"), "--admin=")
	cmd.Env = append(os.Environ(), "JOURNAL_STREAM="+stream)
	cmd.Stderr = other
	cmd.Run()
	if b, _ := os.ReadFile(other.Name()); !strings.HasPrefix(string(b), "rlsidecar serve: ") {
		t.Errorf("stderr not the journal's stream, yet prefixed:\n%s", b)
	}
}

// With --log-format json under systemd, stdout and stderr go to the journal, where a
// log shipper parses each of the unit's lines as JSON: the start line for a terminal
// ("rlsidecar … listening on …", on stdout) was the one line of the daemon that was not
// JSON. There it is left out (the "serving" record says the same); in text, or on a
// stdout that is not the journal, it is written as before.
func TestE2EJournalJSONHasOnlyJSON(t *testing.T) {
	dir := shortTempDir(t)
	for _, format := range []string{"json", "text"} {
		journal, stream := journalFile(t)
		cmd := exec.Command(binary, "serve", "--socket", filepath.Join(dir, format+".sock"), "--admin=", "--log-format", format)
		cmd.Env = append(os.Environ(), "JOURNAL_STREAM="+stream)
		cmd.Stdout, cmd.Stderr = journal, journal
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := waitInBackground(t, cmd)
		deadline := time.Now().Add(30 * time.Second)
		for {
			if b, _ := os.ReadFile(journal.Name()); strings.Contains(string(b), "serving") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the daemon did not log serving within 30 s", format)
			}
			time.Sleep(20 * time.Millisecond)
		}
		cmd.Process.Signal(syscall.SIGTERM)
		if err := <-done; err != nil {
			t.Fatalf("%s: drain: %v", format, err)
		}
		b, _ := os.ReadFile(journal.Name())
		banner := strings.Contains(string(b), "listening on")
		if format == "json" {
			if banner {
				t.Errorf("json: the start line for a terminal is in the journal:\n%s", b)
			}
			for _, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
				if _, rest, ok := strings.Cut(line, ">"); !ok || !json.Valid([]byte(rest)) {
					t.Errorf("json: a line that is not a priority and JSON: %q", line)
				}
			}
		} else if !banner {
			t.Errorf("text: no start line:\n%s", b)
		}
	}
}
