package sync

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// PasswordEnv is the environment variable a Redis password is read from when the URL
// carries none and no password file is given. A password given this way (or in a file)
// never appears in the process list.
const PasswordEnv = "RLSIDECAR_REDIS_PASSWORD"

// Config says how to reach Redis. Exactly one of URL and Cluster is set.
type Config struct {
	// URL of a standalone Redis: redis://[user@]host:port[/db] or rediss:// for TLS.
	// A password in the URL works but shows in `ps`; prefer PasswordFile or PasswordEnv.
	URL string
	// Cluster is the seed nodes of a Redis Cluster, host:port each. A redis:// or
	// rediss:// URL form is accepted too: rediss://[user@]host1:port1,host2:port2.
	Cluster []string
	// PasswordFile holds the password (trailing newline ignored), read again at every
	// new connection (see the PasswordFile type).
	PasswordFile string
	// Passwords, when set, is the password file as LoadPasswordFile read it, which
	// several clients may share (its errors then reported once); PasswordFile is then
	// not read.
	Passwords *PasswordFile
	// Timeout bounds every Redis call (dial, read, write); default 50ms.
	Timeout time.Duration
	// PoolSize bounds each node's main connection pool; default 16. Pipelines (exact
	// syncs, batched global checks) use a second pool, of up to 10 connections per node
	// (go-redis v9.23.0's DefaultPipelinePoolSize), and the main one when it is busy: a
	// node may see up to PoolSize+10 connections from each client Open returns.
	PoolSize int
	// TLS is the CA and client certificate of a rediss:// URL (LoadTLS); nil: the
	// system's CAs and no client certificate. Set with a redis:// URL, an error.
	TLS *TLSFiles
}

// MaxConns is the most connections one client Open returns may hold to the Redis the
// config names: its pool (PoolSize) and go-redis's pool for pipelines
// (redis.DefaultPipelinePoolSize) to each node, counting one node for a URL and the
// addresses given for a Cluster (a Cluster with more masters than were given has more).
func (c Config) MaxConns() int {
	pool := c.PoolSize
	if pool <= 0 {
		pool = defaultPoolSize
	}
	nodes := 1
	if len(c.Cluster) > 0 {
		if addrs, _, _, _, err := parseCluster(c.Cluster); err == nil {
			nodes = max(len(addrs), 1)
		}
	}
	return (pool + redis.DefaultPipelinePoolSize) * nodes
}

// defaultPoolSize is a node's connection pool when Config.PoolSize is not set.
const defaultPoolSize = 16

