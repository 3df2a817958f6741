// Command envoyload is the soak's (scripts/soak/run) load on the Envoy rate limit API:
// for a given number of seconds, gRPC connections that each make 1 to 50
// ShouldRateLimit calls (some cancelled mid-call) and close, and raw TCP connections
// that send a preface or garbage and close, half of them with a reset.
//
// Usage: envoyload HOST:PORT SECONDS
package main

import (
	"context"
	"fmt"
	"math/rand"
	"net"
	"os"
	"strconv"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	pb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: envoyload HOST:PORT SECONDS")
		os.Exit(2)
	}
	addr := os.Args[1]
	secs, err := strconv.Atoi(os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, "envoyload:", err)
		os.Exit(2)
	}
	end := time.Now().Add(time.Duration(secs) * time.Second)
	var calls, errs int
	kinds := []string{"loc", "hy", "gl", "hyban", "glban", "quota", "conc"}
	for time.Now().Before(end) {
		if rand.Intn(10) == 0 { // a raw connection, closed abruptly
			if c, err := net.Dial("tcp", addr); err == nil {
				switch rand.Intn(3) {
				case 0:
					c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
				case 1:
					c.Write([]byte("garbage\x00\x01"))
				}
				if tc, ok := c.(*net.TCPConn); ok && rand.Intn(2) == 0 {
					tc.SetLinger(0) // a reset
				}
				c.Close()
			}
			continue
		}
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			errs++
			continue
		}
		cl := pb.NewRateLimitServiceClient(cc)
		for range rand.Intn(50) + 1 {
			req := &pb.RateLimitRequest{Domain: "soak", Descriptors: []*rlv3.RateLimitDescriptor{{Entries: []*rlv3.RateLimitDescriptor_Entry{
				{Key: "k", Value: kinds[rand.Intn(len(kinds))]}, {Key: "u", Value: fmt.Sprintf("e%d", rand.Intn(3000))}}}}}
			wait := 200 * time.Millisecond
			if rand.Intn(20) == 0 {
				wait = time.Microsecond // cancelled mid-call
			}
			ctx, cancel := context.WithTimeout(context.Background(), wait)
			if _, err := cl.ShouldRateLimit(ctx, req); err != nil {
				errs++
			}
			cancel()
			calls++
		}
		cc.Close()
	}
	fmt.Println("envoyload:", calls, "calls,", errs, "errors")
}
