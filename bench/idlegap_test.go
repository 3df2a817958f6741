package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// procCost is a process's CPU time (user + system, all threads) and context switches
// (voluntary + involuntary, all threads), from /proc.
type procCost struct {
	cpu      time.Duration
	switches float64
}

func readProcCost(tb testing.TB, pid int) procCost {
	tb.Helper()
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		tb.Fatal(err)
	}
	// The fields after the command's closing parenthesis: utime and stime are 14 and 15.
	f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+2:]))
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	const hz = 100 // USER_HZ, 100 on Linux
	c := procCost{cpu: time.Duration((ut + st) * float64(time.Second) / hz)}
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil {
		tb.Fatal(err)
	}
	for _, t := range tasks {
		data, err := os.ReadFile(t)
		if err != nil {
			continue // a thread that ended
		}
		for _, line := range strings.Split(string(data), "\n") {
			if strings.HasSuffix(strings.SplitN(line, ":", 2)[0], "ctxt_switches") {
				v, _ := strconv.ParseFloat(strings.TrimSpace(strings.SplitN(line, ":", 2)[1]), 64)
				c.switches += v
			}
		}
	}
	return c
}

// BenchmarkIdleGaps is a gateway's low rate: one connection, one check at a time, with a
// pause after each answer long enough for the server to go idle, as between the requests
// of a quiet nginx worker. It reports what each check costs the server process — CPU
// time and context switches, all threads — for rlsidecar and for the floor server (a Go
// server that answers without deciding, reading and writing through net.Conn), in
// alternating chunks of the same run. A Go server whose reads and writes enter the
// scheduler's system-call state wakes the runtime's sysmon thread on the first one after
// each pause; rlsidecar's connection loop uses raw system calls (daemon/rawio_linux.go),
// so its figures should be below the floor server's even though it does more per check.
func BenchmarkIdleGaps(b *testing.B) {
	floor, rls := startPair(b)
	fr := frames(4096, 4096)
	cf, cr := dial(b, floor.socket), dial(b, rls.socket)
	cf.roundTrips(fr, 200, nil)
	cr.roundTrips(fr, 200, nil)
	const gap = 300 * time.Microsecond
	var lf, lr []time.Duration
	var costF, costR procCost
	run := func(c *client, s *server, n int, lat []time.Duration, cost *procCost) []time.Duration {
		before := readProcCost(b, s.cmd.Process.Pid)
		for i := 0; i < n; i++ {
			var err error
			if lat, err = c.roundTrips(fr[i%len(fr):], 1, lat); err != nil {
				b.Fatal(err)
			}
			time.Sleep(gap)
		}
		after := readProcCost(b, s.cmd.Process.Pid)
		cost.cpu += after.cpu - before.cpu
		cost.switches += after.switches - before.switches
		return lat
	}
	b.ResetTimer()
	const chunk = 500
	for done := 0; done < b.N; done += chunk {
		n := min(chunk, b.N-done)
		lf = run(cf, floor, n, lf, &costF)
		lr = run(cr, rls, n, lr, &costR)
	}
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(costR.switches/n, "rlsidecar-cs/check")
	b.ReportMetric(costF.switches/n, "floor-cs/check")
	b.ReportMetric(float64(costR.cpu.Microseconds())/n, "rlsidecar-cpu-µs/check")
	b.ReportMetric(float64(costF.cpu.Microseconds())/n, "floor-cpu-µs/check")
	b.ReportMetric(float64(percentile(lr, 0.5).Nanoseconds())/1e3, "rlsidecar-p50-µs")
	b.ReportMetric(float64(percentile(lf, 0.5).Nanoseconds())/1e3, "floor-p50-µs")
	b.ReportMetric(costR.switches/costF.switches, "cs-ratio")
	b.ReportMetric(float64(costR.cpu)/float64(costF.cpu), "cpu-ratio")
	b.ReportMetric(float64(percentile(lr, 0.5))/float64(percentile(lf, 0.5)), "p50-ratio")
}
