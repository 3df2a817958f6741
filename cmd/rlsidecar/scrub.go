package main

import (
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
)

// scrubber keeps a secret (the Redis password) out of the daemon's logs: every record's
// message and attributes are searched for it, whatever quotes it. The daemon never logs
// the password itself, but a Redis server, or a proxy in front of one, may quote a
// command's arguments in an error ("ERR unknown command 'auth', with args beginning
// with: ..."), and such errors are logged as they come. Logging is not on the hot path.
type scrubber struct {
	secret atomic.Pointer[string]
}

// set names the secret; one shorter than 4 bytes is not searched for (it would blank
// out common words, and hides nothing a guess would not find).
func (s *scrubber) set(secret string) {
	if len(secret) >= 4 {
		s.secret.Store(&secret)
	}
}

// replace is a slog.HandlerOptions.ReplaceAttr.
func (s *scrubber) replace(_ []string, a slog.Attr) slog.Attr {
	p := s.secret.Load()
	if p == nil {
		return a
	}
	var text string
	switch v := a.Value.Resolve(); v.Kind() {
	case slog.KindString:
		text = v.String()
	case slog.KindAny:
		switch x := v.Any().(type) {
		case error:
			text = x.Error()
		case fmt.Stringer:
			text = x.String()
		default:
			return a
		}
	default:
		return a
	}
	if strings.Contains(text, *p) {
		a.Value = slog.StringValue(strings.ReplaceAll(text, *p, "xxxxx"))
	}
	return a
}
