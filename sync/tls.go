package sync

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/asn1"
	"errors"
	"fmt"
	"net"
	"os"
	gosync "sync"
	"time"
)

// TLSOptions says what a rediss:// connection trusts and presents beyond the defaults
// (the system's CAs, no client certificate). The file names are the flags'.
type TLSOptions struct {
	// CAFile holds the PEM certificates of the CAs the server's certificate must chain
	// to, in place of the system's (a private CA: cert-manager, a managed Redis's own).
	CAFile string
	// CertFile and KeyFile hold the client certificate and its key (PEM), presented to
	// a server that asks for one (mutual TLS). Both or neither.
	CertFile, KeyFile string
	// ServerName is the name the server's certificate must carry, in place of the host
	// dialed: the URL's, or on a Cluster each node's address as CLUSTER SLOTS gives it
	// (an IP, most often, where the certificate names the service).
	ServerName string
	// OnReloadError, if set, is told of a file that changed on disk and cannot be used
	// (the previous contents stay in use), once per change.
	OnReloadError func(error)
}

// TLSFiles is the CA pool and client certificate of TLSOptions, re-read from their
// files at every new connection: a certificate renewed on disk (cert-manager renews
// before expiry) is used by the next connection without a restart. Connections
// already open keep the certificates they were made with: TLS checks them at the
// handshake only. A file that changed and cannot be used (a key that does not match
// the certificate while the two are being replaced one after the other, a truncated
// file) leaves the previous contents in use. Safe for concurrent use; one TLSFiles may
// serve several clients.
type TLSFiles struct {
	opts TLSOptions

	mu      gosync.Mutex
	caPEM   []byte
	pool    *x509.CertPool // nil: the system's
	certPEM []byte
	keyPEM  []byte
	cert    *tls.Certificate // nil: none
	caErr   string           // the CA file's error last reported, "" once it is good
	pairErr string           // likewise the certificate's and key's
}

// LoadTLS reads the files of o. A file that cannot be read or used is an error, naming
// it (never quoting a key).
func LoadTLS(o TLSOptions) (*TLSFiles, error) {
	if (o.CertFile == "") != (o.KeyFile == "") {
		return nil, errors.New("redis TLS: a client certificate needs both --redis-tls-cert-file and --redis-tls-key-file")
	}
	f := &TLSFiles{opts: o}
	if o.CAFile != "" {
		b, err := os.ReadFile(o.CAFile)
		if err != nil {
			return nil, fmt.Errorf("redis TLS: reading the CA file: %w", err)
		}
		pool, err := parseCA(o.CAFile, b)
		if err != nil {
			return nil, err
		}
		f.caPEM, f.pool = b, pool
	}
	if o.CertFile != "" {
		c, k, err := readPair(o.CertFile, o.KeyFile)
		if err != nil {
			return nil, err
		}
		cert, err := parsePair(o.CertFile, o.KeyFile, c, k)
		if err != nil {
			return nil, err
		}
		f.certPEM, f.keyPEM, f.cert = c, k, cert
	}
	return f, nil
}

func parseCA(name string, b []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("redis TLS: the CA file %s holds no PEM certificate", name)
	}
	return pool, nil
}

func readPair(certFile, keyFile string) (c, k []byte, err error) {
	if c, err = os.ReadFile(certFile); err != nil {
		return nil, nil, fmt.Errorf("redis TLS: reading the client certificate: %w", err)
	}
	if k, err = os.ReadFile(keyFile); err != nil {
		return nil, nil, fmt.Errorf("redis TLS: reading the client key: %w", err)
	}
	return c, k, nil
}

// parsePair parses a certificate and its key. crypto/tls's errors name neither file
// nor quote the key.
func parsePair(certFile, keyFile string, c, k []byte) (*tls.Certificate, error) {
	cert, err := tls.X509KeyPair(c, k)
	if err != nil {
		return nil, fmt.Errorf("redis TLS: the client certificate %s and key %s: %w", certFile, keyFile, err)
	}
	return &cert, nil
}

