package kubeapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/weft-net/weft/e2e"
)

// Defaults of Options.
const (
	DefaultPort         = 6443
	DefaultServiceCIDR  = "10.96.0.0/16"
	DefaultReadyTimeout = 2 * time.Minute
	// etcd listens on these ports of 127.0.0.1 in the server's namespace.
	etcdClientPort = 2379
	etcdPeerPort   = 2380
	// AdminUser is the admin's user name; it is in group system:masters.
	AdminUser = "weft-test-admin"
	// pollInterval is how often readiness is polled.
	pollInterval = 100 * time.Millisecond
	// stopGrace is how long a server process gets after SIGTERM.
	stopGrace = 10 * time.Second
	// logTail is how many log lines a start failure shows.
	logTail = 30
)

// Options configure a Server. The zero value is usable with Start.
type Options struct {
	// Run owns the processes, files and (unless NetNS is given) the
	// namespace. Start makes a fresh e2e test run when it is nil; New needs
	// one.
	Run *e2e.Run
	// NetNS is where etcd and kube-apiserver run; nil makes the namespace
	// <prefix>-kube (several servers in one run: <prefix>-kube2, ...). Give
	// an e2e cluster's Underlay to make the server reachable from its nodes.
	// One server per namespace: etcd takes 127.0.0.1:2379 and :2380 there.
	NetNS *e2e.Netns
	// Address is where kube-apiserver listens, an address of NetNS; zero
	// means 127.0.0.1. With the underlay: e2e.UnderlayGateway.
	Address netip.Addr
	// Port is kube-apiserver's secure port; 0 means DefaultPort.
	Port int
	// ServiceCIDR is --service-cluster-ip-range; "" means DefaultServiceCIDR.
	ServiceCIDR string
	// ReadyTimeout bounds the wait for /readyz; 0 means DefaultReadyTimeout.
	ReadyTimeout time.Duration
	// ExtraArgs are appended to kube-apiserver's command line (later flags
	// win), e.g. "--authorization-mode=RBAC".
	ExtraArgs []string
	// Log receives progress; nil means the run's logger.
	Log *slog.Logger
}

// Server is a running etcd and kube-apiserver in a network namespace.
type Server struct {
	Run  *e2e.Run
	NS   *e2e.Netns // where both processes run
	Bins Bins
	// Addr is where kube-apiserver listens inside NS; URL is https://Addr.
	Addr netip.AddrPort
	URL  string
	Dir  string // certificates, data, logs and kubeconfigs
	// CAFile verifies the server's certificate; CAData is its contents.
	CAFile string
	CAData []byte
	// SAKeyFile signs ServiceAccount tokens (kube-controller-manager's
	// --service-account-private-key-file).
	SAKeyFile string
	// Admin is the cluster admin (group system:masters), as a token, a
	// kubeconfig file and a rest.Config that dials inside NS.
	Admin *Identity

	Etcd      *e2e.Proc
	APIServer *e2e.Proc

	log *slog.Logger
}

// Identity is one user of the server.
type Identity struct {
	User  string // e.g. system:serviceaccount:kube-system:weft
	Token string // bearer token
	// Kubeconfig is a file with the server URL, the CA and the token; it
	// works from any namespace that can reach Server.URL.
	Kubeconfig string
	// Config is the same for client-go, with connections made inside the
	// server's namespace, so it works from the test process.
	Config *rest.Config
}

