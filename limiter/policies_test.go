package limiter

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestWarnAtExactFraction: with warn_at 0.8 on 10 per minute, the 8th request (8 used
// after it) is the first to warn, and every allowed one after it warns; a refused one
// does not. A shadow rule's warning is in its entry, not the answer.
func TestWarnAtExactFraction(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: per-user
    key: user
    algorithm: fixed_window
    limit: { requests: 10, per: 1m }
    warn_at: 0.8
  - name: dark
    key: user
    limit: { requests: 4, per: 1m }
    warn_at: 0.5
    shadow: true
`)
	var d Decision
	in := Input{Attrs: attrs("user=ann"), Cost: 1}
	for i := 1; i <= 11; i++ {
		if err := l.Check(t0, &in, &d); err != nil {
			t.Fatal(err)
		}
		want := i >= 8 && i <= 10
		if d.Allowed != (i <= 10) || d.Warning != want || d.Results[0].Warning != want {
			t.Fatalf("request %d: allowed %v warning %v (entry %v), want allowed %v warning %v",
				i, d.Allowed, d.Warning, d.Results[0].Warning, i <= 10, want)
		}
		if dark := i >= 2 && i <= 4; d.Results[1].Warning != dark {
			t.Fatalf("request %d: shadow entry warning %v, want %v", i, d.Results[1].Warning, dark)
		}
	}
	// A peek (cost 0) at 10 used is refused (it is judged as cost 1): no warning.
	in.Cost = 0
	if err := l.Check(t0, &in, &d); err != nil {
		t.Fatal(err)
	}
	if d.Warning {
		t.Fatal("a refused peek warned")
	}
	// Another key is unaffected.
	in = Input{Attrs: attrs("user=bob"), Cost: 7}
	if err := l.Check(t0, &in, &d); err != nil || d.Warning {
		t.Fatalf("7 of 10 warned (%v)", err)
	}
	in.Cost = 1
	if err := l.Check(t0, &in, &d); err != nil || !d.Warning {
		t.Fatalf("8 of 10 did not warn (%v)", err)
	}
}

// TestDelayAllOrNothing: a delayed rule reserves its tokens only when the whole request
// passes; the answer's delay is the longest of the non-shadow rules'.
func TestDelayAllOrNothing(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: queue
    key: user
    limit: { requests: 1, per: 1s }
    delay: 5s
  - name: slow-queue
    key: user
    limit: { requests: 1, per: 2s }
    delay: 3s
  - name: cap
    match: { path: /capped }
    key: user
    limit: { requests: 1, per: 1h }
`)
	var d Decision
	in := Input{Attrs: attrs("user=ann", "path=/a"), Cost: 1}
	wants := []time.Duration{0, 2 * time.Second, 0}
	for i, want := range wants[:2] {
		if err := l.Check(t0, &in, &d); err != nil {
			t.Fatal(err)
		}
		if !d.Allowed || d.Delay != want {
			t.Fatalf("request %d: allowed %v delay %v, want allowed, delay %v", i+1, d.Allowed, d.Delay, want)
		}
	}
	if d.Results[0].Delay != time.Second || d.Results[1].Delay != 2*time.Second {
		t.Fatalf("entries' delays %v %v, want 1s 2s", d.Results[0].Delay, d.Results[1].Delay)
	}
	// slow-queue would need 4s > 3s: refused; queue's reservation is not taken.
	if err := l.Check(t0, &in, &d); err != nil {
		t.Fatal(err)
	}
	if d.Allowed || d.Delay != 0 || d.Results[0].Delay != 0 || d.Results[1].RetryAfter != time.Second {
		t.Fatalf("request 3: allowed %v delay %v entries %+v, want refused, retry 1s", d.Allowed, d.Delay, d.Results[:2])
	}
	// The path /capped adds a rule that passes once; the refused request reserved nothing.
	in2 := Input{Attrs: attrs("user=bob", "path=/capped"), Cost: 1}
	if err := l.Check(t0, &in2, &d); err != nil || !d.Allowed || d.Delay != 0 {
		t.Fatalf("bob 1: %+v %v", d, err)
	}
	if err := l.Check(t0, &in2, &d); err != nil || d.Allowed || d.Delay != 0 {
		t.Fatalf("bob 2 should be refused by cap: allowed %v delay %v (%v)", d.Allowed, d.Delay, err)
	}
	in2.Attrs = attrs("user=bob", "path=/a")
	if err := l.Check(t0, &in2, &d); err != nil || !d.Allowed || d.Delay != 2*time.Second {
		t.Fatalf("bob 3: allowed %v delay %v, want delay 2s: the refused request reserved nothing (%v)", d.Allowed, d.Delay, err)
	}
}

