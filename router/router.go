package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/weft-net/weft/internal/ipammesh"
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
	gossip  *ipalloc.Gossip // the allocator's adapter to its mesh channel
	metrics *metrics
	name    string
	srcDir  string // where weft-cni and portmap are installed from

	kernel Kernel // the node's network: underlay, bridge, tunnel
	seams  seams  // a test's replacements (build.go); zero in production

	mesh       *mesh.Mesh                // set by Build
	ipamCh     *mesh.Channel             // the allocator's gossip channel
	ipamTr     *ipammesh.Transport       // the allocator's transport on it
	knownPeers []string                  // as last saved
	meshSince  atomic.Pointer[time.Time] // when the mesh started; nil before
	resetCh    chan struct{}             // weft reset succeeded: tear down and exit
	takenOut   atomic.Bool               // stopped on a Node marked for removal, ranges handed over: Run tears down

	kube   *kube.Kube   // --kube: the Kubernetes side, set by Build
	policy *policyWatch // --kube --network-policy: set by Build; nil when off

	keys          *crypt.Keys    // from the password; nil without one
	tunnel        *tunnel.Device // the data plane, set by Build
	dataplaneKick chan struct{}
	lastRanges    []tunnel.OwnedRange // as last applied, by routineDataplane only
	lastResync    time.Time           // by routineDataplane only
	tunnelSettled bool                // tunnel.Settle done, by routineDataplane only
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

// New opens the peer's state and reads its identity: the first step of
// Build (tests of the logic above the network start from it). It takes the
// state dir's lock, so a second router on the same state fails here.
func New(cfg *Validated, log *slog.Logger) (*Router, error) {
	db, err := state.Open(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	r := &Router{cfg: cfg, log: log, db: db, kernel: &HostKernel{Log: log}, reason: "starting", resetCh: make(chan struct{}, 1), dataplaneKick: make(chan struct{}, 1)}
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

// requestReset makes Node.Run tear the node down and return (weft reset).
func (r *Router) requestReset() {
	select {
	case r.resetCh <- struct{}{}:
	default:
	}
}

// teardown removes what the router made on the node: the CNI config, the
// bridge and weft's nftables table. (Node.Run removes the state last.)
// Pods' veths lose their bridge; the CNI plugin binaries stay.
func (r *Router) teardown() error {
	var errs []error
	if _, _, err := removeConfList(r.cfg.CNIConfDir); err != nil {
		errs = append(errs, fmt.Errorf("weft reset: %w", err))
	}
	if err := r.kernel.Teardown(r.cfg.Bridge, r.log); err != nil {
		errs = append(errs, fmt.Errorf("weft reset: %w", err))
	}
	return errors.Join(errs...)
}

// setupUnderlay finds the underlay address and derives the pod MTU.
func (r *Router) setupUnderlay() error {
	ifName, underMTU, defAddr, routeErr := r.kernel.DefaultRoute()
	host := r.cfg.HostAddr
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
	mtu, err := tunnel.PodMTU(underMTU, r.cfg.MTU, r.cfg.EncapMode)
	if err != nil {
		return err
	}
	r.log.Info("underlay", "host", host, "interface", ifName, "underlay-mtu", underMTU, "pod-mtu", mtu, "encap", r.cfg.EncapMode)
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
	// The bridge gets its address first; only then is the gateway
	// published to the data plane, whose routes are sourced from it (a
	// route with a source no interface has is refused: EINVAL).
	ns := r.net()
	ns.gateway = netip.PrefixFrom(gw, r.cfg.Universe.Bits())
	if err := r.ensureBridgeWith(ns); err != nil {
		return err
	}
	r.mu.Lock()
	r.netState.gateway = ns.gateway
	r.mu.Unlock()
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
	r.freeSetupMemory()
	r.log.Info("ready: pods can be attached", "bridge", r.cfg.Bridge, "gateway", gw, "conflist", filepath.Join(r.cfg.CNIConfDir, ConfListName))
	return nil
}

func (r *Router) ensureBridge() error { return r.ensureBridgeWith(r.net()) }

// ensureBridgeWith converges the bridge on ns (its gateway included).
func (r *Router) ensureBridgeWith(ns netState) error {
	// Ensure logs every change it makes itself.
	if err := r.kernel.EnsureBridge(r.bridgeConfig(ns), r.log); err != nil {
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
	if err := checkSocketDir(filepath.Dir(path)); err != nil {
		return nil, err
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
