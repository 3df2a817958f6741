package limiter

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// unindexedBan starts in Redis, through rdb, a ban of 10 minutes of key (a rule's client
// key) that the ban index lacks, as a daemon killed before its round would leave it.
func unindexedBan(t *testing.T, rdb redis.UniversalClient, key string) {
	t.Helper()
	b, err := rlsync.NewBans(rdb, rlsync.DefaultPrefix)
	if err != nil {
		t.Fatal(err)
	}
	pol := rlsync.BanPolicy{After: 1, Within: time.Minute, Ban: 10 * time.Minute, Factor: 2, Max: time.Hour}
	rs := []rlsync.BanRefusal{{Key: key, N: 1, Policy: pol}}
	if err := b.Refused(context.Background(), time.Now().UnixNano(), rs); err != nil || !rs[0].Started {
		t.Fatalf("Refused: %+v %v, want a ban started (and, here, never indexed)", rs[0], err)
	}
}

// indexed fails t unless the ban index lists exactly the ban of key, and l's Bans too.
func indexed(t *testing.T, rdb redis.UniversalClient, l *Limiter, key string) {
	t.Helper()
	if bans := l.Bans(time.Now().UnixNano()); len(bans) != 1 || bans[0].Key != key {
		t.Fatalf("Bans %+v, want the ban of %s", bans, key)
	}
	b, err := rlsync.NewBans(rdb, rlsync.DefaultPrefix)
	if err != nil {
		t.Fatal(err)
	}
	list, err := b.Known(context.Background(), time.Now().UnixNano(), 10)
	if err != nil || len(list) != 1 || list[0].Key != key {
		t.Fatalf("the index: %+v (%v), want the ban of %s", list, err, key)
	}
}

// A shared ban that Redis holds but its index lacks (the daemon that started it was
// killed before its next round indexed it, or the reply of the refusal that started it
// came after the call's timeout, so that daemon never knew it started one) is enforced
// once a hybrid daemon's refusal of the client finds it: the reply says banned, and the
// round indexes it. Before, the daemon learned it from the reply and forgot it at the
// same round's read of the index: no hybrid daemon ever enforced the ban, /bans never
// listed it, and Redis ignored the client's refusals for the ban's whole length (a
// refusal while banned does not count).
func TestSharedBanUnindexedIsIndexedByARefusal(t *testing.T) {
	rdb := realRedis(t)
	l := sharedLimiter(t, rdb, loginRule(1, "1h", "hybrid", "after: 1, within: 1m, ban: 10m"))
	const key = "rl:login:{ip=1.1.1.1}"
	unindexedBan(t, rdb, key)
	check := ipChecker(t, l, "ip=1.1.1.1")
	refuse(t, check, 1) // this daemon does not know the ban: its limit refuses
	for i := 0; i < 3; i++ {
		if err := l.shared.round(context.Background(), time.Now().UnixNano(), true); err != nil {
			t.Fatal(err)
		}
	}
	if r := check(); !r.Banned {
		t.Fatalf("after a refusal that found the ban and three rounds: %+v, want banned", r)
	}
	indexed(t, rdb, l, key)
}

// The same ban found by a global check (which reads the client's ban key, so it answers
// banned) is indexed at the next round. Before, global checks enforced it, but no daemon
// listed it in /bans (nor counted it in rlsidecar_banned_keys), and no hybrid check of
// the rule on another daemon enforced it, for the ban's whole length.
func TestSharedBanUnindexedIsIndexedByAGlobalCheck(t *testing.T) {
	rdb := realRedis(t)
	l := sharedLimiter(t, rdb, loginRule(1, "1h", "global", "after: 1, within: 1m, ban: 10m"))
	const key = "rl:login:{ip=1.1.1.1}"
	unindexedBan(t, rdb, key)
	check := ipChecker(t, l, "ip=1.1.1.1")
	if r := check(); !r.Banned {
		t.Fatalf("a global check of the client banned in Redis: %+v, want banned", r)
	}
	if err := l.shared.round(context.Background(), time.Now().UnixNano(), true); err != nil {
		t.Fatal(err)
	}
	indexed(t, rdb, l, key)
}