// TestPenaltyEscalatesAndDecays: login allows 2 per minute; 3 refusals within 1m ban the
// key for 1m, then 2m, then 4m (factor 2), capped at max 5m; after 5m without a ban the
// next is 1m again. While banned every check is refused at once with the ban's
// remaining time, taking nothing; another key and another rule are unaffected.
func TestPenaltyEscalatesAndDecays(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: login
    match: { path: /login }
    key: ip
    limit: { requests: 2, per: 1m }
    penalty: { after: 3, within: 1m, ban: 1m, factor: 2, max: 5m }
  - name: per-ip
    key: ip
    algorithm: fixed_window
    limit: { requests: 1000, per: 1h }
`)
	var d Decision
	check := func(now int64, ip string) *Decision {
		t.Helper()
		in := Input{Attrs: attrs("path=/login", "ip="+ip), Cost: 1}
		if err := l.Check(now, &in, &d); err != nil {
			t.Fatal(err)
		}
		return &d
	}
	sec := int64(time.Second)
	now := t0
	// earn drives ip to a ban from a fresh minute: 2 allowed, 3 refused (the 3rd bans).
	earn := func(want time.Duration) {
		t.Helper()
		for i := 1; i <= 5; i++ {
			r := check(now, "1.1.1.1")
			switch {
			case i <= 2 && !r.Allowed:
				t.Fatalf("at %ds request %d refused", (now-t0)/sec, i)
			case i > 2 && i < 5 && (r.Allowed || r.Banned):
				t.Fatalf("at %ds request %d: allowed %v banned %v, want refused, not banned", (now-t0)/sec, i, r.Allowed, r.Banned)
			case i == 5 && (r.Allowed || !r.Banned || !r.Results[0].BanStarted || r.Results[0].RetryAfter != want || r.DecidingResult().Name != "login" ||
				r.Results[0].Reset < want):
				t.Fatalf("at %ds request 5: allowed %v banned %v retry %v, want a ban of %v", (now-t0)/sec, r.Allowed, r.Banned, r.Results[0].RetryAfter, want)
			}
		}
	}
	earn(time.Minute)
	// Banned: refused at once, retry = the remaining ban, nothing taken (per-ip).
	now += 30 * sec
	if r := check(now, "1.1.1.1"); r.Allowed || !r.Banned || r.Results[0].RetryAfter != 30*time.Second || r.Results[0].BanStarted {
		t.Fatalf("during the ban: allowed %v banned %v retry %v", r.Allowed, r.Banned, r.Results[0].RetryAfter)
	} else if r.Results[0].Reset < r.Results[0].RetryAfter {
		// Not back to full before the ban ends: reset_ms never below retry_after_ms.
		t.Fatalf("during the ban: reset %v before the retry %v", r.Results[0].Reset, r.Results[0].RetryAfter)
	}
	if r := check(now, "2.2.2.2"); !r.Allowed || r.Banned {
		t.Fatal("another key was banned")
	}
	in := Input{Attrs: attrs("path=/x", "ip=1.1.1.1"), Cost: 0}
	if err := l.Check(now, &in, &d); err != nil || !d.Allowed || d.Results[0].Remaining != 1000-2 {
		t.Fatalf("per-ip: allowed %v remaining %d; the banned checks must take nothing (%v)", d.Allowed, d.Results[0].Remaining, err)
	}
	// Each next ban, earned as the last one ends, is twice the last, capped at 5m.
	last := time.Minute
	now -= 30 * sec
	for _, want := range []time.Duration{2 * time.Minute, 4 * time.Minute, 5 * time.Minute, 5 * time.Minute} {
		now += int64(last) // the ban ends; the bucket (2 per minute) is full again
		earn(want)
		last = want
	}
	// 5m after the last ban ended without another, the count has decayed: 1m again.
	_ = l.Sweep(now) // a ban in force survives a sweep
	if r := check(now+sec, "1.1.1.1"); !r.Banned {
		t.Fatal("a sweep lifted a ban in force")
	}
	now += int64(last) + int64(5*time.Minute)
	earn(time.Minute)
	// Lifting it lets the key through at once.
	if !l.LiftBan("login:{ip=1.1.1.1}", now) {
		t.Fatal("LiftBan found no ban")
	}
	if r := check(now, "1.1.1.1"); r.Banned {
		t.Fatal("still banned after LiftBan")
	}
}

// TestBansOfARemovedPenalty: a reload that removes a rule's penalty ends its bans: they
// are no longer listed or counted, and writing the penalty back does not bring them back
// (they were listed, and enforced again when the penalty returned before a sweep).
func TestBansOfARemovedPenalty(t *testing.T) {
	const with = `
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 1m }
    penalty: { after: 2, within: 1m, ban: 2m }
