package sync

import (
	"context"
	"fmt"
	"os"
	"strings"
	gosync "sync"
)

// PasswordFile is a Redis password read from a file, and read again at every new
// connection to Redis, as the TLS files are: a password rotated in Redis (ACL SETUSER
// <user> ><new>, CONFIG SET requirepass) and written to the file is used by the next
// connection, with no restart. Before, the file was read once at start: connections
// made after a rotation (Redis restarted, or the clients killed) failed WRONGPASS until
// the daemon was restarted, every rule meanwhile on its failure policy. Connections
// already open stay authenticated as they were: Redis checks the password at AUTH only.
// A file that changes to something unusable (emptied, unreadable) leaves the previous
// password in use. Safe for concurrent use; one PasswordFile may serve several clients.
type PasswordFile struct {
	name string
	// onError, if set, is told of a file that changed and cannot be used, once per
	// error; onChange, of each password read that differs from the one before.
	onError  func(error)
	onChange func(password string)

	mu      gosync.Mutex
	current string
	lastErr string // the error last reported, "" once the file is good
}

// LoadPasswordFile reads the password in name (its trailing newlines dropped). An
// unreadable or empty file is an error. onError (may be nil) is called with each error
// of a later read, once until the file is good again, the previous password kept;
// onChange (may be nil) with each new password a later read finds (to keep it out of
// the logs).
func LoadPasswordFile(name string, onError func(error), onChange func(password string)) (*PasswordFile, error) {
	if v := os.Getenv(PasswordEnv); v != "" {
		return nil, fmt.Errorf("redis: --redis-password-file and $%s both set: give one", PasswordEnv)
	}
	p, err := readPasswordFile(name)
	if err != nil {
		return nil, err
	}
	return &PasswordFile{name: name, onError: onError, onChange: onChange, current: p}, nil
}

// Password returns the password as the file now holds it, else the last good one.
func (f *PasswordFile) Password() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, err := readPasswordFile(f.name)
	if err != nil {
		if err.Error() != f.lastErr {
			f.lastErr = err.Error()
			if f.onError != nil {
				f.onError(fmt.Errorf("%w; new connections keep the previous password", err))
			}
		}
		return f.current
	}
	f.lastErr = ""
	if p != f.current {
		f.current = p
		if f.onChange != nil {
			f.onChange(p)
		}
	}
	return f.current
}

// credentials is a go-redis CredentialsProviderContext for user and the file's
// password.
func (f *PasswordFile) credentials(user string) func(context.Context) (string, string, error) {
	return func(context.Context) (string, string, error) { return user, f.Password(), nil }
}

// readPasswordFile reads a password file: its trailing "\r" and "\n" dropped; empty, an
// error.
func readPasswordFile(name string) (string, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return "", fmt.Errorf("reading the Redis password file: %w", err)
	}
	p := strings.TrimRight(string(b), "\r\n")
	if p == "" {
		return "", fmt.Errorf("the Redis password file %s is empty", name)
	}
	return p, nil
}
