package localbucket

import (
	"archive/zip"
	"bytes"
	_ "embed"
	"errors"
	"io"
	"sync"
	"time"
)

// zoneinfoZip is the IANA time zone database, a copy of Go's
// $GOROOT/lib/time/zoneinfo.zip (update it with that file of a newer Go). Calendar
// windows read their zones from it and from nothing else: time.LoadLocation, even with
// time/tzdata linked in, prefers $ZONEINFO and the host's /usr/share/zoneinfo, so two
// hosts whose tzdata packages differ (one updated after a country changed its rules)
// computed different midnights, and in the Redis-backed modes counted one client's
// calendar window in two keys, each admitting the whole limit.
//
//go:embed zoneinfo.zip
var zoneinfoZip []byte

var zoneFiles = sync.OnceValues(func() (map[string]*zip.File, error) {
	r, err := zip.NewReader(bytes.NewReader(zoneinfoZip), int64(len(zoneinfoZip)))
	if err != nil {
		return nil, err
	}
	m := make(map[string]*zip.File, len(r.File))
	for _, f := range r.File {
		m[f.Name] = f
	}
	return m, nil
})

// errUnknownZone is LoadZone's error for a name the database does not hold.
var errUnknownZone = errors.New("unknown time zone")

// LoadZone returns the IANA time zone name from the database built into the binary,
// never the host's zoneinfo or $ZONEINFO, so every daemon computes the same calendar
// windows whatever its host's tzdata. "UTC" is time.UTC; "" and "Local" are errors.
func LoadZone(name string) (*time.Location, error) {
	if name == "UTC" {
		return time.UTC, nil
	}
	files, err := zoneFiles()
	if err != nil {
		return nil, err
	}
	f := files[name]
	if f == nil || name == "" || name == "Local" {
		return nil, errUnknownZone
	}
	rc, err := f.Open()
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, 1<<20))
	if err != nil {
		return nil, err
	}
	return time.LoadLocationFromTZData(name, data)
}
