package rawio

import (
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"syscall"
	"unsafe"
)

// rawIO reads and writes a connection's nonblocking socket with raw system calls, and
// waits in the netpoller, under the connection's deadlines, when a call would block.
//
// Why: a read or write through net.Conn enters the scheduler's system-call state, and the
// first one after the daemon has been idle wakes the runtime's sysmon thread from its deep
// sleep (a futex wake, on the request's path), which then naps in 20 µs steps before it
// sleeps again. A gateway checking at a low rate pays that on every request: measured
// under clients/lua/bench.sh it doubled the daemon's CPU time and context switches per
// check. A read or write of a nonblocking socket cannot block, so it need not enter that
// state. Errors are those of net.Conn: io.EOF, net.ErrClosed once closed,
// os.ErrDeadlineExceeded, and the socket's errno (ECONNRESET, EPIPE, ...).
//
// A rawIO's Read is used by one goroutine at a time, as net.Conn's is, and so are its
// Write and TryWrite, and its WriteBuffers: one goroutine may read while another writes
// (the writes are serialized by the socket's write lock; each keeps its own state).
type rawIO struct {
	rc   syscall.RawConn
	spin *Spinner // nil: wait in the netpoller at once

	// The Read under way: the callback the raw connection calls (bound once, in New, so
	// that a Read allocates nothing: a closure per call would put it and what it
	// captures on the heap) and its state.
	readFn func(fd uintptr) bool
	rp     []byte
	rn     int
	rerrno syscall.Errno
	spun   bool // this Read has spun (once per Read)

	// The Write under way, likewise; tryFn is TryWrite's callback.
	writeFn func(fd uintptr) bool
	tryFn   func(fd uintptr) bool
	wp      []byte
	wdone   int
	werrno  syscall.Errno

	// WriteBuffers's, apart from Write's: the two may run on different goroutines.
	vecFn   func(fd uintptr) bool
	vb      *net.Buffers
	vn      int64
	verrno  syscall.Errno
	vprog   func()
	vwaited bool
	vq      int // the socket's unread bytes when the deadline last moved (SIOCOUTQ)
	qFn     func(fd uintptr)
	q       int32
	iov     [64]syscall.Iovec
}

// New returns the reader and writer of c's hot path: a rawIO, or c itself when its raw
// descriptor is not available. spin, when not nil, is the busy-poll budget c shares.
func New(c Conn, spin *Spinner) io.ReadWriter {
	rc, err := c.SyscallConn()
	if err != nil {
		return c
	}
	r := &rawIO{rc: rc, spin: spin}
	r.readFn, r.writeFn, r.tryFn, r.vecFn, r.qFn = r.readFd, r.writeFd, r.tryWriteFd, r.writeVecFd, r.outqFd
	return r
}

// Read reads into p what the socket holds, waiting for the first byte.
func (r *rawIO) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	r.rp, r.rn, r.rerrno, r.spun = p, 0, 0, false
	err := r.rc.Read(r.readFn)
	n, errno := r.rn, r.rerrno
	r.rp = nil
	switch {
	case err != nil:
		return 0, err
	case errno != 0:
		return 0, errno
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// readFd is Read's callback: it reads r.rp from fd, and reports false (wait in the
// netpoller, then call again) when the socket is empty.
func (r *rawIO) readFd(fd uintptr) bool {
	p := r.rp
	var until int64
	for {
		r1, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		switch e {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			// Once per Read, and by one connection at a time: keep asking for up to
			// the budget, yielding to every other goroutine between asks.
			if until == 0 && !r.spun && r.spin != nil && r.spin.acquire() {
				r.spun = true
				until = nanotime() + int64(r.spin.budget)
			}
			if until != 0 && nanotime() < until {
				runtime.Gosched()
				continue
			}
			if until != 0 {
				r.spin.release()
				until = 0
			}
			return false // wait in the netpoller, then call again
		}
		if until != 0 {
			r.spin.release()
		}
		r.rn, r.rerrno = int(r1), e
		return true
	}
}

// Write writes all of p, waiting while the socket's buffer is full.
func (r *rawIO) Write(p []byte) (int, error) {
	r.wp, r.wdone, r.werrno = p, 0, 0
	err := r.rc.Write(r.writeFn)
	done, errno := r.wdone, r.werrno
	r.wp = nil
	if err != nil {
		return done, err
	}
	if errno != 0 {
		return done, errno
	}
	return done, nil
}

// TryWrite writes what of p the socket's buffer takes now, without waiting for room: n <
// len(p) without an error when it is full.
func (r *rawIO) TryWrite(p []byte) (n int, err error) {
	r.wp, r.wdone, r.werrno = p, 0, 0
	err = r.rc.Write(r.tryFn)
	done, errno := r.wdone, r.werrno
	r.wp = nil
	if err == nil && errno != 0 {
		err = errno
	}
	return done, err
}

// tryWriteFd is TryWrite's callback: writeFd, never waiting.
func (r *rawIO) tryWriteFd(fd uintptr) bool {
	r.writeFd(fd)
	return true
}

// writeFd is Write's callback: it writes what is left of r.wp to fd, and reports false
// (wait in the netpoller, then call again) when the socket's buffer is full.
func (r *rawIO) writeFd(fd uintptr) bool {
	p := r.wp
	for r.wdone < len(p) {
		r1, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&p[r.wdone])), uintptr(len(p)-r.wdone))
		switch e {
		case 0:
			r.wdone += int(r1)
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false
		default:
			r.werrno = e
			return true
		}
	}
	return true
}

