// Package cannedrls is the one answer the do-nothing gRPC baselines of BenchmarkEnvoyRLS
// (bench/grpcfloor, bench/h2floor) give every call: what rlsidecar answers an admitted
// one-descriptor call of the benchmark, so the floors send the same bytes as the daemon.
package cannedrls

import (
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	gproto "google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Answer returns the marshalled RateLimitResponse (no gRPC message prefix).
func Answer() ([]byte, error) {
	return gproto.Marshal(&rlsv3.RateLimitResponse{
		OverallCode: rlsv3.RateLimitResponse_OK,
		Statuses: []*rlsv3.RateLimitResponse_DescriptorStatus{{
			Code:               rlsv3.RateLimitResponse_OK,
			CurrentLimit:       &rlsv3.RateLimitResponse_RateLimit{Name: "per-user", RequestsPerUnit: 1000, Unit: rlsv3.RateLimitResponse_RateLimit_SECOND},
			LimitRemaining:     999,
			DurationUntilReset: durationpb.New(412 * time.Millisecond),
		}},
		ResponseHeadersToAdd: []*corev3.HeaderValue{
			{Key: "RateLimit-Policy", Value: `"per-user";q=1000;w=1`},
			{Key: "RateLimit", Value: `"per-user";r=999;t=1`},
		},
	})
}
