package main

import (
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/rlsidecar/rlsidecar/proto"
)

// exactBurst sends, from each connection at once, its requests (pipelined, in one write
// when more than one) and returns every answer.
func exactBurst(t *testing.T, cs []*rawConn, reqs func(conn, i int) *proto.Request, per int) []*proto.Response {
	t.Helper()
	got := make([][]*proto.Response, len(cs))
	errs := make(chan error, len(cs))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for ci, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			enc := proto.NewEncoder()
			for i := range per {
				enc.EncodeRequest(reqs(ci, i))
			}
			<-start
			if _, err := c.c.Write(enc.Bytes()); err != nil {
				errs <- err
				return
			}
			for range per {
				frame, err := c.readFrame()
				if err != nil {
					errs <- err
					return
				}
				var r proto.Response
				if err := c.dec.DecodeResponse(frame[proto.HeaderSize:], &r); err != nil {
					errs <- err
					return
				}
				got[ci] = append(got[ci], &r)
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var all []*proto.Response
	for _, g := range got {
		all = append(all, g...)
	}
	return all
}

func checkReq(cost uint64, attrs ...string) *proto.Request {
	req := &proto.Request{ID: 1, Op: proto.OpCheck, Cost: cost}
	for _, a := range attrs {
		k, v, _ := strings.Cut(a, "=")
		req.Attrs = append(req.Attrs, proto.Attr{Name: k, Value: v})
	}
	return req
}

// A request a rate rule refuses holds no concurrency slot, not even for a moment:
// another client's check of the same slot, at once, finds it free. Before, the daemon
// took the slot, then gave it back when the rate rule refused, and a fresh user's check
// of the account at that moment was refused with its slot free (6 runs of 8 failed, 1 to
// 3 fresh users refused of 1,000; limiter's TestLeaseNotHeldWhileLocalRateRefuses is
// the same without the socket).
func TestE2ELeaseNotHeldByRefused(t *testing.T) {
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", `
rules:
  - { name: conc, key: acct, concurrency: { max: 1, lease: 1h }, mode: local }
  - { name: rate, key: user, limit: { requests: 1, per: 1h }, mode: local }
`)
	d := startDaemon(t, "--config", cfg)
	cs := make([]*rawConn, 4)
	for i := range cs {
		cs[i] = dialRaw(t, d.socket)
	}
	if r := cs[0].check(1, 1, "user=spent"); !r.Allowed {
		t.Fatalf("first check of user spent refused: %+v", r)
	}
	refused := 0
	const rounds = 1000
	for round := range rounds {
		acct := "acct=" + strconv.Itoa(round)
		fresh := "user=u" + strconv.Itoa(round)
		all := exactBurst(t, cs, func(c, i int) *proto.Request {
			if c == 0 {
				return checkReq(1, acct, fresh)
			}
			return checkReq(1, acct, "user=spent")
		}, 4)
		// cs[0]'s answers come first: its first check is the fresh user's, the other
		// three of that connection are refused by the fresh user's own rate.
		if !all[0].Allowed {
			refused++
		}
		for _, r := range all[4:] {
			if r.Allowed {
				t.Fatalf("round %d: user spent admitted: %+v", round, r)
			}
		}
	}
	if refused > 0 {
		t.Fatalf("%d of %d fresh users refused a free slot, held for a moment by checks their rate rule refused", refused, rounds)
	}
}
