package limiter

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

const leaseRules = `
rules:
  - name: exports
    match: { path: "/v1/exports/**" }
    key: user
    concurrency: { max: 2, lease: 10s }
  - name: per-user
    key: user
    limit: { requests: 5, per: 1h }
`

func exportInput(user string) *Input {
	return &Input{Attrs: attrs("path=/v1/exports/x", "user="+user), Cost: 1}
}

// checkLease runs one check and returns its decision's allowed, lease token and the
// exports rule's result.
func checkLease(t *testing.T, l *Limiter, now int64, in *Input, owner uint64) (bool, string, Result) {
	t.Helper()
	d := Decision{Owner: owner}
	if err := l.Check(now, in, &d); err != nil {
		t.Fatal(err)
	}
	var tok string
	if d.Lease != 0 {
		tok = l.Leases().Token(d.Lease)
	}
	for _, r := range d.Results {
		if r.Name == "exports" {
			return d.Allowed, tok, r
		}
	}
	t.Fatalf("no exports result in %+v", d.Results)
	return false, "", Result{}
}

func stats(l *Limiter, rule string) LeaseStats {
	var out LeaseStats
	l.Leases().Stats(func(name string, s LeaseStats) {
		if name == rule {
			out = s
		}
	})
	return out
}

func TestLeasesTwoThenRefusal(t *testing.T) {
	l := newLimiter(t, leaseRules)
	in := exportInput("ann")
	for i, want := range []uint64{1, 0} {
		ok, tok, r := checkLease(t, l, t0, in, 0)
		if !ok || tok == "" || r.Limit != 2 || r.Remaining != want || r.Window != 10*time.Second {
			t.Fatalf("check %d: allowed %v lease %q limit %d remaining %d window %v; want true, a lease, 2, %d, 10s", i, ok, tok, r.Limit, r.Remaining, want, r.Window)
		}
	}
	ok, tok, r := checkLease(t, l, t0+int64(time.Second), in, 0)
	if ok || tok != "" || r.Allowed || r.RetryAfter != time.Second {
		t.Fatalf("third: allowed %v lease %q retry %v; want refused, no lease, retry capped at 1s", ok, tok, r.RetryAfter)
	}
	// The refused check consumed nothing of per-user: 5 - 2 = 3 left.
	var d Decision
	_ = l.Check(t0, &Input{Attrs: attrs("user=ann"), Cost: 0}, &d)
	if d.Results[0].Remaining != 3 {
		t.Errorf("per-user remaining %d after two leases and a refusal; want 3", d.Results[0].Remaining)
	}
	// Another user has slots of their own.
	if ok, _, _ := checkLease(t, l, t0, exportInput("bob"), 0); !ok {
		t.Error("bob refused: slots are per key")
	}
}