// refresh re-reads the files and takes what changed and parses; it returns the pool and
// certificate in use. An error is reported once, until the file is good again.
func (f *TLSFiles) refresh() (*x509.CertPool, *tls.Certificate) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var errs []error
	report := func(last *string, err error) {
		if err == nil {
			*last = ""
		} else if err.Error() != *last {
			*last = err.Error()
			errs = append(errs, err)
		}
	}
	if f.opts.CAFile != "" {
		b, err := os.ReadFile(f.opts.CAFile)
		if err != nil {
			err = fmt.Errorf("redis TLS: reading the CA file: %w", err)
		} else if !bytes.Equal(b, f.caPEM) {
			var pool *x509.CertPool
			if pool, err = parseCA(f.opts.CAFile, b); err == nil {
				f.caPEM, f.pool = b, pool
			}
		}
		report(&f.caErr, err)
	}
	if f.opts.CertFile != "" {
		c, k, err := readPair(f.opts.CertFile, f.opts.KeyFile)
		if err == nil && (!bytes.Equal(c, f.certPEM) || !bytes.Equal(k, f.keyPEM)) {
			var cert *tls.Certificate
			if cert, err = parsePair(f.opts.CertFile, f.opts.KeyFile, c, k); err == nil {
				f.certPEM, f.keyPEM, f.cert = c, k, cert
			}
		}
		report(&f.pairErr, err)
	}
	if len(errs) > 0 && f.opts.OnReloadError != nil {
		f.opts.OnReloadError(fmt.Errorf("%w; new connections keep the previous contents", errors.Join(errs...)))
	}
	return f.pool, f.cert
}

// dialer returns the dial function of a rediss:// client: a TLS connection to addr,
// made with base (its MinVersion, a skip_verify) and the files as they are now, the
// server's certificate checked against TLSOptions.ServerName, else base's ServerName
// (the standalone URL's host), else the host of addr (a Cluster node's). f may be nil:
// the system's CAs and no client certificate.
func (f *TLSFiles) dialer(base *tls.Config, timeout time.Duration) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c := base.Clone()
		if f != nil {
			pool, cert := f.refresh()
			c.RootCAs = pool
			if cert != nil {
				// Presented whatever CAs the server names in its request: crypto/tls
				// would otherwise send none when the certificate chains to another.
				c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
			}
			if f.opts.ServerName != "" {
				c.ServerName = f.opts.ServerName
			}
		}
		if c.ServerName == "" {
			host, _, err := net.SplitHostPort(addr)
			if err != nil {
				host = addr
			}
			c.ServerName = host
		}
		d := &tls.Dialer{NetDialer: &net.Dialer{Timeout: timeout, KeepAliveConfig: keepAlive}, Config: c}
		conn, err := d.DialContext(ctx, network, addr)
		if err != nil {
			var caFile, serverName string
			if f != nil {
				caFile, serverName = f.opts.CAFile, f.opts.ServerName
			}
			return nil, tlsHint(err, caFile, serverName)
		}
		return checkable(conn.(*tls.Conn)), nil
	}
}

// keepAlive is go-redis's own dialer's TCP keep-alive (probes after 30 s idle, the
// peer dead after 3 unanswered 5 s apart), which a client with its own dialer loses.
var keepAlive = net.KeepAliveConfig{Enable: true, Idle: 30 * time.Second, Interval: 5 * time.Second, Count: 3}

// tlsHint adds to a certificate the client does not trust what to do about it. caFile
// is --redis-tls-ca-file ("" when not given): when it was, the hint to give one would
// send the operator looking for a mistake in the flag rather than in the file. The same
// for serverName, --redis-tls-server-name.
func tlsHint(err error, caFile, serverName string) error {
	var unknown x509.UnknownAuthorityError
	if errors.As(err, &unknown) {
		if caFile != "" {
			return fmt.Errorf("%w (the CA file %s holds no certificate of the CA that issued the server's)", err, caFile)
		}
		return fmt.Errorf("%w (a private CA? give its certificate in --redis-tls-ca-file)", err)
	}
	var name x509.HostnameError
	if errors.As(err, &name) {
		if name.Certificate != nil && !hasSANs(name.Certificate) {
			return fmt.Errorf("%w (the certificate has no subject alternative names, and its Common Name is not checked, so no name matches it: reissue it with the server's names or IPs as subject alternative names)", err)
		}
		if serverName != "" {
			// Not "can be given in --redis-tls-server-name" to an operator who gave it.
			return fmt.Errorf("%w (--redis-tls-server-name is %q: give a name the certificate carries)", err, serverName)
		}
		return fmt.Errorf("%w (the name the certificate carries can be given in --redis-tls-server-name)", err)
	}
	return err
}

// hasSANs reports whether c has the subject alternative name extension, without which
// crypto/x509 matches c to no host (its Common Name is not read): Redis's own
// utils/gen-test-certs.sh makes such certificates.
func hasSANs(c *x509.Certificate) bool {
	for _, e := range c.Extensions {
		if e.Id.Equal(oidSAN) {
			return true
		}
	}
	return false
}

var oidSAN = asn1.ObjectIdentifier{2, 5, 29, 17}
