package kubeapi

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"time"
)

// pki is what the server's TLS and ServiceAccount tokens need, as files in
// one directory.
type pki struct {
	CAFile   string // the CA that signed the serving certificate (PEM)
	CAData   []byte // its contents, for kubeconfigs
	CertFile string // kube-apiserver's serving certificate
	KeyFile  string // and its key
	SAKey    string // the ServiceAccount token signing key (private, PEM)
	SAPub    string // its public half, for verifying tokens
}

// certValidity is long enough for any test run and short enough that a
// leaked certificate is worthless soon.
const certValidity = 48 * time.Hour

// writePKI makes a fresh CA, a serving certificate for the addresses and
// names a client may use to reach the server, and a ServiceAccount signing
// key, and writes them into dir.
func writePKI(dir string, addrs []netip.Addr, names []string) (*pki, error) {
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: CA key: %w", err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "weft-test-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(certValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: CA certificate: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: CA certificate: %w", err)
	}
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: serving key: %w", err)
	}
	srvTmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(certValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     names,
	}
	for _, a := range addrs {
		srvTmpl.IPAddresses = append(srvTmpl.IPAddresses, net.IP(a.AsSlice()))
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, ca, &srvKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: serving certificate: %w", err)
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: ServiceAccount key: %w", err)
	}
	p := &pki{
		CAFile:   filepath.Join(dir, "ca.crt"),
		CertFile: filepath.Join(dir, "apiserver.crt"),
		KeyFile:  filepath.Join(dir, "apiserver.key"),
		SAKey:    filepath.Join(dir, "sa.key"),
		SAPub:    filepath.Join(dir, "sa.pub"),
	}
	p.CAData = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	files := []struct {
		path string
		typ  string
		der  func() ([]byte, error)
		mode os.FileMode
	}{
		{p.CertFile, "CERTIFICATE", func() ([]byte, error) { return srvDER, nil }, 0o644},
		{p.KeyFile, "EC PRIVATE KEY", func() ([]byte, error) { return x509.MarshalECPrivateKey(srvKey) }, 0o600},
		{p.SAKey, "EC PRIVATE KEY", func() ([]byte, error) { return x509.MarshalECPrivateKey(saKey) }, 0o600},
		{p.SAPub, "PUBLIC KEY", func() ([]byte, error) { return x509.MarshalPKIXPublicKey(&saKey.PublicKey) }, 0o644},
	}
	if err := os.WriteFile(p.CAFile, p.CAData, 0o644); err != nil {
		return nil, fmt.Errorf("kubeapi: %w", err)
	}
	for _, f := range files {
		der, err := f.der()
		if err != nil {
			return nil, fmt.Errorf("kubeapi: encoding %s: %w", f.path, err)
		}
		if err := os.WriteFile(f.path, pem.EncodeToMemory(&pem.Block{Type: f.typ, Bytes: der}), f.mode); err != nil {
			return nil, fmt.Errorf("kubeapi: %w", err)
		}
	}
	return p, nil
}

// serial is a random 128-bit certificate serial number.
func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		panic(fmt.Sprintf("kubeapi: crypto/rand failed: %v", err)) // crypto/rand never fails on Linux
	}
	return n
}
