package limiter

import (
	"fmt"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/localbucket"
	"pgregory.net/rapid"
)

// calModelZones are zones with days that do not start at 00:00 or start twice: São Paulo
// (midnight skipped, 2018), Havana (midnight twice), Santiago and Gaza (changes at
// midnight), Apia (2011-12-30 skipped whole), Lord Howe (30-minute DST), Troll (2-hour
// DST), Casablanca (DST suspended each Ramadan), Kolkata and Kathmandu (half and quarter
// hours east of UTC), southern DST zones (Sydney, Auckland, Chatham at +12:45/+13:45),
// and UTC.
var calModelZones = []string{"UTC", "America/Sao_Paulo", "America/Havana", "America/Santiago",
	"Asia/Gaza", "Pacific/Apia", "Australia/Lord_Howe", "Antarctica/Troll", "Africa/Casablanca",
	"Asia/Kolkata", "Asia/Kathmandu", "America/New_York", "Europe/Paris", "Australia/Sydney",
	"Pacific/Auckland", "Pacific/Chatham"}

// calWall is the local date and time of the instant x in loc, read as if it were UTC: a
// number that orders local times (it jumps where the zone's offset changes).
func calWall(x int64, loc *time.Location) int64 {
	t := time.Unix(0, x).In(loc)
	y, mo, d := t.Date()
	h, mi, s := t.Clock()
	return time.Date(y, mo, d, h, mi, s, t.Nanosecond(), time.UTC).UnixNano()
}

