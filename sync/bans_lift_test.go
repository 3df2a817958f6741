package sync

import (
	"context"
	"testing"
	"time"
)

// A ban lifted after it started and before its daemon indexed it stays lifted. The
// daemon that started it adds it to the index at its next round (a global check's, or a
// batch of hybrid refusals'), from its list of bans started and not yet indexed; a lift
// through the admin endpoint in between (the round had taken that list already, or the
// refusal that started it had not yet put it there) deleted the ban key and the index's
// member, and the round's Index then wrote the member back: every daemon read it from
// the index and its hybrid checks refused the client for the whole ban, lifted and
// answered 204. Now Index drops again a member whose ban key no longer holds that ban,
// and writes a re-banned key's member (the same count after a decay) at that ban's end.
func TestBansIndexAfterLift(t *testing.T) {
	for _, be := range globalBackends(t)[1:] { // standalone and cluster
		t.Run(be.name, func(t *testing.T) {
			ctx := context.Background()
			b, err := NewBans(be.rdb, "lift:")
			if err != nil {
				t.Fatal(err)
			}
			pol := BanPolicy{After: 1, Within: time.Minute, Ban: 10 * time.Minute, Factor: 1, Max: 10 * time.Minute}
			const key = "lift:login:{ip=1.1.1.1}"
			now := time.Now().UnixNano()
			rs := []BanRefusal{{Key: key, N: 1, Policy: pol}}
			if err := b.Refused(ctx, now, rs); err != nil || !rs[0].Started {
				t.Fatalf("Refused: %+v %v, want a ban started", rs[0], err)
			}
			started := SharedBan{Key: key, Until: rs[0].Until, Count: rs[0].Count}
			if was, err := b.Lift(ctx, now, key); err != nil || !was {
				t.Fatalf("Lift: %v %v", was, err)
			}
			if err := b.Index(ctx, []SharedBan{started}); err != nil { // the round's, late
				t.Fatal(err)
			}
			if list, err := b.Known(ctx, now, 10); err != nil || len(list) != 0 {
				t.Fatalf("Known after a lift and a late Index: %+v (%v), want none", list, err)
			}

			// Banned again after the lift (count 1 again: the lift forgot the count), a
			// minute later: a late Index of the lifted ban, also count 1, leaves the new
			// ban's end in the index, not the old one's.
			later := now + int64(time.Minute)
			b.Shift(time.Minute) // Redis's clock, which decides, too
			rs = []BanRefusal{{Key: key, N: 1, Policy: pol}}
			if err := b.Refused(ctx, later, rs); err != nil || !rs[0].Started || rs[0].Count != started.Count {
				t.Fatalf("Refused again: %+v %v", rs[0], err)
			}
			again := SharedBan{Key: key, Until: rs[0].Until, Count: rs[0].Count}
			if err := b.Index(ctx, []SharedBan{again}); err != nil {
				t.Fatal(err)
			}
			if err := b.Index(ctx, []SharedBan{started}); err != nil {
				t.Fatal(err)
			}
			if list, err := b.Known(ctx, later, 10); err != nil || len(list) != 1 || list[0] != again {
				t.Fatalf("Known after a late Index of the lifted ban: %+v (%v), want only %+v", list, err, again)
			}
		})
	}
}

