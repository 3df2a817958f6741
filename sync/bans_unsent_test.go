package sync

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
)

// TestContextErrorOnlyBeforeWriting: refusals whose call ended on the caller's context
// before go-redis wrote it are Unsent (the caller sends them again: a round cut as the
// daemon stops, TestSharedBansRoundCutBeforeSendingKeepsRefusals), and refusals whose
// call was written to a Redis that then did not answer are not, whether the deadline
// passed or the context was cancelled during the wait: the script may have run, and sent
// again they could count twice. notWritten rests on go-redis returning the context's
// own error only before a call is written; this holds it to that, on the clients Open
// makes for a standalone Redis and for a Cluster (real servers, frozen).
func TestContextErrorOnlyBeforeWriting(t *testing.T) {
	cl := redistest.StartCluster(t)
	sa := redistest.StartStandalone(t)
	for _, be := range []struct {
		name  string
		cfg   Config
		nodes []*redistest.Server
	}{
		{"standalone", Config{URL: "redis://" + sa.Addr, Timeout: 400 * time.Millisecond}, []*redistest.Server{sa}},
		{"cluster", Config{Cluster: cl.Addrs, Timeout: 400 * time.Millisecond}, cl.Nodes},
	} {
		t.Run(be.name, func(t *testing.T) {
			rdb, err := Open(be.cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer rdb.Close()
			b, err := NewBans(rdb, "unsent:")
			if err != nil {
				t.Fatal(err)
			}
			pol := BanPolicy{After: 100, Within: time.Minute, Ban: time.Minute, Factor: 1, Max: time.Minute}
			refuse := func(ctx context.Context) (BanRefusal, error) {
				rs := []BanRefusal{{Key: "unsent:login:{ip=1.1.1.1}", N: 1, Policy: pol}}
				err := b.Refused(ctx, time.Now().UnixNano(), rs)
				return rs[0], err
			}
			if _, err := refuse(context.Background()); err != nil { // dialled, the script loaded
				t.Fatal(err)
			}

			cancelled, cancel := context.WithCancel(context.Background())
			cancel()
			if r, err := refuse(cancelled); err == nil || !r.Unsent {
				t.Fatalf("a cancelled context: %+v, %v; want unsent", r, err)
			}

			freeze := func() {
				for _, n := range be.nodes {
					n.Freeze()
				}
				t.Cleanup(func() {
					for _, n := range be.nodes {
						n.Thaw()
					}
				})
			}
			thaw := func() {
				for _, n := range be.nodes {
					n.Thaw()
				}
			}
			freeze()
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			r, err := refuse(ctx)
			cancel()
			if err == nil || r.Unsent || !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("written to a frozen Redis, its deadline passed: %+v, %v; want an i/o timeout, not unsent", r, err)
			}
			ctx, cancel = context.WithCancel(context.Background())
			time.AfterFunc(50*time.Millisecond, cancel)
			r, err = refuse(ctx)
			cancel()
			if err == nil || r.Unsent {
				t.Fatalf("written to a frozen Redis, cancelled while it waited: %+v, %v; want not unsent", r, err)
			}
			thaw()
		})
	}
}