func TestLeasesReleaseRenewExpire(t *testing.T) {
	l := newLimiter(t, leaseRules)
	in := exportInput("ann")
	_, a, _ := checkLease(t, l, t0, in, 0)
	_, b, _ := checkLease(t, l, t0, in, 0)
	if a == b {
		t.Fatalf("two leases share the token %q", a)
	}
	ls := l.Leases()
	if !ls.Release(a, t0) {
		t.Fatal("release of a live lease said false")
	}
	if ls.Release(a, t0) {
		t.Fatal("second release said true")
	}
	id, tag, _ := strings.Cut(strings.TrimPrefix(b, ls.nonce+"."), ".")
	n, _ := parseBase32(id)
	next := string(appendBase32(nil, n+1))
	for _, bad := range []string{"", "x", "nonce.1", ls.nonce + ".", ls.nonce + ".zz!", ls.nonce + ".999",
		ls.nonce + "." + id, ls.nonce + "." + id + ".", ls.nonce + "." + next, // no tag
		ls.nonce + "." + next + "." + tag, // the next id, guessed, with a known tag
		ls.nonce + "." + id + "." + tag + "0", ls.nonce + "." + id + "." + tag + ".1",
		ls.nonce + "." + strings.ToUpper(id) + "." + strings.ToUpper(tag), // written in lower case only
		ls.nonce + "." + id + "." + tag[:len(tag)-1] + "w"} {
		if ls.Release(bad, t0) {
			t.Errorf("release of unknown token %q said true", bad)
		}
	}
	ok, c, r := checkLease(t, l, t0, in, 0)
	if !ok || r.Remaining != 0 {
		t.Fatalf("after a release: allowed %v remaining %d; want true 0", ok, r.Remaining)
	}

	// Renew b for 30s at t0+5s; c expires at t0+10s.
	renewed, in30 := ls.Renew(b, 30*time.Second, t0+int64(5*time.Second), nil)
	if !renewed || in30 != 30*time.Second {
		t.Fatalf("renew: %v %v; want true 30s", renewed, in30)
	}
	at := t0 + int64(10*time.Second)
	if ok, _, _ := checkLease(t, l, at, in, 0); !ok {
		t.Fatal("refused at t0+10s, when c has expired")
	}
	if ls.Release(c, at) {
		t.Error("release of an expired lease said true")
	}
	if renewed, _ := ls.Renew(c, 0, at, nil); renewed {
		t.Error("renew of an expired lease said true")
	}
	if ok, _, _ := checkLease(t, l, at, in, 0); ok {
		t.Fatal("allowed a third lease: b (renewed) and the new one hold both slots")
	}
	// Sweep frees what expired without a check on the key.
	if n := l.Sweep(t0 + int64(time.Hour)); n < 2 {
		t.Errorf("sweep an hour later freed %d; want the 2 leases", n)
	}
	if n := ls.Len(); n != 0 {
		t.Errorf("%d leases left after the sweep", n)
	}
	s := stats(l, "exports")
	if s.InFlight != 0 || s.Released != 1 || s.Expired != 3 {
		t.Errorf("stats %+v; want 0 in flight, 1 released, 3 expired", s)
	}
}

func TestLeasesOwnerClosed(t *testing.T) {
	l := newLimiter(t, leaseRules)
	in := exportInput("ann")
	checkLease(t, l, t0, in, 7)
	_, other, _ := checkLease(t, l, t0, in, 8)
	if n := l.Leases().ReleaseOwner(7, t0); n != 1 {
		t.Fatalf("owner 7 closed: freed %d; want 1", n)
	}
	if ok, _, _ := checkLease(t, l, t0, in, 7); !ok {
		t.Fatal("refused after the owner's close freed a slot")
	}
	if !l.Leases().Release(other, t0) {
		t.Fatal("owner 8's lease was freed by owner 7's close")
	}
	if s := stats(l, "exports"); s.Closed != 1 || s.InFlight != 1 {
		t.Errorf("stats %+v; want 1 closed, 1 in flight", s)
	}
}

// A check that finds a slot full frees first the leases of the holders whose
// connections are gone (SetOwnerGone: closed by their clients, not yet seen ending by the
// daemon), as their ReleaseOwner would, and is allowed; a holder not gone keeps its slot,
// and neither the checking owner nor owner 0 is asked about.
func TestLeasesFullSlotReapsGoneOwners(t *testing.T) {
	l := newLimiter(t, leaseRules)
	in := exportInput("ann")
	gone := map[uint64]bool{}
	var asked []uint64
	l.Leases().SetOwnerGone(func(owner uint64) bool {
		asked = append(asked, owner)
		return gone[owner]
	})
	checkLease(t, l, t0, in, 7)
	checkLease(t, l, t0, in, 8)
	if len(asked) != 0 {
		t.Fatalf("asked about %v while the slot had room", asked)
	}
	if ok, _, _ := checkLease(t, l, t0, in, 9); ok {
		t.Fatal("allowed past max while no holder is gone")
	}
	if fmt.Sprint(asked) != "[7 8]" && fmt.Sprint(asked) != "[8 7]" {
		t.Fatalf("asked about %v; want owners 7 and 8", asked)
	}
	// The same instant (one batch of frames), or under goneAskEvery later: not asked
	// again, though owner 7 is gone by now.
	gone[7] = true
	asked = asked[:0]
	if ok, _, _ := checkLease(t, l, t0+int64(goneAskEvery)-1, in, 9); ok || len(asked) != 0 {
		t.Fatalf("asked again within goneAskEvery: allowed %v, asked %v; want refused, none asked", ok, asked)
	}
	t1 := t0 + int64(goneAskEvery)
	ok, _, r := checkLease(t, l, t1, in, 8) // owner 8 is not asked about itself
	if !ok || r.Remaining != 0 {
		t.Fatalf("owner 7 gone: allowed %v, %+v; want allowed, 0 free", ok, r)
	}
	if fmt.Sprint(asked) != "[7]" {
		t.Fatalf("asked about %v; want only owner 7", asked)
	}
	if n := l.Leases().ReleaseOwner(7, t1); n != 0 {
		t.Fatalf("owner 7's close, seen later: freed %d; want 0 (freed already)", n)
	}
	if s := stats(l, "exports"); s.Closed != 1 || s.InFlight != 2 {
		t.Errorf("stats %+v; want 1 closed, 2 in flight", s)
	}
	asked = asked[:0]
	if ok, _, _ := checkLease(t, l, t1+int64(goneAskEvery), in, 0); ok || fmt.Sprint(asked) != "[8]" {
		t.Fatalf("owner 8 holds both slots, not gone: allowed %v, asked %v; want refused, asked [8]", ok, asked)
	}
}

