package sync

import (
	"testing"
	"time"
)

// An idle hybrid daemon (no check, so no sync: only heartbeats tell it its masters
// answer) on a 3-master Cluster, its calls to Redis bounded by 1.5 s, one master frozen
// (SIGSTOP) for 7 s: the two others stay fresh and answering throughout, so their keys
// are decided as usual, and only the frozen master goes stale. Before, the heartbeats to
// every master went in one cluster pipeline, which returned only when the frozen
// master's call timed out: the others' answers were recorded 1.5 s late, the next
// heartbeat was skipped while that one was on its way, and their last answer grew 2.5 s
// old, past StaleAfter (2 s): every key on them went to its failure policy.
func TestHybridClusterFrozenMasterIdle(t *testing.T) {
	const callWait = 1500 * time.Millisecond
	cl, rdb, m, _ := clusterMastersWait(t, time.Second, "rl:hfi", 1, callWait)
	h := NewHybrid(rdb, HybridOptions{}).WithMasters(m) // the daemon's interval: 100 ms
	stop := runWithMasters(h, m, callWait, time.Second)
	frozenAddr := cl.Addrs[0]
	frozen := node(t, cl, frozenAddr)
	thawed := false
	defer func() {
		if !thawed {
			frozen.Thaw()
		}
		stop()
	}()
	// Every master holds a heartbeat set (the usual layout): the heartbeat alone keeps
	// each one answering, no ping.
	held := map[*Master]bool{}
	for _, k := range h.heartbeatKs {
		held[m.ForKey(k)] = true
	}
	if len(held) != len(cl.Addrs) {
		t.Fatalf("heartbeat sets on %d masters of %d; the test cannot tell", len(held), len(cl.Addrs))
	}
	// A few heartbeats first, every master answering.
	time.Sleep(1500 * time.Millisecond)
	now := time.Now().UnixNano()
	for _, x := range m.List() {
		if !x.fresh(now, h.StaleAfter()) || !x.answering() {
			t.Fatalf("master %s not answering before the freeze", x.Addr)
		}
	}

	frozen.Freeze()
	const freeze = 7 * time.Second
	start := time.Now()
	var healthy []*Master
	var frozenM *Master
	for _, x := range m.List() {
		if x.Addr == frozenAddr {
			frozenM = x
		} else {
			healthy = append(healthy, x)
		}
	}
	var worst time.Duration // the oldest a healthy master's last answer was seen
	var worstAddr, firstBad string
	bad := 0
	polls := 0
	for time.Since(start) < freeze {
		now := time.Now().UnixNano()
		polls++
		if !h.Healthy(now) {
			bad++
			if firstBad == "" {
				firstBad = "Healthy false " + time.Since(start).Round(time.Millisecond).String() + " into the freeze"
			}
		}
		for _, x := range healthy {
			age := time.Duration(now - x.lastOK.Load())
			if age > worst {
				worst, worstAddr = age, x.Addr
			}
			if !x.fresh(now, h.StaleAfter()) || !x.answering() {
				bad++
				if firstBad == "" {
					firstBad = x.Addr + " stale or not answering (last answer " + age.Round(time.Millisecond).String() +
						" old) " + time.Since(start).Round(time.Millisecond).String() + " into the freeze"
				}
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("frozen %s (calls bounded by %s, StaleAfter %s): %d polls, %d found a healthy master stale; its last answer at worst %s old (%s)",
		freeze, callWait, h.StaleAfter(), polls, bad, worst.Round(time.Millisecond), worstAddr)
	if bad != 0 {
		t.Errorf("a healthy master's keys went to their failure policy while another master was frozen; first: %s", firstBad)
	}
	// The freeze took: the frozen master's own keys are stale.
	if frozenM.fresh(time.Now().UnixNano(), h.StaleAfter()) {
		t.Errorf("the frozen master %s still counts as fresh after %s", frozenAddr, freeze)
	}
	frozen.Thaw()
	thawed = true
}
