package main

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// scrubber keeps secrets (the Redis passwords) out of the daemon's logs: every record's
// message and attributes are searched for each, whatever quotes it. The daemon never logs
// a password itself, but a Redis server, or a proxy in front of one, may quote a
// command's arguments in an error ("ERR unknown command 'auth', with args beginning
// with: ..."), and such errors are logged as they come. Redis quotes at most 128 bytes
// of them, so a longer password is quoted cut short: the scrubber hides any beginning of
// it of at least scrubMinPrefix bytes too. A password file is read again at each new
// connection, and every password it has held is kept (a rotated one may still be
// quoted by an error about a connection made before). Logging is not on the hot path.
type scrubber struct {
	mu      sync.Mutex
	secrets atomic.Pointer[[]string]
}

// set adds a secret; one shorter than 4 bytes is not searched for (it would blank out
// common words, and hides nothing a guess would not find).
func (s *scrubber) set(secret string) {
	if len(secret) < 4 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var list []string
	if p := s.secrets.Load(); p != nil {
		if slices.Contains(*p, secret) {
			return
		}
		list = slices.Clone(*p)
	}
	list = append(list, secret)
	s.secrets.Store(&list)
}

// replace is a slog.HandlerOptions.ReplaceAttr.
func (s *scrubber) replace(_ []string, a slog.Attr) slog.Attr {
	p := s.secrets.Load()
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
	found := false
	for _, secret := range *p {
		var ok bool
		if text, ok = scrub(text, secret); ok {
			found = true
		}
	}
	if found {
		a.Value = slog.StringValue(text)
	}
	return a
}

// scrubMinPrefix is the shortest beginning of a longer secret that scrub hides: Redis
// cuts a quoted password at 128 bytes (less when other arguments come before it), and
// before, a password of 151 bytes had its first 128 logged, as no whole copy was there
// to hide. Eight bytes of a long secret leave it as hard to guess.
const scrubMinPrefix = 8

// scrub replaces each copy of secret in text, and each beginning of it of at least
// scrubMinPrefix bytes (a copy cut short), with "xxxxx", and reports whether it found
// any. A secret holding '\r' or '\n' is looked for with them as spaces too: Redis maps
// both to spaces in the errors that quote a command's arguments.
func scrub(text, secret string) (string, bool) {
	out, found := scrubCopies(text, secret)
	if spaced := strings.NewReplacer("\r", " ", "\n", " ").Replace(secret); spaced != secret {
		var again bool
		out, again = scrubCopies(out, spaced)
		found = found || again
	}
	return out, found
}

// scrubCopies is scrub for the secret as it is.
func scrubCopies(text, secret string) (string, bool) {
	head := secret[:min(len(secret), scrubMinPrefix)]
	i := strings.Index(text, head)
	if i < 0 {
		return text, false
	}
	var b strings.Builder
	for i >= 0 {
		n := len(head)
		for n < len(secret) && i+n < len(text) && text[i+n] == secret[n] {
			n++
		}
		b.WriteString(text[:i])
		b.WriteString("xxxxx")
		text = text[i+n:]
		i = strings.Index(text, head)
	}
	b.WriteString(text)
	return b.String(), true
}
