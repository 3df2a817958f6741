package main

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A daemon whose log reader has gone keeps serving: its next log line fails (EPIPE)
// instead of killing it by SIGPIPE (`serve 2>&1 | head -2`, then a SIGHUP: status 141,
// no drain, the socket file left behind).
func TestE2ELogReaderGoneKeepsServing(t *testing.T) {
	socket := filepath.Join(shortTempDir(t), "s.sock")
	cmd := exec.Command(binary, "serve", "--socket", socket, "--admin", "")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	logR, logW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = logW
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	logW.Close()
	done := waitInBackground(t, cmd)
	line, _ := bufio.NewReader(stdout).ReadString('\n')
	if !strings.Contains(line, "listening on") {
		t.Fatalf("daemon did not start: %q", line)
	}
	go io.Copy(io.Discard, stdout)
	logR.Close() // the log reader goes away
	for i := 0; i < 3; i++ {
		if err := cmd.Process.Signal(syscall.SIGHUP); err != nil { // each reload logs a line
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("the daemon exited when its log reader went away: %v", err)
	default:
	}
	if l := limitOf(t, dialRaw(t, socket), 1); l == 0 {
		t.Fatal("no answer after the log reader went away")
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if err := <-done; err != nil {
		t.Fatalf("the drain after the log reader went away: %v", err)
	}
	if _, err := os.Stat(socket); !os.IsNotExist(err) {
		t.Fatalf("socket file left behind: %v", err)
	}
}
