package main

import (
	be "encoding/binary"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rlsidecar/rlsidecar/internal/hostile"
	"github.com/rlsidecar/rlsidecar/proto"
)

// A well-behaved client beside hostile ones — 20 connections of random frames, 200
// connections holding half a header, 400,000 never-repeating keys against a key cap of
// 100,000 — gets every answer right, with a loose latency bound (the figure with a
// tight one is BenchmarkHostile); the daemon closes the half-open connections after the
// frame timeout, keeps its RSS below 512 MB and still answers afterwards.
func TestE2EHostileClients(t *testing.T) {
	if testing.Short() {
		t.Skip("hostile-client load: not in -short")
	}
	dir := shortTempDir(t)
	cfg := writeFile(t, dir, "rules.yaml", hostile.Rules)
	const frameTimeout = 500 * time.Millisecond
	d := startDaemon(t, "--config", cfg, "--frame-timeout", frameTimeout.String(), "--max-conns", "512", "--max-keys", "100000", "--log-level", "warn")
	s := &hostile.Scenario{Socket: d.socket, PID: d.cmd.Process.Pid, FrameTimeout: frameTimeout, MaxFrame: proto.DefaultMaxFrame,
		GarbageConns: 20, HalfOpen: 200, FloodKeys: 400_000, FloodConns: 4, MinDuration: 3 * time.Second}
	start := time.Now()
	res := s.Run()
	elapsed := time.Since(start)

	p50, p99, worst := hostile.Percentile(res.Lat, 0.5), hostile.Percentile(res.Lat, 0.99), hostile.Percentile(res.Lat, 1)
	var halfMax time.Duration
	for _, d := range res.HalfClose {
		halfMax = max(halfMax, d)
	}
	t.Logf("%s: good client %d requests, p50 %s, p99 %s, max %s; flood %d keys in %s (%.0f/s); garbage %d frames written, %d answers; half-open closed after at most %s; daemon peak RSS %.0f MB",
		elapsed.Round(time.Millisecond), len(res.Lat), p50, p99, worst, res.FloodN, res.FloodTime.Round(time.Millisecond),
		float64(res.FloodN)/res.FloodTime.Seconds(), res.GarbageOut.Load(), res.GarbageIn.Load(), halfMax, res.PeakRSSMB)

	if res.NGoodErrs > 0 {
		t.Errorf("the good client saw %d errors: %s", res.NGoodErrs, strings.Join(res.GoodErrs, "; "))
	}
	if len(res.Lat) < 100 {
		t.Errorf("the good client got only %d answers", len(res.Lat))
	}
	if p99 > stallBound {
		t.Errorf("the good client's p99 is %s, above the loose bound of %s", p99, stallBound)
	}
	if len(res.FloodErrs) > 0 || res.FloodN != s.FloodKeys {
		t.Errorf("key flood: %d of %d answered; %s", res.FloodN, s.FloodKeys, strings.Join(res.FloodErrs, "; "))
	}
	if len(res.HalfErrs) > 0 {
		t.Errorf("half-open connections: %s", strings.Join(res.HalfErrs, "; "))
	}
	for i, d := range res.HalfClose {
		// Closed after the frame timeout, not before, and before the default one (5 s):
		// the flag's is the one applied. Not sooner: under the flood, on a loaded 2-core
		// machine, one was closed 2.27 s late (the bound was 2 s late).
		if d < frameTimeout-50*time.Millisecond || d > 4500*time.Millisecond {
			t.Errorf("half-open connection %d closed after %s; the frame timeout is %s", i, d, frameTimeout)
			break
		}
	}
	if res.GarbageOut.Load() == 0 || res.GarbageIn.Load() == 0 {
		t.Errorf("garbage: %d frames written, %d answers read", res.GarbageOut.Load(), res.GarbageIn.Load())
	}
	if res.RSSErr != nil {
		t.Errorf("sampling the daemon's RSS: %v (has it exited? %s)", res.RSSErr, d.stderr.String())
	}
	if res.PeakRSSMB >= 512 {
		t.Errorf("the daemon's RSS reached %.0f MB, want < 512", res.PeakRSSMB)
	}

	// Still alive and answering, and the limited key survived the flood.
	select {
	case err := <-d.done:
		t.Fatalf("the daemon exited: %v\n%s", err, d.stderr.String())
	default:
	}
	c := dialRaw(t, d.socket)
	c.send(&proto.Request{ID: 1, Op: proto.OpPing, Cost: 1})
	if r := c.recv(); r.ID != 1 || r.Protocol != proto.Version {
		t.Fatalf("ping after: %+v", r)
	}
	if r := c.check(2, 1, "path=/login", "user=good-client"); r.Allowed || r.Rule != "login" {
		t.Fatalf("the good client's limited login key after the flood: %+v", r)
	}
}

