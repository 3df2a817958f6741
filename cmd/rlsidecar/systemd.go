package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	sdaemon "github.com/coreos/go-systemd/v22/daemon"
	"golang.org/x/sys/unix"
)

// go-systemd is used rather than a hand-written sd_notify: activation.Files checks
// LISTEN_PID, honours LISTEN_FDS/LISTEN_FDNAMES, marks the descriptors close-on-exec and
// consumes the environment, and SdNotify handles abstract NOTIFY_SOCKET addresses — the
// corner cases a hand-written copy would have to re-learn, for one small dependency with
// no transitive ones in the packages we import.

// envoyFDName is the name (FileDescriptorName= in systemd/rlsidecar-envoy.socket) of a
// passed socket the daemon serves Envoy's rate limit service on, instead of binding
// --envoy-rls itself. The msgpack socket may have any other name.
const envoyFDName = "envoy"

// activatedSockets are the listening sockets systemd (or systemd-socket-activate)
// passed in LISTEN_FDS. A nil field was not passed.
type activatedSockets struct {
	socket *net.UnixListener // the msgpack socket: any name but envoyFDName
	envoy  *net.UnixListener // the Envoy API's socket: named envoyFDName
}

// close closes what was passed, for a daemon that fails before serving it.
func (a activatedSockets) close() {
	for _, ln := range []*net.UnixListener{a.socket, a.envoy} {
		if ln != nil {
			ln.Close()
		}
	}
}

// activatedListeners returns the listening sockets systemd passed, by their names
// (LISTEN_FDNAMES): at most one named envoyFDName, at most one other. It consumes the
// environment, so it must be called once. Each must be a listening Unix stream socket;
// anything else is refused here, before the daemon announces anything.
//
// The Envoy socket comes from a .socket unit of its own because a unit's
// FileDescriptorName= names every socket it lists: two ListenStream= lines in
// rlsidecar.socket would reach the daemon under one name.
func activatedListeners() (activatedSockets, error) {
	var got activatedSockets
	files := activation.Files(true)
	defer func() {
		for _, f := range files {
			f.Close() // each listener holds its own descriptor
		}
	}()
	var others []string // where each socket not named envoyFDName listens
	for _, f := range files {
		if f.Name() != envoyFDName {
			others = append(others, socketAddr(f))
		}
	}
	if len(others) > 1 {
		// The likely cause: a drop-in (systemctl edit rlsidecar.socket) whose ListenStream=
		// was meant to move the socket. It adds one: the unit's stays, and both are passed
		// under the unit's FileDescriptorName=.
		return got, fmt.Errorf("socket activation: %d sockets passed (LISTEN_FDS) besides any named %q (%s); rlsidecar takes one Unix stream socket, and one for Envoy's API named %q (FileDescriptorName=%s). A drop-in's ListenStream= adds a socket to the unit's: to move the socket, begin the drop-in with an empty ListenStream= line, which clears the unit's, then give the new path",
			len(others), envoyFDName, strings.Join(others, ", "), envoyFDName, envoyFDName)
	}
	for _, f := range files {
		if f.Name() == envoyFDName && got.envoy != nil {
			got.close()
			return activatedSockets{}, fmt.Errorf("socket activation: two sockets named %q passed; the Envoy API takes one", envoyFDName)
		}
		ln, err := unixStreamListener(f)
		if err != nil {
			got.close()
			return activatedSockets{}, fmt.Errorf("socket activation: %w", err)
		}
		if f.Name() == envoyFDName {
			got.envoy = ln
		} else {
			got.socket = ln
		}
	}
	return got, nil
}

// socketAddr returns where the passed socket f listens (its path, for a Unix socket), or
// its descriptor's name when that cannot be read.
func socketAddr(f *os.File) string {
	rc, err := f.SyscallConn()
	if err != nil {
		return f.Name()
	}
	var sa unix.Sockaddr
	var saErr error
	if err := rc.Control(func(fd uintptr) { sa, saErr = unix.Getsockname(int(fd)) }); err != nil || saErr != nil {
		return f.Name()
	}
	switch a := sa.(type) {
	case *unix.SockaddrUnix:
		return a.Name
	case *unix.SockaddrInet4:
		return net.JoinHostPort(net.IP(a.Addr[:]).String(), fmt.Sprint(a.Port))
	case *unix.SockaddrInet6:
		return net.JoinHostPort(net.IP(a.Addr[:]).String(), fmt.Sprint(a.Port))
	}
	return f.Name()
}

