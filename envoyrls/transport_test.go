package envoyrls

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
	"golang.org/x/net/http2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	_ "google.golang.org/grpc/encoding/gzip" // the client's compressor, for the compression case
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	gproto "google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rlsidecar/rlsidecar/internal/redistest"
	"github.com/rlsidecar/rlsidecar/limiter"
	"github.com/rlsidecar/rlsidecar/localbucket"
	"github.com/rlsidecar/rlsidecar/rules"
	rlsync "github.com/rlsidecar/rlsidecar/sync"
)

// served is a server of testServer's rules listening on a temp Unix socket with the given
// transport, and a grpc-go client connection to it (Envoy's stand-in).
type served struct {
	s    *Server
	conn *grpc.ClientConn
	rls  rlsv3.RateLimitServiceClient
	hc   healthpb.HealthClient
	sock string
	done chan error
}

// serveTest starts s on a temp socket with transport; t.Cleanup shuts it down.
func serveTest(t *testing.T, s *Server, transport string) *served {
	t.Helper()
	dir, err := os.MkdirTemp("", "rls")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "e.sock")
	s.cfg.Addr, s.cfg.Transport = "unix:"+sock, transport
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	sv := &served{s: s, sock: sock, done: make(chan error, 1)}
	go func() { sv.done <- s.Serve() }()
	sv.conn, err = grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	sv.rls, sv.hc = rlsv3.NewRateLimitServiceClient(sv.conn), healthpb.NewHealthClient(sv.conn)
	t.Cleanup(func() {
		sv.conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		if err := <-sv.done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return sv
}

func ctx10(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// Through the real grpc-go client, each transport answers as ShouldRateLimit does in
// process, on random calls (errors included) with the same rules and clock.
func TestTransportsMatchInProcess(t *testing.T) {
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) {
			typed, wire := testServer(t), testServer(t)
			var mu sync.Mutex
			var now int64 = 1_700_000_000_123_456_789
			clock := func() int64 { mu.Lock(); defer mu.Unlock(); return now }
			typed.now, wire.now = clock, clock
			sv := serveTest(t, wire, tr)
			r := rand.New(rand.NewPCG(13, 4))
			users := []string{"u1", "u2", "u3"}
			for i := range 300 {
				req := randomRequest(r, users)
				mu.Lock()
				now += int64(r.IntN(300)) * int64(time.Millisecond)
				mu.Unlock()
				want, wantErr := typed.ShouldRateLimit(context.Background(), req)
				got, gotErr := sv.rls.ShouldRateLimit(ctx10(t), req)
				if status.Code(gotErr) != status.Code(wantErr) || (gotErr != nil && status.Convert(gotErr).Message() != status.Convert(wantErr).Message()) {
					t.Fatalf("call %d: %v, in process %v", i, gotErr, wantErr)
				}
				if gotErr == nil && !gproto.Equal(got, want) {
					t.Fatalf("call %d: answer\n%v\nin process\n%v", i, got, want)
				}
			}
		})
	}
}

