//go:build !peers

package main

// startPeers without the "peers" build tag: the harness alone, no peer dependencies
// compiled (the CI smoke). scripts/compare builds with -tags peers.
func startPeers(dir string, ks keys) ([]*system, []string, func()) {
	return nil, []string{"built without the peers tag: gubernator and envoy-ratelimit not measured"}, func() {}
}

// startRedisPeers without the "peers" build tag: none.
func startRedisPeers(dir string) ([]*redisSystem, []string, func()) { return nil, nil, func() {} }

// differential without the "peers" build tag: no envoyproxy/ratelimit to compare with.
func differential(dir, bin string) (*DiffReport, error) { return nil, nil }
