package localbucket

import (
	"testing"
	"time"
)

// TestCalendarBoundaries checks calendar windows at instants around DST changes, leap
// days and year ends, on an injected clock (the instant given), against boundaries
// written out by hand from the zones' published rules.
func TestCalendarBoundaries(t *testing.T) {
	tests := []struct {
		name       string
		zone       string
		unit       Calendar
		at         string // RFC 3339, the instant decided at
		start, end string // RFC 3339, the window holding it
	}{
		// São Paulo, 2018-11-04: clocks went from 00:00 to 01:00; midnight did not exist.
		{"sao paulo gap: the day starts at 01:00", "America/Sao_Paulo", Day, "2018-11-04T12:00:00-02:00", "2018-11-04T01:00:00-02:00", "2018-11-05T00:00:00-02:00"},
		{"sao paulo gap: the day before ends at 01:00", "America/Sao_Paulo", Day, "2018-11-03T23:59:59-03:00", "2018-11-03T00:00:00-03:00", "2018-11-04T01:00:00-02:00"},
		{"sao paulo gap: the first instant of the day", "America/Sao_Paulo", Day, "2018-11-04T01:00:00-02:00", "2018-11-04T01:00:00-02:00", "2018-11-05T00:00:00-02:00"},
		{"sao paulo month of the gap", "America/Sao_Paulo", Month, "2018-11-30T23:00:00-02:00", "2018-11-01T00:00:00-03:00", "2018-12-01T00:00:00-02:00"},
		// New York: 2026-03-08 has 23 hours, 2026-11-01 has 25.
		{"new york spring forward", "America/New_York", Day, "2026-03-08T03:30:00-04:00", "2026-03-08T00:00:00-05:00", "2026-03-09T00:00:00-04:00"},
		{"new york fall back, first 01:30", "America/New_York", Day, "2026-11-01T01:30:00-04:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00"},
		{"new york fall back, second 01:30", "America/New_York", Day, "2026-11-01T01:30:00-05:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00"},
		{"new york last instant of the long day", "America/New_York", Day, "2026-11-01T23:59:59.999-05:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00"},
		// Lord Howe: DST is 30 minutes; 2026-10-04 02:00 → 02:30, 2026-04-05 02:00 → 01:30.
		{"lord howe spring", "Australia/Lord_Howe", Day, "2026-10-04T12:00:00+11:00", "2026-10-04T00:00:00+10:30", "2026-10-05T00:00:00+11:00"},
		{"lord howe autumn", "Australia/Lord_Howe", Day, "2026-04-05T01:45:00+10:30", "2026-04-05T00:00:00+11:00", "2026-04-06T00:00:00+10:30"},
		// Havana ends DST at 01:00 back to 00:00: midnight happens twice; the first counts.
		{"havana repeated midnight, first", "America/Havana", Day, "2026-11-01T00:30:00-04:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00"},
		{"havana repeated midnight, second", "America/Havana", Day, "2026-11-01T00:10:00-05:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00"},
		{"havana day before", "America/Havana", Day, "2026-10-31T23:59:59-04:00", "2026-10-31T00:00:00-04:00", "2026-11-01T00:00:00-04:00"},
		// February 29.
		{"leap day", "UTC", Day, "2028-02-29T12:00:00Z", "2028-02-29T00:00:00Z", "2028-03-01T00:00:00Z"},
		{"leap february", "UTC", Month, "2028-02-29T23:59:59Z", "2028-02-01T00:00:00Z", "2028-03-01T00:00:00Z"},
		{"plain february", "Europe/Paris", Month, "2027-02-15T00:00:00+01:00", "2027-02-01T00:00:00+01:00", "2027-03-01T00:00:00+01:00"},
		{"leap week", "UTC", Week, "2028-02-29T00:00:00Z", "2028-02-28T00:00:00Z", "2028-03-06T00:00:00Z"},
		// The end of a leap year in zones whose rules Go's zoneinfo.zip gives as a POSIX TZ
		// string (golang/go#81583: ZoneBounds ends that year's last period on December
		// 31 at 00:00 UTC). Before, in New York December 30 ended at 19:00, December 31
		// ran from then to 19:00 on the 31st, when December ended too; Paris's December
		// 31 lasted until 01:00, Sydney's January 1 began at 11:00.
		{"new york, the day before a leap year's last", "America/New_York", Day, "2028-12-30T12:00:00-05:00", "2028-12-30T00:00:00-05:00", "2028-12-31T00:00:00-05:00"},
		{"new york, a leap year's last day", "America/New_York", Day, "2028-12-31T12:00:00-05:00", "2028-12-31T00:00:00-05:00", "2029-01-01T00:00:00-05:00"},
		{"new york, a leap year's december", "America/New_York", Month, "2028-12-31T20:00:00-05:00", "2028-12-01T00:00:00-05:00", "2029-01-01T00:00:00-05:00"},
		{"new york, january after a leap year", "America/New_York", Month, "2029-01-01T00:00:00-05:00", "2029-01-01T00:00:00-05:00", "2029-02-01T00:00:00-05:00"},
		{"paris, a leap year's last day", "Europe/Paris", Day, "2024-12-31T12:00:00+01:00", "2024-12-31T00:00:00+01:00", "2025-01-01T00:00:00+01:00"},
		{"sydney, the first day after a leap year", "Australia/Sydney", Day, "2029-01-01T05:00:00+11:00", "2029-01-01T00:00:00+11:00", "2029-01-02T00:00:00+11:00"},
		{"santiago, a leap year's last week", "America/Santiago", Week, "2024-12-31T12:00:00-03:00", "2024-12-30T00:00:00-03:00", "2025-01-06T00:00:00-03:00"},
		// Weeks start on Monday, across a year end.
		{"week across a year end, thursday", "Europe/Berlin", Week, "2026-12-31T10:00:00+01:00", "2026-12-28T00:00:00+01:00", "2027-01-04T00:00:00+01:00"},
		{"week across a year end, sunday night", "Europe/Berlin", Week, "2027-01-03T23:59:59+01:00", "2026-12-28T00:00:00+01:00", "2027-01-04T00:00:00+01:00"},
		{"week across a year end, monday", "Europe/Berlin", Week, "2027-01-04T00:00:00+01:00", "2027-01-04T00:00:00+01:00", "2027-01-11T00:00:00+01:00"},
		{"week holding a DST change", "America/New_York", Week, "2026-03-08T12:00:00-04:00", "2026-03-02T00:00:00-05:00", "2026-03-09T00:00:00-04:00"},
		{"month across a year end", "Asia/Tokyo", Month, "2026-12-31T23:59:59+09:00", "2026-12-01T00:00:00+09:00", "2027-01-01T00:00:00+09:00"},
		{"month in a zone east of UTC, on the 1st", "Asia/Kolkata", Month, "2027-01-01T00:00:00+05:30", "2027-01-01T00:00:00+05:30", "2027-02-01T00:00:00+05:30"},
	}
	parse := func(s string) int64 {
		v, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			t.Fatal(err)
		}
		return v.UnixNano()
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			loc, err := LoadZone(tt.zone)
			if err != nil {
				t.Fatal(err)
			}
			lim, err := NewCalendarLimit(3, tt.unit, loc)
			if err != nil {
				t.Fatal(err)
			}
			at, start, end := parse(tt.at), parse(tt.start), parse(tt.end)
			if s, e := lim.fixedBounds(at); s != start || e != end {
				t.Fatalf("window [%v, %v), want [%v, %v)", time.Unix(0, s).In(loc), time.Unix(0, e).In(loc), tt.start, tt.end)
			}
			// Through Take: reset and retry-after count to the next boundary, and a new
			// window starts empty at it.
			var st State
			var r Result
			for range 3 {
				st, r = lim.Take(st, at, 1)
			}
			if !r.Allowed || r.Reset != end-at || r.Expires != end {
				t.Fatalf("third take: %+v, want allowed, reset %v", r, time.Duration(end-at))
			}
			if _, r = lim.Take(st, at, 1); r.Allowed || r.RetryAfter != end-at {
				t.Fatalf("fourth take: %+v, want refused, retry after %v", r, time.Duration(end-at))
			}
			if _, r = lim.Take(st, end-1, 1); r.Allowed {
				t.Fatal("allowed 1ns before the boundary")
			}
			if _, r = lim.Take(st, end, 1); !r.Allowed || r.Remaining != 2 {
				t.Fatalf("at the boundary: %+v, want allowed with 2 left", r)
			}
		})
	}
}