// unixStreamListener returns a listener on a copy of f's descriptor when f is a listening
// Unix stream socket, and an error saying what f is otherwise. Go's net.FileListener
// alone takes a datagram or seqpacket socket too (a listener whose Accept fails, or one
// that serves frames with message boundaries), so the socket's type is read first
// (SO_TYPE), then whether it listens (SO_ACCEPTCONN).
func unixStreamListener(f *os.File) (*net.UnixListener, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("the descriptor passed (%s): %w", f.Name(), err)
	}
	var (
		sa            unix.Sockaddr
		typ, accepts  int
		saErr, optErr error
	)
	if err := rc.Control(func(fd uintptr) {
		if sa, saErr = unix.Getsockname(int(fd)); saErr != nil {
			return
		}
		if typ, optErr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TYPE); optErr != nil {
			return
		}
		accepts, optErr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
	}); err != nil {
		return nil, fmt.Errorf("the descriptor passed (%s): %w", f.Name(), err)
	}
	if saErr != nil {
		return nil, fmt.Errorf("the descriptor passed (%s) is not a socket: %w", f.Name(), saErr)
	}
	if optErr != nil {
		return nil, fmt.Errorf("the socket passed (%s): reading its type: %w", f.Name(), optErr)
	}
	if _, ok := sa.(*unix.SockaddrUnix); !ok || typ != unix.SOCK_STREAM {
		return nil, fmt.Errorf("the socket passed (%s) is %s, not a Unix stream socket (ListenStream= must be a path)", f.Name(), socketKind(sa, typ))
	}
	if accepts == 0 {
		return nil, fmt.Errorf("the socket passed (%s) is a Unix stream socket that does not listen (the .socket unit needs Accept=no)", f.Name())
	}
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("the socket passed (%s): %w", f.Name(), err)
	}
	ul, ok := ln.(*net.UnixListener)
	if !ok { // checked above; a BUG if it happens
		ln.Close()
		return nil, fmt.Errorf("the socket passed (%s) is not a Unix stream socket (ListenStream= must be a path)", f.Name())
	}
	return ul, nil
}

// socketKind names a socket's family and type for an error message: "a TCP socket",
// "a Unix datagram socket".
func socketKind(sa unix.Sockaddr, typ int) string {
	family := "a non-Unix"
	switch sa.(type) {
	case *unix.SockaddrUnix:
		family = "a Unix"
	case *unix.SockaddrInet4, *unix.SockaddrInet6:
		switch typ {
		case unix.SOCK_STREAM:
			return "a TCP socket"
		case unix.SOCK_DGRAM:
			return "a UDP socket"
		}
		family = "an IP"
	}
	switch typ {
	case unix.SOCK_STREAM:
		return family + " stream socket"
	case unix.SOCK_DGRAM:
		return family + " datagram socket"
	case unix.SOCK_SEQPACKET:
		return family + " seqpacket socket"
	}
	return fmt.Sprintf("%s socket of type %d", family, typ)
}

// notifier tells the service manager about the daemon's state (sd_notify). With no
// NOTIFY_SOCKET it does nothing, so it is always safe to call. Its zero value is not
// usable; use newNotifier. Safe for concurrent use.
type notifier struct {
	log     *slog.Logger
	mu      sync.Mutex
	warned  bool
	stopped bool // STOPPING=1 sent: READY=1 and RELOADING=1 are not sent after it
}

func newNotifier(log *slog.Logger) *notifier { return &notifier{log: log} }

// send sends the given assignments (READY=1, STATUS=…) in one datagram. A failure is
// logged once: the service manager's view is not worth stopping for.
func (n *notifier) send(lines ...string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.sendLocked(lines...)
}

// sendLocked is send with n.mu held.
func (n *notifier) sendLocked(lines ...string) {
	if _, err := sdaemon.SdNotify(false, strings.Join(lines, "\n")); err != nil && !n.warned {
		n.warned = true
		n.log.Warn("sd_notify failed; the service manager may not see the daemon's state", "err", err)
	}
}

// ready says the daemon serves: the rules are loaded and the socket listens. Not once
// it drains: a reload the file watcher began then (it runs until the drain ends) would
// have said READY=1 after STOPPING=1, and `systemctl status` showed a draining daemon as
// serving. Whether it drains is read under the lock the message is sent under: read
// before, a STOPPING=1 sent in between went first (TestNotifierNothingAfterStopping).
func (n *notifier) ready(status string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.stopped {
		n.sendLocked("READY=1", "STATUS="+status)
	}
}

// reloading says a reload began, stamped with CLOCK_MONOTONIC as systemd requires;
// ready must follow when it is over, whatever its outcome. Not once it drains (ready).
func (n *notifier) reloading(status string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.stopped {
		n.sendLocked("RELOADING=1", "MONOTONIC_USEC="+fmt.Sprint(monotonicUsec()), "STATUS="+status)
	}
}

// stopping says the daemon is draining.
func (n *notifier) stopping(status string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.stopped = true
	n.sendLocked("STOPPING=1", "STATUS="+status)
}

// watchdog pings the service manager every half WATCHDOG_USEC until ctx ends, when the
// unit sets WatchdogSec= (and WATCHDOG_PID, if set, names this process). A ping proves
// the process is alive and schedules goroutines; it returns at once when there is no
// watchdog.
func (n *notifier) watchdog(ctx context.Context) {
	every, err := sdaemon.SdWatchdogEnabled(false)
	if err != nil {
		n.log.Warn("ignoring the systemd watchdog settings", "err", err)
		return
	}
	if every <= 0 {
		return
	}
	t := time.NewTicker(every / 2)
	defer t.Stop()
	n.send("WATCHDOG=1")
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			n.send("WATCHDOG=1")
		}
	}
}

// monotonicUsec reads CLOCK_MONOTONIC in microseconds, the clock systemd compares
// MONOTONIC_USEC with (Go's monotonic readings have another origin).
func monotonicUsec() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0
	}
	return ts.Nano() / 1000
}
