package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/weft-net/weft/bridge"
	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/kube"
	"github.com/weft-net/weft/mesh"
	"github.com/weft-net/weft/state"
	"github.com/weft-net/weft/tunnel"
	"github.com/weft-net/weft/tunnel/crypt"
)

// Version is set at link time by the Makefile.
var Version = "dev"

// reconcileEvery is how often the bridge and its rules are re-ensured, so
// that a bridge or table deleted by hand comes back without a restart.
const reconcileEvery = 30 * time.Second

// Router is one running peer.
type Router struct {
	cfg     *Validated
	log     *slog.Logger
	db      *state.DB
	ipam    *ipalloc.Service
	metrics *metrics
	name    string
	srcDir  string // where weft-cni and portmap are installed from

	mesh       *mesh.Mesh    // set by Run
	ipamCh     *mesh.Channel // the allocator's gossip channel
	knownPeers []string      // as last saved
	resetCh    chan struct{} // weft reset succeeded: tear down and exit

	kube     *kube.Kube    // --kube: the Kubernetes side, set by Run
	kubeDone chan struct{} // closed when kube.Run has returned

	keys          *crypt.Keys    // from the password; nil without one
	tunnel        *tunnel.Device // the data plane, set by Run
	dataplaneKick chan struct{}
	lastRanges    []tunnel.OwnedRange // as last applied, by routineDataplane only
	lastResync    time.Time           // by routineDataplane only
	guard         guardState          // the bridge guard's sets (dataplane.go)

	mu       sync.Mutex
	netState netState
	ready    bool
	reason   string
}

// netState is what the router learnt about its node's network.
type netState struct {
	host        netip.Addr
	mtu         int // the pod MTU
	underlayMTU int
	gateway     netip.Prefix
}

func (r *Router) net() netState {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.netState
}

// Ready reports whether the router can attach pods, and if not, why.
func (r *Router) Ready() (bool, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ready, r.reason
}

func (r *Router) setReady(ok bool, reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ready, r.reason = ok, reason
}

