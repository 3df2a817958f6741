//go:build peers

package main

import "testing"

// TestGubernatorClusterShares: the two in-process gubernator nodes form one cluster, so
// a GLOBAL limit checked on both admits fewer than two nodes counting apart would (twice
// the limit), and at least the limit.
func TestGubernatorClusterShares(t *testing.T) {
	nodes, stop, err := gubernatorCluster(2)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	s := &redisSystem{name: "gubernator-global", instances: 2, dial: func(i int) (admitter, error) {
		c, err := dialGub(nodes[i])
		return c, err
	}}
	row, err := accuracy(s, "hot", 1)
	if err != nil {
		t.Fatal(err)
	}
	if row.Admitted < hotLimit || row.Admitted >= 2*hotLimit {
		t.Fatalf("admitted %d of a limit of %d on two nodes: not one cluster", row.Admitted, hotLimit)
	}
	t.Logf("admitted %d (%.3f of the limit)", row.Admitted, row.Ratio)
}