// Open connects (lazily) to the Redis the config names.
func Open(cfg Config) (redis.UniversalClient, error) {
	if (cfg.URL == "") == (len(cfg.Cluster) == 0) {
		return nil, errors.New("redis: give either a URL or cluster nodes")
	}
	timeout := cfg.Timeout
	if timeout <= 0 {
		timeout = 50 * time.Millisecond
	}
	pool := cfg.PoolSize
	if pool <= 0 {
		pool = defaultPoolSize
	}
	pwFile, err := cfg.passwords()
	if err != nil {
		return nil, err
	}
	password := os.Getenv(PasswordEnv)
	if pwFile != nil {
		password = pwFile.Password()
	}
	// A password in the URL and another source: which one a reader of the unit meant
	// is a guess (the URL's won, and a rotated file was silently not used).
	if p, _ := cfg.urlPassword(); p != "" && password != "" {
		if cfg.PasswordFile != "" {
			return nil, errors.New("redis: a password in the URL and --redis-password-file: give one")
		}
		return nil, fmt.Errorf("redis: a password in the URL and in $%s: give one", PasswordEnv)
	}
	if cfg.URL != "" {
		if err := checkURL(cfg.URL); err != nil {
			return nil, fmt.Errorf("redis URL %s: %w", redactURL(cfg.URL), quoteless(cfg.URL, err))
		}
		opt, err := redis.ParseURL(cfg.URL)
		if err != nil {
			return nil, fmt.Errorf("redis URL %s: %w", redactURL(cfg.URL), quoteless(cfg.URL, urlErr(err)))
		}
		if opt.Password == "" {
			if pwFile != nil {
				opt.CredentialsProviderContext = pwFile.credentials(opt.Username)
			} else {
				opt.Password = password
			}
		}
		if err := cfg.checkTLS(opt.TLSConfig); err != nil {
			return nil, err
		}
		opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout = timeout, timeout, timeout
		opt.Dialer = redis.NewDialer(opt)
		if opt.TLSConfig != nil {
			opt.Dialer = cfg.TLS.dialer(opt.TLSConfig, timeout)
		}
		opt.Dialer = noDialGate(opt.Dialer) // a call that needs a connection always dials
		opt.PoolSize = pool
		opt.MaxRetries = -1   // the caller's failure policy decides, not a retry loop
		opt.DialerRetries = 1 // nor a dial retried within the call (go-redis: 5, 100 ms apart)
		opt.ContextTimeoutEnabled = true
		opt.DisableIdentity = true // one round trip fewer in a new connection's first call
		opt.MaintNotificationsConfig = noMaintNotifications()
		return redis.NewClient(opt), nil
	}
	addrs, user, urlPass, useTLS, err := parseCluster(cfg.Cluster)
	if err != nil {
		return nil, err
	}
	if urlPass != "" {
		password = urlPass
	}
	var credentials func(context.Context) (string, string, error)
	if urlPass == "" && pwFile != nil {
		credentials = pwFile.credentials(user)
	}
	opt := &redis.ClusterOptions{
		Addrs:    addrs,
		Username: user,
		Password: password,
		// The password file read at each new connection to a node (PasswordFile).
		CredentialsProviderContext: credentials,
		DialTimeout:                timeout,
		ReadTimeout:                timeout,
		WriteTimeout:               timeout,
		PoolSize:                   pool,
		MaxRetries:                 -1,
		DialerRetries:              1,
		ContextTimeoutEnabled:      true,
		// Each node's client takes both (noMaintNotifications).
		DisableIdentity:          true,
		MaintNotificationsConfig: noMaintNotifications(),
	}
	if useTLS {
		// No ServerName: each node's certificate is checked against the host of the
		// node's address, or TLSOptions.ServerName.
		opt.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
		opt.Dialer = cfg.TLS.dialer(opt.TLSConfig, timeout)
	} else {
		d := &net.Dialer{Timeout: timeout, KeepAliveConfig: keepAlive} // go-redis's own
		opt.Dialer = d.DialContext
	}
	opt.Dialer = noDialGate(opt.Dialer) // a call that needs a connection always dials
	if err := cfg.checkTLS(opt.TLSConfig); err != nil {
		return nil, err
	}
	cc := redis.NewClusterClient(opt)
	cc.OnNewNode(func(c *redis.Client) { c.AddHook(noEmptySlotMap{}) })
	return cc, nil
}

// noMaintNotifications turns off go-redis's maintenance notifications; with
// DisableIdentity it spares two of the round trips that go-redis v9.23.0 makes to set a
// connection up, which it does when a call first takes the connection, within that
// call's deadline: HELLO; CLIENT MAINT_NOTIFICATIONS on a client's first connection
// (each Cluster node's; on every connection where Redis accepts it); CLIENT SETINFO
// twice (lib-name, lib-ver, pipelined); then the call. After a timed-out call has
// closed its connection, the next call (a new key's exact sync, bounded by FetchWait,
// 25 ms; a global check) opens another, and on a host short of CPU those round trips
// made it miss its bound and answer degraded (docs/reliability.md, "Known
// limitations"). What is lost: CLIENT LIST shows no lib-name or lib-ver for the daemon's
// connections, and a Redis that announces its maintenance (Redis Cloud, Enterprise;
// 7.0 refuses the command) does not get the daemon to move its connections ahead.
func noMaintNotifications() *maintnotifications.Config {
	return &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
}