// New opens the peer's state and loads its allocator. It takes the state
// dir's lock, so a second router on the same state fails here.
func New(cfg *Validated, log *slog.Logger) (*Router, error) {
	db, err := state.Open(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	r := &Router{cfg: cfg, log: log, db: db, reason: "starting", resetCh: make(chan struct{}, 1), dataplaneKick: make(chan struct{}, 1)}
	fail := func(err error) (*Router, error) { db.Close(); return nil, err }

	r.name, err = db.PeerName(cfg.Name)
	if err != nil {
		return fail(fmt.Errorf("reading the peer name from %s: %w", db.Path(), err))
	}
	if err := ValidatePeerName(r.name); err != nil {
		return fail(fmt.Errorf("the peer name saved in %s is invalid (%w); start with --name", db.Path(), err))
	}
	exe, err := os.Executable()
	if err == nil {
		exe, err = filepath.EvalSymlinks(exe)
	}
	if err != nil {
		return fail(fmt.Errorf("finding the weft binary (to install the CNI plugins from beside it): %w", err))
	}
	r.srcDir = filepath.Dir(exe)
	r.metrics = newMetrics(r)
	log.Info("peer identity", "name", r.name, "nickname", cfg.Nickname, "state", db.Path())
	return r, nil
}

// Name is this peer's name.
func (r *Router) Name() string { return r.name }

// Run sets the node up, serves until ctx ends, then shuts down in this
// order: the servers, the allocator, the mesh (leaving it), the state.
// Pods, the bridge and the CNI config are left in place so that a restart
// (or an upgrade) disturbs nothing. After weft reset, Run removes the
// bridge with its nftables table, the CNI config and the state file too.
func (r *Router) Run(ctx context.Context) (runErr error) {
	reset := false
	defer func() {
		if err := r.db.Close(); err != nil {
			r.log.Warn("closing the state", "err", err)
		}
		if reset {
			if err := os.Remove(r.db.Path()); err != nil && !errors.Is(err, os.ErrNotExist) {
				runErr = errors.Join(runErr, fmt.Errorf("weft reset: removing the state: %w", err))
				return
			}
			r.log.Info("weft reset: removed the state", "path", r.db.Path())
		}
	}()

	if err := r.setupUnderlay(); err != nil {
		return err
	}
	kubeCtx, stopKube := context.WithCancel(ctx)
	defer func() {
		stopKube()
		if r.kubeDone == nil {
			return
		}
		// client-go's informer can take long to wind down while the API
		// server is unreachable; the process is exiting, so do not wait
		// for it beyond a moment.
		select {
		case <-r.kubeDone:
		case <-time.After(2 * time.Second):
			r.log.Warn("kubernetes: the node watch did not stop within 2s; exiting without it")
		}
	}()
	if r.cfg.Kube {
		if err := r.startKube(kubeCtx); err != nil {
			return err
		}
	}
	if err := r.openIPAM(ctx); err != nil {
		return err
	}
	r.reclaimFromBridge()
	if err := r.deriveKeys(); err != nil {
		return err
	}
	if err := r.openTunnel(); err != nil {
		return err
	}
	defer r.tunnel.Close() // also when Run fails before the tunnel runs
	if err := r.startMesh(ctx); err != nil {
		return err
	}
	defer func() {
		r.saveKnownPeers()
		if err := r.mesh.Close(); err != nil {
			r.log.Warn("closing the mesh", "err", err)
		}
	}()

	apiLn, err := listenUnix(r.cfg.Socket)
	if err != nil {
		return err
	}
	statusLn, err := net.Listen("tcp", r.cfg.HTTPAddr)
	if err != nil {
		apiLn.Close()
		return fmt.Errorf("status server on --http-addr %s: %w (is another router using it? give each its own)", r.cfg.HTTPAddr, err)
	}
	loopback := false
	if ap, err := netip.ParseAddrPort(statusLn.Addr().String()); err == nil {
		loopback = ap.Addr().IsLoopback()
	}
	if !loopback {
		r.log.Warn("the status server listens beyond loopback; it is read-only, but anyone who can reach it can read this node's state", "http-addr", statusLn.Addr())
	}
	apiSrv := &http.Server{Handler: (&localAPI{r: r}).handler(), ReadHeaderTimeout: 10 * time.Second}
	statusSrv := &http.Server{Handler: r.statusHandler(loopback), ReadHeaderTimeout: 10 * time.Second}

	runCtx, stopRoutines := context.WithCancel(ctx)
	var wg sync.WaitGroup
	errc := make(chan error, 4)
	serve := func(name string, s *http.Server, ln net.Listener) {
		defer wg.Done()
		if err := s.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("%s: %w", name, err)
		}
	}
	wg.Add(7)
	go serve("local API", apiSrv, apiLn)
	go func() {
		defer wg.Done()
		if err := r.tunnel.Run(runCtx); err != nil {
			errc <- fmt.Errorf("data plane: %w", err)
		}
	}()
	go func() { defer wg.Done(); r.routineDataplane(runCtx) }()
	if r.kube != nil {
		wg.Add(1)
		go func() { defer wg.Done(); r.routineKube(runCtx) }()
	}
	go serve("status server", statusSrv, statusLn)
	go func() { defer wg.Done(); r.ipam.Run(runCtx, meshTransport{ch: r.ipamCh}) }()
	go func() { defer wg.Done(); r.routineMembers(runCtx) }()
	go func() {
		defer wg.Done()
		if err := r.routineSetup(runCtx); err != nil {
			errc <- err
		}
	}()
	r.log.Info("serving", "local-api", r.cfg.Socket, "status", "http://"+statusLn.Addr().String()+"/status")

	t := time.NewTicker(reconcileEvery)
	defer t.Stop()
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case <-r.resetCh:
			reset = true
			break loop
		case err := <-errc:
			runErr = err
			break loop
		case <-t.C:
			if ok, _ := r.Ready(); ok {
				if err := r.ensureBridge(); err != nil {
					r.log.Error("re-ensuring the bridge failed", "err", err)
				}
			}
			r.saveKnownPeers()
			if err := r.ipam.Err(); err != nil {
				runErr = err // restart, rebuilding from what is on disk
				break loop
			}
		}
	}
	r.log.Info("shutting down")
	shutCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = apiSrv.Shutdown(shutCtx)
	_ = statusSrv.Shutdown(shutCtx)
	stopRoutines()
	wg.Wait()
	if reset {
		runErr = errors.Join(runErr, r.teardown())
	}
	os.Remove(r.cfg.Socket)
	return runErr
}

// requestReset makes Run tear the node down and return (weft reset).
func (r *Router) requestReset() {
	select {
	case r.resetCh <- struct{}{}:
	default:
	}
}