// Start starts a server for a test and fails the test if it cannot. It skips
// the test when not root (namespaces need root) and in -short mode. Without
// opts.Run it makes a test run of its own, closed in t.Cleanup; with one,
// the caller's run stops the server on Close.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	if uid := os.Geteuid(); uid != 0 {
		t.Skipf("kubeapi: needs root to make network namespaces (running as uid %d)", uid)
	}
	if testing.Short() {
		t.Skip("kubeapi: a real control plane is skipped in -short mode")
	}
	if opts.Run == nil {
		opts.Run = e2e.NewTestRun(t)
	}
	// Stop short of the test binary's own timeout, which would panic without
	// saying why: a cold build of the binaries takes minutes.
	ctx := context.Background()
	if d, ok := t.(interface{ Deadline() (time.Time, bool) }); ok {
		if dl, ok := d.Deadline(); ok {
			var cancel context.CancelFunc
			ctx, cancel = context.WithDeadline(ctx, dl.Add(-startMargin))
			defer cancel()
		}
	}
	s, err := New(ctx, opts)
	if err != nil {
		if ctx.Err() != nil {
			t.Fatalf("%v\n(out of time: if the control-plane binaries were being built, run `make kube-tools` first, or give go test a longer -timeout)", err)
		}
		t.Fatalf("%v", err)
	}
	return s
}

// startMargin is how long before the test binary's timeout Start gives up.
const startMargin = 20 * time.Second

// New builds (or takes from the cache) the binaries, then starts etcd and
// kube-apiserver in opts.NetNS and waits until /readyz answers. What it
// starts belongs to opts.Run, whose Close stops it.
func New(ctx context.Context, opts Options) (*Server, error) {
	if opts.Run == nil {
		return nil, errors.New("kubeapi: Options.Run is required: the server's processes and files belong to an e2e.Run")
	}
	run := opts.Run
	log := opts.Log
	if log == nil {
		log = run.Log()
	}
	if opts.Port == 0 {
		opts.Port = DefaultPort
	}
	if opts.Port < 1 || opts.Port > 65535 {
		return nil, fmt.Errorf("kubeapi: Options.Port %d: give a port between 1 and 65535, or 0 for %d", opts.Port, DefaultPort)
	}
	if !opts.Address.IsValid() {
		opts.Address = netip.MustParseAddr("127.0.0.1")
	}
	if !opts.Address.Is4() {
		return nil, fmt.Errorf("kubeapi: Options.Address %s: give an IPv4 address of the server's namespace", opts.Address)
	}
	if opts.ServiceCIDR == "" {
		opts.ServiceCIDR = DefaultServiceCIDR
	}
	svc, err := netip.ParsePrefix(opts.ServiceCIDR)
	if err != nil || !svc.Addr().Is4() {
		return nil, fmt.Errorf("kubeapi: Options.ServiceCIDR %q: give an IPv4 CIDR such as %s", opts.ServiceCIDR, DefaultServiceCIDR)
	}
	svc = svc.Masked()
	if opts.ReadyTimeout == 0 {
		opts.ReadyTimeout = DefaultReadyTimeout
	}

	bins, err := Binaries(ctx, log)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(run.Dir(), "kubeapi-")
	if err != nil {
		return nil, fmt.Errorf("kubeapi: %w", err)
	}
	nsh := opts.NetNS
	if nsh == nil {
		if nsh, err = newNetns(ctx, run); err != nil {
			return nil, err
		}
	}
	s := &Server{
		Run:  run,
		NS:   nsh,
		Bins: bins,
		Addr: netip.AddrPortFrom(opts.Address, uint16(opts.Port)),
		Dir:  dir,
		log:  log,
	}
	s.URL = "https://" + s.Addr.String()

	names := []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}
	addrs := []netip.Addr{opts.Address, netip.MustParseAddr("127.0.0.1"), svc.Addr().Next()}
	p, err := writePKI(dir, addrs, names)
	if err != nil {
		return nil, err
	}
	s.CAFile, s.CAData, s.SAKeyFile = p.CAFile, p.CAData, p.SAKey
	admin, err := randomToken()
	if err != nil {
		return nil, err
	}
	tokens := filepath.Join(dir, "tokens.csv")
	// token,user,uid,"group1,group2"
	if err := os.WriteFile(tokens, fmt.Appendf(nil, "%s,%s,%s,\"system:masters\"\n", admin, AdminUser, AdminUser), 0o600); err != nil {
		return nil, fmt.Errorf("kubeapi: %w", err)
	}
	if s.Admin, err = s.identity(AdminUser, admin, filepath.Join(dir, "admin.kubeconfig")); err != nil {
		return nil, err
	}

	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdClientPort)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(etcdPeerPort)
	s.Etcd, err = run.Start(nsh, "etcd", filepath.Join(dir, "etcd.log"), bins.Etcd,
		"--name=weft-test",
		"--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+etcdURL,
		"--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL,
		"--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=weft-test="+peerURL,
		"--listen-metrics-urls=",
		"--log-level=warn",
		"--unsafe-no-fsync", // a test's data dies with the test
	)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: %w", err)
	}
	args := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=" + opts.Address.String(),
		"--advertise-address=" + opts.Address.String(),
		"--secure-port=" + strconv.Itoa(opts.Port),
		"--cert-dir=" + dir,
		"--tls-cert-file=" + p.CertFile,
		"--tls-private-key-file=" + p.KeyFile,
		"--service-account-key-file=" + p.SAPub,
		"--service-account-signing-key-file=" + p.SAKey,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--token-auth-file=" + tokens,
		"--authorization-mode=Node,RBAC",
		"--service-cluster-ip-range=" + svc.String(),
		"--allow-privileged=true",
		"--endpoint-reconciler-type=none",
		"--profiling=false",
		"--v=1",
	}
	s.APIServer, err = run.Start(nsh, "kube-apiserver", filepath.Join(dir, "kube-apiserver.log"), append(append([]string{bins.APIServer}, args...), opts.ExtraArgs...)...)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: %w", err)
	}
	// The run's own stop gives a process a few seconds; an API server that
	// is closing watches may need longer. This runs first (Close goes in
	// reverse), and the run's stop then finds it gone.
	for _, p := range []*e2e.Proc{s.Etcd, s.APIServer} {
		run.Defer("stop "+p.Name, func() error { return p.Stop(stopGrace) })
	}
	start := time.Now()
	if err := s.waitReady(ctx, opts.ReadyTimeout); err != nil {
		return nil, err
	}
	log.Info("kubeapi: control plane ready", "url", s.URL, "netns", nsh.Name, "took", time.Since(start).Round(time.Millisecond), "admin-kubeconfig", s.Admin.Kubeconfig)
	return s, nil
}