func TestCalendarLimit(t *testing.T) {
	if _, err := NewCalendarLimit(10, NoCalendar, nil); err == nil {
		t.Fatal("NoCalendar accepted")
	}
	if _, err := NewCalendarLimit(0, Day, nil); err == nil {
		t.Fatal("0 requests accepted")
	}
	utc, _ := NewCalendarLimit(10, Day, nil)
	if u, loc := utc.Calendar(); u != Day || loc != time.UTC {
		t.Fatalf("Calendar() = %v %v", u, loc)
	}
	paris, _ := LoadZone("Europe/Paris")
	p, _ := NewCalendarLimit(10, Day, paris)
	fixed, _ := NewLimit(FixedWindow, 10, 24*time.Hour, 0)
	if utc.stateKind() == p.stateKind() || utc.stateKind() == fixed.stateKind() {
		t.Fatal("a state of another zone or of a plain window would be read as this one's")
	}
	half, err := p.WithRequests(5, 0)
	if err != nil {
		t.Fatal(err)
	}
	if u, loc := half.Calendar(); u != Day || loc != paris || half.Requests() != 5 {
		t.Fatalf("WithRequests lost the calendar: %v %v %d", u, loc, half.Requests())
	}
	for _, s := range []string{"day", "week", "month"} {
		if c, ok := ParseCalendar(s); !ok || c.String() != s {
			t.Fatalf("ParseCalendar(%q) = %v %v", s, c, ok)
		}
	}
	if _, ok := ParseCalendar("1d"); ok {
		t.Fatal(`"1d" parsed as a calendar unit`)
	}
}

