package sync

import (
	"context"
	"strings"
	"testing"
	"time"
)

func TestCheckPrefix(t *testing.T) {
	for _, tc := range []struct {
		prefix string
		err    string // "" when valid
	}{
		{"rl:", ""},
		{"tenant-a:", ""},
		{"app:prod:", ""},
		{":", ""},
		{strings.Repeat("p", MaxPrefixLen-1) + ":", ""},
		{"", "must not be empty"},
		{strings.Repeat("p", MaxPrefixLen) + ":", "at most 64"},
		{"rl", "must end with ':'"},
		{"a:b", "must end with ':'"},
		{"{t}:", "must not contain '{'"},
		{"t}:", "must not contain '{'"},
		{"my app:", "not printable"},
		{"a\n:", "not printable"},
		{"é:", "not printable"},
		{"a\x00:", "not printable"},
	} {
		err := CheckPrefix(tc.prefix)
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("CheckPrefix(%q) = %v, want nil", tc.prefix, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("CheckPrefix(%q) = %v, want an error containing %q", tc.prefix, err, tc.err)
		}
	}
}

// A valid prefix never changes a key's Redis Cluster slot: the client's hash tag decides.
func TestPrefixKeepsSlot(t *testing.T) {
	for _, p := range []string{"rl:", "tenant-a:", "x:y:"} {
		if err := CheckPrefix(p); err != nil {
			t.Fatal(err)
		}
		for _, rest := range []string{"per-user:{user=alice}", "~inline/token_bucket/5/1000/5:{k}"} {
			if got, want := Slot(p+rest), Slot("rl:"+rest); got != want {
				t.Errorf("Slot(%q) = %d, want %d as under rl:", p+rest, got, want)
			}
		}
	}
	if DaemonsKeyFor(DefaultPrefix) != DaemonsKey {
		t.Fatalf("DaemonsKeyFor(DefaultPrefix) = %q, DaemonsKey = %q", DaemonsKeyFor(DefaultPrefix), DaemonsKey)
	}
}

// Daemons count each other only under the same prefix: on one real Redis, two under
// "a:" count two, the one under "b:" counts itself, and nothing lands under "rl:".
func TestHeartbeatCountsPerPrefix(t *testing.T) {
	rdb := standalone(t)
	ctx := context.Background()
	hs := map[string]*Hybrid{
		"a1": NewHybrid(rdb, HybridOptions{Prefix: "a:"}),
		"a2": NewHybrid(rdb, HybridOptions{Prefix: "a:"}),
		"b1": NewHybrid(rdb, HybridOptions{Prefix: "b:"}),
	}
	want := map[string]int{"a1": 2, "a2": 2, "b1": 1}
	for round := 0; round < 2; round++ { // the second round sees every heartbeat
		for id, h := range hs {
			if _, err := h.Heartbeat(ctx, id, time.Minute); err != nil {
				t.Fatal(err)
			}
		}
	}
	for id, h := range hs {
		if got := h.Replicas(); got != want[id] {
			t.Errorf("%s counts %d live daemons, want %d", id, got, want[id])
		}
	}
	for key, n := range map[string]int64{"a:daemons": 2, "b:daemons": 1, DaemonsKey: 0} {
		if got := rdb.ZCard(ctx, key).Val(); got != n {
			t.Errorf("ZCARD %s = %d, want %d", key, got, n)
		}
	}
}
