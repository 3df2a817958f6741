package main

import (
	"strconv"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// Through the daemon, a key cap well below the keys seen: a client that emptied its
// bucket (refused once: limited until its next unit) keeps its state through a flood of
// one-off keys once that unit has come, and is refused again. Before, the store read the
// mark such a client keeps (when it was limited until) as units used, ranked it below
// every other key, evicted it at the flood's first key in its shard, and admitted it
// 100 of 100 at once, fresh.
func TestE2EKeyCapKeepsAClientOnceLimited(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - name: per-user
    key: user
    limit: { requests: 100, per: 10s }
`)
	d := startDaemon(t, "--config", cfg, "--max-keys", "2048") // 8 keys a shard
	c := dialRaw(t, d.socket)
	id := uint64(0)
	ask := func(user string, n int) (allowed int) {
		enc := proto.NewEncoder()
		for range n {
			id++
			enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: user}}})
		}
		c.write(enc.Bytes())
		for range n {
			if c.recv().Allowed {
				allowed++
			}
		}
		return allowed
	}
	if got := ask("client", 101); got != 100 {
		t.Fatalf("%d of 101 admitted from a full bucket of 100, want 100", got)
	}
	// A unit comes back every 100 ms: the client is no longer limited. (A question would
	// write its state again, marked by units used: the flood must come first.)
	time.Sleep(300 * time.Millisecond)
	flood := 0
	for range 8 { // 4,000 one-off keys: every shard's 8 keys replaced many times over
		enc := proto.NewEncoder()
		for range 500 {
			id++
			flood++
			enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "flood" + strconv.Itoa(flood)}}})
		}
		c.write(enc.Bytes())
		for range 500 {
			c.recv()
		}
	}
	// What refilled since the bucket was emptied is a few units a second of this test
	// (on a slow machine, a few more); a fresh state admits all 100.
	if got := ask("client", 100); got >= 50 {
		t.Fatalf("%d of 100 admitted at once after 4,000 one-off keys, from a client that had emptied its bucket of 100 per 10 s: its state was evicted and came back fresh", got)
	}
}
