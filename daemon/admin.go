package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
)

// Admin is the admin HTTP endpoint: /metrics (Prometheus text), /healthz (the process
// answers), /readyz (rules loaded: the daemon answers every check, by the rules' failure
// policies while Redis is away), /rules (the active rules, their version and load
// time), /top (the clients most often rejected, per rule), /bans (the penalty rules'
// bans in force; DELETE /bans/{rule}/{client} lifts one, from loopback only).
type Admin struct {
	srv *http.Server
	ln  net.Listener
}

// AdminDeps is what the admin endpoint reports on.
type AdminDeps struct {
	Metrics *Metrics
	Limiter *limiter.Limiter
	// StoreReachable reports whether Redis answers; nil when the daemon has none. It
	// feeds the gauge rlsidecar_store_unreachable, never /readyz.
	StoreReachable func() bool
	// Now is the limiter's clock (the daemon's monotonic one), for the bans' remaining
	// times; nil: the wall clock.
	Now func() int64
}

// NewAdmin listens on addr (e.g. 127.0.0.1:9464).
func NewAdmin(addr string, deps AdminDeps) (*Admin, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("admin endpoint on %s: %w", addr, err)
	}
	if deps.StoreReachable != nil {
		deps.Metrics.GaugeFunc("rlsidecar_store_unreachable", "1 while Redis does not answer: hybrid and global rules are decided by their failure policies (the daemon stays ready).", func() float64 {
			if deps.StoreReachable() {
				return 0
			}
			return 1
		})
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		deps.Metrics.WritePrometheus(w)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if why := notReady(deps); why != "" {
			http.Error(w, why, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	mux.HandleFunc("GET /rules", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, rulesDoc(deps))
	})
	mux.HandleFunc("GET /top", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, deps.Metrics.Top())
	})
	if deps.Now == nil {
		deps.Now = func() int64 { return time.Now().UnixNano() }
	}
	if deps.Limiter != nil {
		deps.Metrics.SetBannedKeys(func() map[string]int { return deps.Limiter.BannedKeys(deps.Now()) })
	}
	mux.HandleFunc("GET /bans", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, bansDoc(deps))
	})
	mux.HandleFunc("DELETE /bans/{rule}/{client}", func(w http.ResponseWriter, r *http.Request) {
		if !fromLoopback(r) {
			http.Error(w, "lifting a ban is allowed from the loopback interface only", http.StatusForbidden)
			return
		}
		rule, client := r.PathValue("rule"), r.PathValue("client")
		if lifted := liftBan(deps, rule, client); !lifted {
			http.Error(w, fmt.Sprintf("no ban of %q by rule %q (give the client as /bans names it, or as attr=value)", client, rule), http.StatusNotFound)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	a := &Admin{srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}, ln: ln}
	return a, nil
}

// banDoc is one ban as /bans lists it: the client named as in the metrics (a keyed hash
// unless --top-labels raw).
type banDoc struct {
	Rule   string `json:"rule"`
	Client string `json:"client"`
	LeftMs int64  `json:"left_ms"`
	Count  uint32 `json:"count"`
}

func bansDoc(deps AdminDeps) []banDoc {
	out := []banDoc{}
	if deps.Limiter == nil {
		return out
	}
	for _, b := range deps.Limiter.Bans(deps.Now()) {
		out = append(out, banDoc{Rule: b.Rule, Client: deps.Metrics.ClientName(string(clientOf([]byte(b.Key)))),
			LeftMs: int64((b.Left + time.Millisecond - 1) / time.Millisecond), Count: b.Count})
	}
	return out
}

// liftBan lifts the ban of client by rule; client is the name /bans gives it, or the
// client part of the key as sent (attr=value|attr=value).
func liftBan(deps AdminDeps, rule, client string) bool {
	if deps.Limiter == nil {
		return false
	}
	now := deps.Now()
	for _, b := range deps.Limiter.Bans(now) {
		if b.Rule != rule {
			continue
		}
		c := string(clientOf([]byte(b.Key)))
		if c == client || deps.Metrics.ClientName(c) == client {
			return deps.Limiter.LiftBan(b.Key, now)
		}
	}
	return false
}

// fromLoopback reports whether r comes from a loopback address.
func fromLoopback(r *http.Request) bool {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// Addr returns the address the endpoint listens on.
func (a *Admin) Addr() string { return a.ln.Addr().String() }

// Serve serves until Shutdown.
func (a *Admin) Serve() error {
	if err := a.srv.Serve(a.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Shutdown stops the endpoint and releases its port, also when Serve was never called
// (a start that failed after binding it).
func (a *Admin) Shutdown(ctx context.Context) error {
	err := a.srv.Shutdown(ctx)
	_ = a.ln.Close() // already closed when Serve ran
	return err
}

// notReady says why the daemon cannot answer, or "" when it can. Redis being away is not
// a reason: every check is then decided by its rule's failure policy (open, closed or
// local), which is an answer. Were it a reason, losing Redis would mark every gateway's
// daemon unready at once; degradation is the gauge rlsidecar_store_unreachable and its
// alert instead.
func notReady(deps AdminDeps) string {
	if deps.Limiter.Rules() == nil {
		return "no rules loaded"
	}
	return ""
}

type ruleDoc struct {
	Name           string   `json:"name"`
	Key            []string `json:"key"`
	Algorithm      string   `json:"algorithm"`
	Requests       uint64   `json:"requests"`
	Per            string   `json:"per"`
	Burst          uint64   `json:"burst,omitempty"`
	Mode           string   `json:"mode"`
	OnStoreFailure string   `json:"on_store_failure"`
	Shadow         bool     `json:"shadow"`
	Split          any      `json:"split,omitempty"`
	// Concurrency is set for a concurrency rule: requests is then its max, per its lease.
	Concurrency *concurrencyDoc `json:"concurrency,omitempty"`
	File        string          `json:"file"`
	Line        int             `json:"line"`
}

type concurrencyDoc struct {
	Max   uint64 `json:"max"`
	Lease string `json:"lease"`
}

func rulesDoc(deps AdminDeps) any {
	set := deps.Limiter.Rules()
	out := struct {
		Version string    `json:"version"`
		Source  string    `json:"source"`
		Loaded  time.Time `json:"loaded_at"`
		Shadow  bool      `json:"shadow_all"`
		Rules   []ruleDoc `json:"rules"`
	}{Version: set.Version, Source: set.Source, Shadow: deps.Limiter.ShadowAll(), Rules: []ruleDoc{}}
	deps.Metrics.mu.Lock()
	out.Loaded = deps.Metrics.config.loaded
	deps.Metrics.mu.Unlock()
	for _, r := range set.Rules {
		d := ruleDoc{Name: r.Name, Key: r.Key, Algorithm: r.Algorithm.String(), Requests: r.Requests, Per: r.Per.String(),
			Burst: r.Burst, Mode: deps.Limiter.ModeOf(r).String(), OnStoreFailure: r.OnStoreFailure.String(), Shadow: r.Shadow,
			File: r.File, Line: r.Line}
		if r.SplitAuto {
			d.Split = "auto"
		} else if r.Split > 0 {
			d.Split = r.Split
		}
		if r.Concurrency {
			d.Concurrency = &concurrencyDoc{Max: r.Requests, Lease: r.Per.String()}
		}
		out.Rules = append(out.Rules, d)
	}
	return out
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
