package redistest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a private certificate authority for TLS tests: no system trusts it, so a client
// reaches a server whose certificate it issued only when told to trust CertFile. Its
// methods are safe for concurrent use.
type CA struct {
	// CertFile is the CA certificate, PEM: what a client or server is told to trust.
	CertFile string

	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// NewCA makes a CA named name, its files in a temp dir of t.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	der, key := makeCert(t, &x509.Certificate{
		Subject:               pkix.Name{CommonName: name},
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}, nil, nil)
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{cert: cert, key: key, CertFile: filepath.Join(t.TempDir(), "ca.crt")}
	writePEM(t, ca.CertFile, "CERTIFICATE", der)
	return ca
}

// Issue makes a certificate and key for cn, signed by the CA, good for a server at
// 127.0.0.1 or localhost and for a client (both extended key usages: a cluster node is
// both), and returns their PEM files, in a temp dir of t of their own.
func (ca *CA) Issue(t testing.TB, cn string) (certFile, keyFile string) {
	t.Helper()
	dir := t.TempDir()
	certFile = filepath.Join(dir, cn+".crt")
	keyFile = filepath.Join(dir, cn+".key")
	ca.IssueTo(t, cn, certFile, keyFile)
	return certFile, keyFile
}

// IssueTo is Issue writing the files at certFile and keyFile, replacing what they hold
// (as a rotation does), each by a rename so that no reader sees half a file.
func (ca *CA) IssueTo(t testing.TB, cn, certFile, keyFile string) {
	t.Helper()
	ca.issueTo(t, cn, certFile, keyFile, true)
}

// issueTo is IssueTo; without sans, the certificate names cn in its Common Name only.
func (ca *CA) issueTo(t testing.TB, cn, certFile, keyFile string, sans bool) {
	t.Helper()
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: cn},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	if sans {
		tmpl.DNSNames = []string{"localhost"}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
	}
	der, key := makeCert(t, tmpl, ca.cert, ca.key)
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, certFile, "CERTIFICATE", der)
	writePEM(t, keyFile, "PRIVATE KEY", keyDER)
}

// ClientConfig returns a tls.Config that trusts the CA and presents the certificate in
// certFile and keyFile ("" for none).
func (ca *CA) ClientConfig(t testing.TB, certFile, keyFile string) *tls.Config {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	c := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if certFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			t.Fatal(err)
		}
		c.Certificates = []tls.Certificate{pair}
	}
	return c
}

// makeCert signs tmpl, given a fresh key, a serial number and a day's validity (from an
// hour ago), with parentKey as parent, or by itself when parent is nil; it returns the
// certificate (DER) and its key.
func makeCert(t testing.TB, tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) ([]byte, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl.SerialNumber = serial(t)
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour)
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	return der, key
}

func serial(t testing.TB) *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// TLS makes a server (or every node of a cluster) serve TLS only (port 0, tls-port) with
// a certificate the CA issued; see WithTLS.
type TLS struct {
	// CA issues the server's certificate and is the one it trusts for clients'.
	CA *CA
	// AuthClients makes the server refuse a client that presents no certificate the CA
	// issued (tls-auth-clients yes: mutual TLS); else it asks for none.
	AuthClients bool
	// CommonNameOnly gives the server a certificate that names it ("redis-server") in
	// its Common Name only, with no subject alternative names, as Redis's
	// utils/gen-test-certs.sh makes them: Go's TLS clients accept it by no name. This
	// package then checks the certificate's chain, not its name.
	CommonNameOnly bool
}

// WithTLS makes StartStandalone's server, or StartCluster's nodes (tls-cluster yes: the
// cluster bus too), serve TLS only, on Addr, with a certificate for 127.0.0.1 that
// c.CA issued.
func WithTLS(c TLS) Option {
	return func(cfg *config) { cfg.tls = &c }
}

// tlsFiles are the files of a TLS server: its certificate and key, which it presents
// to clients and, on a cluster, to the other nodes; and the client configuration this
// package reaches it with.
type tlsFiles struct {
	cert, key string
	client    *tls.Config
}

// serverTLS issues the certificate of a TLS server (or of every node of a cluster).
func serverTLS(t testing.TB, c *TLS) *tlsFiles {
	t.Helper()
	if !c.CommonNameOnly {
		cert, key := c.CA.Issue(t, "redis-server")
		return &tlsFiles{cert: cert, key: key, client: c.CA.ClientConfig(t, cert, key)}
	}
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "redis-server.crt"), filepath.Join(dir, "redis-server.key")
	c.CA.issueTo(t, "redis-server", cert, key, false)
	client := c.CA.ClientConfig(t, cert, key)
	roots := client.RootCAs
	client.InsecureSkipVerify = true // the name: checked below, the chain only
	client.VerifyConnection = func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("redistest: no server certificate")
		}
		_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: roots})
		return err
	}
	return &tlsFiles{cert: cert, key: key, client: client}
}