// WriteBuffers writes bufs in full, consuming them as net.Buffers.WriteTo does, with one
// writev per attempt. Before it first waits for room, and before each wait that follows
// bytes going out, it calls waiting (if not nil): where the caller moves its write
// deadline, so that a peer taking its bytes slowly but steadily is waited for, and one
// that takes none for the deadline's length is not. A wait the netpoller ends without
// room (a spurious wake) does not call it again.
func (r *rawIO) WriteBuffers(bufs *net.Buffers, waiting func()) (int64, error) {
	r.vb, r.vn, r.verrno, r.vprog, r.vwaited = bufs, 0, 0, waiting, false
	err := r.rc.Write(r.vecFn)
	// The netpoller reports room only once the peer has read most of what the socket
	// holds (a Unix socket is writable again below a quarter of its buffer): a peer
	// reading slowly but steadily can take bytes for longer than the deadline without a
	// wake. When the deadline passes, the socket's unread bytes tell whether it did.
	for waiting != nil && errors.Is(err, os.ErrDeadlineExceeded) && r.peerTook() {
		waiting()
		err = r.rc.Write(r.vecFn)
	}
	n, errno := r.vn, r.verrno
	r.vb, r.vprog = nil, nil
	if err == nil && errno != 0 {
		err = errno
	}
	return n, err
}

func (r *rawIO) writeVecFd(fd uintptr) bool {
	moved := false
	for {
		iov := r.iov[:0]
		for _, p := range *r.vb {
			if len(iov) == cap(iov) {
				break
			}
			if len(p) > 0 {
				v := syscall.Iovec{Base: &p[0]}
				v.SetLen(len(p))
				iov = append(iov, v)
			}
		}
		if len(iov) == 0 {
			*r.vb = (*r.vb)[:0]
			return true
		}
		r1, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
		// The vector points into the buffers written: left there, it kept them from the
		// garbage collector for as long as the connection lived (megabytes, once a
		// client had pipelined thousands of checks before reading).
		clear(iov)
		switch e {
		case 0:
			r.vn += int64(r1)
			consume(r.vb, int(r1))
			moved = true
		case syscall.EINTR:
		case syscall.EAGAIN:
			if (moved || !r.vwaited) && r.vprog != nil {
				r.vprog()
				r.outqFd(fd)
				r.vq = int(r.q)
			}
			r.vwaited = true
			return false // wait in the netpoller (under the write deadline), then call again
		default:
			r.verrno = e
			return true
		}
	}
}

// peerTook reports whether the socket holds fewer unread bytes than when the deadline
// last moved, and notes how many it holds now.
func (r *rawIO) peerTook() bool {
	r.q = -1
	if err := r.rc.Control(r.qFn); err != nil || r.q < 0 {
		return false
	}
	took := int(r.q) < r.vq
	r.vq = int(r.q)
	return took
}

// outqFd reads the bytes the socket holds that its peer has not read (SIOCOUTQ) into
// r.q; -1 when it cannot tell.
func (r *rawIO) outqFd(fd uintptr) {
	r.q = -1
	if _, _, e := syscall.RawSyscall(syscall.SYS_IOCTL, fd, syscall.TIOCOUTQ, uintptr(unsafe.Pointer(&r.q))); e != 0 {
		r.q = -1
	}
}

// consume drops the first n bytes of v.
func consume(v *net.Buffers, n int) {
	for len(*v) > 0 {
		l := len((*v)[0])
		if l > n {
			(*v)[0] = (*v)[0][n:]
			return
		}
		n -= l
		*v = (*v)[1:]
	}
}
