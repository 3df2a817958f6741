package daemon

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// Checks of a global penalty rule's key pipelined on one connection are decided in
// request order with their ban, as the protocol says checks sharing a key are: with a
// limit of 1 and `after: 3`, eight checks sent at once are allowed, refused twice,
// refused with the ban the third refusal starts, then refused as banned. Before, the
// next check went to Redis once the one before it was queued there, ahead of that one's
// refusal count (a second call): the ban was answered on whichever refusal's count came
// third (the first refusal, say), and a check after it was refused unbanned (through
// the real daemon, 3 of 5 pipelines of 6).
func TestGlobalPenaltyPipelinedInOrder(t *testing.T) {
	const yaml = `
rules:
  - name: login
    match: { path: /login }
    key: user
    limit: { requests: 1, per: 1h, burst: 1 }
    mode: global
    penalty: { after: 3, within: 1h, ban: 1h }
`
	srv := redistest.StartStandalone(t)
	rdb, err := rlsync.Open(rlsync.Config{URL: "redis://" + srv.Addr, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	set, err := rules.Parse("test.yaml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	bans, err := rlsync.NewBans(rdb, rlsync.DefaultPrefix)
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{})).
		WithGlobal(rlsync.NewGlobal(rdb).WithAutoPipeline(), 5*time.Second).
		WithSharedBans(bans, 5*time.Second)
	dir, err := os.MkdirTemp("", "rlsd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s, err := New(Config{Socket: filepath.Join(dir, "s.sock")}, lim)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); s.Serve() }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Shutdown(ctx)
		<-done
	})

	c, err := net.Dial("unix", s.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	dec := proto.NewDecoder()
	enc := proto.NewEncoder()
	const n = 8
	for user := 0; user < 20; user++ {
		enc.Reset()
		for i := 0; i < n; i++ {
			enc.EncodeRequest(&proto.Request{ID: uint64(i), Op: proto.OpCheck, Cost: 1,
				Attrs: []proto.Attr{{Name: "path", Value: "/login"}, {Name: "user", Value: fmt.Sprint("u", user)}}})
		}
		if _, err := c.Write(enc.Bytes()); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		got := make([]string, n)
		for i := 0; i < n; i++ {
			body, err := proto.ReadFrame(br, nil, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			var r proto.Response
			if err := dec.DecodeResponse(body, &r); err != nil {
				t.Fatal(err)
			}
			switch {
			case r.IsError() || r.ID != uint64(i):
				t.Fatalf("user %d, answer %d: %+v", user, i, r)
			case r.Allowed:
				got[i] = "allowed"
			case r.Banned:
				got[i] = "banned"
			default:
				got[i] = "refused"
			}
		}
		want := []string{"allowed", "refused", "refused", "banned", "banned", "banned", "banned", "banned"}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("user %d: pipelined answers %v, want %v", user, got, want)
		}
	}
}
