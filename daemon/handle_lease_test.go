package daemon

import (
	"bytes"
	"testing"
	"time"
	"unsafe"

	"github.com/rlsidecar/rlsidecar/proto"
)

// benchRulesLease is benchRules with a concurrency rule that the check frame matches.
const benchRulesLease = benchRules + `  - name: exports
    key: user
    concurrency: { max: 1000, lease: 30s }
`

// leaseKey is how a check's answer writes its lease's key (msgpack "lease").
var leaseKey = []byte("\xa5lease")

// newLeaseConn is a test conn on benchRulesLease owning the leases it takes, as a
// connection of the daemon does (its id: limiter.Decision.Owner).
func newLeaseConn(tb testing.TB, withMetrics bool) *conn {
	cn := newTestConnRules(tb, benchRulesLease, withMetrics)
	cn.id = 1
	cn.st.d.Owner = cn.id
	return cn
}

// answeredLease returns the lease token of the check answer in cn.enc (its bytes,
// aliased), or nil.
func answeredLease(cn *conn) []byte {
	b := cn.enc.Bytes()
	i := bytes.Index(b, leaseKey)
	if i < 0 || i+len(leaseKey) >= len(b) {
		return nil
	}
	b = b[i+len(leaseKey):]
	var n int
	switch c := b[0]; {
	case c >= 0xa0 && c <= 0xbf:
		n, b = int(c&0x1f), b[1:]
	case c == 0xd9 && len(b) > 1:
		n, b = int(b[1]), b[2:]
	default:
		return nil
	}
	if n > len(b) {
		return nil
	}
	return b[:n]
}

// leaseRound is one check taking a lease and the release of that lease through the
// server's handler, the release frame written into rel from the check's answer. It
// reports whether the check was allowed with a lease and the release freed it.
func leaseRound(cn *conn, check []byte, rel *proto.Encoder, now int64) bool {
	cn.enc.Reset()
	cn.handle(check, now)
	tok := answeredLease(cn)
	if tok == nil {
		return false
	}
	rel.Reset()
	rel.EncodeRequest(&proto.Request{ID: 8, Op: proto.OpRelease, Cost: 1, Lease: unsafe.String(&tok[0], len(tok))})
	body := rel.Bytes()[proto.HeaderSize:]
	cn.enc.Reset()
	cn.handle(body, now)
	return bytes.HasSuffix(cn.enc.Bytes(), []byte("\xa8released\xc3"))
}

// TestHandleLeaseAllocs: a check that takes a local lease, and the release of that
// lease, allocate nothing once the client's keys exist.
func TestHandleLeaseAllocs(t *testing.T) {
	cn := newLeaseConn(t, true)
	check, rel := checkFrame(), proto.NewEncoder()
	now := time.Now().UnixNano()
	for range 3 {
		if !leaseRound(cn, check, rel, now) {
			t.Fatalf("the check took no lease or its release freed none: % x", cn.enc.Bytes())
		}
	}
	ok := true
	allocs := testing.AllocsPerRun(1000, func() { ok = ok && leaseRound(cn, check, rel, now) })
	if !ok {
		t.Fatal("a round took no lease or freed none")
	}
	if allocs != 0 {
		t.Fatalf("%v allocs per check with a lease and its release", allocs)
	}
}

// BenchmarkHandleLease is BenchmarkHandle for a check that matches a concurrency rule
// too, plus the release of its lease: the server-side CPU of a leased request, without
// the socket. Beside BenchmarkHandle (two frames here, one there).
func BenchmarkHandleLease(b *testing.B) {
	cn := newLeaseConn(b, false)
	check, rel := checkFrame(), proto.NewEncoder()
	now := time.Now().UnixNano()
	b.ReportAllocs()
	for b.Loop() {
		if !leaseRound(cn, check, rel, now) {
			b.Fatal("no lease taken or freed")
		}
	}
}
