package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"syscall"
)

// toJournal reports whether w is the systemd journal's stream for this process: systemd
// sets JOURNAL_STREAM to the device and inode of the stream it connects stdout or stderr
// to (systemd.exec(5)), which a file w that is still that stream matches.
func toJournal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	want := os.Getenv("JOURNAL_STREAM")
	if want == "" {
		return false
	}
	// Stat, not Fd and Fstat: Fd would put the file into blocking mode.
	fi, err := f.Stat()
	if err != nil {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && want == fmt.Sprintf("%d:%d", uint64(st.Dev), uint64(st.Ino))
}

// journalPriority is the syslog priority prefix ("<N>", sd-daemon(3)) of a record of
// level l: journald files a line that starts with one at that priority, and strips it.
// Without it every line of the daemon was filed at the unit's SyslogLevel= (info), so
// `journalctl -u rlsidecar -p warning` and `-p err`, which docs/operations.md gives for
// the alerts, showed none of its warnings and errors.
func journalPriority(l slog.Level) string {
	switch {
	case l >= slog.LevelError:
		return "<3>" // LOG_ERR
	case l >= slog.LevelWarn:
		return "<4>" // LOG_WARNING
	case l >= slog.LevelInfo:
		return "<6>" // LOG_INFO
	default:
		return "<7>" // LOG_DEBUG
	}
}

// prefixWriter writes each record's line after the prefix its handler set; slog's text
// and JSON handlers write a record in one Write, under journalHandler's lock.
type prefixWriter struct {
	mu     sync.Mutex
	w      io.Writer
	prefix string
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	if _, err := io.WriteString(p.w, p.prefix+string(b)); err != nil {
		return 0, err
	}
	return len(b), nil
}

// journalHandler prefixes each record its inner handler writes with its level's
// journalPriority.
type journalHandler struct {
	slog.Handler
	out *prefixWriter
}

func (h journalHandler) Handle(ctx context.Context, r slog.Record) error {
	h.out.mu.Lock()
	defer h.out.mu.Unlock()
	h.out.prefix = journalPriority(r.Level)
	return h.Handler.Handle(ctx, r)
}

func (h journalHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return journalHandler{h.Handler.WithAttrs(as), h.out}
}

func (h journalHandler) WithGroup(name string) slog.Handler {
	return journalHandler{h.Handler.WithGroup(name), h.out}
}