// newNetns makes <prefix>-kube, or <prefix>-kube2, ... when the run has one.
func newNetns(ctx context.Context, run *e2e.Run) (*e2e.Netns, error) {
	for i := 1; ; i++ {
		name := "kube"
		if i > 1 {
			name += strconv.Itoa(i)
		}
		if _, err := os.Stat(filepath.Join("/run/netns", run.Prefix()+"-"+name)); err == nil {
			continue
		}
		n, err := run.NewNetns(ctx, name)
		if err != nil {
			return nil, fmt.Errorf("kubeapi: %w", err)
		}
		return n, nil
	}
}

// waitReady polls /readyz until it answers 200, a process exits, or the
// timeout passes; the error carries the tail of the logs.
func (s *Server) waitReady(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	hc, err := rest.HTTPClientFor(s.Admin.Config)
	if err != nil {
		return fmt.Errorf("kubeapi: %w", err)
	}
	var last string
	t := time.NewTicker(pollInterval)
	defer t.Stop()
	for {
		for _, p := range []*e2e.Proc{s.Etcd, s.APIServer} {
			if !p.Running() {
				return fmt.Errorf("kubeapi: %s exited before the server was ready (%v)\n%s", p.Name, p.Wait(), s.logTails())
			}
		}
		last = s.probe(ctx, hc)
		if last == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kubeapi: %s/readyz not ready within %s: %s\n%s", s.URL, timeout, last, s.logTails())
		case <-t.C:
		}
	}
}

