package main

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// stopDaemon sends SIGTERM and waits for a clean exit.
func stopDaemon(t *testing.T, d *daemonProc) {
	t.Helper()
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-d.done:
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, d.stderr.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("daemon did not exit\n%s", d.stderr.String())
	}
}

// A daemon restarted under the same --daemon-id (a fixed name per host, or hostname-pid
// for a container whose process is pid 1) counts in Redis every unit each of its runs
// admitted. Before, every run's sync tokens started at 1, so a key's first sync in the
// new run carried the token the old run had recorded on the key, and the script took it
// for a replay: 40 keys checked once per run, three runs, Redis counted 1 of 3 on each.
func TestE2EHybridRestartSameIDCountsOnce(t *testing.T) {
	srv := redistest.StartStandalone(t)
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: per-user
    key: user
    algorithm: fixed_window
    limit: { requests: 1000, per: 1h }
`)
	const keys = 40
	admitted := make([]int, keys)
	socket := dir + "/s.sock"
	for run := 0; run < 3; run++ {
		d := startDaemonAt(t, socket, "--config", cfg, "--redis", "redis://"+srv.Addr, "--daemon-id", "gw-1")
		c := dialRaw(t, d.socket)
		for k := 0; k < keys; k++ {
			if r := c.check(uint64(k+1), 1, fmt.Sprint("user=u", k)); r.Allowed {
				admitted[k]++
			} else {
				t.Fatalf("run %d, user u%d refused: %+v", run, k, r)
			}
		}
		stopDaemon(t, d) // its last sync settles what it admitted
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	for k := 0; k < keys; k++ {
		key := fmt.Sprintf("rl:per-user~fw1h:{user=u%d}", k)
		if n, err := rdb.HGet(ctx, key, "n").Int(); err != nil || n != admitted[k] {
			t.Errorf("%s: Redis counts %d (%v), the runs admitted %d", key, n, err, admitted[k])
		}
	}
}
