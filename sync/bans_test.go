package sync

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestBanKey(t *testing.T) {
	tests := []struct{ key, want string }{
		{"rl:login:{ip=1.1.1.1}", "rl:login@ban:{ip=1.1.1.1}"},
		{"a:b:login:{user=x:{y}}", "a:b:login@ban:{user=x:{y}}"}, // prefix with ':'; client with braces
		// The same ban under any fingerprint or calendar window of the rule.
		{"rl:login~sw1m:{ip=1.1.1.1}", "rl:login@ban:{ip=1.1.1.1}"},
		{"rl:login~tb30s:{ip=1.1.1.1}", "rl:login@ban:{ip=1.1.1.1}"},
		{"rl:monthly~cmonth.1a2b3c4d@1767236400:{user=a~b@c}", "rl:monthly@ban:{user=a~b@c}"},
		{"p~@:login~fw1h:{ip=1}", "p~@:login@ban:{ip=1}"}, // a prefix with '~' and '@'
	}
	for _, tt := range tests {
		if got := BanKey(tt.key); got != tt.want {
			t.Errorf("BanKey(%q) = %q, want %q", tt.key, got, tt.want)
		}
		if got := string(AppendBanIdentity([]byte("x"), []byte(tt.key))); got != "x"+BanIdentity(tt.key) {
			t.Errorf("AppendBanIdentity(%q) = %q, BanIdentity %q", tt.key, got, BanIdentity(tt.key))
		}
		if Slot(BanKey(tt.key)) != Slot(tt.key) {
			t.Errorf("%q: the ban key is on another slot", tt.key)
		}
	}
}

// TestBansEscalateAndDecay drives ban.lua on Redis's clock moved by Bans.Shift, on a
// standalone Redis and a 3-master Cluster: refusals add up (in batches, as hybrid daemons send them) within
// `within`; bans last ban, ban×factor, ban×factor², capped at max; refusals during a ban
// do not count; max without a ban resets the count; the key expires once it carries
// nothing; the index lists the bans in force; Lift ends one.
func TestBansEscalateAndDecay(t *testing.T) {
	for _, be := range globalBackends(t)[1:] { // standalone (grouped by slot) and cluster
		t.Run(be.name, func(t *testing.T) {
			ctx := context.Background()
			b, err := NewBans(be.rdb, "t:")
			if err != nil {
				t.Fatal(err)
			}
			pol := BanPolicy{After: 3, Within: time.Minute, Ban: time.Minute, Factor: 2, Max: 5 * time.Minute}
			const key = "t:login:{ip=1.1.1.1}"
			// The caller's clock is years behind Redis's: Redis's decides.
			now := int64(1_700_000_000) * int64(time.Second)
			pass := func(d time.Duration) { now += int64(d); b.Shift(d) }
			// at is the Redis time r was counted at: a ban's end is at + its length.
			at := func(r BanRefusal) int64 { return r.At }
			refuse := func(n uint64) BanRefusal {
				t.Helper()
				rs := []BanRefusal{{Key: key, N: n, Policy: pol}}
				if err := b.Refused(ctx, now, rs); err != nil {
					t.Fatal(err)
				}
				if rs[0].Started {
					if err := b.Index(ctx, []SharedBan{{Key: key, Until: rs[0].Until, Count: rs[0].Count}}); err != nil {
						t.Fatal(err)
					}
				}
				return rs[0]
			}
			// 2 refusals, then the window passes: they are forgotten.
			if r := refuse(2); r.Until != 0 || r.Started {
				t.Fatalf("2 refusals: %+v, want no ban", r)
			}
			pass(time.Minute)
			if r := refuse(2); r.Until != 0 {
				t.Fatalf("2 refusals in a new window: %+v, want no ban", r)
			}
			last, lastUntil := time.Duration(0), int64(0)
			for i, want := range []time.Duration{time.Minute, 2 * time.Minute, 4 * time.Minute, 5 * time.Minute, 5 * time.Minute} {
				pass(last)
				var r BanRefusal
				if i == 0 {
					r = refuse(1) // the third of the window
				} else {
					r = refuse(3) // a daemon's batch of three
				}
				if !r.Started || r.Until != at(r)+int64(want) || r.Count != uint32(i+1) {
					t.Fatalf("ban %d: %+v, want started, %v, count %d", i+1, r, want, i+1)
				}
				if r2 := refuse(5); r2.Started || r2.Until != r.Until {
					t.Fatalf("refusals during ban %d: %+v, want the same ban", i+1, r2)
				}
				last, lastUntil = want, r.Until
			}
			list, err := b.Known(ctx, now, 10)
			if err != nil || len(list) != 1 || list[0] != (SharedBan{Key: key, Until: lastUntil, Count: 5}) {
				t.Fatalf("Known: %+v (%v)", list, err)
			}
			// The key lives until max after the ban's end, then carries nothing.
			ttl, err := be.rdb.PTTL(ctx, BanKey(key)).Result()
			if err != nil || ttl <= last+5*time.Minute-time.Second || ttl > last+5*time.Minute+2*time.Second {
				t.Fatalf("ban key TTL %v (%v), want about the ban (%v) + max (5m)", ttl, err, last)
			}
			// max without a ban after the last ends: the count decays, 1m again.
			pass(last + 5*time.Minute)
			if r := refuse(3); !r.Started || r.Until != at(r)+int64(time.Minute) || r.Count != 1 {
				t.Fatalf("after the decay: %+v, want a 1m ban, count 1", r)
			}
			if list, _ := b.Known(ctx, now, 10); len(list) != 1 || list[0].Count != 1 {
				t.Fatalf("Known after the decay: %+v, want only the new ban", list)
			}
			was, err := b.Lift(ctx, now, key)
			if err != nil || !was {
				t.Fatalf("Lift: %v %v", was, err)
			}
			if n, _ := be.rdb.Exists(ctx, BanKey(key)).Result(); n != 0 {
				t.Fatal("the ban key survived Lift")
			}
			if list, _ := b.Known(ctx, now, 10); len(list) != 0 {
				t.Fatalf("Known after Lift: %+v", list)
			}
			if was, err := b.Lift(ctx, now, key); err != nil || was {
				t.Fatalf("Lift of nothing: %v %v", was, err)
			}
		})
	}
}

