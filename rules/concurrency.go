package rules

import (
	"time"

	"go.yaml.in/yaml/v3"
)

// A concurrency rule (concurrency: { max: N, lease: DURATION }) limits the requests in
// flight instead of their rate: an allowed request holds one of max slots until it is
// released, or until its lease runs out. Its Rule has Concurrency set, Requests = max and
// Per = the lease; its limit (and each plan's) is a token bucket of max per lease, which
// the limiter's lease store reads as max slots held for lease each. Plans and split apply
// to max as they apply to requests.

// DefaultLease is a concurrency rule's lease when the rule gives none.
const DefaultLease = 30 * time.Second

// MaxLease is the longest lease a concurrency rule may give.
const MaxLease = time.Hour

var concurrencyFields = []string{"max", "lease"}

// concurrency reads concurrency: {max, lease} into r; ok when both are valid.
func (p *parser) concurrency(r *Rule, n *yaml.Node, field string) bool {
	r.Concurrency = true
	f, ok := p.mapping(n, field, concurrencyFields)
	if f == nil {
		return false
	}
	if v := f["max"]; isNull(v) {
		p.errorf(n, field+".max", "missing (required): how many requests may be in flight at once")
		ok = false
	} else {
		var mok bool
		r.Requests, mok = p.count(v, field+".max", "")
		ok = ok && mok
	}
	r.Per = DefaultLease
	if v := f["lease"]; !isNull(v) {
		s, sok := p.str(v, field+".lease")
		switch {
		case !sok:
			ok = false
		default:
			d, msg := parsePer(s)
			switch {
			case msg != "":
				p.errorf(v, field+".lease", "%s", msg)
				ok = false
			case d > MaxLease:
				p.errorf(v, field+".lease", "%q is longer than the longest lease, 1h; renew a long request's lease instead", s)
				ok = false
			default:
				r.Per = d
			}
		}
	}
	return ok
}