// errEmptySlotMap is what noEmptySlotMap makes of a CLUSTER SLOTS reply listing no slot.
var errEmptySlotMap = errors.New("redis: CLUSTER SLOTS listed no slot (a node removed from the cluster, or not yet in it)")

// noEmptySlotMap makes a CLUSTER SLOTS reply that lists no slot an error, on each node
// of a Cluster client, so that go-redis reads the slot map from another node. It reads
// the map from a node it picks at random among those it knows, and a node removed with
// `redis-cli --cluster del-node` is reset and keeps running until stopped: it lists no
// slot, and go-redis took that for the Cluster's map, sending each command to a random
// node, the removed one among them, which refuses every key (CLUSTERDOWN Hash slot not
// served). Until the next reload the daemon's calls failed or took a redirection.
type noEmptySlotMap struct{}

func (noEmptySlotMap) DialHook(next redis.DialHook) redis.DialHook { return next }

func (noEmptySlotMap) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if c, ok := cmd.(*redis.ClusterSlotsCmd); ok && err == nil && len(c.Val()) == 0 {
			err = errEmptySlotMap
			c.SetErr(err)
		}
		return err
	}
}

func (noEmptySlotMap) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// checkTLS refuses TLS files without TLS (a redis:// URL: the daemon would talk to
// Redis in the clear, its operator believing otherwise), and a CA file beside a
// rediss:// URL's skip_verify=true, which would not check the server against it.
func (cfg Config) checkTLS(base *tls.Config) error {
	switch {
	case cfg.TLS == nil:
		return nil
	case base == nil:
		return errors.New("redis: TLS options (--redis-tls-*) need a rediss:// URL (on a Cluster, rediss://host:port,host:port); this one is in the clear")
	case base.InsecureSkipVerify && cfg.TLS.opts.CAFile != "":
		return errors.New("redis: the URL's skip_verify=true checks no certificate: drop it, or --redis-tls-ca-file")
	}
	return nil
}

// Password returns the password Open authenticates with: the URL's, else the file's, else
// $RLSIDECAR_REDIS_PASSWORD's; "" for none. The daemon keeps it out of its logs.
func (cfg Config) Password() (string, error) {
	if p, ok := cfg.urlPassword(); ok {
		return p, nil
	}
	if cfg.Passwords != nil {
		return cfg.Passwords.Password(), nil
	}
	return readPassword(cfg.PasswordFile)
}

// urlPassword returns the password the URL (or the cluster URL) holds; ok when it holds
// one.
func (cfg Config) urlPassword() (string, bool) {
	if cfg.URL != "" {
		if u, err := url.Parse(cfg.URL); err == nil && u.User != nil {
			if p, ok := u.User.Password(); ok && p != "" {
				return p, true
			}
		}
	} else if len(cfg.Cluster) > 0 {
		if _, _, p, _, err := parseCluster(cfg.Cluster); err == nil && p != "" {
			return p, true
		}
	}
	return "", false
}

// passwords returns the password file Open reads at each new connection: Passwords,
// else PasswordFile loaded; nil for none.
func (cfg Config) passwords() (*PasswordFile, error) {
	if cfg.Passwords != nil {
		return cfg.Passwords, nil
	}
	if cfg.PasswordFile == "" {
		return nil, nil
	}
	return LoadPasswordFile(cfg.PasswordFile, nil, nil)
}

// readPassword reads the password from file, else from $RLSIDECAR_REDIS_PASSWORD. Both
// set, or an empty file, is an error: the one not used, or an empty password, would
// otherwise show only as Redis refusing the daemon (WRONGPASS, NOAUTH).
func readPassword(file string) (string, error) {
	if file != "" {
		f, err := LoadPasswordFile(file, nil, nil)
		if err != nil {
			return "", err
		}
		return f.Password(), nil
	}
	return os.Getenv(PasswordEnv), nil
}

