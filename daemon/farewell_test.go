package daemon

import (
	"context"
	"errors"
	"io"
	"syscall"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/proto"
	"github.com/rlsidecar/rlsidecar/rules"
)

// A connection the drain has read to its end gets, after its last answer, an error frame
// with id 0 and code shutting_down: whatever its client sent without an answer before it
// was not read, so not decided (it can be sent again to the successor), whatever the
// client went on writing during the drain. Before, the connection just closed, and a
// client could not tell those requests from ones a daemon that died had decided.
func TestDrainFarewell(t *testing.T) {
	for round := range 5 {
		s := startServerRules(t, Config{}, `
rules:
  - name: per-ip
    key: ip
    algorithm: fixed_window
    limit: { requests: 1000000, per: 1h }
`)
		c, br := dialServer(t, s)
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		check := func(id uint64) []byte {
			enc := proto.NewEncoder()
			enc.EncodeRequest(&proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "ip", Value: "farewell"}}})
			return enc.Bytes()
		}
		var before []byte
		for id := uint64(1); id <= 100; id++ {
			before = append(before, check(id)...)
		}
		if _, err := c.Write(before); err != nil {
			t.Fatal(err)
		}
		// Read them, so that the daemon has read them too.
		for id := uint64(1); id <= 100; id++ {
			if r := readResponse(t, br); r.ID != id || r.Err.Code != "" {
				t.Fatalf("round %d: answer %d: %+v", round, id, r)
			}
		}
		done := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			done <- s.Shutdown(ctx)
		}()
		// The client goes on writing through the drain, until its writes fail.
		written := uint64(100)
		writer := make(chan struct{})
		go func() {
			defer close(writer)
			for written < 100_000 {
				if _, err := c.Write(check(written + 1)); err != nil {
					return
				}
				written++
			}
		}()
		answered := uint64(100)
		for {
			body, err := proto.ReadFrame(br, nil, 1<<20)
			if err != nil {
				t.Fatalf("round %d: no farewell after answer %d: %v", round, answered, err)
			}
			var r proto.Response
			if err := proto.NewDecoder().DecodeResponse(body, &r); err != nil {
				t.Fatal(err)
			}
			if r.ID == 0 {
				if r.Err.Code != proto.CodeShuttingDown {
					t.Fatalf("round %d: after answer %d: %+v, want shutting_down", round, answered, r)
				}
				break
			}
			if r.ID != answered+1 || r.Err.Code != "" {
				t.Fatalf("round %d: after answer %d: %+v", round, answered, r)
			}
			answered++
		}
		if _, err := proto.ReadFrame(br, nil, 1<<20); !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("round %d: after the farewell: %v, want the end", round, err)
		}
		c.Close()
		<-writer
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		// Counted: exactly the checks answered, none of those after.
		t.Logf("round %d: %d checks written, %d answered before the farewell", round, written, answered)
		if got := countedFarewell(t, s); got != answered {
			t.Fatalf("round %d: %d checks counted, %d answered", round, got, answered)
		}
	}
}

// countedFarewell returns how many units s's per-ip rule counts for ip farewell.
func countedFarewell(t *testing.T, s *Server) uint64 {
	t.Helper()
	var d limiter.Decision
	in := limiter.Input{Attrs: []rules.Attr{{Name: "ip", Value: "farewell"}}} // cost 0: asks
	if err := s.lim.Check(time.Now().UnixNano(), &in, &d); err != nil {
		t.Fatal(err)
	}
	return d.Results[0].Limit - d.Results[0].Remaining
}