func TestLeasesRateRefusedHoldsNothing(t *testing.T) {
	l := newLimiter(t, leaseRules)
	in := exportInput("ann")
	for range 5 { // per-user allows 5 an hour; release each lease
		ok, tok, _ := checkLease(t, l, t0, in, 0)
		if !ok || !l.Leases().Release(tok, t0) {
			t.Fatal("setup check refused")
		}
	}
	ok, tok, r := checkLease(t, l, t0, in, 0)
	if ok || tok != "" || !r.Allowed || r.Remaining != 2 {
		t.Fatalf("rate-refused check: allowed %v lease %q exports allowed %v remaining %d; want refused, no lease, exports 2 free", ok, tok, r.Allowed, r.Remaining)
	}
	if n := l.Leases().Len(); n != 0 {
		t.Fatalf("%d leases held after a rate refusal", n)
	}
	if s := stats(l, "exports"); s.InFlight != 0 {
		t.Fatalf("in flight %d after a rate refusal", s.InFlight)
	}
}

func TestLeasesShadowAndPeek(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: exports
    key: user
    concurrency: { max: 1 }
    shadow: true
`)
	in := &Input{Attrs: attrs("user=ann"), Cost: 0}
	var d Decision
	if err := l.Check(t0, in, &d); err != nil || d.Lease != 0 || d.Results[0].Remaining != 1 {
		t.Fatalf("cost 0: lease %d remaining %d err %v; want a peek: no lease, 1 free", d.Lease, d.Results[0].Remaining, err)
	}
	in.Cost = 1
	_ = l.Check(t0, in, &d)
	if !d.Allowed || d.Lease == 0 {
		t.Fatal("first shadow check took no lease")
	}
	_ = l.Check(t0, in, &d)
	if !d.Allowed || d.Lease != 0 || d.Results[0].Allowed {
		t.Fatalf("shadow over max: allowed %v lease %d rule allowed %v; want allowed, no lease, rule refused", d.Allowed, d.Lease, d.Results[0].Allowed)
	}
}

// BenchmarkCheckLease: a check matching a concurrency rule and a rate rule, then the
// release of its lease by token (as the daemon does), beside BenchmarkCheck2Rules.
func BenchmarkCheckLease(b *testing.B) {
	l := newLimiter(b, `
rules:
  - name: exports
    key: user
    concurrency: { max: 2, lease: 10s }
  - name: per-ip
    key: ip
    limit: { requests: 1000000000, per: 1h }
`)
	in := &Input{Attrs: attrs("user=ann", "ip=1.2.3.4"), Cost: 1}
	var d Decision
	ls := l.Leases()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		now := t0 + int64(i)
		if err := l.Check(now, in, &d); err != nil || !d.Allowed {
			b.Fatal("refused", err)
		}
		if !ls.Release(ls.Token(d.Lease), now) {
			b.Fatal("not released")
		}
	}
}

// Two parts of one check matching one concurrency rule with one key take two slots of
// it: against max 1 the check is refused and holds nothing; against max 2 it holds both,
// and one release frees both.
func TestLeasesPartsShareASlot(t *testing.T) {
	for _, tc := range []struct {
		max     string
		allowed bool
	}{{"1", false}, {"2", true}} {
		l := newLimiter(t, "rules:\n  - name: c\n    key: user\n    concurrency: { max: "+tc.max+" }\n")
		in := &Input{Parts: []Part{part(1, "user=ann"), part(1, "user=ann")}}
		var d Decision
		if err := l.Check(t0, in, &d); err != nil {
			t.Fatal(err)
		}
		if d.Allowed != tc.allowed || (d.Lease != 0) != tc.allowed {
			t.Fatalf("max %s: allowed %v lease %d; want allowed %v", tc.max, d.Allowed, d.Lease, tc.allowed)
		}
		if s := stats(l, "c"); s.InFlight != map[bool]int64{false: 0, true: 2}[tc.allowed] {
			t.Fatalf("max %s: %d in flight", tc.max, s.InFlight)
		}
		if tc.allowed {
			if !l.Leases().Release(l.Leases().Token(d.Lease), t0) || stats(l, "c").InFlight != 0 {
				t.Fatal("one release did not free both parts")
			}
		}
	}
}

// Past the bound on live leases a check is refused and takes nothing; a release makes
// room again.
func TestLeasesBound(t *testing.T) {
	l := newLimiter(t, leaseRules)
	l.Leases().SetMax(2)
	_, a, _ := checkLease(t, l, t0, exportInput("ann"), 0)
	checkLease(t, l, t0, exportInput("bob"), 0)
	ok, tok, r := checkLease(t, l, t0, exportInput("cid"), 0)
	if ok || tok != "" || r.Allowed || r.RetryAfter != time.Second || l.Leases().Capped() != 1 || l.Leases().Len() != 2 {
		t.Fatalf("third lease past a bound of 2: allowed %v lease %q retry %v capped %d live %d; want refused, nothing taken",
			ok, tok, r.RetryAfter, l.Leases().Capped(), l.Leases().Len())
	}
	var d Decision
	_ = l.Check(t0, &Input{Attrs: attrs("user=cid"), Cost: 0}, &d)
	if d.Results[0].Remaining != 5 {
		t.Fatalf("the refused check charged per-user: %d left", d.Results[0].Remaining)
	}
	l.Leases().Release(a, t0)
	if ok, _, _ := checkLease(t, l, t0, exportInput("cid"), 0); !ok {
		t.Fatal("refused after a release made room")
	}
}

// The bound on live leases counts their slots' keys' bytes: leases never released on
// distinct 4,000-byte keys (a concurrency rule keyed by a client's own API key) hold no
// more memory than the bound's leases on short keys would. Before, each counted as one
// lease whatever its key: 1,000 of them under a bound of 1,000 held 4 MB of keys, and
// the default bound of 1,048,576 about 4.5 GB.
func TestLeasesBoundCountsKeyBytes(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: per-key
    key: api_key
    concurrency: { max: 1, lease: 1h }
`)
	const bound = 1000
	l.Leases().SetMax(bound)
	var d Decision
	for i := range 2 * bound {
		in := Input{Attrs: attrs(fmt.Sprintf("api_key=%08d%s", i, strings.Repeat("k", 3992))), Cost: 1}
		if err := l.Check(t0, &in, &d); err != nil {
			t.Fatal(err)
		}
	}
	ls := l.Leases()
	ls.mu.Lock()
	held, units := 0, 0
	for k := range ls.slots {
		held += len(k)
		units += slotUnits(len(k))
	}
	n, ku := len(ls.leases), ls.keyUnits
	ls.mu.Unlock()
	if units != ku {
		t.Fatalf("keyUnits %d, the slots' keys take %d", ku, units)
	}
	if limit := bound * slotKeyUnit; held > limit || n == 0 {
		t.Fatalf("%d leases held on keys of %d bytes in all; want some, on at most %d", n, held, limit)
	}
	// Leases that run out give their units back.
	ls.Sweep(t0 + int64(2*time.Hour))
	ls.mu.Lock()
	ku, slots := ls.keyUnits, len(ls.slots)
	ls.mu.Unlock()
	if ku != 0 || slots != 0 {
		t.Fatalf("keyUnits %d with %d slots held, after every lease ran out", ku, slots)
	}
}