// parseCluster accepts host:port entries, or one URL redis[s]://[user[:pass]@]h1:p1,h2:p2.
func parseCluster(nodes []string) (addrs []string, user, pass string, useTLS bool, err error) {
	if len(nodes) == 1 && strings.Contains(nodes[0], "://") {
		u, perr := url.Parse(nodes[0])
		if perr != nil {
			return nil, "", "", false, fmt.Errorf("redis cluster URL %s: %w", redactURL(nodes[0]), quoteless(nodes[0], urlErr(perr)))
		}
		switch u.Scheme {
		case "redis":
		case "rediss":
			useTLS = true
		default:
			return nil, "", "", false, fmt.Errorf("redis cluster URL: scheme %q: use redis:// or rediss://", u.Scheme)
		}
		// A query or a database the cluster client would not read: refused, as the
		// standalone URL's are, rather than dropped (?password=… silently left the daemon
		// unauthenticated, NOAUTH at every call; a Cluster has database 0 only).
		if u.RawQuery != "" || u.ForceQuery {
			return nil, "", "", false, fmt.Errorf("redis cluster URL %s: options after '?' are not read: give the password as redis://[user]:password@host1:port1,host2:port2, --redis-password-file or $%s", redactURL(nodes[0]), PasswordEnv)
		}
		if u.Path != "" && u.Path != "/" && u.Path != "/0" {
			return nil, "", "", false, fmt.Errorf("redis cluster URL %s: a Redis Cluster has database 0 only", redactURL(nodes[0]))
		}
		if u.User != nil {
			user = u.User.Username()
			pass, _ = u.User.Password()
		}
		nodes = strings.Split(u.Host, ",")
	}
	for _, n := range nodes {
		for _, a := range strings.Split(n, ",") {
			a = strings.TrimSpace(a)
			if a == "" {
				continue
			}
			if strings.Contains(a, "/") || strings.Contains(a, "@") {
				// A second URL (redis://:pw@h1:1,redis://:pw@h2:2) would make "redis:" a
				// node; the error must not quote it, password and all.
				return nil, "", "", false, errors.New("redis cluster: give host:port nodes, or one URL with every node in its host part: redis://[user:password@]host1:port1,host2:port2")
			}
			host, port, err := net.SplitHostPort(a)
			if err != nil || host == "" || !isPort(port) {
				// Quoted redacted: a node written host:port?password=… must not show it.
				return nil, "", "", false, fmt.Errorf("redis cluster node %q: want host:port, the port 1 to 65535", redactBare(a))
			}
			addrs = append(addrs, a)
		}
	}
	if len(addrs) == 0 {
		return nil, "", "", false, errors.New("redis cluster: no nodes")
	}
	return addrs, user, pass, useTLS, nil
}

// checkURL refuses what go-redis would read as another Redis than the one meant: a
// redis: or rediss: URL without "//" (redis:pw@host:6380 is an opaque URL, which go-redis
// dials as localhost:6379) or without a host (redis://:pw@/0, the same). The other
// malformations are go-redis's to refuse.
func checkURL(s string) error {
	u, err := url.Parse(s)
	if err != nil {
		return nil // ParseURL refuses it, with its own message
	}
	switch u.Scheme {
	case "redis", "rediss":
		if u.Opaque != "" || u.Host == "" {
			return fmt.Errorf("no host: want %s://[[user]:password@]host[:port][/db] (is the \"//\" missing?)", u.Scheme)
		}
		if p := u.Port(); p != "" && !isPort(p) {
			return fmt.Errorf("port %q: want 1 to 65535", p) // else refused only at the first dial
		}
	}
	return nil
}

