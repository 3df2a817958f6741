package daemon

import (
	"bufio"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
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
	s := startGlobalServerWith(t, yaml, true)

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
