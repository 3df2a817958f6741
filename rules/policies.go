package rules

import (
	"fmt"
	"math"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/rlsidecar/rlsidecar/localbucket"
)

// maxDelay bounds a rule's delay: a gateway holding a request longer than this is a
// queue, not a rate limiter.
const maxDelay = time.Hour

// policies reads a rule's optional policies, warn_at and delay, from its fields f, and
// keeps a calendar rule local. It runs after the limit, plans and mode are read, and
// gives each of the rule's limits the delay.
func (p *parser) policies(r *Rule, f map[string]*yaml.Node, field string) {
	if r.Calendar != localbucket.NoCalendar {
		p.localOnly(r, f["limit"], field+".limit.per", "a calendar window (per: "+r.Calendar.String()+")")
	}
	if v := f["warn_at"]; !isNull(v) {
		var x float64
		if v.Kind != yaml.ScalarNode || (v.ShortTag() != "!!float" && v.ShortTag() != "!!int") || v.Decode(&x) != nil {
			p.errorf(v, field+".warn_at", "expected a fraction of the limit in (0, 1], got %s", describe(v))
		} else if !(x > 0 && x <= 1) {
			p.errorf(v, field+".warn_at", "%s is not in (0, 1]: the fraction of the limit used from which an answer warns, e.g. 0.8", v.Value)
		} else if r.Unlimited || r.Deny {
			p.errorf(v, field+".warn_at", "a rule whose limit is unlimited or deny has no limit to warn about")
		} else {
			r.WarnAt = x
		}
	}
	if v := f["delay"]; !isNull(v) {
		s, ok := p.str(v, field+".delay")
		if !ok {
			return
		}
		d, msg := parsePer(s)
		switch {
		case msg != "":
			p.errorf(v, field+".delay", "%s", msg)
		case d > maxDelay:
			p.errorf(v, field+".delay", "%s is longer than the maximum of 1h", s)
		case r.Unlimited || r.Deny:
			p.errorf(v, field+".delay", "a rule whose limit is unlimited or deny has nothing to delay")
		case r.Algorithm != localbucket.TokenBucket:
			p.errorf(v, field+".delay", "delay applies to token_bucket only (algorithm is %s)", r.Algorithm)
		default:
			r.Delay = d
			r.limit = r.limit.WithDelay(d)
			for _, pl := range r.plans {
				if !pl.unlimited {
					pl.limit = pl.limit.WithDelay(d)
				}
			}
			p.localOnly(r, v, field+".delay", "delay")
		}
	}
}

// localOnly makes r, which uses policy what, a local-mode rule: the policies other than
// warn_at are decided by this daemon's buckets for now (the Redis scripts do not carry
// them yet). A rule that asks for hybrid or global mode is an error, not a silent change.
func (p *parser) localOnly(r *Rule, at *yaml.Node, field, what string) {
	switch r.Mode {
	case ModeDefault:
		r.Mode = ModeLocal
	case ModeLocal:
	default:
		p.errorf(at, field, "%s is decided in mode local only (for now); mode %s does not carry it (use mode local, or drop %s)", what, r.Mode, what)
	}
}

// WarnThreshold returns how much of capacity must be used, after a request, for the
// rule to warn: ⌈WarnAt × capacity⌉, at least 1; 0 when the rule has no warn_at.
func (r *Rule) WarnThreshold(capacity uint64) uint64 {
	if r.WarnAt == 0 {
		return 0
	}
	// A product a rounding error above a whole number counts as that number, so 0.7 ×
	// 10 (7.000000000000001 in binary) asks for 7, as written.
	x := r.WarnAt * float64(capacity)
	f := math.Floor(x)
	if x-f > 1e-12*max(1, x) {
		f++
	}
	return max(uint64(f), 1)
}

// loadZone loads an IANA time zone from the embedded database (localbucket imports
// time/tzdata), so every host agrees; msg is empty on success.
func loadZone(name string) (*time.Location, string) {
	if name == "" || name == "Local" {
		return nil, fmt.Sprintf("%q is not an IANA time zone (e.g. UTC, Europe/Paris, America/Sao_Paulo)", name)
	}
	loc, err := time.LoadLocation(name)
	if err != nil {
		return nil, fmt.Sprintf("unknown time zone %q (an IANA name, e.g. Europe/Paris, America/Sao_Paulo)", name)
	}
	return loc, ""
}
