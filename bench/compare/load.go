package main

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// A checker sends one check at a time and waits for its answer: one connection of one
// system, driven through that system's own client API. Not safe for concurrent use; the
// load generator gives each goroutine its own.
type checker interface {
	// check sends the check for the run's i-th request (keys[i] is its key) and waits.
	check(i int) error
	close()
}

// A system under test: a name for the report and a way to open connections.
type system struct {
	name string
	dial func() (checker, error)
	// pipelined, when set, runs the pipelined load (pre-encoded frames, depth requests in
	// flight on each of conns connections) for d and returns the checks answered and the
	// latency samples.
	pipelined func(conns, depth int, d time.Duration) (int, []time.Duration, error)
	// memory, when set, makes n distinct keys active and returns what they cost.
	memory func(n int) (MemoryRow, error)
}

// Row is one line of report.json's latency array.
type Row struct {
	System  string  `json:"system"`
	Conns   int     `json:"conns"`
	Depth   int     `json:"depth"`
	Load    string  `json:"load"` // "closed" (as fast as answers come) or "open@NN%" (fixed arrival rate)
	P50us   float64 `json:"p50_us"`
	P99us   float64 `json:"p99_us"`
	P999us  float64 `json:"p999_us"`
	OpsPerS float64 `json:"ops_per_s"`
	Errors  int64   `json:"errors"`
}

func pct(d []time.Duration, p float64) float64 {
	if len(d) == 0 {
		return 0
	}
	i := int(p * float64(len(d)-1))
	return float64(d[i]) / float64(time.Microsecond)
}

func makeRow(sys string, conns, depth int, load string, lat []time.Duration, n int, errs int64, elapsed time.Duration) Row {
	slices.Sort(lat)
	return Row{System: sys, Conns: conns, Depth: depth, Load: load, P50us: pct(lat, 0.50), P99us: pct(lat, 0.99),
		P999us: pct(lat, 0.999), OpsPerS: float64(n) / elapsed.Seconds(), Errors: errs}
}

// keys is the run's traffic: key indexes drawn from Zipf over nkeys keys, with every
// hotEvery-th request going to one of a few hot keys. Precomputed so drawing costs nothing
// during the measurement.
type keys []int

func makeKeys(n, nkeys int) keys {
	rng := rand.New(rand.NewPCG(42, 7))
	z := rand.NewZipf(rng, 1.1, 1, uint64(nkeys-1))
	ks := make(keys, n)
	for i := range ks {
		if i%10 == 0 {
			ks[i] = i / 10 % 4 // four hot keys take a tenth of the traffic
		} else {
			ks[i] = int(z.Uint64())
		}
	}
	return ks
}

// closedLoop runs conns goroutines, each with its own checker, each sending its next check
// when the last is answered, for d. It returns a row.
func closedLoop(s *system, ks keys, conns int, d time.Duration) (Row, error) {
	cs := make([]checker, conns)
	for i := range cs {
		c, err := s.dial()
		if err != nil {
			for _, c := range cs[:i] {
				c.close()
			}
			return Row{}, fmt.Errorf("%s: connection %d: %w", s.name, i, err)
		}
		cs[i] = c
	}
	defer func() {
		for _, c := range cs {
			c.close()
		}
	}()
	var (
		wg    sync.WaitGroup
		errs  atomic.Int64
		total atomic.Int64
		mu    sync.Mutex
		all   []time.Duration
		stop  atomic.Bool
	)
	start := time.Now()
	for g, c := range cs {
		wg.Go(func() {
			lat := make([]time.Duration, 0, 1<<16)
			n := 0
			for k := g * 7919; !stop.Load(); k++ {
				t := time.Now()
				if err := c.check(k % len(ks)); err != nil {
					errs.Add(1)
					if errs.Load() > 100 {
						return
					}
					continue
				}
				lat = append(lat, time.Since(t))
				n++
			}
			total.Add(int64(n))
			mu.Lock()
			all = append(all, lat...)
			mu.Unlock()
		})
	}
	time.Sleep(d)
	stop.Store(true)
	wg.Wait()
	elapsed := time.Since(start)
	if errs.Load() > 100 {
		return Row{}, fmt.Errorf("%s: more than 100 failed checks", s.name)
	}
	return makeRow(s.name, conns, 1, "closed", all, int(total.Load()), errs.Load(), elapsed), nil
}

// openLoop sends checks at a fixed arrival rate for d over a pool of conns checkers and
// measures each check's latency from the moment it was due, not from when a checker got to
// send it: a stalled server is charged for every arrival it delayed (no coordinated
// omission, as k6's constant-arrival-rate executor measures).
func openLoop(s *system, ks keys, conns int, rate float64, d time.Duration, load string) (Row, error) {
	cs := make([]checker, conns)
	for i := range cs {
		c, err := s.dial()
		if err != nil {
			for _, c := range cs[:i] {
				c.close()
			}
			return Row{}, fmt.Errorf("%s: connection %d: %w", s.name, i, err)
		}
		cs[i] = c
	}
	defer func() {
		for _, c := range cs {
			c.close()
		}
	}()
	n := int(rate * d.Seconds())
	due := make(chan time.Time, n)
	var (
		wg   sync.WaitGroup
		errs atomic.Int64
		mu   sync.Mutex
		all  = make([]time.Duration, 0, n)
	)
	for g, c := range cs {
		wg.Go(func() {
			lat := make([]time.Duration, 0, n/conns+1)
			k := g * 7919
			for t := range due {
				if err := c.check(k % len(ks)); err != nil {
					errs.Add(1)
				} else {
					lat = append(lat, time.Since(t))
				}
				k++
			}
			mu.Lock()
			all = append(all, lat...)
			mu.Unlock()
		})
	}
	start := time.Now()
	interval := time.Duration(float64(time.Second) / rate)
	for i := 0; i < n; {
		now := time.Now()
		// Release every arrival that is due; sleep until the next one.
		for ; i < n; i++ {
			at := start.Add(time.Duration(i) * interval)
			if at.After(now) {
				time.Sleep(at.Sub(now))
				break
			}
			due <- at
		}
	}
	close(due)
	wg.Wait()
	elapsed := time.Since(start)
	return makeRow(s.name, conns, 1, load, all, len(all), errs.Load(), elapsed), nil
}