// TestBansBadInput: ban.lua refuses malformed arguments and writes nothing; NewBans
// refuses a bad prefix.
func TestBansBadInput(t *testing.T) {
	be := globalBackends(t)[0]
	if _, err := NewBans(be.rdb, "no-colon"); err == nil {
		t.Fatal("NewBans accepted a prefix without ':'")
	}
	ctx := context.Background()
	err := be.rdb.Eval(ctx, banSrc, []string{"t:x@ban:{a}"}, "now", 1, 1, 1, 1, 1, 1).Err()
	if err == nil || !strings.Contains(err.Error(), "rlsidecar ban.lua") {
		t.Fatalf("bad now: %v, want ban.lua's error", err)
	}
	if n, _ := be.rdb.Exists(ctx, "t:x@ban:{a}").Result(); n != 0 {
		t.Fatal("a refused call wrote its key")
	}
}

// TestBansKnownLimit: past its limit, Known keeps the bans ending last.
func TestBansKnownLimit(t *testing.T) {
	be := globalBackends(t)[0]
	ctx := context.Background()
	b, err := NewBans(be.rdb, "k:")
	if err != nil {
		t.Fatal(err)
	}
	now := int64(1_700_000_000) * int64(time.Second)
	for i, ban := range []time.Duration{time.Minute, 3 * time.Minute, 2 * time.Minute} {
		rs := []BanRefusal{{Key: "k:r:{c=" + string(rune('a'+i)) + "}", N: 1,
			Policy: BanPolicy{After: 1, Within: time.Minute, Ban: ban, Factor: 2, Max: time.Hour}}}
		if err := b.Refused(ctx, now, rs); err != nil || !rs[0].Started {
			t.Fatalf("ban %d: %+v %v", i, rs[0], err)
		}
		if err := b.Index(ctx, []SharedBan{{Key: rs[0].Key, Until: rs[0].Until, Count: rs[0].Count}}); err != nil {
			t.Fatal(err)
		}
	}
	// The index expires a minute after its last ban ends (3 minutes from now), not
	// before, nor never (it had no TTL).
	if ttl, err := be.rdb.PTTL(ctx, "k:~bans").Result(); err != nil || ttl < 3*time.Minute || ttl > 4*time.Minute+time.Second {
		t.Fatalf("the index's TTL is %v (%v), want about 4m", ttl, err)
	}
	list, err := b.Known(ctx, now, 2)
	if err != nil || len(list) != 2 || list[0].Key != "k:r:{c=b}" || list[1].Key != "k:r:{c=c}" {
		t.Fatalf("Known(limit 2) = %+v (%v), want the 3m and 2m bans", list, err)
	}
	b.Shift(150 * time.Second)
	if list, _ := b.Known(ctx, now+int64(150*time.Second), 10); len(list) != 1 || list[0].Key != "k:r:{c=b}" {
		t.Fatalf("Known 2.5m later = %+v, want the 3m ban only", list)
	}
}

