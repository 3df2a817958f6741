package redistest

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// clusterTimeout bounds creating the cluster and waiting for every node to report it ok.
const clusterTimeout = 60 * time.Second

// Cluster is a Redis Cluster of three masters and no replicas, each master owning about a
// third of the 16384 slots.
type Cluster struct {
	// Addrs are the nodes' "127.0.0.1:port" addresses, for redis.ClusterOptions.Addrs.
	Addrs []string
	// Nodes are the node processes, in the order of Addrs, for failure tests.
	Nodes []*Server
	// Replicas are the replicas AddReplica started.
	Replicas []*Server

	cfg config
}

// StartCluster starts three cluster-enabled redis-servers (cluster-node-timeout 2000
// unless WithClusterNodeTimeout, no persistence) on free loopback ports whose bus ports
// (port+10000) are free too, joins them with `redis-cli --cluster create …
// --cluster-replicas 0 --cluster-yes`, and waits until every node reports
// cluster_state:ok with all 16384 slots served. t.Cleanup stops every node. Of opts,
// only WithClusterNodeTimeout and WithTLS apply.
func StartCluster(t testing.TB, opts ...Option) *Cluster {
	t.Helper()
	cli := lookPath(t, "redis-cli")
	var cfg config
	for _, o := range opts {
		o(&cfg)
	}
	c := &Cluster{cfg: config{cluster: true, nodeTimeout: cfg.nodeTimeout, tls: cfg.tls}}
	if cfg.tls != nil {
		c.cfg.files = serverTLS(t, cfg.tls) // one certificate for every node
	}
	for i := 0; i < 3; i++ {
		// Nodes start one after another, so each probe for a free port pair sees the
		// earlier nodes' ports and bus ports taken.
		n := start(t, c.cfg)
		c.Nodes = append(c.Nodes, n)
		c.Addrs = append(c.Addrs, n.Addr)
	}

	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()
	var args []string
	if f := c.cfg.files; f != nil {
		args = []string{"--tls", "--cacert", c.cfg.tls.CA.CertFile, "--cert", f.cert, "--key", f.key}
	}
	args = append(args, "--cluster", "create")
	args = append(args, c.Addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("redistest: redis-cli %s: %v\n%s\n%s", strings.Join(args, " "), err, out, c.logTails())
	}

	deadline, _ := ctx.Deadline()
	for {
		err := c.check()
		if err == nil {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("redistest: cluster %v not ready after %v: %v\n%s", c.Addrs, clusterTimeout, err, c.logTails())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// check returns nil once every node sees the whole cluster: state ok, all slots ok,
// every node known.
func (c *Cluster) check() error {
	for _, n := range c.Nodes {
		info, err := n.Command("CLUSTER", "INFO")
		if err != nil {
			return fmt.Errorf("%s: %w", n.Addr, err)
		}
		for _, want := range []string{
			"cluster_state:ok",
			"cluster_slots_assigned:16384",
			"cluster_slots_ok:16384",
			fmt.Sprintf("cluster_known_nodes:%d", len(c.Nodes)),
		} {
			if !hasLine(info, want) {
				return fmt.Errorf("%s: CLUSTER INFO lacks %s:\n%s", n.Addr, want, info)
			}
		}
	}
	return nil
}

// AddReplica starts one more cluster-enabled redis-server, joins it to the cluster as a
// replica of the master Nodes[i], and waits until it has synced from it: stopping that
// master then fails its slots over to the replica (after cluster-node-timeout). It fails
// t if the replica is not in sync within a minute; t.Cleanup stops it.
func (c *Cluster) AddReplica(t testing.TB, i int) *Server {
	t.Helper()
	master := c.Nodes[i]
	id, err := master.Command("CLUSTER", "MYID")
	if err != nil {
		t.Fatalf("redistest: CLUSTER MYID on %s: %v", master.Addr, err)
	}
	r := start(t, c.cfg)
	host, port, err := net.SplitHostPort(master.Addr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Command("CLUSTER", "MEET", host, port); err != nil {
		t.Fatalf("redistest: CLUSTER MEET from %s: %v", r.Addr, err)
	}
	deadline := time.Now().Add(clusterTimeout)
	for {
		// REPLICATE is refused until the new node knows the master.
		_, err := r.Command("CLUSTER", "REPLICATE", id)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("redistest: CLUSTER REPLICATE %s on %s: %v\n%s", id, r.Addr, err, r.logTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
	for {
		info, err := r.Command("INFO", "replication")
		if err == nil && hasLine(info, "master_link_status:up") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("redistest: replica %s of %s not in sync: %v\n%s\n%s", r.Addr, master.Addr, err, info, r.logTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
	c.Replicas = append(c.Replicas, r)
	return r
}

// AddMaster starts one more cluster-enabled redis-server and joins it to the cluster as a
// master owning no slot (as `redis-cli --cluster add-node` does), waiting until every
// node knows it and it reports the cluster ok. It is appended to Nodes and Addrs; MoveSlot gives it slots. It fails t
// if the node is not known within a minute; t.Cleanup stops it.
func (c *Cluster) AddMaster(t testing.TB) *Server {
	t.Helper()
	n := start(t, c.cfg)
	host, port, err := net.SplitHostPort(c.Nodes[0].Addr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.Command("CLUSTER", "MEET", host, port); err != nil {
		t.Fatalf("redistest: CLUSTER MEET from %s: %v", n.Addr, err)
	}
	c.Nodes = append(c.Nodes, n)
	c.Addrs = append(c.Addrs, n.Addr)
	deadline := time.Now().Add(clusterTimeout)
	for {
		err := c.known()
		if err == nil {
			return n
		}
		if time.Now().After(deadline) {
			t.Fatalf("redistest: new master %s not known: %v\n%s", n.Addr, err, c.logTails())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// known returns nil once every node of Nodes and Replicas knows all of them and reports
// the cluster ok (a node that has just met the others answers CLUSTERDOWN until it has
// learned the slot map).
func (c *Cluster) known() error {
	want := fmt.Sprintf("cluster_known_nodes:%d", len(c.Nodes)+len(c.Replicas))
	for _, n := range append(append([]*Server{}, c.Nodes...), c.Replicas...) {
		info, err := n.Command("CLUSTER", "INFO")
		if err != nil {
			return fmt.Errorf("%s: %w", n.Addr, err)
		}
		for _, w := range []string{want, "cluster_state:ok"} {
			if !hasLine(info, w) {
				return fmt.Errorf("%s: CLUSTER INFO lacks %s", n.Addr, w)
			}
		}
	}
	return nil
}

// MoveSlot moves hash slot slot from the master from to the master to as `redis-cli
// --cluster reshard` does: IMPORTING on to, MIGRATING on from, its keys moved with
// MIGRATE … KEYS batch keys a call (between calls, each key moved is answered by ASK
// and a script over keys split between the two by TRYAGAIN), then the slot given to to
// on every master. between, if not nil, runs after each MIGRATE call, the slot still
// migrating. It fails t on any error, BUSYKEY included (a key written on the target
// while its slot migrated).
func (c *Cluster) MoveSlot(t testing.TB, slot int, from, to *Server, batch int, between func()) {
	t.Helper()
	fromID, err := from.Command("CLUSTER", "MYID")
	if err != nil {
		t.Fatal(err)
	}
	toID, err := to.Command("CLUSTER", "MYID")
	if err != nil {
		t.Fatal(err)
	}
	s := strconv.Itoa(slot)
	if _, err := to.Command("CLUSTER", "SETSLOT", s, "IMPORTING", fromID); err != nil {
		t.Fatalf("redistest: SETSLOT IMPORTING on %s: %v", to.Addr, err)
	}
	if _, err := from.Command("CLUSTER", "SETSLOT", s, "MIGRATING", toID); err != nil {
		t.Fatalf("redistest: SETSLOT MIGRATING on %s: %v", from.Addr, err)
	}
	host, port, err := net.SplitHostPort(to.Addr)
	if err != nil {
		t.Fatal(err)
	}
	for {
		keys, err := from.Strings("CLUSTER", "GETKEYSINSLOT", s, strconv.Itoa(batch))
		if err != nil {
			t.Fatalf("redistest: GETKEYSINSLOT on %s: %v", from.Addr, err)
		}
		if len(keys) == 0 {
			break
		}
		args := append([]string{"MIGRATE", host, port, "", "0", "5000", "KEYS"}, keys...)
		if _, err := from.Command(args...); err != nil {
			t.Fatalf("redistest: %s on %s: %v", strings.Join(args, " "), from.Addr, err)
		}
		if between != nil {
			between()
		}
	}
	// The target first, as redis-cli does: it then answers for the slot.
	for _, n := range append([]*Server{to, from}, c.Nodes...) {
		if n.Addr == "" || !n.running() {
			continue
		}
		if _, err := n.Command("CLUSTER", "SETSLOT", s, "NODE", toID); err != nil {
			t.Fatalf("redistest: SETSLOT NODE on %s: %v", n.Addr, err)
		}
	}
}

func hasLine(text, line string) bool {
	for _, l := range strings.Split(text, "\n") {
		if strings.TrimSpace(l) == line {
			return true
		}
	}
	return false
}

func (c *Cluster) logTails() string {
	var b strings.Builder
	for _, n := range c.Nodes {
		b.WriteString(n.logTail())
		b.WriteString("\n")
	}
	return b.String()
}
