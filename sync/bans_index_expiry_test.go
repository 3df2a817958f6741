package sync

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// A late Index of bans that all ended over a minute ago (a daemon's round retries the
// bans it could not index, after an outage) keeps the index and the live bans in it.
// Index gives the index an expiry of its last ban's end plus a minute, by Redis's
// clock, with PEXPIREAT NX for an index without one; an expiry in the past deletes the
// key. The index has none when the ZADD before it created the key (Redis restarted, or
// every ban had expired), and another daemon's ZADD of a live ban may land between the
// two: that ban was deleted with the index, so no other daemon learned it. Now the expiry
// is at least a minute from Redis's time (as the last Known measured it).
func TestBansIndexOfEndedBansKeepsTheIndex(t *testing.T) {
	for _, be := range globalBackends(t)[1:] { // standalone and cluster
		t.Run(be.name, func(t *testing.T) {
			ctx := context.Background()
			b, err := NewBans(be.rdb, "late:")
			if err != nil {
				t.Fatal(err)
			}
			now := time.Now().UnixNano()
			if _, err := b.Known(ctx, now, 10); err != nil { // a round's read, before
				t.Fatal(err)
			}
			tm, err := be.rdb.Time(ctx).Result()
			if err != nil {
				t.Fatal(err)
			}
			rnow := tm.UnixMilli()
			// Another daemon's live ban, its ZADD in the index without an expiry yet.
			const live = "late:login:{ip=2.2.2.2}"
			if err := be.rdb.ZAdd(ctx, "late:~bans", redis.Z{Score: float64(rnow + 10*60_000), Member: "1|" + live}).Err(); err != nil {
				t.Fatal(err)
			}
			// This daemon's ban that ended two minutes ago, indexed late.
			ended := SharedBan{Key: "late:login:{ip=1.1.1.1}", Until: (rnow - 2*60_000) * int64(time.Millisecond), Count: 1}
			if err := b.Index(ctx, []SharedBan{ended}); err != nil {
				t.Fatal(err)
			}
			list, err := b.Known(ctx, time.Now().UnixNano(), 10)
			if err != nil || len(list) != 1 || list[0].Key != live {
				t.Fatalf("Known after a late Index of an ended ban: %+v (%v), want the live ban of %s", list, err, live)
			}
			if ttl, err := be.rdb.PTTL(ctx, "late:~bans").Result(); err != nil || ttl < 50*time.Second {
				t.Fatalf("the index's TTL %v (%v), want at least about a minute", ttl, err)
			}
		})
	}
}
