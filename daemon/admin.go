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
	"github.com/rlsidecar/rlsidecar/rules"
)

// Admin is the admin HTTP endpoint: /metrics (Prometheus text), /healthz (the process
// answers), /readyz (rules loaded, and the store reachable or every rule's failure
// policy tolerating its absence), /rules (the active rules, their version and load
// time), /top (the clients most often rejected, per rule).
type Admin struct {
	srv *http.Server
	ln  net.Listener
}

// AdminDeps is what the admin endpoint reports on.
type AdminDeps struct {
	Metrics *Metrics
	Limiter *limiter.Limiter
	// StoreReachable reports whether Redis answers; nil when the daemon has none.
	StoreReachable func() bool
}

// NewAdmin listens on addr (e.g. 127.0.0.1:9464).
func NewAdmin(addr string, deps AdminDeps) (*Admin, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("admin endpoint on %s: %w", addr, err)
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
	a := &Admin{srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}, ln: ln}
	return a, nil
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

// Shutdown stops the endpoint.
func (a *Admin) Shutdown(ctx context.Context) error { return a.srv.Shutdown(ctx) }

func notReady(deps AdminDeps) string {
	set := deps.Limiter.Rules()
	if set == nil {
		return "no rules loaded"
	}
	if deps.StoreReachable == nil || deps.StoreReachable() {
		return ""
	}
	for _, r := range set.Rules {
		if r.Mode != rules.ModeLocal && r.OnStoreFailure == rules.FailClosed {
			return fmt.Sprintf("Redis is unreachable and rule %q fails closed without it", r.Name)
		}
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
	File           string   `json:"file"`
	Line           int      `json:"line"`
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