// The cases a client can meet, on each transport through grpc-go's client: health, an
// unknown method, a request spread over many DATA frames, one past the maximum message
// size, compression, many concurrent streams on one connection.
func TestTransportCases(t *testing.T) {
	long := strings.Repeat("v", 1000)
	big := &rlsv3.RateLimitRequest{Domain: "api"}
	for i := range 60 {
		big.Descriptors = append(big.Descriptors, &commonrl.RateLimitDescriptor{Entries: []*commonrl.RateLimitDescriptor_Entry{
			{Key: "user", Value: long + string(rune('a'+i%26))}}})
	}
	huge := &rlsv3.RateLimitRequest{Domain: strings.Repeat("d", 5<<20), Descriptors: []*commonrl.RateLimitDescriptor{desc1("u")}}
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) {
			sv := serveTest(t, testServer(t), tr)
			// A deadline per subtest, not one for all: under -race at load average 18 the
			// native transport's subtests took more than 10 s together, and the 64 concurrent
			// streams met its end (DeadlineExceeded).
			t.Run("health", func(t *testing.T) {
				ctx := ctx10(t)
				for _, svc := range []string{"", ServiceName} {
					h, err := sv.hc.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
					if err != nil || h.Status != healthpb.HealthCheckResponse_SERVING {
						t.Errorf("%q: %v %v", svc, h, err)
					}
				}
				if _, err := sv.hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "nope"}); status.Code(err) != codes.NotFound {
					t.Errorf("unknown service: %v", err)
				}
			})
			t.Run("watch", func(t *testing.T) {
				ctx := ctx10(t)
				w, err := sv.hc.Watch(ctx, &healthpb.HealthCheckRequest{Service: ServiceName})
				if err != nil {
					t.Fatal(err)
				}
				resp, err := w.Recv()
				switch tr {
				case TransportNative: // not served: UNIMPLEMENTED, documented
					if status.Code(err) != codes.Unimplemented {
						t.Errorf("Watch: %v %v", resp, err)
					}
				default:
					if err != nil || resp.Status != healthpb.HealthCheckResponse_SERVING {
						t.Errorf("Watch: %v %v", resp, err)
					}
				}
			})
			t.Run("unknown method", func(t *testing.T) {
				ctx := ctx10(t)
				err := sv.conn.Invoke(ctx, "/"+ServiceName+"/Nope", &rlsv3.RateLimitRequest{}, &rlsv3.RateLimitResponse{})
				if status.Code(err) != codes.Unimplemented {
					t.Errorf("%v", err)
				}
				err = sv.conn.Invoke(ctx, "/no.Such/Method", &rlsv3.RateLimitRequest{}, &rlsv3.RateLimitResponse{})
				if status.Code(err) != codes.Unimplemented {
					t.Errorf("%v", err)
				}
			})
			t.Run("many DATA frames", func(t *testing.T) {
				ctx := ctx10(t)
				if gproto.Size(big) < 3*16384 {
					t.Fatalf("the big request is %d bytes: not several frames", gproto.Size(big))
				}
				resp, err := sv.rls.ShouldRateLimit(ctx, big)
				if err != nil || len(resp.Statuses) != len(big.Descriptors) {
					t.Fatalf("%v", err)
				}
			})
			t.Run("past the stream's receive window", func(t *testing.T) {
				ctx := ctx10(t)
				// 3 MiB: the server must give window back while the request arrives.
				resp, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: strings.Repeat("w", 3<<20), Descriptors: []*commonrl.RateLimitDescriptor{desc1("u")}})
				if err != nil || len(resp.Statuses) != 1 {
					t.Fatalf("%v", err)
				}
			})
			t.Run("past the maximum message", func(t *testing.T) {
				ctx := ctx10(t)
				_, err := sv.rls.ShouldRateLimit(ctx, huge)
				if status.Code(err) != codes.ResourceExhausted {
					t.Errorf("%v", err)
				}
				// The connection still serves.
				if _, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{desc1("u9")}}); err != nil {
					t.Errorf("after: %v", err)
				}
			})
			t.Run("compressed", func(t *testing.T) {
				ctx := ctx10(t)
				_, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{desc1("u9")}}, grpc.UseCompressor("gzip"))
				want := codes.OK // grpc-go decompresses what it has a codec for
				if tr == TransportNative {
					want = codes.Unimplemented
				}
				if status.Code(err) != want {
					t.Errorf("%v, want %v", err, want)
				}
			})
			t.Run("64 concurrent streams", func(t *testing.T) {
				// 3,200 calls: 7 s alone under -race at load average 14.
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				var wg sync.WaitGroup
				errs := make(chan error, 64)
				for g := range 64 {
					wg.Go(func() {
						for i := range 50 {
							u := string(rune('A'+g)) + string(rune('a'+i%26))
							resp, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{desc1(u)}})
							if err != nil || len(resp.Statuses) != 1 || resp.Statuses[0].CurrentLimit == nil {
								errs <- errors.Join(err, errors.New(resp.String()))
								return
							}
						}
					})
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					t.Error(err)
				}
			})
		})
	}
}

func desc1(user string) *commonrl.RateLimitDescriptor {
	return &commonrl.RateLimitDescriptor{Entries: []*commonrl.RateLimitDescriptor_Entry{{Key: "user", Value: user}}}
}

// Shutdown with a call in flight: the call is answered, new calls are not taken, Serve
// returns nil and no goroutine is left.
func TestTransportGracefulShutdown(t *testing.T) {
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) {
			s, frozen := globalServer(t)
			defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
			sv := serveTestNoCleanup(t, s, tr)
			// A global call waits on the frozen Redis.
			frozen.Freeze()
			answered := make(chan error, 1)
			go func() {
				_, err := sv.rls.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "g", Descriptors: []*commonrl.RateLimitDescriptor{desc1("x")}})
				answered <- err
			}()
			waitFor(t, func() bool { return inFlight(s) > 0 })
			shut := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				shut <- s.Shutdown(ctx)
			}()
			select {
			case err := <-answered:
				t.Fatalf("answered while Redis is frozen: %v", err)
			case <-time.After(200 * time.Millisecond):
			}
			frozen.Thaw()
			if err := <-answered; err != nil {
				t.Errorf("the call in flight: %v", err)
			}
			if err := <-shut; err != nil {
				t.Errorf("Shutdown: %v", err)
			}
			if err := <-sv.done; err != nil {
				t.Errorf("Serve: %v", err)
			}
			sv.conn.Close()
		})
	}
}