// probe asks /readyz once and returns "" when ready, else why not.
func (s *Server) probe(ctx context.Context, hc *http.Client) string {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/readyz", nil)
	if err != nil {
		return err.Error()
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	var body bytes.Buffer
	_, _ = body.ReadFrom(http.MaxBytesReader(nil, resp.Body, 64<<10))
	if resp.StatusCode == http.StatusOK {
		return ""
	}
	return fmt.Sprintf("%s: %s", resp.Status, bytes.TrimSpace(body.Bytes()))
}

// logTails is the end of both logs, for errors.
func (s *Server) logTails() string {
	var b strings.Builder
	for _, p := range []*e2e.Proc{s.Etcd, s.APIServer} {
		if p != nil {
			fmt.Fprintf(&b, "--- last %d lines of %s ---\n%s\n", logTail, p.LogPath, tail(p.LogPath, logTail))
		}
	}
	return b.String()
}

// tail returns the last n lines of a file.
func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// DialContext makes a connection from inside the server's namespace; the
// socket stays there whatever thread uses it later. Addresses must be IP
// literals (no name resolution happens inside).
func (s *Server) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var conn net.Conn
	var dialErr error
	err := s.NS.Do(func() error {
		var d net.Dialer
		conn, dialErr = d.DialContext(ctx, network, addr)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("kubeapi: entering netns %s: %w", s.NS.Name, err)
	}
	return conn, dialErr
}

// RESTConfig is a client-go config for token on this server, verifying its
// certificate, with connections made inside the server's namespace and no
// proxy from the environment.
func (s *Server) RESTConfig(token string) *rest.Config {
	return &rest.Config{
		Host:            s.URL,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: s.CAData},
		Dial:            s.DialContext,
		Proxy:           func(*http.Request) (*url.URL, error) { return nil, nil },
		QPS:             200,
		Burst:           400,
		Timeout:         30 * time.Second,
		UserAgent:       "weft-e2e-kubeapi",
	}
}

// identity writes a kubeconfig for user's token to path.
func (s *Server) identity(user, token, path string) (*Identity, error) {
	if err := writeKubeconfig(path, s.URL, s.CAData, user, token); err != nil {
		return nil, err
	}
	return &Identity{User: user, Token: token, Kubeconfig: path, Config: s.RESTConfig(token)}, nil
}

// Clientset is a typed client for the admin.
func (s *Server) Clientset() (kubernetes.Interface, error) {
	cs, err := kubernetes.NewForConfig(s.Admin.Config)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: admin client: %w", err)
	}
	return cs, nil
}

// minTokenTTL is the shortest token the API server issues.
const minTokenTTL = 10 * time.Minute

// ServiceAccount issues a token for the ServiceAccount namespace/name (which
// must exist, e.g. from applying deploy/weft.yaml) through the TokenRequest
// API, as the kubelet does for a pod, and writes a kubeconfig for it. ttl 0
// means an hour; the server refuses less than ten minutes.
func (s *Server) ServiceAccount(ctx context.Context, namespace, name string, ttl time.Duration) (*Identity, error) {
	if ttl == 0 {
		ttl = time.Hour
	}
	if ttl < minTokenTTL {
		return nil, fmt.Errorf("kubeapi: token lifetime %s for %s/%s: give at least %s", ttl, namespace, name, minTokenTTL)
	}
	cs, err := s.Clientset()
	if err != nil {
		return nil, err
	}
	secs := int64(ttl / time.Second)
	tr, err := cs.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &secs},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("kubeapi: token for ServiceAccount %s/%s (does it exist?): %w", namespace, name, err)
	}
	user := "system:serviceaccount:" + namespace + ":" + name
	f, err := os.CreateTemp(s.Dir, "sa-"+namespace+"-"+name+"-*.kubeconfig")
	if err != nil {
		return nil, fmt.Errorf("kubeapi: %w", err)
	}
	path := f.Name()
	f.Close()
	return s.identity(user, tr.Status.Token, path)
}

// Kubectl runs kubectl as the admin inside the server's namespace and
// returns its standard output. A failure is an error with its standard
// error.
func (s *Server) Kubectl(ctx context.Context, args ...string) ([]byte, error) {
	return s.KubectlIn(ctx, nil, s.Admin.Kubeconfig, nil, args...)
}