// TestBansOfAnEarlierVersion: a ban written by a daemon of the version before bans were
// decided on Redis's clock (ban.lua wrote u and the index's score by that daemon's wall
// clock, the same fields) is honoured: with that daemon's clock right, Refused finds it
// in force and counts nothing, Known lists it with its end, Lift finds and ends it.
// That is what a blue/green upgrade shares Redis with.
func TestBansOfAnEarlierVersion(t *testing.T) {
	for _, be := range globalBackends(t)[1:] {
		t.Run(be.name, func(t *testing.T) {
			ctx := context.Background()
			b, err := NewBans(be.rdb, "old:")
			if err != nil {
				t.Fatal(err)
			}
			const key = "old:login:{ip=1.1.1.1}"
			now := time.Now().UnixNano()
			until := (now + int64(time.Minute)) / int64(time.Millisecond) // as the old ban.lua: ms
			if err := be.rdb.HSet(ctx, BanKey(key), "u", until, "c", 2, "w", until-60000, "r", 0).Err(); err != nil {
				t.Fatal(err)
			}
			if err := be.rdb.ZAdd(ctx, "old:~bans", redis.Z{Score: float64(until), Member: "2|" + key}).Err(); err != nil {
				t.Fatal(err)
			}
			rs := []BanRefusal{{Key: key, N: 1, Policy: BanPolicy{After: 1, Within: time.Minute, Ban: time.Hour, Factor: 2, Max: time.Hour}}}
			if err := b.Refused(ctx, now, rs); err != nil || rs[0].Started || rs[0].Until != until*int64(time.Millisecond) || rs[0].Count != 2 {
				t.Fatalf("Refused on the old ban: %+v %v, want its end and count, not a new ban", rs[0], err)
			}
			list, err := b.Known(ctx, now, 10)
			if err != nil || len(list) != 1 || list[0] != (SharedBan{Key: key, Until: until * int64(time.Millisecond), Count: 2}) {
				t.Fatalf("Known: %+v (%v), want the old ban", list, err)
			}
			if was, err := b.Lift(ctx, now, key); err != nil || !was {
				t.Fatalf("Lift of the old ban: %v %v", was, err)
			}
			if list, _ := b.Known(ctx, now, 10); len(list) != 0 {
				t.Fatalf("Known after Lift: %+v", list)
			}
		})
	}
}

// TestBansOffset: the offset of Redis's clock from the caller's is Redis's time in a reply
// less the middle of the call's round trip; a slow reply (over maxOffsetRTT) is used only
// when there is no estimate yet, so one stalled read does not move a good estimate.
func TestBansOffset(t *testing.T) {
	var b Bans
	if _, ok := b.Offset(); ok {
		t.Fatal("an offset before any reply")
	}
	now := int64(1_000) * int64(time.Second)
	redisUs := (now + int64(2*time.Minute)) / int64(time.Microsecond) // Redis 2 min ahead
	// measure is given a call that began age ago; the round trip it sees is age plus the
	// time the test took to call it, which a loaded machine can make tens of ms: the
	// estimate, 2m less half the round trip, is checked against the bounds that time
	// gives, not against a fixed millisecond.
	measure := func(age time.Duration, redisUs int64) (lo, hi int64) {
		t0 := time.Now()
		b.measure(now, t0.Add(-age), redisUs)
		el := time.Since(t0)
		return int64(2*time.Minute) - int64(age+el)/2 - int64(time.Microsecond), int64(2*time.Minute) - int64(age)/2 + int64(time.Microsecond)
	}
	// A slow first reply is the only estimate there is: used.
	lo, hi := measure(time.Second, redisUs)
	if off, ok := b.Offset(); !ok || off < lo || off > hi {
		t.Fatalf("offset %v %v after a slow first reply, want about 2m less half a second (%v to %v)", time.Duration(off), ok, time.Duration(lo), time.Duration(hi))
	}
	lo, hi = measure(0, redisUs)
	quick, _ := b.Offset()
	if quick < lo || quick > hi {
		t.Fatalf("offset %v after a quick reply, want 2m less half its round trip (%v to %v)", time.Duration(quick), time.Duration(lo), time.Duration(hi))
	}
	// A slow reply now (Redis stalled for a second): the quick reply's estimate stays.
	measure(time.Second, redisUs+int64(time.Second/time.Microsecond))
	if off, _ := b.Offset(); off != quick {
		t.Fatalf("offset %v after a slow reply, want the quick one's %v", time.Duration(off), time.Duration(quick))
	}
}
