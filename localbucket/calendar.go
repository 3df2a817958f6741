package localbucket

import (
	"errors"
	"fmt"
	"hash/fnv"
	"sync/atomic"
	"time"
)

// Calendar is the unit of a calendar window: a fixed window whose boundaries are local
// midnights in a time zone. The zero value, NoCalendar, is a window of fixed length.
type Calendar uint8

const (
	NoCalendar Calendar = iota
	Day                 // from one local midnight to the next
	Week                // from a Monday's local midnight to the next Monday's
	Month               // from the 1st's local midnight to the next 1st's
)

var calendarNames = [...]string{NoCalendar: "", Day: "day", Week: "week", Month: "month"}

// ParseCalendar returns the unit named s ("day", "week" or "month"); ok is false for
// anything else.
func ParseCalendar(s string) (c Calendar, ok bool) {
	for u := Day; u <= Month; u++ {
		if calendarNames[u] == s {
			return u, true
		}
	}
	return NoCalendar, false
}

// String returns "day", "week" or "month", or "" for NoCalendar.
func (c Calendar) String() string {
	if int(c) < len(calendarNames) {
		return calendarNames[c]
	}
	return fmt.Sprintf("Calendar(%d)", uint8(c))
}

// Nominal is a unit's nominal length, reported as a calendar limit's Window: a day is
// 24h (23h or 25h across a DST change), a week 7 days, a month 31 days (its longest).
func (c Calendar) Nominal() time.Duration {
	switch c {
	case Week:
		return 7 * 24 * time.Hour
	case Month:
		return 31 * 24 * time.Hour
	}
	return 24 * time.Hour
}

// calendar is a calendar limit's unit and zone, and the window last computed, shared by
// the copies of the Limit (it is immutable but for the cache, which is safe for
// concurrent use).
type calendar struct {
	unit Calendar
	loc  *time.Location
	kind uint64 // stateKind: the unit and a hash of the zone's name
	last atomic.Pointer[calWindow]
}

type calWindow struct{ start, end int64 }

// NewCalendarLimit builds a fixed-window limit of requests per calendar unit in loc (nil
// means UTC; load it with LoadZone, so that every host agrees on it): windows start at
// local midnight (on Mondays for a week, on the 1st for a month). Where a midnight does not exist (a DST gap) the window starts at the first
// instant after it; where it happens twice, at the first. requests must be in
// [1, 2^32-1].
func NewCalendarLimit(requests uint64, unit Calendar, loc *time.Location) (Limit, error) {
	if unit < Day || unit > Month {
		return Limit{}, errors.New("calendar unit must be day, week or month")
	}
	if loc == nil {
		loc = time.UTC
	}
	l, err := NewLimit(FixedWindow, requests, unit.Nominal(), 0)
	if err != nil {
		return Limit{}, err
	}
	h := fnv.New32a()
	h.Write([]byte(loc.String()))
	l.cal = &calendar{unit: unit, loc: loc, kind: 5 | uint64(unit)<<3 | uint64(h.Sum32())<<8}
	l.kind = l.cal.kind
	return l, nil
}

// Calendar returns l's calendar unit and zone; NoCalendar and nil for a window of fixed
// length.
func (l *Limit) Calendar() (Calendar, *time.Location) {
	if l.cal == nil {
		return NoCalendar, nil
	}
	return l.cal.unit, l.cal.loc
}

// fixedBounds returns the fixed window [start, end) that holds t.
func (l *Limit) fixedBounds(t int64) (start, end int64) {
	if l.cal != nil {
		return l.cal.bounds(t)
	}
	start = alignDown(t, l.window)
	return start, start + l.window
}

// bounds returns the calendar window [start, end) that holds t: the cached one when t
// is in it (a window changes once a day at most), else computed and cached.
func (c *calendar) bounds(t int64) (start, end int64) {
	if w := c.last.Load(); w != nil && w.start <= t && t < w.end {
		return w.start, w.end
	}
	start, end = c.compute(t)
	c.last.Store(&calWindow{start, end})
	return start, end
}

// compute finds the window holding t from its local date.
func (c *calendar) compute(t int64) (start, end int64) {
	y, m, d := time.Unix(0, t).In(c.loc).Date()
	switch c.unit {
	case Week:
		d -= (int(time.Date(y, m, d, 0, 0, 0, 0, time.UTC).Weekday()) + 6) % 7
	case Month:
		d = 1
	}
	for {
		start = c.midnight(y, m, d)
		ny, nm, nd := y, m, d
		switch c.unit {
		case Day:
			nd++
		case Week:
			nd += 7
		case Month:
			nm++
		}
		ny, nm, nd = time.Date(ny, nm, nd, 0, 0, 0, 0, time.UTC).Date()
		end = c.midnight(ny, nm, nd)
		if t < end {
			return start, end
		}
		// t's local date is before its window's: a midnight that happened twice (the
		// clock went back across it) and t is after the first.
		y, m, d = ny, nm, nd
	}
}

// midnight returns the first instant whose local time is at or after 00:00 on y-m-d:
// the midnight, or the end of a DST gap that skipped it; the first of two midnights.
func (c *calendar) midnight(y int, m time.Month, d int) int64 {
	wall := time.Date(y, m, d, 0, 0, 0, 0, time.UTC).UnixNano() // local midnight read as UTC
	// Local time rises within each zone period, so the answer is, in the first period
	// that has one, the first instant there whose local time reaches wall. Offsets are
	// within ±26h: start two days early, where every local time is before wall.
	x := wall - int64(48*time.Hour)
	for range 16 {
		lt := time.Unix(0, x).In(c.loc)
		_, off := lt.Zone()
		_, e := lt.ZoneBounds()
		if !e.IsZero() && e.UnixNano() <= x {
			// Go's ZoneBounds (golang/go#81583): where a zone's POSIX TZ rule serves a
			// leap year (past its last written transition: since 2007 in New York), the
			// year's last period ends 365 days after the year began, at 00:00 UTC on
			// December 31, before x. It ends at the next year's start, with no change
			// of offset. Before, the search stalled there and returned wall read as
			// UTC: in New York December 30 ended at 19:00, and so did December 31
			// and December, in every leap year; in Paris December 31 ended at 01:00.
			e = time.Date(time.Unix(0, x).UTC().Year()+1, 1, 1, 0, 0, 0, 0, time.UTC)
		}
		cand := max(x, wall-int64(off)*int64(time.Second))
		if e.IsZero() || cand < e.UnixNano() {
			return cand
		}
		x = e.UnixNano()
	}
	return wall // unreachable for real zones: at most a few transitions in four days
}

// CalendarBounds returns the calendar window [start, end) that holds the wall time t (ns
// since the Unix epoch); ok is false for a limit that is not a calendar window. The
// Redis-backed modes name the window by its start in the key, so every daemon counts it
// in one place.
func (l *Limit) CalendarBounds(t int64) (start, end int64, ok bool) {
	if l.cal == nil {
		return 0, 0, false
	}
	start, end = l.cal.bounds(t)
	return start, end, true
}
