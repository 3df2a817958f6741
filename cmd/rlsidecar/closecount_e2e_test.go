package main

import (
	"math/rand"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/hostile"
	"github.com/rlsidecar/rlsidecar/proto"
)

// closedCounts returns rlsidecar_connections_closed_total by reason from the daemon's
// admin endpoint at base.
func closedCounts(t *testing.T, base string) map[string]float64 {
	t.Helper()
	closed := map[string]float64{}
	for k, v := range scrapeSamples(t, base) {
		if r, ok := strings.CutPrefix(k, `rlsidecar_connections_closed_total{reason="`); ok {
			closed[strings.TrimSuffix(r, `"}`)] = v
		}
	}
	if len(closed) == 0 {
		t.Fatal("no rlsidecar_connections_closed_total in the metrics")
	}
	return closed
}

// wantClosed fails unless the daemon at base has counted want (reason → count) in
// rlsidecar_connections_closed_total, and 0 for every other reason.
func wantClosed(t *testing.T, base string, want map[string]float64) {
	t.Helper()
	for r, n := range closedCounts(t, base) {
		if n != want[r] {
			t.Errorf("rlsidecar_connections_closed_total{reason=%q} = %v, want %v", r, n, want[r])
		}
	}
}

// waitSample waits until the sample name of the daemon at base is want, or fails after
// 10 s.
func waitSample(t *testing.T, base, name string, want float64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := scrapeSamples(t, base)[name]
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s = %v after 10 s, want %v", name, got, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// checkBurst is n pipelined checks of user u, ids 1 to n.
func checkBurst(n int, u string) []byte {
	enc := proto.NewEncoder()
	var b []byte
	for i := 0; i < n; i++ {
		b = append(b, hostile.EncodeFrame(enc, &proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: u}}})...)
	}
	return b
}

// bulkRules is a rule no test here exhausts.
const bulkRules = "rules:\n  - { name: bulk, key: user, limit: { requests: 1000000, per: 1h } }\n"

// A client that shuts its read side (shutdown(SHUT_RD)) while the daemon holds answers
// waiting for room, and takes what its socket holds, ends its connection: the daemon's
// next write fails (EPIPE), which is the client's close, counted under no reason. Before,
// the failed write's wake-up of the reader (a past read deadline) was read as the
// reader's own timeout: an idle_timeout while it waited for a next frame, even at
// --idle-timeout 0 (a soak counted 30 and 55 of them with no idle cut configured), and a
// frame_timeout while it waited for the rest of one; at --idle-timeout 1s the idle wait
// also set its own deadline over the wake-up, and the connection stayed open until it
// was cut as idle.
func TestE2EHalfShutClientCountsNoTimeout(t *testing.T) {
	const checks = 10000 // their answers are several times what the socket takes
	for _, tc := range []struct {
		name        string
		idleTimeout string
		partial     bool // a frame's first bytes follow the checks: the reader waits for its rest
	}{
		{"idle wait, no idle timeout", "0", false},
		{"idle wait, idle timeout", "1s", false},
		{"frame wait", "0", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := writeFile(t, shortTempDir(t), "rules.yaml", bulkRules)
			d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0", "--idle-timeout", tc.idleTimeout)
			base := "http://" + adminAddr(t, d)
			c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: d.socket, Net: "unix"})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close() // open until the end: only its read side is shut
			b := checkBurst(checks, "ann")
			if tc.partial {
				b = append(b, b[:5]...)
			}
			c.SetDeadline(time.Now().Add(30 * time.Second))
			if _, err := c.Write(b); err != nil {
				t.Fatal(err)
			}
			// Every check decided (counted as the reader hands its answers over, just
			// before it waits for a next frame, or the rest of one), and answers waiting
			// for room.
			waitSample(t, base, `rlsidecar_checks_total{rule="bulk",result="allowed"}`, checks)
			if err := c.CloseRead(); err != nil {
				t.Fatal(err)
			}
			// What the socket holds is still read, making room: the daemon's writer
			// wakes, and its write fails.
			buf := make([]byte, 64<<10)
			got := 0
			for {
				n, err := c.Read(buf)
				got += n
				if err != nil {
					break
				}
			}
			if got == 0 {
				t.Fatal("no answer read")
			}
			waitSample(t, base, "rlsidecar_connections", 0)
			wantClosed(t, base, nil)
		})
	}
}

// Clients that pipeline checks in pieces and close without reading their answers (some
// of them mid-frame, as a process killed while writing) end their connections
// themselves: none is counted. Before, a client's close woke the daemon's writer, whose
// answers waited for room, and its failed write's wake-up of the reader was counted as
// an idle_timeout, or a frame_timeout, when it came as the reader went back to waiting,
// at --idle-timeout 0 too (a soak had counted 30 and 55 idle_timeout): here 1 to 4 in 7
// runs (frame_timeout, idle_timeout), and 49 to 88 idle_timeout in 2,400 connections
// that all wrote whole frames; 0 since.
func TestE2EClientsClosingUnreadCountNoClose(t *testing.T) {
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", bulkRules)
	d := startDaemon(t, "--config", cfg, "--admin", "127.0.0.1:0", "--idle-timeout", "0")
	base := "http://" + adminAddr(t, d)
	bursts := [][]byte{checkBurst(1500, "a"), checkBurst(4000, "b"), checkBurst(10000, "c")}
	piece := len(bursts[0]) / 15 // 100 frames
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(w)))
			for range 100 {
				c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: d.socket, Net: "unix"})
				if err != nil {
					t.Error(err)
					return
				}
				c.SetWriteDeadline(time.Now().Add(10 * time.Second))
				b := bursts[rng.Intn(len(bursts))]
				if rng.Intn(8) == 0 {
					b = b[:len(b)-3] // the last frame unfinished
				}
				for off := 0; off < len(b); off += piece {
					if _, err := c.Write(b[off:min(off+piece, len(b))]); err != nil {
						break
					}
				}
				if rng.Intn(4) > 0 {
					time.Sleep(time.Duration(rng.Intn(2000)) * time.Microsecond)
				}
				c.Close()
			}
		}()
	}
	wg.Wait()
	waitSample(t, base, "rlsidecar_connections", 0)
	wantClosed(t, base, nil)
}
