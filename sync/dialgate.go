package sync

import (
	"context"
	"net"
	"syscall"
	"time"
)

// noDialGate wraps dial so that go-redis never counts a dial as failed: a dial that
// fails comes back as a connection whose every use fails with the dial's error, so the
// call that needed it fails with that error all the same, at once, and the pool drops
// the connection.
//
// Why: go-redis v9.23.0's pool (internal/pool/pool.go, dialConn) counts the dials that
// failed and lowers the count only when a background dial, tried once a second, succeeds
// (tryDial), not when a call's dial does. Once the count reaches the pool's size (16 for
// a node's main pool by default, 10 for its pipeline pool) the pool stops dialling: every
// call that needs a new connection fails at once with the last dial error, up to a second
// after Redis is back. A daemon's breaker probing in that second fails without a dial,
// and waits another cool-down. The count grows over every outage a daemon lives through,
// so it is reached after a few short ones as well as by one long one: after the fifth 2 s
// kill of one daemon's Redis, the first normal global answer came 1.9 s after Redis
// answered, not 0.9 s. The daemon's breakers already keep calls off a Redis that keeps
// failing (a probe a cool-down), which is what go-redis's gate is for.
func noDialGate(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return failedDial{err}, nil
		}
		return c, nil
	}
}

// failedDial is a connection that could not be made: reads and writes fail with the
// dial's error. It is a syscall.Conn whose SyscallConn fails too, so that go-redis's
// health check drops it should it ever be pooled idle (a dial whose caller gave up
// first is pooled for the next call).
type failedDial struct{ err error }

// Read and Write return the dial's error wrapped once: go-redis unwraps once the error
// of a new connection's set-up, which would otherwise strip what our dialers add to
// theirs (tlsHint's CA file).
func (c failedDial) Read([]byte) (int, error)              { return 0, dialError(c) }
func (c failedDial) Write([]byte) (int, error)             { return 0, dialError(c) }
func (c failedDial) SyscallConn() (syscall.RawConn, error) { return nil, c.err }
func (failedDial) Close() error                            { return nil }
func (failedDial) LocalAddr() net.Addr                     { return &net.TCPAddr{} }
func (failedDial) RemoteAddr() net.Addr                    { return &net.TCPAddr{} }
func (failedDial) SetDeadline(time.Time) error             { return nil }
func (failedDial) SetReadDeadline(time.Time) error         { return nil }
func (failedDial) SetWriteDeadline(time.Time) error        { return nil }

// dialError is a failed dial's error, as a failedDial's reads and writes return it.
type dialError struct{ err error }

func (e dialError) Error() string { return e.err.Error() }
func (e dialError) Unwrap() error { return e.err }