`
	l := newLimiter(t, with)
	var d Decision
	check := func(now int64) *Decision {
		t.Helper()
		if err := l.Check(now, &Input{Attrs: attrs("ip=1.1.1.1"), Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
		return &d
	}
	for range 3 {
		check(t0)
	}
	if r := check(t0); !r.Banned {
		t.Fatal("not banned after two refusals")
	}
	l.SetRules(mustRules(t, strings.Replace(with, "    penalty: { after: 2, within: 1m, ban: 2m }\n", "", 1)))
	if bans, keys := l.Bans(t0), l.BannedKeys(t0); len(bans) != 0 || len(keys) != 0 {
		t.Fatalf("with the penalty removed: bans %+v, banned keys %v, want none", bans, keys)
	}
	if r := check(t0); r.Banned {
		t.Fatal("banned by a rule without a penalty")
	}
	l.SetRules(mustRules(t, with))
	if r := check(t0 + int64(time.Minute)); r.Banned || !r.Allowed {
		t.Fatalf("the penalty written back: allowed %v banned %v, want the old ban gone", r.Allowed, r.Banned)
	}
}

// TestBansBounded: a flood of distinct refused keys stops being recorded at the cap, and
// a key already recorded still earns its ban.
func TestBansBounded(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 1h }
    penalty: { after: 2, within: 1h, ban: 1h }
`)
	l.bans.maxPerShard = 2
	var d Decision
	check := func(ip string) *Decision {
		in := Input{Attrs: attrs("ip=" + ip), Cost: 1}
		if err := l.Check(t0, &in, &d); err != nil {
			t.Fatal(err)
		}
		return &d
	}
	check("first")
	check("first") // refused once: recorded
	for i := range 1000 {
		ip := "flood-" + strconv.Itoa(i)
		check(ip)
		check(ip)
	}
	n := 0
	for i := range l.bans.shards {
		n += len(l.bans.shards[i].m)
	}
	if n > 2*len(l.bans.shards) {
		t.Fatalf("%d records, want at most %d", n, 2*len(l.bans.shards))
	}
	if r := check("first"); !r.Banned {
		t.Fatal("a key recorded before the flood earned no ban")
	}
}

// TestBansBoundedInBytes: the ban table's bound counts a key's bytes, not only its
// records, so banned clients with 4,000-byte keys (their own API keys) hold no more
// memory than the bound's short keys would. Before, each took one record of the bound
// whatever its length: against the real binary, 100,000 such banned clients held 0.99
// GB of RSS, and the bound of 4,194,304 records allowed about 17 GB.
func TestBansBoundedInBytes(t *testing.T) {
	l := newLimiter(t, `
rules:
  - name: login
    key: api_key
    limit: { requests: 1, per: 1h }
    penalty: { after: 1, within: 1h, ban: 1h }
`)
	const perShard = 100
	l.bans.maxPerShard = perShard
	var d Decision
	for i := range 2 * perShard * len(l.bans.shards) {
		in := Input{Attrs: attrs(fmt.Sprintf("api_key=%08d%s", i, strings.Repeat("k", 3992))), Cost: 1}
		for range 2 {
			if err := l.Check(t0, &in, &d); err != nil {
				t.Fatal(err)
			}
		}
	}
	held, records := 0, 0
	for i := range l.bans.shards {
		sh := &l.bans.shards[i]
		load := 0
		for k := range sh.m {
			held += len(k)
			load += banUnits(len(k), perShard)
		}
		records += len(sh.m)
		if load != sh.load {
			t.Fatalf("shard %d: load %d, its keys take %d", i, sh.load, load)
		}
	}
	// A short key's record takes about 130 bytes: the bound's records hold 128 bytes of
	// key each, at most.
	if limit := perShard * len(l.bans.shards) * 128; held > limit {
		t.Errorf("%d records of 4,000-byte keys, %d bytes of keys: more than the %d the bound's %d records allow", records, held, limit, perShard*len(l.bans.shards))
	}
	if records == 0 {
		t.Error("no ban recorded")
	}
	// Lifted, swept or forgotten at a reload, a record gives its units back.
	for i := range l.bans.shards {
		sh := &l.bans.shards[i]
		for k := range sh.m {
			l.bans.lift([]byte(k), t0)
			break
		}
	}
	l.bans.sweep(t0+int64(24*time.Hour), l.Rules()) // past the bans and their 16 h max
	for i := range l.bans.shards {
		if sh := &l.bans.shards[i]; sh.load != 0 || len(sh.m) != 0 {
			t.Fatalf("shard %d: load %d, %d records after all went", i, sh.load, len(sh.m))
		}
	}
}
