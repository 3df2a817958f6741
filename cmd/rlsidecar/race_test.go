package main

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/proto"
)

// The real daemon built with the race detector, under everything at once: pipelined
// checks on many connections over local, hybrid and global rules, rule reloads, metrics
// scrapes, then SIGTERM. A race anywhere in the daemon fails the test (the race
// detector reports it and exits non-zero).
func TestE2EDaemonUnderRaceDetector(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the daemon with -race")
	}
	bin := filepath.Join(filepath.Dir(binary), "rlsidecar-race")
	if out, err := exec.Command("go", "build", "-race", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build -race: %v\n%s", err, out)
	}
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	rulesFor := func(n int) string {
		return fmt.Sprintf(`
rules:
  - name: per-ip
    key: ip
    limit: { requests: %d, per: 1s }
    mode: local
  - name: per-user
    key: user
    limit: { requests: 50, per: 1s }
  - name: otp
    match: { path: /otp }
    key: user
    limit: { requests: 5, per: 1m }
    mode: global
`, 100+n)
	}
	cfg := writeFile(t, dir, "rules.yaml", rulesFor(0))
	socket := filepath.Join(dir, "s.sock")
	cmd := exec.Command(bin, "serve", "--socket", socket, "--config", cfg, "--redis", "redis://"+srv.Addr,
		"--admin", "127.0.0.1:0", "--sync-interval", "20ms", "--global-timeout", "200ms")
	stderr := &syncBuffer{}
	cmd.Stderr = stderr
	cmd.Stdout = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := waitInBackground(t, cmd)
	d := &daemonProc{t: t, cmd: cmd, socket: socket, stderr: stderr, done: done}
	base := "http://" + adminAddr(t, d)

	var wg sync.WaitGroup
	stop := make(chan struct{})
	for c := 0; c < 6; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn := dialRaw(t, socket)
			enc := proto.NewEncoder()
			for round := 0; ; round++ {
				select {
				case <-stop:
					return
				default:
				}
				enc.Reset()
				for i := 0; i < 16; i++ {
					path := "/api"
					if i%5 == 0 {
						path = "/otp"
					}
					enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
						{Name: "ip", Value: fmt.Sprint("10.0.0.", (c+i)%7)}, {Name: "user", Value: fmt.Sprint("u", (round+i)%11)},
						{Name: "path", Value: path}}})
				}
				conn.write(enc.Bytes())
				for i := 0; i < 16; i++ {
					if r := conn.recv(); r.IsError() {
						t.Errorf("error answer: %+v", r.Err)
						return
					}
				}
			}
		}()
	}
	wg.Add(1)
	go func() { // reloads and scrapes meanwhile
		defer wg.Done()
		for i := 1; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := os.WriteFile(cfg, []byte(rulesFor(i)), 0o644); err != nil {
				t.Error(err)
				return
			}
			if i%3 == 0 {
				cmd.Process.Signal(syscall.SIGHUP)
			}
			for _, p := range []string{"/metrics", "/top", "/rules", "/readyz"} {
				if resp, err := http.Get(base + p); err == nil {
					resp.Body.Close()
				}
			}
			time.Sleep(30 * time.Millisecond)
		}
	}()
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-done:
		if err != nil || strings.Contains(stderr.String(), "DATA RACE") {
			t.Fatalf("daemon under the race detector: %v\n%s", err, stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("daemon did not exit")
	}
}