// KubectlIn runs kubectl with kubeconfig inside ns (nil: the server's
// namespace), with stdin (may be nil), and returns its standard output.
func (s *Server) KubectlIn(ctx context.Context, ns *e2e.Netns, kubeconfig string, stdin []byte, args ...string) ([]byte, error) {
	if ns == nil {
		ns = s.NS
	}
	argv := append([]string{"--kubeconfig=" + kubeconfig, "--cache-dir=" + filepath.Join(s.Dir, "kubectl-cache")}, args...)
	cmd := exec.CommandContext(ctx, s.Bins.Kubectl, argv...)
	cmd.Env = kubectlEnv()
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	var runErr error
	if err := ns.Do(func() error { runErr = cmd.Run(); return nil }); err != nil {
		return nil, fmt.Errorf("kubeapi: entering netns %s: %w", ns.Name, err)
	}
	if runErr != nil {
		return stdout.Bytes(), &KubectlError{Args: args, NS: ns.Name, Err: runErr, Stderr: strings.TrimSpace(stderr.String())}
	}
	return stdout.Bytes(), nil
}

// KubectlError is a kubectl run that failed.
type KubectlError struct {
	Args   []string
	NS     string
	Err    error  // usually an *exec.ExitError
	Stderr string // what kubectl said
}

func (e *KubectlError) Error() string {
	return fmt.Sprintf("kubectl %s (in netns %s): %v: %s", strings.Join(e.Args, " "), e.NS, e.Err, e.Stderr)
}

func (e *KubectlError) Unwrap() error { return e.Err }

// ExitCode is kubectl's exit status, or -1 if it did not run to an exit.
func (e *KubectlError) ExitCode() int {
	var ee *exec.ExitError
	if errors.As(e.Err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

// kubectlEnv is the environment without proxies and kubeconfig settings
// that would send kubectl elsewhere.
func kubectlEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch strings.ToUpper(k) {
		case "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "KUBECONFIG":
			continue
		}
		env = append(env, kv)
	}
	return env
}

// randomToken is 32 random hex characters.
func randomToken() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("kubeapi: random token: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// Apply runs `kubectl apply -f` as the admin for each path, a file or a
// directory (for -k use Kubectl).
func (s *Server) Apply(ctx context.Context, paths ...string) error {
	for _, p := range paths {
		if _, err := s.Kubectl(ctx, "apply", "-f", p); err != nil {
			return err
		}
	}
	return nil
}

// ApplyWeft applies deploy/weft.yaml of the repository: the weft
// ServiceAccount, its RBAC and the DaemonSet (which nothing runs here: the
// server has no kubelet nor controllers).
func (s *Server) ApplyWeft(ctx context.Context) error {
	dir, err := DeployDir()
	if err != nil {
		return err
	}
	return s.Apply(ctx, filepath.Join(dir, "weft.yaml"))
}

// CreateNode registers a Node as a kubelet would (the server has none):
// with internalIP as its InternalIP address, Ready, and NetworkUnavailable
// true until a pod network clears it, as a cloud's route controller leaves
// new nodes.
func (s *Server) CreateNode(ctx context.Context, name string, internalIP netip.Addr) (*corev1.Node, error) {
	cs, err := s.Clientset()
	if err != nil {
		return nil, err
	}
	now := metav1.Now()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name}}}
	created, err := cs.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("kubeapi: creating node %s: %w", name, err)
	}
	created.Status = corev1.NodeStatus{
		Addresses: []corev1.NodeAddress{
			{Type: corev1.NodeInternalIP, Address: internalIP.String()},
			{Type: corev1.NodeHostName, Address: name},
		},
		Conditions: []corev1.NodeCondition{
			{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastHeartbeatTime: now, LastTransitionTime: now},
			{Type: corev1.NodeNetworkUnavailable, Status: corev1.ConditionTrue, Reason: "NoRouteCreated", Message: "no pod network yet", LastTransitionTime: now},
		},
	}
	updated, err := cs.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("kubeapi: setting the status of node %s: %w", name, err)
	}
	return updated, nil
}