// redactURL hides the passwords of the URLs in s, for error messages and logs: in each
// scheme://userinfo@host, the password of user:password, and a lone name whole
// (redis-cli reads redis://secret@host as a password, go-redis as a user name). It works
// on the text, not on a parse, so that a malformed URL, or several in one flag (a Cluster
// given as redis://:pw@h1:1,redis://:pw@h2:2), shows none of its passwords either.
func redactURL(s string) string {
	var b strings.Builder
	for {
		i := strings.Index(s, "://")
		if i < 0 {
			b.WriteString(redactBare(s))
			return b.String()
		}
		b.WriteString(s[:i+3])
		s = s[i+3:]
		end := len(s) // this URL runs to the next one's scheme
		if j := strings.Index(s, "://"); j >= 0 {
			end = j
		}
		seg := s[:end]
		// Up to the last '@', not the authority's end: a password may hold '/', '?' or
		// '#' unescaped, and a '@' in a query only masks more than it must.
		if at := strings.LastIndex(seg, "@"); at >= 0 {
			if k := strings.Index(seg[:at], ":"); k >= 0 {
				b.WriteString(seg[:k])
				b.WriteString(":xxxxx")
			} else {
				b.WriteString("xxxxx")
			}
			seg = seg[at:]
		}
		b.WriteString(redactQuery(seg))
		s = s[end:]
	}
}

// redactBare hides what could be a password in text with no scheme://: everything from
// its first ':' (or its start) to its last '@', so that a URL mistyped without its "//"
// (redis:pw@host:1, :pw@host:1, redis//:pw@host:1) shows none of it either.
func redactBare(s string) string {
	at := strings.LastIndex(s, "@")
	if at < 0 {
		return redactQuery(s)
	}
	k := strings.Index(s[:at], ":")
	if k < 0 {
		return "xxxxx" + redactQuery(s[at:])
	}
	return s[:k] + ":xxxxx" + redactQuery(s[at:])
}

// redactQuery hides the values of the query parameters of seg (the rest of a URL) that
// name a password or a secret (password=, pass=, pwd=, secret=, token=, any case): a
// URL given as redis://host/0?password=s3cret is refused (go-redis takes no such
// option), and the error quoted it whole.
func redactQuery(seg string) string {
	q := strings.IndexByte(seg, '?')
	if q < 0 {
		return seg
	}
	var b strings.Builder
	b.WriteString(seg[:q+1])
	for i, part := range strings.Split(seg[q+1:], "&") {
		if i > 0 {
			b.WriteByte('&')
		}
		name, _, ok := strings.Cut(part, "=")
		switch strings.ToLower(name) {
		case "password", "pass", "pwd", "secret", "token", "auth", "requirepass":
			if ok {
				b.WriteString(name)
				b.WriteString("=xxxxx")
				continue
			}
		}
		b.WriteString(part)
	}
	return b.String()
}

func isPort(s string) bool {
	if s == "" || len(s) > 5 {
		return false
	}
	n := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
		n = n*10 + int(c-'0')
	}
	return n >= 1 && n <= 65535
}

// urlErr is err, an error parsing a Redis URL, without the URL it may quote (net/url's
// errors quote it whole, password included) or the escape that failed (which may be
// part of the password).
func urlErr(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	var esc url.EscapeError
	if errors.As(err, &esc) {
		return errors.New("invalid %-escape (a '%' in a password is written %25)")
	}
	return err
}

// quoteless returns err, about the URL s, unless s has a password that a parser may
// have read as something else, which err may then quote: a '/', '?' or '#' in it,
// unescaped, ends the authority before the '@', and go-redis's error about the
// database number ("MyS3cret@127.0.0.1:6390") or the port (":Hunter2") showed the
// password, or part of it, that redactURL hid in the URL beside. Then a hint instead.
func quoteless(s string, err error) error {
	i := strings.Index(s, "://")
	if i < 0 {
		return err
	}
	at := strings.LastIndex(s[i+3:], "@")
	if at < 0 || !strings.ContainsAny(s[i+3:i+3+at], "/?#") {
		return err
	}
	return errors.New("malformed; is there a '/', '?' or '#' in the password? write them %2F, %3F and %23 (and '%' as %25)")
}

// Redact returns the URL with its password hidden, for logs.
func Redact(s string) string { return redactURL(s) }