// A lift tried again after one that deleted the ban's key and failed to remove the
// index's member (the index's master down: on a Cluster the two are on different slots)
// removes the member. Before, the retry found no ban key, so it did not know the
// member's name (the ban's count is in it), left it, and the ban came back on every
// daemon at its next read of the index. A key with a pattern's special bytes is taken
// literally, and another key's member stays.
func TestBansLiftAgainAfterPartialLift(t *testing.T) {
	for _, be := range globalBackends(t)[1:] { // standalone and cluster
		t.Run(be.name, func(t *testing.T) {
			ctx := context.Background()
			b, err := NewBans(be.rdb, "relift:")
			if err != nil {
				t.Fatal(err)
			}
			pol := BanPolicy{After: 1, Within: time.Minute, Ban: 10 * time.Minute, Factor: 1, Max: 10 * time.Minute}
			now := time.Now().UnixNano()
			keys := []string{`relift:login:{api_key=k*[a]\?|ip=1}`, "relift:login:{api_key=k1|ip=1}"}
			for _, key := range keys {
				rs := []BanRefusal{{Key: key, N: 1, Policy: pol}}
				if err := b.Refused(ctx, now, rs); err != nil || !rs[0].Started {
					t.Fatalf("Refused: %+v %v, want a ban started", rs[0], err)
				}
				if err := b.Index(ctx, []SharedBan{{Key: key, Until: rs[0].Until, Count: rs[0].Count}}); err != nil {
					t.Fatal(err)
				}
			}
			// The first lift's key deletion, without its removal from the index.
			if err := be.rdb.Del(ctx, BanKey(keys[0])).Err(); err != nil {
				t.Fatal(err)
			}
			if _, err := b.Lift(ctx, now, keys[0]); err != nil {
				t.Fatalf("Lift again: %v", err)
			}
			list, err := b.Known(ctx, now, 10)
			if err != nil || len(list) != 1 || list[0].Key != keys[1] {
				t.Fatalf("Known after the lift tried again: %+v (%v), want only the other key's ban", list, err)
			}
		})
	}
}

// LiftBanned lifts a ban in force, its key and its index member, as Lift does, and leaves
// a key holding no ban as it is: its refusals count toward the next ban (the admin
// endpoint asks it of a client no daemon lists, which may be another client than meant).
func TestBansLiftBanned(t *testing.T) {
	for _, be := range globalBackends(t)[1:] { // standalone and cluster
		t.Run(be.name, func(t *testing.T) {
			ctx := context.Background()
			b, err := NewBans(be.rdb, "liftb:")
			if err != nil {
				t.Fatal(err)
			}
			pol := BanPolicy{After: 2, Within: time.Hour, Ban: 10 * time.Minute, Factor: 1, Max: 10 * time.Minute}
			const banned, refused = "liftb:login:{ip=1.1.1.1}", "liftb:login:{ip=2.2.2.2}"
			now := time.Now().UnixNano()
			rs := []BanRefusal{{Key: banned, N: 2, Policy: pol}, {Key: refused, N: 1, Policy: pol}}
			if err := b.Refused(ctx, now, rs); err != nil || !rs[0].Started || rs[1].Until != 0 {
				t.Fatalf("Refused: %+v %v, want the first banned, the second not", rs, err)
			}
			if err := b.Index(ctx, []SharedBan{{Key: banned, Until: rs[0].Until, Count: rs[0].Count}}); err != nil {
				t.Fatal(err)
			}
			if was, err := b.LiftBanned(ctx, now, refused); err != nil || was {
				t.Fatalf("LiftBanned of a key with no ban: %v %v, want false", was, err)
			}
			if was, err := b.LiftBanned(ctx, now, banned); err != nil || !was {
				t.Fatalf("LiftBanned of a ban in force: %v %v, want true", was, err)
			}
			if list, err := b.Known(ctx, now, 10); err != nil || len(list) != 0 {
				t.Fatalf("Known after the lift: %+v (%v), want none", list, err)
			}
			rs = []BanRefusal{{Key: refused, N: 1, Policy: pol}, {Key: banned, N: 1, Policy: pol}}
			if err := b.Refused(ctx, now, rs); err != nil {
				t.Fatal(err)
			}
			if !rs[0].Started {
				t.Errorf("the unbanned key's second refusal started no ban: its first was forgotten (%+v)", rs[0])
			}
			if rs[1].Started {
				t.Errorf("the lifted key's count was kept: one refusal banned it again (%+v)", rs[1])
			}
		})
	}
}
