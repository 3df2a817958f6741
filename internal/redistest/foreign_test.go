package redistest

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// A redis-server started on a port that another one took first (between freePort's probe
// and its own bind: on a loaded machine, another test's server, in this process or
// another) cannot bind it and exits, but the other server answers its readiness PING.
// run took that answer for its own server's: the test then used the other test's Redis,
// and saw it vanish when that test stopped it (go-redis's "connection refused", and a
// global check answered degraded, in daemon's TestGlobalLongPipelineWrittenBeforeReading
// at load 10-18). run must report the bind failure, so that start tries another port.
func TestRunNotAnsweredByAnotherServer(t *testing.T) {
	other := StartStandalone(t)
	bin := lookPath(t, "redis-server")
	_, portText, err := net.SplitHostPort(other.Addr)
	if err != nil {
		t.Fatal(err)
	}
	port, _ := strconv.Atoi(portText)
	dir := t.TempDir()
	s := &Server{Addr: other.Addr, dir: dir, conf: filepath.Join(dir, "redis.conf"), log: filepath.Join(dir, "redis.log")}
	t.Cleanup(s.Stop)
	if err := os.WriteFile(s.conf, []byte(configFile(dir, port, config{})), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.run(bin); !errors.Is(err, errBind) {
		t.Fatalf("run on %s, which another redis-server holds: %v, want a bind failure", s.Addr, err)
	}
	if s.running() {
		t.Fatal("run failed but its server is still listed as running")
	}
}

// start, given first a port another server holds (as freePort can, in a race), starts
// its own server on the next port: the one at its Addr is its own process.
func TestStartRetriesPastAnotherServersPort(t *testing.T) {
	other := StartStandalone(t)
	_, portText, _ := net.SplitHostPort(other.Addr)
	taken, _ := strconv.Atoi(portText)
	first := true
	nextPort = func(cluster bool) (int, error) {
		if first {
			first = false
			return taken, nil
		}
		return freePort(cluster)
	}
	t.Cleanup(func() { nextPort = freePort })
	s := StartStandalone(t)
	if s.Addr == other.Addr {
		t.Fatalf("started on %s, the other server's port", s.Addr)
	}
	info, err := s.Command("INFO", "server")
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	pid := s.proc.cmd.Process.Pid
	s.mu.Unlock()
	if !strings.Contains(info, "\r\nprocess_id:"+strconv.Itoa(pid)+"\r\n") {
		t.Fatalf("the server at %s is not the one started (pid %d):\n%s", s.Addr, pid, info)
	}
}
