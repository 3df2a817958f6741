package daemon

import (
	"bytes"
	"encoding/json"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/plural"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// /rules never shows a reload's count beside the rules that reload replaced: it reads
// the count before the rules, and a reload counts its end after its rules are in force.
// Read the other way, a reload ending between the two reads did, and `rlsidecar reload`,
// which waits for its reload's count, printed the replaced version as the one in force
// (a CI run of TestE2EReloadCommandWaits). The test holds the count's lock, lets rulesDoc
// block on it, then reloads as the daemon does (the new rules, then the end counted)
// before letting go. Against the old order (ca63f34) the rules were read before the
// block: the document paired the new count with the old version, in 500 runs of 500.
func TestRulesDocCountsNoReloadBesideOldRules(t *testing.T) {
	parse := func(requests int) *rules.Set {
		set, err := rules.Parse("test.yaml", fmt.Appendf(nil, "rules:\n  - name: r\n    key: ip\n    limit: { requests: %d, per: 1m }\n", requests))
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	old, next := parse(1), parse(2)
	if old.Version == next.Version {
		t.Fatalf("both sets have version %s", old.Version)
	}
	lim := limiter.New(old, localbucket.NewStore(localbucket.Options{}))
	reloads := &ReloadState{}
	deps := AdminDeps{Metrics: NewMetrics("test", 10), Limiter: lim, Reloads: reloads}

	reloads.Begin()
	reloads.mu.Lock()
	docs := make(chan any, 1)
	go func() { docs <- rulesDoc(deps) }()
	// Wait for the goroutine to be in ReloadState.Get: the rules' read is then behind it
	// (the old order) or waits for the lock (the new one). Reloads and Limiter are
	// concrete types with no hook to run the reload inside a read, so the test looks at
	// the goroutine's stack rather than add one to the daemon.
	deadline := time.Now().Add(10 * time.Second)
	for !goroutineIn("(*ReloadState).Get(", t.Name()+".func") {
		if time.Now().After(deadline) {
			reloads.mu.Unlock()
			t.Fatal("rulesDoc never called ReloadState.Get")
		}
		time.Sleep(time.Millisecond)
	}
	lim.SetRules(next)
	reloads.ended++ // End, under the lock already held
	reloads.mu.Unlock()

	b, err := json.Marshal(<-docs)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Version string `json:"version"`
		Reloads uint64 `json:"reloads"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Reloads != 1 || doc.Version != next.Version {
		t.Fatalf("/rules shows %s ended beside version %s; want 1 beside %s, the reload's (%s is the set it replaced)",
			plural.Count(doc.Reloads, "reload"), doc.Version, next.Version, old.Version)
	}
}

// goroutineIn reports whether one goroutine's stack has every one of frames in it.
func goroutineIn(frames ...string) bool {
	buf := make([]byte, 1<<20)
	for n := runtime.Stack(buf, true); ; n = runtime.Stack(buf, true) {
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf)) // cut short: the goroutine may be in what was not written
	}
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		all := true
		for _, f := range frames {
			all = all && bytes.Contains(g, []byte(f))
		}
		if all {
			return true
		}
	}
	return false
}