// Frames with an unknown field whose str/bin header announces ~4 GB, of which only a few
// bytes follow, are bad_request and cost the daemon nothing: its memory does not grow
// with their number on one connection. (Found by FuzzDecodeRequest: skipping such a
// value made the connection's msgpack decoder grow its buffer by 1 MB per frame.)
func TestE2EHostileSkippedLengths(t *testing.T) {
	d := startDaemon(t, "--log-level", "warn")
	c := dialRaw(t, d.socket)
	// {"x": bin32 announcing 0xfffffff0 bytes, then 4 bytes}
	body := []byte{0x81, 0xa1, 'x', 0xc6, 0xff, 0xff, 0xff, 0xf0, 1, 2, 3, 4}
	frame := be.BigEndian.AppendUint32(nil, uint32(len(body)))
	frame = append(frame, body...)
	before, err := hostile.RSSMB(d.cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	const frames = 200
	start := time.Now()
	fail := func(i int, what string) {
		t.Helper()
		mb, _ := hostile.RSSMB(d.cmd.Process.Pid)
		t.Fatalf("after %d frames of %d bytes on one connection: %s; the daemon's RSS is %.0f MB (%.0f MB before), %s elapsed",
			i, len(frame), what, mb, before, time.Since(start).Round(time.Millisecond))
	}
	for i := 1; i <= frames; i++ {
		c.write(frame)
		_ = c.c.SetReadDeadline(time.Now().Add(3 * time.Second))
		got, err := c.readFrame()
		if err != nil {
			fail(i, fmt.Sprintf("no answer within 3s (%v)", err))
		}
		var r proto.Response
		if err := c.dec.DecodeResponse(got[proto.HeaderSize:], &r); err != nil || r.Err.Code != proto.CodeBadRequest {
			t.Fatalf("frame %d: %+v %v, want bad_request", i, r, err)
		}
		if i%5 == 0 {
			if mb, err := hostile.RSSMB(d.cmd.Process.Pid); err != nil {
				t.Fatal(err)
			} else if mb > before+128 {
				fail(i, "memory grows with frames that hold a few bytes")
			}
		}
	}
	mb, _ := hostile.RSSMB(d.cmd.Process.Pid)
	t.Logf("%d frames in %s; RSS %.0f MB → %.0f MB", frames, time.Since(start).Round(time.Millisecond), before, mb)
}

// A client that pipelines without pause keeps a partial frame in the daemon's buffer at
// every moment, though each frame completes within 100 ms: the daemon answers each frame
// as it completes, and the frame timeout (500 ms here) never cuts the connection. Today
// it does both wrong: answers wait until the buffer empties, and the first frame deadline
// set is never moved, so the connection is closed 500 ms in (daemon/server.go, need and
// loop).
func TestE2EPipelinedStreamOutlivesFrameTimeout(t *testing.T) {
	d := startDaemon(t, "--frame-timeout", "500ms", "--log-level", "warn")
	c := dialRaw(t, d.socket)
	enc := proto.NewEncoder()
	frame := append([]byte(nil), hostile.EncodeFrame(enc, &proto.Request{ID: 1, Op: proto.OpPing, Cost: 1})...)
	start := time.Now()
	c.write(frame[:5])
	for i := 1; i <= 15; i++ {
		time.Sleep(100 * time.Millisecond)
		sent := time.Since(start).Round(time.Millisecond)
		// Completes frame i, begins frame i+1.
		if _, err := c.c.Write(append(append([]byte(nil), frame[5:]...), frame[:5]...)); err != nil {
			t.Fatalf("the daemon closed the connection after %s, %d frames sent whole: %v", time.Since(start).Round(time.Millisecond), i-1, err)
		}
		_ = c.c.SetReadDeadline(time.Now().Add(time.Second))
		if _, err := c.readFrame(); err != nil {
			t.Fatalf("frame %d, complete at %s, not answered while frame %d was being sent (%s): %v", i, sent, i+1, time.Since(start).Round(time.Millisecond), err)
		}
	}
}