// siphashRef is SipHash-2-4 of any message, as its paper defines it.
func siphashRef(k0, k1 uint64, msg []byte) uint64 {
	v := [4]uint64{k0 ^ 0x736f6d6570736575, k1 ^ 0x646f72616e646f6d, k0 ^ 0x6c7967656e657261, k1 ^ 0x7465646279746573}
	round := func() {
		v[0] += v[1]
		v[1] = bits.RotateLeft64(v[1], 13) ^ v[0]
		v[0] = bits.RotateLeft64(v[0], 32)
		v[2] += v[3]
		v[3] = bits.RotateLeft64(v[3], 16) ^ v[2]
		v[0] += v[3]
		v[3] = bits.RotateLeft64(v[3], 21) ^ v[0]
		v[2] += v[1]
		v[1] = bits.RotateLeft64(v[1], 17) ^ v[2]
		v[2] = bits.RotateLeft64(v[2], 32)
	}
	block := func(m uint64) {
		v[3] ^= m
		round()
		round()
		v[0] ^= m
	}
	n := len(msg)
	for ; len(msg) >= 8; msg = msg[8:] {
		block(binary.LittleEndian.Uint64(msg))
	}
	var last [8]byte
	copy(last[:], msg)
	last[7] = byte(n)
	block(binary.LittleEndian.Uint64(last[:]))
	v[2] ^= 0xff
	for range 4 {
		round()
	}
	return v[0] ^ v[1] ^ v[2] ^ v[3]
}