// teardown removes what the router made on the node: the CNI config, the
// bridge and weft's nftables table. (Run removes the state last.) Pods'
// veths lose their bridge; the CNI plugin binaries stay.
func (r *Router) teardown() error {
	var errs []error
	conf := filepath.Join(r.cfg.CNIConfDir, ConfListName)
	if err := os.Remove(conf); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("weft reset: removing %s: %w", conf, err))
	}
	if err := bridge.Teardown("", r.cfg.Bridge, r.log); err != nil {
		errs = append(errs, fmt.Errorf("weft reset: removing bridge %s: %w", r.cfg.Bridge, err))
	}
	// The TUN device went with the tunnel; a kernel IPIP device stays
	// across restarts and is removed here.
	if err := tunnel.RemoveKernelIPIP(tunnel.DefaultIPIPName); err != nil {
		errs = append(errs, fmt.Errorf("weft reset: %w", err))
	}
	return errors.Join(errs...)
}

// setupUnderlay finds the underlay address and derives the pod MTU.
func (r *Router) setupUnderlay() error {
	ifName, underMTU, defAddr, routeErr := bridge.DefaultRouteMTU("")
	host := r.cfg.Host
	switch {
	case host.IsValid():
		if routeErr != nil {
			underMTU = 1500
			r.log.Warn("no default route to read the underlay MTU from; assuming 1500", "err", routeErr)
		}
	case routeErr != nil:
		return fmt.Errorf("cannot detect this node's underlay address: %w", routeErr)
	default:
		host = defAddr
	}
	mtu, err := tunnel.PodMTU(underMTU, r.cfg.MTU, r.cfg.Encap)
	if err != nil {
		return err
	}
	r.log.Info("underlay", "host", host, "interface", ifName, "underlay-mtu", underMTU, "pod-mtu", mtu, "encap", r.cfg.Encap)
	r.mu.Lock()
	r.netState = netState{host: host, mtu: mtu, underlayMTU: underMTU}
	r.mu.Unlock()
	return nil
}

// routineSetup waits for this peer's first address (the bridge's gateway:
// it comes once the ring is claimed and this peer has space), then
// converges the bridge and installs the CNI plugin, and only then declares
// the peer ready.
func (r *Router) routineSetup(ctx context.Context) error {
	var gw netip.Addr
	for {
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		addr, _, err := r.ipam.Allocate(actx, ipalloc.GatewayKey(r.cfg.Bridge), ipalloc.Meta{})
		cancel()
		if err == nil {
			gw = addr
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		reason := "ipam " + r.ipamStatus(r.ipam.Snapshot())
		r.setReady(false, reason)
		r.log.Info("waiting for this peer's first address", "status", reason, "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
	r.mu.Lock()
	r.netState.gateway = netip.PrefixFrom(gw, r.cfg.Universe.Bits())
	r.mu.Unlock()
	if err := r.ensureBridge(); err != nil {
		return err
	}
	r.kickDataplane() // routes into the tunnel are sourced from the gateway
	changed, err := installCNI(r.srcDir, r.cfg.CNIBinDir, r.cfg.CNIConfDir, r.cfg.Socket)
	if err != nil {
		r.setReady(false, "CNI plugin not installed: "+err.Error())
		r.log.Error("cannot install the CNI plugin; pods cannot be attached", "err", err)
		return nil
	}
	for _, c := range changed {
		r.log.Info("installed CNI file", "path", c)
	}
	r.setReady(true, "")
	r.log.Info("ready: pods can be attached", "bridge", r.cfg.Bridge, "gateway", gw, "conflist", filepath.Join(r.cfg.CNIConfDir, ConfListName))
	return nil
}

func (r *Router) ensureBridge() error {
	ns := r.net()
	// Ensure logs every change it makes itself.
	if _, err := bridge.Ensure("", r.bridgeConfig(ns), r.log); err != nil {
		return fmt.Errorf("setting up bridge %s: %w", r.cfg.Bridge, err)
	}
	r.syncGuard() // hostile-dp: the guard's sets, at once
	return nil
}

// listenUnix listens on the local API socket with mode 0600. A stale socket
// from a crashed router is replaced; a live one belongs to another router
// and is an error.
func listenUnix(path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("creating the directory of --socket %s: %w", path, err)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("--socket %s exists and is not a socket; remove it or choose another path", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("--socket %s is served by another process (another weft router?); give each router its own", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("removing stale socket %s: %w", path, err)
		}
	}
	old := syscall.Umask(0o177) // the socket is born 0600
	ln, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("local API on --socket %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, err
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	return ln, nil
}
