package localbucket

import (
	"fmt"
	"testing"
	"time"
)

// A batch's inserts do not make room by evicting the batch's own keys: a request of two
// keys in a shard full of limited clients but for one place stored each key in turn in
// that place, the second insert evicting the first, which came back fresh at its next
// request and so never reached its limit.
func TestStoreKeyCapKeepsTheBatchsOwnKeys(t *testing.T) {
	for _, keys := range []int{2, 3, 6} { // apply2, applySmall, the general path
		t.Run(fmt.Sprint(keys), func(t *testing.T) { keyCapKeepsOwnKeys(t, keys) })
	}
}

func keyCapKeepsOwnKeys(t *testing.T, keys int) {
	s := NewStore(Options{Shards: 1, MaxKeys: 4})
	hour, err := NewLimit(FixedWindow, 1, time.Hour, 0)
	if err != nil {
		t.Fatal(err)
	}
	five, err := NewLimit(FixedWindow, 5, time.Hour, 0)
	if err != nil {
		t.Fatal(err)
	}
	many, err := NewLimit(FixedWindow, 1000, time.Hour, 0)
	if err != nil {
		t.Fatal(err)
	}
	now := int64(time.Hour) * 1000
	// Three limited clients: kept, never evicted.
	for i := 0; i < 3; i++ {
		k := []byte(fmt.Sprintf("rl:limited:{%d}", i))
		for j := 0; j < 2; j++ {
			s.Apply(now, []Op{{Key: k, Limit: &hour, Cost: 1}})
		}
	}
	admitted := 0
	for i := 0; i < 20; i++ {
		ops := []Op{{Key: []byte("rl:user:{a}"), Limit: &five, Cost: 1}}
		for k := 1; k < keys; k++ {
			ops = append(ops, Op{Key: []byte(fmt.Sprintf("rl:path%d:{a}", k)), Limit: &many, Cost: 1})
		}
		if s.Apply(now, ops) {
			admitted++
		}
		now += int64(time.Millisecond)
	}
	if admitted > 5 {
		t.Fatalf("admitted %d of 20 under a limit of 5 an hour (evictions %d, untracked %d)", admitted, s.Evictions(), s.Untracked())
	}
}