// The tokens' tag is SipHash-2-4: the reference implementation gives the paper's test
// vector, and the tag function agrees with it on 8-byte messages.
func TestSiphash(t *testing.T) {
	msg := make([]byte, 15)
	for i := range msg {
		msg[i] = byte(i)
	}
	k0, k1 := uint64(0x0706050403020100), uint64(0x0f0e0d0c0b0a0908)
	if got := siphashRef(k0, k1, msg); got != 0xa129ca6149be45e5 {
		t.Fatalf("reference SipHash-2-4 of the paper's vector = %#x", got)
	}
	var m [8]byte
	for i := range 1000 {
		k := [2]uint64{k0 * uint64(i+1), k1 ^ uint64(i)<<7}
		x := uint64(i) * 0x9e3779b97f4a7c15
		binary.LittleEndian.PutUint64(m[:], x)
		if got, want := siphash(k, x), siphashRef(k[0], k[1], m[:]); got != want {
			t.Fatalf("siphash(%x, %#x) = %#x, want %#x", k, x, got, want)
		}
	}
}

// A renew without a duration gives each part its rule's lease as the rules in force say
// it, a reload having changed it, as a global lease's renew already did.
func TestLeaseRenewAfterReload(t *testing.T) {
	l := newLimiter(t, leaseRules)
	ok, tok, _ := checkLease(t, l, t0, exportInput("ann"), 0)
	if !ok {
		t.Fatal("refused")
	}
	l.SetRules(mustRules(t, strings.Replace(leaseRules, "lease: 10s", "lease: 1s", 1)))
	renewed, in := l.RenewLease(tok, 0, t0)
	if !renewed || in != time.Second {
		t.Fatalf("renewed %v for %v after the lease was reloaded to 1s, want 1s", renewed, in)
	}
	l.SetRules(mustRules(t, strings.Replace(leaseRules, "name: exports", "name: renamed", 1)))
	if renewed, in := l.RenewLease(tok, 0, t0); !renewed || in != 10*time.Second {
		t.Fatalf("renewed %v for %v once its rule is gone, want its lease when taken, 10s", renewed, in)
	}
}

