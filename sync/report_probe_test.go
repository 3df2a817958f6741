package sync

import (
	"testing"
	"time"
)

// A sync that an open breaker let through as its probe must settle the probe, whatever
// its outcome: a master that answered some of its keys (others timed out, or met
// CLUSTERDOWN) answers, and closes the breaker; a sync whose keys all went unsent for
// want of time hands the probe back. Before, report left the probe taken in both cases,
// and the breaker refused every later call, probes included, for good: after a Cluster
// failover under load, a healthy master's hybrid keys stayed degraded until the daemon
// restarted.
func TestReportSettlesProbe(t *testing.T) {
	for _, tc := range []struct {
		name     string
		o        masterOutcome
		wantOpen bool
	}{
		{"some answered, some failed", masterOutcome{ok: 3, failed: 1}, false},
		{"some answered, some unsent", masterOutcome{ok: 3, unsent: 2}, false},
		{"all unsent", masterOutcome{unsent: 4}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := NewBreaker(1, 8*time.Millisecond)
			b.Failure()
			if !b.Open() {
				t.Fatal("the breaker did not open")
			}
			time.Sleep(10 * time.Millisecond)
			if ok, probe := b.allow(); !ok || !probe {
				t.Fatalf("no probe after the wait: ok %v probe %v", ok, probe)
			}
			tc.o.m = &Master{breaker: b}
			report([]masterOutcome{tc.o})
			if b.Open() != tc.wantOpen {
				t.Fatalf("open %v after report, want %v", b.Open(), tc.wantOpen)
			}
			if ok, _ := b.allow(); !ok {
				t.Fatal("the breaker lets no call through after report: its probe was left taken")
			}
		})
	}
}
