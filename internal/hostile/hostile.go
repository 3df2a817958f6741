// Package hostile is the hostile-client scenario of rlsidecar's tests and benchmarks: a
// well-behaved client beside connections writing random frames, connections that send
// half a header and stay open, and a flood of never-repeating keys. The end-to-end test
// (cmd/rlsidecar) asserts on it with loose bounds; the benchmark (bench) reports its
// figures at full size.
package hostile

import (
	"bufio"
	be "encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rlsidecar/rlsidecar/proto"
)

// Rules: every request with a user is counted per user (the key flood lands
// here); /login is 3 per hour per user, so the well-behaved client holds a limited key
// that eviction under the flood must not drop.
const Rules = `
rules:
  - name: per-user
    key: user
    limit: { requests: 1000000, per: 24h }
  - name: login
    match: { path: /login }
    key: user
    limit: { requests: 3, per: 1h }
`

// Scenario is a well-behaved client beside hostile ones: connections writing
// random frames, connections that send half a header and stay open, and a flood of
// never-repeating keys pipelined on a few connections.
type Scenario struct {
	Socket       string
	PID          int
	FrameTimeout time.Duration // the daemon's --frame-timeout
	MaxFrame     int           // the daemon's --max-frame
	GarbageConns int
	HalfOpen     int
	FloodKeys    int
	FloodConns   int
	MinDuration  time.Duration // the good client checks at least this long
	// GoodInterval is the good client's pause between two requests (a client with other
	// work to do); default 200µs.
	GoodInterval time.Duration
	// Good, when set, runs the good client instead of this process (e.g. in a process of
	// its own, as a gateway would be: then the attackers' goroutines do not delay its
	// measurements in this process's scheduler). It runs until stop is closed.
	Good func(stop <-chan struct{}) GoodResult
}

// GoodResult is what a good client measured.
type GoodResult struct {
	Lat   []time.Duration // round trips
	Errs  []string        // first few errors
	NErrs int
	// Degraded counts the answers marked degraded: decided by a rule's failure policy,
	// not by its mode (hybrid or global: Redis did not answer in time).
	Degraded int
}

// RunGoodClient runs the good client until stop is closed: the body of a good client
// run in a process of its own (see Scenario.Good).
func (s *Scenario) RunGoodClient(stop <-chan struct{}) GoodResult {
	var r GoodResult
	errs := &errList{list: &r.Errs}
	r.Lat, r.Degraded = s.goodClient(stop, errs)
	r.NErrs = errs.n
	return r
}

type Result struct {
	Lat        []time.Duration // the good client's round trips
	GoodErrs   []string        // what went wrong for the good client (first few)
	NGoodErrs  int
	Degraded   int             // the good client's answers marked degraded (GoodResult.Degraded)
	HalfClose  []time.Duration // per half-open connection: from its half header to EOF
	HalfErrs   []string
	FloodN     int // flood answers received
	FloodErrs  []string
	FloodTime  time.Duration
	GarbageOut atomic.Int64 // garbage frames written
	GarbageIn  atomic.Int64 // answers to them read
	PeakRSSMB  float64
	RSSErr     error
}

type errList struct {
	mu   sync.Mutex
	n    int
	list *[]string
}

func (e *errList) add(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.n++
	if len(*e.list) < 10 {
		*e.list = append(*e.list, fmt.Sprintf(format, args...))
	}
}

func RSSMB(pid int) (float64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			kb, err := strconv.Atoi(strings.Fields(line)[1])
			return float64(kb) / 1024, err
		}
	}
	return 0, errors.New("no VmRSS in /proc/PID/status")
}

func EncodeFrame(enc *proto.Encoder, req *proto.Request) []byte {
	enc.Reset()
	enc.EncodeRequest(req)
	return enc.Bytes()
}