// A lease over two concurrency rules of different leases, renewed after its shorter part
// ran out, is not renewed: it no longer holds that rule's slot (another request may have
// taken it). Before, the answer was renewed: true, its other part extended, and the
// gateway believed it held both. Its other part keeps its expiry and is released as usual.
func TestLeaseRenewAfterAPartRanOut(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: quick
    key: user
    concurrency: { max: 1, lease: 1s }
  - name: exports
    key: user
    concurrency: { max: 1, lease: 1m }
`)
	in := &Input{Attrs: attrs("user=ann"), Cost: 1}
	ok, tok, _ := checkLease(t, l, t0, in, 0)
	if !ok || tok == "" {
		t.Fatal("first check refused")
	}
	ls := l.Leases()
	if renewed, _ := ls.Renew(tok, 0, t0+int64(500*time.Millisecond), nil); !renewed {
		t.Fatal("renew while both parts are live said false")
	}
	at := t0 + int64(2*time.Second) // quick's part ran out at t0+1.5s
	if renewed, in := ls.Renew(tok, 0, at, nil); renewed {
		t.Fatalf("renew after quick's part ran out: renewed, first part expires in %v; want false", in)
	}
	if renewed, _ := l.RenewLease(tok, 0, at); renewed {
		t.Fatal("RenewLease after quick's part ran out said true")
	}
	if s := stats(l, "exports"); s.InFlight != 1 {
		t.Fatalf("exports after the refused renew: %+v; want its slot still held", s)
	}
	if !ls.Release(tok, at) {
		t.Fatal("release of the lease's live part said false")
	}
	if s := stats(l, "exports"); s.InFlight != 0 || s.Released != 1 {
		t.Fatalf("exports after the release: %+v; want freed", s)
	}
}

// A renewal whose global half failed puts its local half's expiry back (restore), unless
// the lease was renewed again since: two renewals of one mixed lease at once, the later
// one renewed in full and the earlier one refused by Redis. Before, the earlier one's
// restore took back the later renewal: the lease ran out at its first expiry, though its
// gateway had been told it was renewed for 10 s more.
func TestLeaseRestoreKeepsALaterRenewal(t *testing.T) {
	l := newLimiter(t, leaseRules)
	ok, tok, _ := checkLease(t, l, t0, exportInput("ann"), 0)
	if !ok {
		t.Fatal("refused")
	}
	sec := int64(time.Second)
	ls := l.Leases()
	ok1, _, first := ls.renew(tok, 0, t0+sec, nil, true) // to t0+11s
	ok2, _, _ := ls.renew(tok, 0, t0+2*sec, nil, true)   // to t0+12s
	if !ok1 || !ok2 {
		t.Fatal("renewals refused")
	}
	ls.restore(tok, first) // the first renewal's global half failed; the second's did not
	if renewed, _ := ls.Renew(tok, 0, t0+10*sec+sec/2, nil); !renewed {
		t.Fatal("the lease ran out at t0+10s: the failed renewal's restore took back the later one (renewed to t0+12s)")
	}
	// The last renewal undone puts back the expiry it replaced.
	ok3, _, third := ls.renew(tok, 0, t0+11*sec, nil, true) // to t0+21s, from t0+20.5s
	if !ok3 {
		t.Fatal("third renewal refused")
	}
	ls.restore(tok, third)
	if renewed, _ := ls.Renew(tok, 0, t0+20*sec+3*sec/4, nil); renewed {
		t.Fatal("the restored renewal still holds the lease past the expiry it replaced (t0+20.5s)")
	}
}

// A lease renewed after it ran out, before any sweep or check of its slot noticed, is not
// renewed. Before, the renewal freed it (expireLease dropped the lease and emptied its
// parts) and then answered renewed: true, expires_ms 0: the gateway believed it held a
// slot that the next check took.
func TestLeaseRenewAfterItRanOut(t *testing.T) {
	l := newLimiter(t, strings.Replace(leaseRules, "max: 2", "max: 1", 1))
	ok, tok, _ := checkLease(t, l, t0, exportInput("ann"), 0)
	if !ok {
		t.Fatal("refused")
	}
	at := t0 + int64(11*time.Second) // the lease (10s) ran out at t0+10s
	if renewed, in := l.RenewLease(tok, 0, at); renewed {
		t.Fatalf("renewed a lease run out 1s ago, expiring in %v; want renewed: false", in)
	}
	if ok, _, _ := checkLease(t, l, at, exportInput("ann"), 0); !ok {
		t.Fatal("the slot of the expired lease was not free")
	}
}

// The base 32 of lease tokens reads back what it writes, for every width, and refuses
// what it does not write: other digits, a leading zero, an empty or too long string, a
// value past 64 bits.
func TestBase32(t *testing.T) {
	for _, v := range []uint64{0, 1, 31, 32, 1<<35 - 1, 1 << 59, 1<<60 - 1, 1 << 60, 1<<63 + 12345, math.MaxUint64} {
		s := string(appendBase32([]byte("x"), v))[1:]
		if got, ok := parseBase32(s); !ok || got != v {
			t.Errorf("%d wrote %q, read back %d %v", v, s, got, ok)
		}
		if want := strconv.FormatUint(v, 32); s != want {
			t.Errorf("%d wrote %q, want %q", v, s, want)
		}
	}
	for _, s := range []string{"", "w", "A", "0x1", "-1", " 1", "1.", "01", "00000000000000", "g000000000000", "vvvvvvvvvvvvv"} {
		if v, ok := parseBase32(s); ok {
			t.Errorf("%q read as %d, want refused", s, v)
		}
	}
	if v, ok := parseBase32("fvvvvvvvvvvvv"); !ok || v != math.MaxUint64 {
		t.Errorf("the largest 13-digit value read as %d %v", v, ok)
	}
}

// TestLeaseMemory: what a local lease holds of the heap, its slot and key with it, on
// distinct keys of a few bytes and owners as a daemon's connections take them, so that
// DefaultMaxLeases's bound means what its comment says (about 300 bytes each).
func TestLeaseMemory(t *testing.T) {
	l := newLimiter(t, "rules:\n  - name: c\n    key: user\n    concurrency: { max: 2, lease: 30s }\n")
	const n = 100000
	ins := make([]Input, n)
	for i := range ins {
		ins[i] = Input{Attrs: attrs("user=user-" + strconv.Itoa(i)), Cost: 1}
	}
	var d Decision
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for i := range ins {
		d.Owner = uint64(i%64 + 1)
		if err := l.Check(t0, &ins[i], &d); err != nil || d.Lease == 0 {
			t.Fatalf("check %d took no lease: %v", i, err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := (float64(after.HeapAlloc) - float64(before.HeapAlloc)) / n
	t.Logf("%.0f bytes a lease (%d live)", per, l.Leases().Len())
	if per > 400 {
		t.Errorf("%.0f bytes a lease; DefaultMaxLeases is sized for about 300", per)
	}
	runtime.KeepAlive(ins)
}

// Every token this daemon gives out reads back as its lease, and none with one byte
// changed (or cut, or one added) reads as any lease: base 32 without leading zeros
// writes each id and tag one way only, so a changed byte changes the id, the tag or
// the nonce, and the tag is checked against the id.
func TestTokenOneByteOffIsUnknown(t *testing.T) {
	ls := newLeases()
	alphabet := []byte(base32Digits + ".~-_gwzAZ0")
	for _, id := range []uint64{1, 2, 31, 32, 1 << 20, 1<<40 + 7, math.MaxUint64} {
		tok := ls.Token(id)
		if got := ls.parse(tok); got != id {
			t.Fatalf("token %q of %d reads as %d", tok, id, got)
		}
		for i := range len(tok) + 1 {
			var variants []string
			if i < len(tok) {
				variants = append(variants, tok[:i]+tok[i+1:]) // cut
				for _, c := range alphabet {
					if c != tok[i] {
						variants = append(variants, tok[:i]+string(c)+tok[i+1:])
					}
				}
			}
			for _, c := range alphabet {
				variants = append(variants, tok[:i]+string(c)+tok[i:]) // added
			}
			for _, v := range variants {
				if got := ls.parse(v); got != 0 {
					t.Fatalf("%q, one byte off %q (lease %d), reads as lease %d", v, tok, id, got)
				}
			}
		}
	}
}
