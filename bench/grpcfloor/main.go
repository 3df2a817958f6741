// Command grpcfloor is the baseline of BenchmarkEnvoyRLS: a do-nothing grpc-go server
// with the transport options rlsidecar's Envoy listener uses (envoyrls.TransportOptions),
// answering every ShouldRateLimit with the same canned bytes, without decoding the request
// or deciding anything. What rlsidecar's Envoy listener costs beyond it is rlsidecar's
// work; what it costs beside the msgpack socket's floor is grpc-go's.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime/trace"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/mem"

	"github.com/rlsidecar/rlsidecar/bench/internal/cannedrls"
	"github.com/rlsidecar/rlsidecar/envoyrls"
)

// raw is what the codec passes: the request's bytes are dropped, the answer's written.
type raw struct{ b []byte }

// codec decodes nothing and encodes the canned answer.
type codec struct{}

func (codec) Name() string { return "proto" }

func (codec) Marshal(v any) (mem.BufferSlice, error) {
	r, ok := v.(*raw)
	if !ok {
		return nil, fmt.Errorf("grpcfloor: cannot marshal %T", v)
	}
	return mem.BufferSlice{mem.SliceBuffer(r.b)}, nil
}

func (codec) Unmarshal(data mem.BufferSlice, v any) error { return nil }

func main() {
	socket := flag.String("socket", "", "Unix socket path")
	flag.Parse()
	os.Remove(*socket)
	ln, err := net.Listen("unix", *socket)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// The answer rlsidecar gives an admitted one-descriptor call of the benchmark.
	answer, err := cannedrls.Answer()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	canned := &raw{b: answer}
	s := grpc.NewServer(append(envoyrls.TransportOptions(), grpc.ForceServerCodecV2(codec{}))...)
	s.RegisterService(&grpc.ServiceDesc{
		ServiceName: envoyrls.ServiceName,
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "ShouldRateLimit",
			Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				if err := dec(nil); err != nil {
					return nil, err
				}
				return canned, nil
			},
		}},
	}, struct{}{})
	// GRPCFLOOR_TRACE=FILE writes an execution trace (runtime/trace) until SIGTERM: the
	// goroutine handoffs of each call (go tool trace).
	if path := os.Getenv("GRPCFLOOR_TRACE"); path != "" {
		f, err := os.Create(path)
		if err == nil {
			err = trace.Start(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		defer f.Close()
	}
	fmt.Println("grpcfloor listening on", *socket)
	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		<-sig
		s.Stop()
		trace.Stop()
		os.Exit(0)
	}()
	if err := s.Serve(ln); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
