package daemon

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// TestAdminLiftUnlistedSharedBan: two daemons share a global penalty rule's bans on one
// real Redis. Daemon A's checks ban the user "{a}"; daemon B has not read the bans' index
// since (its rounds come every interval; here none runs), so its /bans does not list the
// ban, which every global check, B's included, enforces. DELETE on B lifts it in Redis,
// by the client as the request sent it: 204, and A's next check passes the ban. Before,
// B answered 404 "no ban" (it looked only among the bans it lists), as it did for any
// ban past the 10,000 a read of the index keeps. A client Redis holds no ban of is
// still 404, and its refusals are kept (the lift does not reach another client's count).
func TestAdminLiftUnlistedSharedBan(t *testing.T) {
	set, err := rules.Parse("test.yaml", []byte(`
rules:
  - name: login
    key: user
    limit: { requests: 1, per: 1h }
    mode: global
    penalty: { after: 2, within: 1h, ban: 1h }
`))
	if err != nil {
		t.Fatal(err)
	}
	srv := redistest.StartStandalone(t)
	rdb, err := rlsync.Open(rlsync.Config{URL: "redis://" + srv.Addr, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	newDaemon := func() *limiter.Limiter {
		bans, err := rlsync.NewBans(rdb, rlsync.DefaultPrefix)
		if err != nil {
			t.Fatal(err)
		}
		lim := limiter.New(set, localbucket.NewStore(localbucket.Options{})).
			WithGlobal(rlsync.NewGlobal(rdb), 5*time.Second).WithSharedBans(bans, 5*time.Second)
		if err := lim.LearnSharedBans(context.Background(), time.Now().UnixNano()); err != nil {
			t.Fatal(err)
		}
		return lim
	}
	a, b := newDaemon(), newDaemon()
	check := func(lim *limiter.Limiter, user string) limiter.Decision {
		t.Helper()
		var d limiter.Decision
		if err := lim.Check(time.Now().UnixNano(), &limiter.Input{Attrs: []rules.Attr{{Name: "user", Value: user}}, Cost: 1}, &d); err != nil {
			t.Fatal(err)
		}
		if d.Degraded {
			t.Fatalf("degraded with Redis up: %+v", d)
		}
		return d
	}
	banned := func(lim *limiter.Limiter, user string) bool {
		t.Helper()
		d := check(lim, user)
		return d.Deciding >= 0 && d.Results[d.Deciding].Banned
	}
	for i := 0; !banned(a, "{a}"); i++ {
		if i > 10 {
			t.Fatal("user {a} never banned on daemon A")
		}
	}
	if !banned(b, "{a}") {
		t.Fatal("daemon B's global check does not enforce the ban")
	}
	// The user "c", refused once on A: one refusal counted, no ban.
	check(a, "c")
	if d := check(a, "c"); d.Allowed || d.Results[d.Deciding].Banned {
		t.Fatalf("user c's first refusal: allowed %v banned %v", d.Allowed, d.Results[d.Deciding].Banned)
	}

	base := startAdmin(t, AdminDeps{Metrics: NewMetrics("test", 10), Limiter: b, Now: func() int64 { return time.Now().UnixNano() }})
	if _, body := get(t, base+"/bans"); strings.Contains(body, `"login"`) {
		t.Fatalf("daemon B lists the ban before any read of the index: %s (this test needs it unlisted)", body)
	}
	if code, body := doHost(t, "DELETE", base, "/bans/login/user=c", "localhost"); code != http.StatusNotFound {
		t.Fatalf("lifting the ban of user c, who has none: %d %q, want 404", code, body)
	}
	if code, body := doHost(t, "DELETE", base, "/bans/login/user=%7Ba%7D", "localhost"); code != http.StatusNoContent {
		t.Fatalf("lifting on daemon B the ban of user {a} daemon A started: %d %q, want 204", code, body)
	}
	if banned(a, "{a}") {
		t.Fatal("daemon A still enforces the ban lifted on daemon B")
	}
	// User c's refusal was kept: the next one reaches after (2) and bans.
	if !banned(a, "c") {
		t.Fatal("user c's refusal was forgotten by the lift that found no ban")
	}
}