// serveTestNoCleanup is serveTest whose caller shuts the server down.
func serveTestNoCleanup(t *testing.T, s *Server, transport string) *served {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "e.sock")
	s.cfg.Addr, s.cfg.Transport = "unix:"+sock, transport
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	sv := &served{s: s, sock: sock, done: make(chan error, 1)}
	go func() { sv.done <- s.Serve() }()
	var err error
	sv.conn, err = grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	sv.rls, sv.hc = rlsv3.NewRateLimitServiceClient(sv.conn), healthpb.NewHealthClient(sv.conn)
	return sv
}

// stop closes sv's client and shuts its server down, for a test that checks what is
// left running after it (goleak) and so cannot leave that to Cleanup.
func (sv *served) stop(t *testing.T) {
	t.Helper()
	sv.conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := sv.s.Shutdown(ctx); err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	if err := <-sv.done; err != nil {
		t.Errorf("Serve: %v", err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// standaloneRedis starts a redis-server for t and opens the daemon's client to it.
func standaloneRedis(t *testing.T) (*redistest.Server, redis.UniversalClient) {
	t.Helper()
	srv := redistest.StartStandalone(t)
	rdb, err := rlsync.Open(rlsync.Config{URL: "redis://" + srv.Addr, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	return srv, rdb
}

// globalServer is a server (not listening) whose domain "g" is decided by a global rule on
// a real redis-server, returned too (to freeze), and domain "api" locally.
func globalServer(t *testing.T) (*Server, *redistest.Server) {
	t.Helper()
	srv, rdb := standaloneRedis(t)
	return redisServer(t, rdb, `
rules:
  - name: g
    match: { domain: g }
    key: user
    mode: global
    limit: { requests: 1000, per: 1h }
  - name: l
    match: { domain: api, descriptor: user }
    key: user
    limit: { requests: 1000, per: 1h }
`), srv
}

// redisServer is a server (not listening) of the rules src, its global ones on rdb.
func redisServer(t *testing.T, rdb redis.UniversalClient, src string) *Server {
	t.Helper()
	set, err := rules.Parse("g.yaml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	lim := limiter.New(set, localbucket.NewStore(localbucket.Options{})).WithGlobal(rlsync.NewGlobal(rdb), 30*time.Second)
	s, err := New(Config{Addr: "unused:0"}, lim)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func inFlight(s *Server) int64 { return s.deciding.Load() }

// A call that waits on Redis does not stall its connection: a local call on the same
// connection is answered while the global one waits on a frozen Redis, which then answers
// too.
func TestTransportGlobalCallDoesNotStall(t *testing.T) {
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) {
			s, frozen := globalServer(t)
			sv := serveTest(t, s, tr)
			ctx := ctx10(t)
			if _, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "g", Descriptors: []*commonrl.RateLimitDescriptor{desc1("warm")}}); err != nil {
				t.Fatal(err)
			}
			frozen.Freeze()
			defer frozen.Thaw()
			global := make(chan *rlsv3.RateLimitResponse, 1)
			go func() {
				resp, err := sv.rls.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "g", Descriptors: []*commonrl.RateLimitDescriptor{desc1("x")}})
				if err != nil {
					t.Error(err)
				}
				global <- resp
			}()
			waitFor(t, func() bool { return inFlight(s) > 0 })
			for i := range 20 {
				resp, err := sv.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{desc1("local")}})
				if err != nil || resp.Statuses[0].CurrentLimit.GetName() != "l" {
					t.Fatalf("local call %d: %v %v", i, resp, err)
				}
			}
			select {
			case resp := <-global:
				t.Fatalf("the global call was answered with Redis frozen: %v", resp)
			default:
			}
			frozen.Thaw()
			if resp := <-global; resp == nil || resp.OverallCode != rlsv3.RateLimitResponse_OK || resp.Statuses[0].CurrentLimit.GetName() != "g" {
				t.Fatalf("global: %v", resp)
			}
		})
	}
}

