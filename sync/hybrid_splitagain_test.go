package sync

import (
	"context"
	"errors"
	"testing"

	"github.com/redis/go-redis/v9"
)

// tryAgainErr is Redis's TRYAGAIN as go-redis hands it over (a redis.Error).
type tryAgainErr struct{}

func (tryAgainErr) Error() string { return "TRYAGAIN Multiple keys request during rehashing of slot" }
func (tryAgainErr) RedisError()   {}

// A call Redis refused with TRYAGAIN ran nothing: every one of its keys is not served
// (pending for the next sync, no failure) until a resend's reply says otherwise, those
// past its first slot too. Before, they kept the TRYAGAIN when the sync's time ran out
// before their resend: a failure, counted against the master's breaker, during a
// reshard.
func TestSplitAgainTryAgainMarksEveryKeyNotServed(t *testing.T) {
	keys := []string{"rl:a:{user=1}:x", "rl:b:{user=1}:x", "rl:a:{user=2}:x", "rl:a:{user=3}:x"}
	if Slot(keys[0]) != Slot(keys[1]) || Slot(keys[1]) == Slot(keys[2]) || Slot(keys[2]) == Slot(keys[3]) {
		t.Fatal("want two keys of one slot, then two of two others")
	}
	items := make([]syncItem, len(keys))
	for i, k := range keys {
		items[i].e = &hentry{}
		items[i].e.setKey(k)
	}
	cmd := redis.NewCmd(context.Background())
	cmd.SetErr(tryAgainErr{})
	if !redis.HasErrorPrefix(cmd.Err(), "TRYAGAIN") {
		t.Fatal("the stand-in is not read as TRYAGAIN")
	}
	c := syncCall{items: items, cmd: cmd}
	parseSyncReply(&c) // every item gets the call's error, as in send
	rest := splitAgain([]syncCall{c})
	if len(rest) != 3 { // the first slot's two keys one by one, then the rest together
		t.Fatalf("%d calls to send again, want 3", len(rest))
	}
	for i := range items {
		if !errors.Is(items[i].err, errNotServed) {
			t.Errorf("key %s: error %v, want not served", keys[i], items[i].err)
		}
	}
}
