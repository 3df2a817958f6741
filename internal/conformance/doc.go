// Package conformance holds no code of the daemon: its test runs the wire-protocol
// conformance suite (proto/conformance, Python, written from shared/PROTOCOL.md alone)
// against the real daemon in the Redis-backed modes, on redis-servers started by
// internal/redistest (free loopback ports, temp dirs, stopped by t.Cleanup): global and
// hybrid mode, each on a standalone Redis and on a 3-master Redis Cluster.
//
// scripts/test-clients runs it (it needs Debian's /usr/bin/python3 with python3-msgpack and
// python3-pytest, which that script installs), after the suite's local-mode run:
//
//	RLSIDECAR_CONFORMANCE_REDIS=1 go test -count=1 ./internal/conformance
//
// Without RLSIDECAR_CONFORMANCE_REDIS=1 the test skips, so that `go test ./...` (run before
// the Python packages are installed on a fresh machine) does not depend on them.
package conformance
