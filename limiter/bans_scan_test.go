package limiter

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// fillBans bans n clients of the rule login (local mode, after one refusal) at now.
func fillBans(tb testing.TB, l *Limiter, n int, now int64) {
	tb.Helper()
	r := l.active.Load().set.Rules[0]
	l.bans.maxPerShard = n // room for all of them
	key := []byte("login:{ip=")
	for i := range n {
		k := append(strconv.AppendInt(key, int64(i), 10), '}')
		if _, started := l.bans.refused(k, r, now, 0); !started {
			tb.Fatalf("key %s: no ban started", k)
		}
	}
}

// BenchmarkBannedKeys is a scrape's count of the bans in force (rlsidecar_banned_keys)
// under a million local bans, as an attack from a million addresses leaves them: a walk
// of every ban, each shard's lock held while its bans are walked. Beside it, a goroutine
// reads the bans of random clients as checks do (bannedUntil), and its p99 and p999
// waits are reported: what a scrape costs a check.
func BenchmarkBannedKeys(b *testing.B) {
	l := newLimiter(b, loginRule(1, "1h", "local", "after: 1, within: 1m, ban: 10m"))
	now := time.Now().UnixNano()
	const n = 1_000_000
	fillBans(b, l, n, now)
	stop := make(chan struct{})
	waits := make(chan []time.Duration)
	go func() {
		var w []time.Duration
		key := []byte("login:{ip=")
		for i := 0; ; i++ {
			select {
			case <-stop:
				waits <- w
				return
			default:
			}
			k := append(strconv.AppendInt(key[:10], int64(i*7919%n), 10), '}')
			t := time.Now()
			if l.bans.bannedUntil(k, now+1) == 0 {
				panic("not banned")
			}
			w = append(w, time.Since(t))
		}
	}()
	for b.Loop() {
		if got := l.BannedKeys(now + 1)["login"]; got != n {
			b.Fatalf("%d banned, want %d", got, n)
		}
	}
	close(stop)
	w := <-waits
	slices.Sort(w)
	b.ReportMetric(float64(w[len(w)*99/100].Nanoseconds())/1e3, "check-p99-µs")
	b.ReportMetric(float64(w[len(w)*999/1000].Nanoseconds())/1e3, "check-p999-µs")
}

// BenchmarkBanSweep is the sweep over a million local bans in force (none dropped).
func BenchmarkBanSweep(b *testing.B) {
	l := newLimiter(b, loginRule(1, "1h", "local", "after: 1, within: 1m, ban: 10m"))
	now := time.Now().UnixNano()
	const n = 1_000_000
	fillBans(b, l, n, now)
	set := l.active.Load().set
	for b.Loop() {
		if d := l.bans.sweep(now+1, set); d != 0 {
			b.Fatalf("swept %d", d)
		}
	}
}

// TestBannedKeysCountsEachRule: the gauge counts, per penalty rule, the bans in force at
// now, whatever order the rules' bans come in; a ban that ended is not counted, nor a ban
// of a rule whose penalty a reload removed.
func TestBannedKeysCountsEachRule(t *testing.T) {
	const two = `
rules:
  - name: login
    key: ip
    limit: { requests: 1, per: 1h }
    penalty: { after: 1, within: 1m, ban: 10m }
  - name: signup
    key: ip
    limit: { requests: 1, per: 1h }
    penalty: { after: 1, within: 1m, ban: 1m }
  - name: search
    key: ip
    limit: { requests: 1, per: 1h }
    penalty: { after: 1, within: 1m, ban: 10m }
`
	l := newLimiter(t, two)
	now := time.Now().UnixNano()
	rs := l.active.Load().set.Rules
	want := map[string]int{}
	for i := range 3000 {
		r := rs[i*7%len(rs)] // the rules' bans interleaved in every shard
		k := []byte(r.Name + ":{ip=" + strconv.Itoa(i) + "}")
		if _, started := l.bans.refused(k, r, now, 0); !started {
			t.Fatalf("%s: no ban", k)
		}
		want[r.Name]++
	}
	if got := l.BannedKeys(now + 1); !maps.Equal(got, want) {
		t.Fatalf("BannedKeys %v, want %v", got, want)
	}
	later := now + int64(2*time.Minute) // signup's bans have ended
	delete(want, "signup")
	if got := l.BannedKeys(later); !maps.Equal(got, want) {
		t.Fatalf("after signup's bans ended: BannedKeys %v, want %v", got, want)
	}
	l.SetRules(mustRules(t, strings.Replace(two, "penalty: { after: 1, within: 1m, ban: 10m }\n  - name: signup", "\n  - name: signup", 1)))
	delete(want, "login")
	if got := l.BannedKeys(later); !maps.Equal(got, want) {
		t.Fatalf("login's penalty removed: BannedKeys %v, want %v", got, want)
	}
}
