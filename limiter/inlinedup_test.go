package limiter

import (
	"reflect"
	"testing"
	"time"
)

// TestInlineDuplicateChargedOnce: the same inline limit listed twice in one request
// (same key, algorithm, limit, window and burst) is one limit: decided and charged once,
// and reported twice, both rules[] entries alike (each under its own name). A limit of 1
// listed twice admits its one request. A different limit between them, and a rule before
// them, keep their places and their own counts. In local, hybrid and global mode (the
// latter two on a real Redis).
func TestInlineDuplicateChargedOnce(t *testing.T) {
	const yaml = `
rules:
  - name: per-ip
    key: ip
    mode: local
    limit: { requests: 100, per: 1m }
`
	for _, mode := range []string{"local", "hybrid", "global"} {
		t.Run(mode, func(t *testing.T) {
			var l *Limiter
			if mode == "local" {
				l = newLimiter(t, yaml)
			} else {
				l = policyLimiter(t, realRedis(t), yaml)
			}
			now := time.Now().UnixNano()
			dup := Inline{Key: "dup", Limit: 10, WindowMs: 60_000, Mode: mode}
			other := Inline{Key: "dup", Limit: 10, WindowMs: 30_000, Mode: mode} // another window: another limit
			named := dup
			named.Name = "again"
			in := Input{Attrs: attrs("ip=1.1.1.1"), Limits: []Inline{dup, other, dup, named}, Cost: 1}
			var d Decision
			for i := uint64(1); i <= 3; i++ {
				if err := l.Check(now, &in, &d); err != nil {
					t.Fatal(err)
				}
				if !d.Allowed || len(d.Results) != 5 {
					t.Fatalf("request %d: allowed %v, %d results; want allowed, 5", i, d.Allowed, len(d.Results))
				}
				names := [5]string{"per-ip", "dup", "dup", "dup", "again"}
				for k, want := range []uint64{100 - i, 10 - i, 10 - i, 10 - i, 10 - i} {
					r := d.Results[k]
					if r.Name != names[k] || r.Remaining != want || !r.Allowed {
						t.Fatalf("request %d: result %d %q remaining %d allowed %v; want %q remaining %d (charged once)",
							i, k, r.Name, r.Remaining, r.Allowed, names[k], want)
					}
				}
				if r := d.Results[3]; !sameResult(r, d.Results[1]) || !sameResult(d.Results[4], r) || r.Window != time.Minute || r.Limit != 10 {
					t.Fatalf("request %d: the copy %+v differs from the first %+v", i, r, d.Results[1])
				}
				if d.Results[1].Repeat || d.Results[2].Repeat || !d.Results[3].Repeat || !d.Results[4].Repeat {
					t.Fatalf("request %d: Repeat %v %v %v %v, want only the copies (3, 4)", i,
						d.Results[1].Repeat, d.Results[2].Repeat, d.Results[3].Repeat, d.Results[4].Repeat)
				}
				// The deciding rule: the least remaining, the first listed on a tie.
				if d.Deciding != 1 {
					t.Fatalf("request %d: deciding %d, want 1", i, d.Deciding)
				}
			}

			// The deciding result after a copy moves with it: a, a, b with b deciding.
			two := Inline{Key: "two", Limit: 2, WindowMs: 60_000, Mode: "local"}
			in = Input{Limits: []Inline{dup, dup, two}, Cost: 1}
			if err := l.Check(now, &in, &d); err != nil {
				t.Fatal(err)
			}
			if !d.Allowed || len(d.Results) != 3 || d.Deciding != 2 || d.DecidingResult().Name != "two" || d.Results[1].Remaining != 6 {
				t.Fatalf("dup, dup, two: allowed %v deciding %d results %+v; want two deciding, dup at 6", d.Allowed, d.Deciding, d.Results)
			}

			// A limit of 1 listed twice: the first request passes, the second is refused,
			// both entries alike, and the deciding index is the first's.
			one := Inline{Key: "one", Limit: 1, WindowMs: 60_000, Mode: mode}
			wide := Inline{Key: "wide", Limit: 5, WindowMs: 60_000, Mode: "local"} // what a hybrid view grants a fresh key is the sync's business
			in = Input{Limits: []Inline{wide, one, one}, Cost: 1}
			if err := l.Check(now, &in, &d); err != nil {
				t.Fatal(err)
			}
			if !d.Allowed || d.Results[1].Remaining != 0 || d.Results[2].Remaining != 0 || d.Deciding != 1 {
				t.Fatalf("limit 1 twice, first request: allowed %v results %+v deciding %d; want allowed", d.Allowed, d.Results, d.Deciding)
			}
			if err := l.Check(now, &in, &d); err != nil {
				t.Fatal(err)
			}
			if d.Allowed || d.Results[1].Allowed || d.Results[2].Allowed || d.Results[1].RetryAfter != d.Results[2].RetryAfter || d.Deciding != 1 || !d.Results[0].Allowed {
				t.Fatalf("limit 1 twice, second request: allowed %v deciding %d results %+v; want refused by the first entry", d.Allowed, d.Deciding, d.Results)
			}
			if d.Results[0].Remaining != 4 { // all-or-nothing: the refused request took nothing
				t.Fatalf("wide: remaining %d, want 4", d.Results[0].Remaining)
			}
		})
	}
}

// TestInlineDuplicateAcrossRedisModes: a hybrid and a global inline limit that agree on
// key, algorithm, limit, window and burst share one Redis counter, so listed together
// they are one limit, decided by the first listed's store and charged once: a limit of 1
// so listed admits its one request. A local one beside them has its own counter.
func TestInlineDuplicateAcrossRedisModes(t *testing.T) {
	l := policyLimiter(t, realRedis(t), "rules: []\n")
	lim := func(mode string) Inline { return Inline{Key: "x", Limit: 1, WindowMs: 60_000, Mode: mode} }
	// The local one admits two, so that the second check is refused by the Redis limit
	// alone: with a local limit of 1 too, both refused and the longer retry decided, the
	// local one's by a few ms at times (its clock is the daemon's, the other's Redis's).
	local := lim("local")
	local.Limit = 2
	in := Input{Limits: []Inline{lim("global"), lim("hybrid"), local}, Cost: 1}
	var d Decision
	if err := l.Check(time.Now().UnixNano(), &in, &d); err != nil {
		t.Fatal(err)
	}
	if !d.Allowed || len(d.Results) != 3 || d.Results[0].Remaining != 0 || !sameResult(d.Results[1], d.Results[0]) || !d.Results[2].Allowed {
		t.Fatalf("allowed %v results %+v; want allowed, the Redis counter charged once", d.Allowed, d.Results)
	}
	if err := l.Check(time.Now().UnixNano(), &in, &d); err != nil {
		t.Fatal(err)
	}
	if d.Allowed || d.Results[0].Allowed || !sameResult(d.Results[1], d.Results[0]) || d.Deciding != 0 || !d.Results[2].Allowed {
		t.Fatalf("again: allowed %v deciding %d results %+v; want refused by the first", d.Allowed, d.Deciding, d.Results)
	}
}

// sameResult reports whether a and b are alike but for their names (and Repeat).
func sameResult(a, b Result) bool {
	a.Name, b.Name = "", ""
	a.Repeat, b.Repeat = false, false
	return reflect.DeepEqual(a, b)
}
