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

// policies reads a rule's optional policies, warn_at, penalty and delay, from its fields
// f. It runs after the limit, plans and mode are read, and gives each of the rule's
// limits the delay. Every policy works in every mode: in hybrid mode a calendar window or
// a delay is decided by the global scripts (limiter), and bans are shared through Redis.
func (p *parser) policies(r *Rule, f map[string]*yaml.Node, field string) {
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
	if v := f["penalty"]; !isNull(v) {
		if r.Unlimited || r.Deny {
			p.errorf(v, field+".penalty", "a rule whose limit is unlimited or deny refuses nobody, or everybody: no penalty")
		} else if pen := p.penalty(v, field+".penalty"); pen != nil {
			r.Penalty = pen
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
		case r.Concurrency:
			p.errorf(v, field+".delay", "a concurrency rule holds leases, it has no tokens to delay (delay applies to token_bucket only)")
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
		}
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

// loadZone loads an IANA time zone from the database built into the binary
// (localbucket.LoadZone), not the host's, so every host agrees; msg is empty on success.
func loadZone(name string) (*time.Location, string) {
	if name == "" || name == "Local" {
		return nil, fmt.Sprintf("%q is not an IANA time zone (e.g. UTC, Europe/Paris, America/Sao_Paulo)", name)
	}
	loc, err := localbucket.LoadZone(name)
	if err != nil {
		return nil, fmt.Sprintf("unknown time zone %q (an IANA name, e.g. Europe/Paris, America/Sao_Paulo)", name)
	}
	return loc, ""
}

// Penalty is a rule's escalating bans: a key the rule refuses After times within Within
// is banned for Ban; each later ban of it lasts Factor times the one before, at most
// Max; after Max without a ban, the next one is Ban again. Immutable.
type Penalty struct {
	After  uint64
	Within time.Duration
	Ban    time.Duration
	Factor float64       // >= 1; 2 when not written
	Max    time.Duration // >= Ban; Ban × 16 (capped at 30 days) when not written
}

// maxBan bounds a ban and a penalty's within.
const maxBan = 366 * 24 * time.Hour

// BanFor returns how long the ban after n earlier ones (since the count decayed) lasts:
// Ban × Factor^n, at most Max. With ban 1m, factor 2, max 10m: 1m, 2m, 4m, 8m, 10m, 10m...
func (p *Penalty) BanFor(n uint32) time.Duration {
	d := float64(p.Ban) * math.Pow(p.Factor, float64(n))
	if d >= float64(p.Max) { // +Inf too
		return p.Max
	}
	return time.Duration(d)
}

var penaltyFields = []string{"after", "within", "ban", "factor", "max"}

// penalty reads a penalty mapping; nil when it is invalid (errors recorded).
func (p *parser) penalty(n *yaml.Node, field string) *Penalty {
	f, ok := p.mapping(n, field, penaltyFields)
	if f == nil {
		return nil
	}
	pen := &Penalty{Factor: 2}
	dur := func(name string, required bool, out *time.Duration) {
		v := f[name]
		if isNull(v) {
			if required {
				p.errorf(n, field+"."+name, "missing (required): a duration, e.g. 1m")
				ok = false
			}
			return
		}
		s, sok := p.str(v, field+"."+name)
		if !sok {
			ok = false
			return
		}
		d, msg := parsePer(s)
		if msg == "" && d > maxBan {
			msg = fmt.Sprintf("%q is longer than the maximum of 366 days", s)
		}
		if msg != "" {
			p.errorf(v, field+"."+name, "%s", msg)
			ok = false
			return
		}
		*out = d
	}
	if v := f["after"]; isNull(v) {
		p.errorf(n, field+".after", "missing (required): how many refusals within `within` earn a ban")
		ok = false
	} else if a, aok := p.count(v, field+".after", ""); !aok {
		ok = false
	} else {
		pen.After = a
	}
	dur("within", true, &pen.Within)
	dur("ban", true, &pen.Ban)
	dur("max", false, &pen.Max)
	if v := f["factor"]; !isNull(v) {
		var x float64
		if v.Kind != yaml.ScalarNode || (v.ShortTag() != "!!float" && v.ShortTag() != "!!int") || v.Decode(&x) != nil {
			p.errorf(v, field+".factor", "expected a number at least 1, got %s", describe(v))
			ok = false
		} else if !(x >= 1 && x <= 1000) {
			p.errorf(v, field+".factor", "%s is not in [1, 1000]: each ban is this many times the one before", v.Value)
			ok = false
		} else {
			pen.Factor = x
		}
	}
	if !ok {
		return nil
	}
	if pen.Max == 0 {
		pen.Max = max(pen.Ban, min(16*pen.Ban, 30*24*time.Hour))
	} else if pen.Max < pen.Ban {
		p.errorf(f["max"], field+".max", "%v is shorter than ban (%v)", pen.Max, pen.Ban)
		return nil
	}
	return pen
}