func (s *Scenario) Run() *Result {
	res := &Result{}
	stop := make(chan struct{})
	var hostile, sampler, good sync.WaitGroup

	// The daemon's RSS, every 100 ms.
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			mb, err := RSSMB(s.PID)
			if err != nil {
				res.RSSErr = err
				return
			}
			res.PeakRSSMB = max(res.PeakRSSMB, mb)
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()

	// The well-behaved client starts first and stops last.
	goodDone := make(chan struct{})
	good.Add(1)
	go func() {
		defer good.Done()
		defer close(goodDone)
		run := s.RunGoodClient
		if s.Good != nil {
			run = s.Good
		}
		r := run(stop)
		res.Lat, res.GoodErrs, res.NGoodErrs, res.Degraded = r.Lat, r.Errs, r.NErrs, r.Degraded
	}()

	// Garbage frames on garbageConns connections, each reconnecting when the daemon
	// closes it (after an oversized header).
	for g := 0; g < s.GarbageConns; g++ {
		hostile.Add(1)
		go func() {
			defer hostile.Done()
			s.garbage(uint64(g), stop, res)
		}()
	}

	// Half a header, left open: the daemon must close each within the frame timeout.
	res.HalfClose = make([]time.Duration, s.HalfOpen)
	halfErrs := &errList{list: &res.HalfErrs}
	var half sync.WaitGroup
	for h := 0; h < s.HalfOpen; h++ {
		half.Add(1)
		go func() {
			defer half.Done()
			c, err := net.Dial("unix", s.Socket)
			if err != nil {
				halfErrs.add("half-open %d: dial: %v", h, err)
				return
			}
			defer c.Close()
			start := time.Now()
			if _, err := c.Write([]byte{0, 0}); err != nil {
				halfErrs.add("half-open %d: write: %v", h, err)
				return
			}
			_ = c.SetReadDeadline(start.Add(s.FrameTimeout + 10*time.Second))
			n, err := c.Read(make([]byte, 64))
			res.HalfClose[h] = time.Since(start)
			if n != 0 || !errors.Is(err, io.EOF) {
				halfErrs.add("half-open %d: want EOF, got %d bytes, %v after %s", h, n, err, res.HalfClose[h])
			}
		}()
	}

	// The key flood: floodKeys never-repeating users over floodConns pipelined connections.
	floodErrs := &errList{list: &res.FloodErrs}
	var flood sync.WaitGroup
	var floodN atomic.Int64
	floodStart := time.Now()
	for fc := 0; fc < s.FloodConns; fc++ {
		flood.Add(1)
		go func() {
			defer flood.Done()
			n, err := s.keyFlood(fc, s.FloodKeys/s.FloodConns)
			floodN.Add(int64(n))
			if err != nil {
				floodErrs.add("flood connection %d: %v", fc, err)
			}
		}()
	}
	flood.Wait()
	res.FloodTime = time.Since(floodStart)
	res.FloodN = int(floodN.Load())
	half.Wait()
	// Let the good client run its minimum, then stop everyone.
	select {
	case <-goodDone:
	case <-time.After(time.Until(floodStart.Add(s.MinDuration))):
	}
	close(stop)
	hostile.Wait()
	good.Wait()
	sampler.Wait()
	return res
}

// goodClient checks sequentially on its own key until stop: /api checks are allowed by
// per-user (limit 1,000,000), /login checks are allowed three times and then rejected
// by login (limit 3) for the rest of the hour, and every tenth request is a ping. It
// returns its round trips and how many answers were marked degraded.
func (s *Scenario) goodClient(stop <-chan struct{}, errs *errList) (lat []time.Duration, degraded int) {
	c, err := net.Dial("unix", s.Socket)
	if err != nil {
		errs.add("dial: %v", err)
		return nil, 0
	}
	defer c.Close()
	br := bufio.NewReader(c)
	enc := proto.NewEncoder()
	dec := proto.NewDecoder()
	var body []byte
	var resp proto.Response
	lat = make([]time.Duration, 0, 1<<16)
	logins := 0
	interval := s.GoodInterval
	if interval <= 0 {
		interval = 200 * time.Microsecond
	}
	for id := uint64(1); ; id++ {
		select {
		case <-stop:
			return lat, degraded
		default:
		}
		req := proto.Request{ID: id, Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{{Name: "path", Value: "/api"}, {Name: "user", Value: "good-client"}}}
		switch {
		case id%10 == 0:
			req = proto.Request{ID: id, Op: proto.OpPing, Cost: 1}
		case id%10 == 5:
			req.Attrs[0].Value = "/login"
		}
		frame := EncodeFrame(enc, &req)
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		start := time.Now()
		if _, err := c.Write(frame); err != nil {
			errs.add("request %d: write: %v", id, err)
			return lat, degraded
		}
		body, err = proto.ReadFrame(br, body, 1<<20)
		if err != nil {
			errs.add("request %d: read: %v", id, err)
			return lat, degraded
		}
		lat = append(lat, time.Since(start))
		if err := dec.DecodeResponse(body, &resp); err != nil {
			errs.add("request %d: %v", id, err)
			continue
		}
		if resp.Degraded {
			degraded++
		}
		switch {
		case resp.ID != id:
			errs.add("request %d: answer has id %d", id, resp.ID)
		case resp.IsError():
			errs.add("request %d: error %s: %s", id, resp.Err.Code, resp.Err.Message)
		case req.Op == proto.OpPing:
			if resp.Protocol != proto.Version || resp.Version == "" {
				errs.add("ping %d: %+v", id, resp)
			}
		case req.Attrs[0].Value == "/login":
			logins++
			wantAllowed := logins <= 3
			if resp.Allowed != wantAllowed || resp.Rule != "login" || resp.Limit != 3 || len(resp.Rules) != 2 ||
				(!wantAllowed && (resp.RetryAfterMs == 0 || resp.Remaining != 0)) {
				errs.add("login %d (the %dth): want allowed=%v by login (limit 3), got %+v", id, logins, wantAllowed, resp)
			}
		default:
			if !resp.Allowed || resp.Rule != "per-user" || resp.Limit != 1_000_000 || resp.Remaining >= 1_000_000 || len(resp.Rules) != 1 {
				errs.add("check %d: want allowed by per-user (limit 1000000), got %+v", id, resp)
			}
		}
		time.Sleep(interval) // a client with other work to do
	}
}