// calMidnight is README's start of the local day y-m-d in loc: the first instant whose
// local time is at or after its 00:00 (the end of a gap that skipped it; the first of two
// midnights). Found by brute force, independently of localbucket: a scan by minutes over
// the ±26 hours an offset allows (every zone changes offset on whole minutes since 1970),
// then a bisection of the minute that crosses.
func calMidnight(y int, m time.Month, d int, loc *time.Location) int64 {
	wall := time.Date(y, m, d, 0, 0, 0, 0, time.UTC).UnixNano()
	lo := wall - int64(26*time.Hour)
	for calWall(lo+int64(time.Minute), loc) < wall {
		lo += int64(time.Minute)
	}
	hi := lo + int64(time.Minute) // calWall(lo) < wall <= calWall(hi)
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if calWall(mid, loc) >= wall {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi
}

// calModelWindow is the calendar window [start, end) holding t: of the windows the unit's
// dates start (days; Mondays; 1sts), the one whose start is at or before t and whose
// next window's start is after it.
func calModelWindow(t int64, unit localbucket.Calendar, loc *time.Location) (start, end int64) {
	y, m, d := time.Unix(0, t).In(loc).Date()
	first := time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
	switch unit {
	case localbucket.Day:
		first = first.AddDate(0, 0, -1)
	case localbucket.Week:
		first = first.AddDate(0, 0, -(int(first.Weekday())+6)%7-7)
	case localbucket.Month:
		first = time.Date(y, m-1, 1, 0, 0, 0, 0, time.UTC)
	}
	next := func(u time.Time) time.Time {
		switch unit {
		case localbucket.Week:
			return u.AddDate(0, 0, 7)
		case localbucket.Month:
			return u.AddDate(0, 1, 0)
		}
		return u.AddDate(0, 0, 1)
	}
	for u := first; ; u = next(u) {
		s := calMidnight(u.Year(), u.Month(), u.Day(), loc)
		n := next(u)
		e := calMidnight(n.Year(), n.Month(), n.Day(), loc)
		if s <= t && t < e {
			return s, e
		}
		if s > t {
			panic(fmt.Sprintf("no window holds %v", time.Unix(0, t).In(loc)))
		}
	}
}

// TestCalendarAgainstAModel runs random checks (costs 0 to 4 against 3 per day, week or
// month in a zone) at random instants from 2011 to 2037, the clock stepping by minutes to
// weeks and to just before, at and after the window's end, with sweeps, against a model
// whose windows are found by brute force from README's definition (local midnights,
// weeks from Monday, months from the 1st; a skipped midnight starts the window at the
// first instant after it, a repeated one at the first). Every answer's allowed,
// remaining, reset, retry_after and window must be the model's: a fixed window of 3 per
// calendar window, all its units back at the window's end. It found the windows at the
// end of a leap year wrong in zones with DST (golang/go#81583: TestCalendarBoundaries).
func TestCalendarAgainstAModel(t *testing.T) {
	calendarAgainstAModel(t, func(yaml string) *Limiter { return newLimiter(t, yaml) })
}

// TestCalendarGlobalAgainstAModel is TestCalendarAgainstAModel in global mode, the
// windows counted on a real Redis (hybrid mode hands calendar windows to the global
// scripts), the key naming the window's start. It found the retry-after up to 1 ms
// early (TestCalendarGlobalRetryNotEarly).
func TestCalendarGlobalAgainstAModel(t *testing.T) {
	rdb := realRedis(t)
	calendarAgainstAModel(t, func(yaml string) *Limiter { return policyLimiter(t, rdb, yaml) })
}

func calendarAgainstAModel(t *testing.T, newLimiter func(yaml string) *Limiter) {
	const limit = 3
	run := 0
	rapid.Check(t, func(rt *rapid.T) {
		run++ // a rule of its own: the Redis keys of one run are not another's
		zone := rapid.SampledFrom(calModelZones).Draw(rt, "zone")
		unit := rapid.SampledFrom([]localbucket.Calendar{localbucket.Day, localbucket.Week, localbucket.Month}).Draw(rt, "unit")
		loc, err := localbucket.LoadZone(zone)
		if err != nil {
			rt.Fatal(err)
		}
		l := newLimiter(fmt.Sprintf("rules:\n  - name: q%d\n    key: user\n    limit: { requests: %d, per: %s, tz: %s }\n", run, limit, unit, zone))
		from := time.Date(2011, 12, 20, 0, 0, 0, 0, time.UTC).Unix()
		to := time.Date(2037, 1, 1, 0, 0, 0, 0, time.UTC).Unix()
		if rapid.Bool().Draw(rt, "year_end") { // where Go's ZoneBounds errs in leap years
			y := rapid.IntRange(2012, 2036).Draw(rt, "year")
			from = time.Date(y, 12, 28, 0, 0, 0, 0, time.UTC).Unix()
			to = from + 6*24*3600
		}
		now := rapid.Int64Range(from, to).Draw(rt, "start")*int64(time.Second) +
			rapid.SampledFrom([]int64{0, 1, int64(time.Second) - 1}).Draw(rt, "ns")
		type window struct{ start, end, count int64 }
		keys := map[string]*window{}
		for step := rapid.IntRange(1, 40).Draw(rt, "steps"); step > 0; step-- {
			switch rapid.IntRange(0, 5).Draw(rt, "op") {
			case 0, 1: // check
				user := rapid.SampledFrom([]string{"ann", "bob"}).Draw(rt, "user")
				cost := rapid.Uint64Range(0, limit+1).Draw(rt, "cost")
				w := keys[user]
				if w == nil || now >= w.end {
					s, e := calModelWindow(now, unit, loc)
					w = &window{start: s, end: e}
					keys[user] = w
				}
				var want localbucket.Result
				switch {
				case cost > limit:
				case int64(max(cost, 1)) <= limit-w.count:
					want.Allowed = true
					w.count += int64(cost)
				default:
					want.RetryAfter = w.end - now
				}
				want.Remaining = uint64(limit - w.count)
				if w.count > 0 {
					want.Reset = w.end - now
				}
				var d Decision
				if err := l.Check(now, &Input{Attrs: attrs("user=" + user), Cost: cost}, &d); err != nil {
					rt.Fatal(err)
				}
				r := d.Results[0]
				// As the wire has them, in ms rounded up (global mode's scripts count in µs).
				if r.Allowed != want.Allowed || r.Remaining != want.Remaining || CeilMs(r.Reset) != CeilMs(time.Duration(want.Reset)) ||
					CeilMs(r.RetryAfter) != CeilMs(time.Duration(want.RetryAfter)) || r.Window != unit.Nominal() || r.Impossible != (cost > limit) {
					rt.Fatalf("%s cost %d at %v (window %v to %v, %d taken): allowed %v remaining %d reset %v retry %v window %v, model %v %d %v %v",
						user, cost, time.Unix(0, now).In(loc), time.Unix(0, w.start).In(loc), time.Unix(0, w.end).In(loc), w.count,
						r.Allowed, r.Remaining, r.Reset, r.RetryAfter, r.Window,
						want.Allowed, want.Remaining, time.Duration(want.Reset), time.Duration(want.RetryAfter))
				}
			case 2:
				l.Sweep(now)
			case 3: // to the end of a key's window
				user := rapid.SampledFrom([]string{"ann", "bob"}).Draw(rt, "at_end_of")
				if w := keys[user]; w != nil && w.end > now {
					now = w.end + rapid.Int64Range(-1, 1).Draw(rt, "off")
				}
			case 4:
				now += rapid.Int64Range(1, int64(36*time.Hour)).Draw(rt, "ns")
			case 5:
				now += rapid.Int64Range(1, int64(40*24*time.Hour)).Draw(rt, "ns")
			}
		}
	})
}
