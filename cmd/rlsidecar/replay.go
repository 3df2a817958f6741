package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"time"

	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
)

// traceLine is one request of a trace: virtual time in ms, attributes, cost (default 1).
type traceLine struct {
	TMs   *int64            `json:"t_ms"`
	Attrs map[string]string `json:"attrs"`
	Cost  *uint64           `json:"cost"`
}

type ruleSummary struct {
	Name           string `json:"name"`
	Matched        uint64 `json:"matched"`
	Allowed        uint64 `json:"allowed"`
	Rejected       uint64 `json:"rejected"`
	ShadowRejected uint64 `json:"shadow_rejected"`
	Decided        uint64 `json:"decided_rejections"`
}

type replaySummary struct {
	Requests   uint64 `json:"requests"`
	Allowed    uint64 `json:"allowed"`
	Rejected   uint64 `json:"rejected"`
	Unmatched  uint64 `json:"unmatched"`
	DurationMs int64  `json:"duration_ms"`
	// OutOfOrder counts the lines whose t_ms is before an earlier line's (a trace merged
	// from several gateways' logs): each is replayed at the latest time seen, as the
	// daemon, whose clock only moves forward, would have seen it. MaxLateMs is the most
	// such a line was moved.
	OutOfOrder uint64         `json:"out_of_order,omitempty"`
	MaxLateMs  int64          `json:"max_late_ms,omitempty"`
	Rules      []*ruleSummary `json:"rules"`
}

func replay(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("replay", stderr)
	config := fs.String("config", "", "rules file (YAML), or a directory whose *.yaml and *.yml files are one rule set; empty: the built-in example rules")
	trace := fs.String("trace", "", `JSON-lines trace, one request a line: {"t_ms": 990, "attrs": {...}, "cost": 1} ("-": stdin)`)
	if err := noPositional(fs, args); err != nil {
		return err
	}
	if *trace == "" {
		return fmt.Errorf("%w: --trace is required", errUsage)
	}
	set := rules.Default()
	if *config != "" {
		var err error
		if set, err = rules.Load(*config); err != nil {
			return err
		}
	}
	var in io.Reader = os.Stdin
	if *trace != "-" {
		f, err := os.Open(*trace)
		if err != nil {
			return err
		}
		defer f.Close()
		in = f
	}
	sum, err := runReplay(set, in, *trace)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(sum)
}

// runReplay runs every trace line through the rules, in local mode, on a store of its
// own, at the line's virtual time (t_ms after the Unix epoch, so windows align with
// whole seconds of the trace).
func runReplay(set *rules.Set, in io.Reader, name string) (*replaySummary, error) {
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{}))
	sum := &replaySummary{}
	byName := map[string]*ruleSummary{}
	for _, r := range set.Rules {
		rs := &ruleSummary{Name: r.Name}
		byName[r.Name] = rs
		sum.Rules = append(sum.Rules, rs)
	}
	var (
		input    limiter.Input
		d        limiter.Decision
		first    = true
		tMin     int64
		tMax     int64
		lineNo   int
		attrKeys []string
	)
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		lineNo++
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		var tl traceLine
		dec := json.NewDecoder(bytes.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&tl); err != nil {
			return nil, fmt.Errorf("%s:%d: %v", name, lineNo, err)
		}
		if tl.TMs == nil {
			return nil, fmt.Errorf("%s:%d: t_ms is required", name, lineNo)
		}
		t := *tl.TMs
		if first || t < tMin {
			tMin = t
		}
		if first || t > tMax {
			tMax = t
		} else if t < tMax {
			sum.OutOfOrder++
			sum.MaxLateMs = max(sum.MaxLateMs, tMax-t)
			t = tMax
		}
		first = false
		attrKeys = attrKeys[:0]
		for k := range tl.Attrs {
			attrKeys = append(attrKeys, k)
		}
		sort.Strings(attrKeys)
		input.Attrs = input.Attrs[:0]
		for _, k := range attrKeys {
			input.Attrs = append(input.Attrs, rules.Attr{Name: k, Value: tl.Attrs[k]})
		}
		input.Cost = 1
		if tl.Cost != nil {
			input.Cost = *tl.Cost
		}
		if err := lim.Check(t*int64(time.Millisecond), &input, &d); err != nil {
			return nil, fmt.Errorf("%s:%d: %v", name, lineNo, err)
		}
		if tok := lim.LeaseToken(&d); tok != "" {
			// A log has no request durations: each request releases its lease at once.
			lim.ReleaseLease(tok, t*int64(time.Millisecond))
		}
		sum.Requests++
		if d.Allowed {
			sum.Allowed++
		} else {
			sum.Rejected++
		}
		if len(d.Results) == 0 {
			sum.Unmatched++
		}
		for i, r := range d.Results {
			rs := byName[r.Name]
			rs.Matched++
			switch {
			case r.Allowed:
				rs.Allowed++
			case r.Shadow:
				rs.ShadowRejected++
			default:
				rs.Rejected++
			}
			if !d.Allowed && i == d.Deciding {
				rs.Decided++
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading %s: %w", name, err)
	}
	sum.DurationMs = tMax - tMin
	return sum, nil
}