// TestCalendarOnMonotonicClock: the daemon gives the store a monotonic now and the wall
// clock's offset from it; a calendar window still ends at the zone's wall midnight, and
// the instants the store keeps are on the monotonic clock.
func TestCalendarOnMonotonicClock(t *testing.T) {
	paris, err := LoadZone("Europe/Paris")
	if err != nil {
		t.Fatal(err)
	}
	lim, err := NewCalendarLimit(2, Day, paris)
	if err != nil {
		t.Fatal(err)
	}
	wall := time.Date(2026, 3, 29, 23, 0, 0, 0, paris).UnixNano() // an hour before midnight, the day DST began
	const mono = int64(5 * time.Second)                           // the monotonic clock: seconds since start
	s := NewStore(Options{Shards: 1})
	s.SetWallOffset(wall - mono)
	ops := []Op{{Key: []byte("daily:{ip=a}"), Limit: &lim, Cost: 2}}
	if !s.Apply(mono, ops) || ops[0].Result.Reset != int64(time.Hour) || ops[0].Result.Expires != mono+int64(time.Hour) {
		t.Fatalf("first: %+v, want allowed, reset 1h, expiring 1h from now on the monotonic clock", ops[0].Result)
	}
	ops[0].Cost = 1
	if s.Apply(mono+int64(59*time.Minute), ops) || ops[0].Result.RetryAfter != int64(time.Minute) {
		t.Fatalf("59m later: %+v, want refused, retry after 1m", ops[0].Result)
	}
	if !s.Apply(mono+int64(time.Hour), ops) || ops[0].Result.Remaining != 1 {
		t.Fatalf("at midnight: %+v, want allowed in a new day", ops[0].Result)
	}
}

// TestLoadZone: zones come from the database built in; "UTC" is time.UTC; "", "Local",
// paths and unknown names are errors.
func TestLoadZone(t *testing.T) {
	if l, err := LoadZone("UTC"); err != nil || l != time.UTC {
		t.Fatalf("UTC: %v %v", l, err)
	}
	l, err := LoadZone("America/Sao_Paulo")
	if err != nil || l.String() != "America/Sao_Paulo" {
		t.Fatalf("America/Sao_Paulo: %v %v", l, err)
	}
	if _, off := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC).In(l).Zone(); off != -3*3600 {
		t.Fatalf("America/Sao_Paulo offset %d in December 2026", off)
	}
	for _, bad := range []string{"", "Local", "Mars/Olympus", "/etc/localtime", "../zoneinfo.zip", "America", "America/"} {
		if l, err := LoadZone(bad); err == nil {
			t.Errorf("%q loaded as %v", bad, l)
		}
	}
}