// A call whose deadline has passed before it is decided is answered DEADLINE_EXCEEDED and
// takes nothing, on either transport (Envoy gave up on it, and applied its own failure
// mode: the call's hit must not be counted as well).
func TestTransportLateCallTakesNothing(t *testing.T) {
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) {
			s := testServer(t)
			s.now = func() int64 { return 1_700_000_000_000_000_000 } // one window throughout
			sv := serveTest(t, s, tr)
			r := dialRaw(t, sv.sock)
			r.headers(1, false, grpcHeaders(pathShouldRateLimit, "grpc-timeout", "0n")...)
			r.fr.WriteData(1, true, oneCall("late"))
			if rp := r.await(1, nil); rp.grpcStatus != "4" {
				t.Errorf("a call past its deadline: %+v, want grpc-status 4 (DEADLINE_EXCEEDED)", rp)
			}
			resp, err := sv.rls.ShouldRateLimit(ctx10(t), &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{desc1("late")}})
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.Statuses[0].LimitRemaining; got != 4 {
				t.Errorf("after the late call and one more, %d remain of 5, want 4: the late call was charged", got)
			}
		})
	}
}

// A call that waits on Redis is decided on a goroutine of its own (native) or a stream
// worker (grpc-go). One the client reset or cancelled, or whose deadline passed, before
// that began is not decided: nothing is taken for an answer nobody reads.
func TestGoneBeforeDecidingTakesNothing(t *testing.T) {
	const now = 1_700_000_000_000_000_000 // one window throughout
	msg := oneCall("gone")[5:]
	remaining := func(t *testing.T, s *Server) uint32 {
		t.Helper()
		ask := desc1("gone")
		ask.HitsAddend = wrapperspb.UInt64(0)
		resp, err := s.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*commonrl.RateLimitDescriptor{ask}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Statuses[0].LimitRemaining
	}
	for _, tc := range []struct {
		name string
		gone func(cn *h2conn, st *h2stream) // under cn.mu, before the goroutine begins
	}{
		{"native, reset", func(cn *h2conn, st *h2stream) { cn.closeStream(st) }}, // RST_STREAM
		{"native, deadline", func(cn *h2conn, st *h2stream) { st.deadline = now }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := testServer(t)
			s.now = func() int64 { return now }
			cn := newH2Conn(s, &fakeConn{in: bytes.NewReader(nil), closed: make(chan struct{})})
			cn.mu.Lock()
			st := cn.newStream(1)
			cn.streams[1] = st
			cn.decideLater(st, msg, 0)
			tc.gone(cn, st)
			cn.mu.Unlock()
			cn.deciding.Wait()
			if got := remaining(t, s); got != 5 {
				t.Errorf("%d of 5 remain: the call was charged", got)
			}
		})
	}
	t.Run("grpc-go, cancelled", func(t *testing.T) {
		s := testServer(t)
		s.now = func() int64 { return now }
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		dec := func(v any) error {
			sc := v.(*scratch)
			sc.raw = append(sc.raw[:0], msg...)
			return parseRequest(sc.raw, &sc.call)
		}
		if _, err := wireHandler(s, ctx, dec, nil); status.Code(err) != codes.Canceled {
			t.Errorf("%v, want Canceled", err)
		}
		if got := remaining(t, s); got != 5 {
			t.Errorf("%d of 5 remain: the call was charged", got)
		}
	})
}

// A connection whose client pings it, idle or not (Envoy's HTTP/2 connection_keepalive
// on the rate limit cluster), stays open on both transports. grpc-go's server by default
// counts a ping on a connection with no call in flight, sent within two hours of the one
// before, as a strike, and at the third closes the connection: GOAWAY ENHANCE_YOUR_CALM,
// "too_many_pings". An Envoy pinging every 30 s lost its idle connections to the
// grpc-go transport every minute and a half; the native transport kept them.
func TestTransportKeepalivePings(t *testing.T) {
	for _, tr := range Transports {
		t.Run(tr, func(t *testing.T) {
			sv := serveTest(t, testServer(t), tr)
			r := dialRaw(t, sv.sock)
			for i := range 6 {
				if err := r.fr.WritePing(false, [8]byte{byte(i + 1)}); err != nil {
					t.Fatalf("ping %d: %v", i, err)
				}
				for acked := false; !acked; {
					switch f := r.next().(type) {
					case *http2.GoAwayFrame:
						t.Fatalf("ping %d: GOAWAY %v %q", i, f.ErrCode, f.DebugData())
					case *http2.PingFrame:
						acked = f.IsAck() && f.Data[0] == byte(i+1)
					}
				}
			}
		})
	}
}
