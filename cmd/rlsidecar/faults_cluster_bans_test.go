package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// A ban lifted (DELETE /bans) while the master holding the bans' index is down (killed,
// its replica not yet promoted): the ban's key, on its client's slot, is deleted, the
// index's member is not, and the daemon answers 503, try again. The retry must finish the lift. Before, it found the ban's key gone, so it did
// not know the member's name (its count) and left the member in the index, yet answered
// 204: every daemon read the ban back from the index at its next round and, in hybrid
// mode, enforced it until its end (10 minutes here).
func TestFaultClusterBanLiftRetried(t *testing.T) {
	cl := redistest.StartCluster(t) // node timeout 2 s: a quick failover
	cfg := writeFile(t, shortTempDir(t), "rules.yaml", `
rules:
  - name: login
    match: { path: /h }
    key: ip
    limit: { requests: 1, per: 1h }
    penalty: { after: 2, within: 1m, ban: 10m }
`)
	d := startDaemon(t, "--config", cfg, "--redis-cluster", strings.Join(cl.Addrs, ","), "--admin", "127.0.0.1:0",
		"--sync-interval", "50ms", "--global-timeout", "250ms", "--redis-timeout", "250ms")
	base := "http://" + adminAddr(t, d)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	defer cc.Close()
	ctx := context.Background()
	const index = "rl:~bans"
	im := masterOf(t, cc, cl, index)
	cl.AddReplica(t, im)
	var ip string
	for i := 0; ip == ""; i++ {
		if a := fmt.Sprintf("10.0.0.%d", i); masterOf(t, cc, cl, "{ip="+a+"}") != im {
			ip = a
		}
	}
	c := dialFault(t, d.socket)
	attrs := []string{"path=/h", "ip=" + ip}
	// Refused twice: banned, and the ban indexed.
	waitFor(t, 10*time.Second, "a ban", func() bool {
		r, _, err := c.Check(attrs...)
		if err != nil {
			t.Fatal(err)
		}
		return r.Banned
	})
	inIndex := func() []string {
		t.Helper()
		var out []string
		var ms []string
		waitFor(t, 30*time.Second, "the index readable", func() bool {
			// A client of its own each time: go-redis reloads a slot map on a
			// redirection, which a dead node does not give.
			fresh := redis.NewClusterClient(&redis.ClusterOptions{Addrs: append(append([]string{}, cl.Addrs...), cl.Replicas[0].Addr)})
			defer fresh.Close()
			var err error
			ms, err = fresh.ZRange(ctx, index, 0, -1).Result()
			return err == nil
		})
		for _, m := range ms {
			if strings.HasSuffix(m, "{ip="+ip+"}") {
				out = append(out, m)
			}
		}
		return out
	}
	waitFor(t, 10*time.Second, "the ban in the index", func() bool { return len(inIndex()) > 0 })

	logged503 := false
	lift := func() int {
		req, _ := http.NewRequest(http.MethodDelete, base+"/bans/login/ip="+ip, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || !logged503 {
			t.Logf("DELETE /bans/login/ip=%s: %d %s", ip, resp.StatusCode, strings.TrimSpace(string(b)))
		}
		logged503 = logged503 || resp.StatusCode == http.StatusServiceUnavailable
		return resp.StatusCode
	}
	// The index's master killed; its replica, which holds the member, takes over after
	// the node timeout. The lift comes at once: the ban's master still answers.
	cl.Nodes[im].Stop()
	if code := lift(); code != http.StatusServiceUnavailable {
		t.Fatalf("the lift with the index's master down answered %d, want 503 (this test needs the index unreachable)", code)
	}
	// The operator tries again, as told, until the lift is done.
	waitFor(t, 30*time.Second, "a lift answering 204", func() bool { return lift() == http.StatusNoContent })
	lifted := time.Now()
	if m := inIndex(); len(m) > 0 {
		t.Errorf("the lift answered 204, yet the index still holds the ban: %q (every daemon learns it again at its next round)", m)
	}
	// What an operator and the client see: the daemon reads the index every interval
	// (50 ms), once its slot map has followed the failover (a second or so); over the next
	// 10 s the lifted ban must not come back.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if _, body := httpGet(t, base+"/bans"); strings.Contains(body, `"login"`) { // the client shows hashed
			r, _, err := c.Check(attrs...)
			t.Fatalf("the lifted ban is back in /bans after %s: %s; a check: banned %v (%v)", time.Since(lifted).Round(time.Millisecond), body, r.Banned, err)
		}
	}
	if r, _, err := c.Check(attrs...); err != nil || r.Banned {
		t.Fatalf("a check after the lift: banned %v (%v), want not banned", r.Banned, err)
	}
}
