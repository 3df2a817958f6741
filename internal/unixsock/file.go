package unixsock

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"
)

// FileID names a file whatever path leads to it: its device and inode. A listener
// removes the socket file it made only while its path still names that file: another
// daemon may have put its own there since (after this one's was removed).
type FileID struct{ dev, ino uint64 }

// IDOf returns fi's device and inode (zero where the system does not give them).
func IDOf(fi os.FileInfo) FileID {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return FileID{}
	}
	return FileID{dev: uint64(st.Dev), ino: uint64(st.Ino)}
}

// lockWait bounds how long Lock waits for another daemon starting on the same path:
// that one holds the lock for a probe (at most a second) and a bind.
const lockWait = 3 * time.Second

// Lock takes the lock that serialises, between daemons, looking at the socket path,
// replacing a stale socket there and binding it (and, at shutdown, removing it): an
// flock on PATH.lock, created beside the socket and never removed (a lock file removed
// while another daemon waits for it locks nothing). The returned func releases it. The
// lock is held only for those steps, not for the daemon's life: a daemon draining
// after SIGTERM, its socket already removed, must not keep its successor from starting
// on the same path.
//
// The file is opened read-only (flock needs no more) and created readable by all, so
// that a daemon of another user, or a non-root one after root, takes the lock a previous
// daemon left; one it cannot open or that is not a regular file (another user's, made
// unreadable; a FIFO) is done without: the lock only narrows a race two daemons starting
// at the same instant run, and a daemon that started before the lock existed must not
// be kept from starting by it.
func Lock(path string) (unlock func(), err error) {
	name := path + ".lock"
	f, err := os.OpenFile(name, os.O_RDONLY|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0o644)
	if err != nil {
		return func() {}, nil
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return func() {}, nil
	}
	for deadline := time.Now().Add(lockWait); ; {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) || time.Now().After(deadline) {
			f.Close()
			if errors.Is(err, syscall.EWOULDBLOCK) {
				return nil, fmt.Errorf("another process has held the start lock %s for %s (a daemon starting on this socket, stuck?)", name, lockWait)
			}
			return nil, fmt.Errorf("taking the start lock %s: %w", name, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return func() { f.Close() }, nil // closing the last descriptor releases the lock
}