// garbage writes bursts of random frames — random lengths, some above the maximum,
// random bodies, some starting like a msgpack map — and drains the answers.
func (s *Scenario) garbage(seed uint64, stop <-chan struct{}, res *Result) {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	// Bodies are random windows of one random pool: random bytes, cheap to produce.
	pool := make([]byte, 256<<10)
	for i := range pool {
		pool[i] = byte(rng.Uint32())
	}
	buf := make([]byte, 0, 64<<10)
	for {
		select {
		case <-stop:
			return
		default:
		}
		c, err := net.Dial("unix", s.Socket)
		if err != nil {
			time.Sleep(10 * time.Millisecond)
			continue
		}
		drained := make(chan struct{})
		go func() {
			defer close(drained)
			br := bufio.NewReader(c)
			var body []byte
			for {
				var err error
				if body, err = proto.ReadFrame(br, body, 1<<20); err != nil {
					return
				}
				res.GarbageIn.Add(1)
			}
		}()
	write:
		for {
			select {
			case <-stop:
				break write
			default:
			}
			buf = buf[:0]
			for range 1 + rng.IntN(8) {
				var n int
				switch r := rng.IntN(100); {
				case r < 3: // oversized: the daemon answers frame_too_large and closes
					n = s.MaxFrame + 1 + rng.IntN(1<<30)
					buf = be.BigEndian.AppendUint32(buf, uint32(n))
					n = rng.IntN(64) // a few bytes of the body it will not read
				case r < 6: // L = 0
					buf = be.BigEndian.AppendUint32(buf, 0)
				default:
					n = 1 + rng.IntN(2048)
					buf = be.BigEndian.AppendUint32(buf, uint32(n))
				}
				start := len(buf)
				off := rng.IntN(len(pool) - n)
				buf = append(buf, pool[off:off+n]...)
				if n > 0 && rng.IntN(2) == 0 {
					buf[start] = 0x80 | byte(rng.IntN(16)) // a fixmap: the decoder goes deeper
				}
				res.GarbageOut.Add(1)
			}
			_ = c.SetWriteDeadline(time.Now().Add(time.Second))
			if _, err := c.Write(buf); err != nil {
				break
			}
			time.Sleep(time.Millisecond)
		}
		c.Close()
		<-drained
	}
}

// keyFlood sends n checks, each on a user never seen before, pipelined in batches of
// 512 written at once, and checks each answer's id. (A batch is answered before the
// next is sent: a stream that never lets the daemon's buffer empty is cut after the
// frame timeout — TestE2EPipelinedStreamOutlivesFrameTimeout.)
func (s *Scenario) keyFlood(fc, n int) (int, error) {
	c, err := net.Dial("unix", s.Socket)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Minute))
	enc := proto.NewEncoder()
	br := bufio.NewReaderSize(c, 64<<10)
	dec := proto.NewDecoder()
	var body, batch []byte
	var resp proto.Response
	const batchSize = 512
	for done := 0; done < n; {
		batch = batch[:0]
		m := min(batchSize, n-done)
		for i := done; i < done+m; i++ {
			req := proto.Request{ID: uint64(i + 1), Op: proto.OpCheck, Cost: 1, Attrs: []proto.Attr{
				{Name: "path", Value: "/api"}, {Name: "user", Value: "flood-" + strconv.Itoa(fc) + "-" + strconv.Itoa(i)}}}
			batch = append(batch, EncodeFrame(enc, &req)...)
		}
		if _, err := c.Write(batch); err != nil {
			return done, err
		}
		for i := done; i < done+m; i++ {
			if body, err = proto.ReadFrame(br, body, 1<<20); err != nil {
				return i, fmt.Errorf("reading answer %d: %w", i+1, err)
			}
			if err := dec.DecodeResponse(body, &resp); err != nil {
				return i, fmt.Errorf("answer %d: %w", i+1, err)
			}
			if resp.ID != uint64(i+1) || resp.IsError() || resp.Rule != "per-user" {
				return i, fmt.Errorf("answer %d: %+v", i+1, resp)
			}
		}
		done += m
	}
	return n, nil
}

func Percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[int(float64(len(s)-1)*p)]
}
