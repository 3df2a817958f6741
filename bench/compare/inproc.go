package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"github.com/rlsidecar/rlsidecar/proto"
)

// inProcessRate is the in-process lower bound: a map of golang.org/x/time/rate limiters,
// one per key, behind a mutex, as an application would hold them, checked by conns
// goroutines for d. No socket, no decoding.
func inProcessRate(ks keys, conns int, d time.Duration) Row {
	var (
		mu    sync.Mutex
		lims  = map[int]*rate.Limiter{}
		stop  atomic.Bool
		total atomic.Int64
		wg    sync.WaitGroup
		amu   sync.Mutex
		all   []time.Duration
	)
	allow := func(k int) bool {
		mu.Lock()
		l := lims[k]
		if l == nil {
			l = rate.NewLimiter(rate.Limit(1e9/3600.0), 1e9)
			lims[k] = l
		}
		mu.Unlock()
		return l.Allow()
	}
	start := time.Now()
	for g := 0; g < conns; g++ {
		wg.Go(func() {
			lat := make([]time.Duration, 0, 1<<16)
			n := 0
			for i := g * 7919; !stop.Load(); i++ {
				if n%64 == 0 { // sample: time.Now costs as much as the check
					t := time.Now()
					allow(ks[i%len(ks)])
					lat = append(lat, time.Since(t))
				} else {
					allow(ks[i%len(ks)])
				}
				n++
			}
			total.Add(int64(n))
			amu.Lock()
			all = append(all, lat...)
			amu.Unlock()
		})
	}
	time.Sleep(d)
	stop.Store(true)
	wg.Wait()
	return makeRow("x-time-rate", conns, 1, "closed", all, int(total.Load()), 0, time.Since(start))
}

// rlsidecarMemory starts a fresh daemon, makes n distinct users active (one key each
// under the one rule) and returns the growth of its RSS per key.
func rlsidecarMemory(dir string, n int) (MemoryRow, error) {
	sub, err := os.MkdirTemp(dir, "mem")
	if err != nil {
		return MemoryRow{}, err
	}
	for _, b := range []string{"rlsidecar"} {
		if err := os.Link(filepath.Join(dir, b), filepath.Join(sub, b)); err != nil {
			return MemoryRow{}, err
		}
	}
	p, socket, err := startRlsidecar(sub)
	if err != nil {
		return MemoryRow{}, err
	}
	defer p.stop()
	before, err := p.rssKB()
	if err != nil {
		return MemoryRow{}, err
	}
	const batch = 1 << 14
	enc := proto.NewEncoder()
	fr := make([][]byte, 0, batch)
	for lo := 0; lo < n; lo += batch {
		fr = fr[:0]
		for k := lo; k < min(n, lo+batch); k++ {
			enc.Reset()
			enc.EncodeRequest(&proto.Request{ID: uint64(k), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "user", Value: "user-" + strconv.Itoa(k)}}})
			fr = append(fr, append([]byte(nil), enc.Bytes()...))
		}
		if err := sendAll(socket, fr); err != nil {
			return MemoryRow{}, fmt.Errorf("rlsidecar memory: %w", err)
		}
	}
	after, err := p.rssKB()
	if err != nil {
		return MemoryRow{}, err
	}
	return MemoryRow{System: "rlsidecar", Keys: n, BytesPerKey: float64(after-before) * 1024 / float64(n), Measure: "daemon RSS growth"}, nil
}

// sendAll sends every frame once over one connection, 32 in flight.
func sendAll(socket string, fr [][]byte) error {
	s, err := dialSock(socket, fr)
	if err != nil {
		return err
	}
	defer s.close()
	for lo := 0; lo < len(fr); lo += 32 {
		s.out = s.out[:0]
		hi := min(len(fr), lo+32)
		for _, f := range fr[lo:hi] {
			s.out = append(s.out, f...)
		}
		if _, err := s.c.Write(s.out); err != nil {
			return err
		}
		for range hi - lo {
			if s.buf, err = proto.ReadFrame(s.br, s.buf, 1<<20); err != nil {
				return err
			}
		}
	}
	return nil
}
