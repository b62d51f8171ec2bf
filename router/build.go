package router

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"time"

	"github.com/hashicorp/memberlist"
	"k8s.io/client-go/kubernetes"

	"github.com/weft-net/weft/internal/ipammesh"
	"github.com/weft-net/weft/mesh"
)

// Node is a router built and ready to run: every part of it exists before
// any of its goroutines starts.
type Node struct {
	*Router
	apiLn, statusLn   net.Listener
	apiSrv, statusSrv *http.Server
	closers           []func() error // what Build made, closed in reverse
}

// Build constructs a router, in dependency order and before any of its
// goroutines runs: the state and the peer identity, the underlay, the
// Kubernetes client (--kube; only read here, once, when a peer without a
// ring must learn from the cluster how to make the first claim), the
// allocator, the keys from the password, the tunnel, the mesh (not joined
// yet), and the servers' listeners. So whatever Run starts finds all of
// them there: the Kubernetes side never sees the allocator or the mesh
// missing. kernel nil is HostKernel. On an error what was made is closed.
func Build(ctx context.Context, cfg *Validated, log *slog.Logger, kernel Kernel) (*Node, error) {
	return build(ctx, cfg, log, kernel, seams{})
}

// seams are what a test of this package replaces beyond the Kernel, so
// that whole routers run in one process without root; the zero value is
// production's.
type seams struct {
	// cniSrcDir is where weft-cni and portmap are installed from; empty:
	// beside the executable.
	cniSrcDir string
	// gossip is the mesh's transport (meshtest's in-memory network); nil:
	// UDP and TCP on --host:--port.
	gossip memberlist.NodeAwareTransport
	// meshTimings tune the mesh; zero fields take its defaults.
	meshTimings mesh.Timings
	// kubeClient is the API server's client (--kube; client-go's fake
	// clientset); nil: the one --kubeconfig or the cluster gives.
	kubeClient kubernetes.Interface
	// kubeResync is how often the reclaim pass runs besides Node
	// deletions; zero: kube.DefaultResync.
	kubeResync time.Duration
	// policyRetry is the first wait before a failed NetworkPolicy Sync
	// is retried; zero: policyRetryMin.
	policyRetry time.Duration
	// now is the IPAM's clock (the age of allocations for --gc-grace);
	// nil: time.Now.
	now func() time.Time
}

func build(ctx context.Context, cfg *Validated, log *slog.Logger, kernel Kernel, s seams) (_ *Node, err error) {
	r, err := New(cfg, log)
	if err != nil {
		return nil, err
	}
	if kernel != nil {
		r.kernel = kernel
	}
	if s.cniSrcDir != "" {
		r.srcDir = s.cniSrcDir
	}
	r.seams = s
	n := &Node{Router: r}
	n.closers = append(n.closers, r.db.Close)
	if c, ok := r.kernel.(io.Closer); ok {
		n.closers = append(n.closers, c.Close) // the guard's nftables connection
	}
	defer func() {
		if err != nil {
			n.close()
		}
	}()

	if err := r.setupUnderlay(); err != nil {
		return nil, err
	}
	if r.cfg.Kube {
		if err := r.newKube(); err != nil {
			return nil, err
		}
	}
	if err := r.openIPAM(ctx); err != nil {
		return nil, err
	}
	r.reclaimFromBridge()
	if err := r.deriveKeys(); err != nil {
		return nil, err
	}
	r.freeKDFMemory()
	if err := r.openTunnel(); err != nil {
		return nil, err
	}
	n.closers = append(n.closers, r.tunnel.Close)
	if err := r.newMesh(); err != nil {
		return nil, err
	}
	n.closers = append(n.closers, r.mesh.Close)

	if n.apiLn, err = listenUnix(r.cfg.Socket); err != nil {
		return nil, err
	}
	n.closers = append(n.closers, func() error {
		err := n.apiLn.Close()
		os.Remove(r.cfg.Socket)
		return err
	})
	if n.statusLn, err = net.Listen("tcp", r.cfg.HTTPAddr); err != nil {
		return nil, fmt.Errorf("status server on --http-addr %s: %w (is another router using it? give each its own)", r.cfg.HTTPAddr, err)
	}
	n.closers = append(n.closers, n.statusLn.Close)
	loopback := false
	if ap, err := netip.ParseAddrPort(n.statusLn.Addr().String()); err == nil {
		loopback = ap.Addr().IsLoopback()
	}
	if !loopback {
		r.log.Warn("the status server listens beyond loopback; it is read-only, but anyone who can reach it can read this node's state", "http-addr", n.statusLn.Addr())
	}
	n.apiSrv, n.apiLn = newLocalAPIServer(r), limitListener(n.apiLn, localAPILimits.MaxConns)
	n.statusSrv, n.statusLn = newServer(r.statusHandler(loopback), statusLimits), limitListener(n.statusLn, statusLimits.MaxConns)
	return n, nil
}

// close closes what Build made, in reverse order (each is safe to close
// twice: Run has stopped most of it already).
func (n *Node) close() error {
	var errs []error
	for i := len(n.closers) - 1; i >= 0; i-- {
		if err := n.closers[i](); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, err)
		}
	}
	n.closers = nil
	return errors.Join(errs...)
}

// meshStopWithin bounds the mesh's leave at shutdown (memberlist's own
// timeouts are shorter: the goodbye and the leave, 3s each by default).
const meshStopWithin = 10 * time.Second

// errReset ends Run after weft reset: the node is then torn down.
var errReset = fmt.Errorf("weft reset: %w", errStop)

// Run serves until ctx ends, a component fails, or weft reset: it starts
// the components in the order of components(), under one supervisor (the
// first error stops them all), and stops them in reverse order. Pods, the
// bridge and the CNI config are left in place so that a restart (or an
// upgrade) disturbs nothing. After weft reset, Run removes the bridge with
// its nftables table, the CNI config and the state file too. Run closes
// the Node; call it once.
func (n *Node) Run(ctx context.Context) error {
	r := n.Router
	r.log.Info("serving", "local-api", r.cfg.Socket, "status", "http://"+n.statusLn.Addr().String()+"/status")
	err := supervise(ctx, r.log, n.components())
	reset := errors.Is(err, errReset) || r.takenOut.Load()
	if reset {
		err = r.teardown()
	}
	if cerr := n.close(); cerr != nil {
		r.log.Warn("closing", "err", cerr)
	}
	if reset {
		if rerr := os.Remove(r.db.Path()); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			return errors.Join(err, fmt.Errorf("weft reset: removing the state: %w", rerr))
		}
		r.log.Info("weft reset: removed the state", "path", r.db.Path())
	}
	return err
}

// components are what a running router runs, in start order; they stop in
// reverse: the servers first (no new requests), the Kubernetes side, the
// allocator, the mesh (leaving it), the data plane last (pods keep their
// traffic while the peer leaves).
func (n *Node) components() []component {
	r := n.Router
	serve := func(name string, s *http.Server, ln net.Listener) component {
		return component{
			name: name,
			run: func(context.Context) error {
				if err := s.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
					return err
				}
				return nil
			},
			stop: s.Shutdown,
		}
	}
	comps := []component{
		{name: "data plane", run: r.tunnel.Run, stop: func(context.Context) error { return r.tunnel.Close() }},
		{
			name:  "mesh",
			start: r.startMesh,
			stop: func(context.Context) error {
				r.saveKnownPeers()
				return r.mesh.Close()
			},
			within: meshStopWithin,
		},
		{name: "allocator", run: func(ctx context.Context) error { r.ipam.Run(ctx, r.ipamTr); return nil }},
		{name: "mesh members", run: func(ctx context.Context) error { ipammesh.RunMembers(ctx, r.mesh, r.ipam, r.ipamTr); return nil }},
		{name: "ring pull", run: func(ctx context.Context) error { ipammesh.RunPull(ctx, r.mesh, r.ipam, nil); return nil }},
		{name: "data plane sync", run: func(ctx context.Context) error { r.routineDataplane(ctx); return nil }},
	}
	if r.kube != nil {
		comps = append(comps,
			// client-go's informer can take long to wind down while the API
			// server is unreachable; the process is exiting, so do not
			// wait for it beyond a moment.
			component{name: "kubernetes", run: r.kube.Run, within: 2 * time.Second},
			component{name: "kubernetes sync", run: func(ctx context.Context) error { r.routineKube(ctx); return nil }},
		)
	}
	if r.policy != nil {
		// Before the local API: an ADD waits for its pod's rules.
		comps = append(comps, component{name: "network policy", run: r.policy.Run, within: 2 * time.Second},
			component{name: "network policy log", run: r.policy.runSamples, within: 2 * time.Second})
	} else {
		comps = append(comps, component{name: "network policy off", start: r.removePolicyRules})
	}
	return append(comps,
		component{name: "setup", run: r.routineSetup},
		component{name: "reconcile", run: r.routineReconcile},
		serve("local API", n.apiSrv, n.apiLn),
		serve("status server", n.statusSrv, n.statusLn),
		// Stopped first, while the mesh and the allocator still run: a
		// router stopped on a Node marked for removal hands its ranges
		// over here (takeOut), and Run tears the node down.
		component{name: "reset", within: resetWait + 5*time.Second, run: func(ctx context.Context) error {
			select {
			case <-ctx.Done():
				switch {
				case r.kube == nil:
				case r.kube.MarkedForReset():
					r.takeOut()
				case r.kube.DaemonSetGone():
					r.removeCNIConfigOnStop()
				}
				return nil
			case <-r.resetCh:
				return errReset
			}
		}},
	)
}

// routineReconcile re-ensures the bridge and saves the known peers every
// reconcileEvery, and fails when the allocator's state failed (the router
// then restarts, rebuilding from what is on disk).
func (r *Router) routineReconcile(ctx context.Context) error {
	t := time.NewTicker(reconcileEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if ok, _ := r.Ready(); ok {
			if err := r.ensureBridge(); err != nil {
				r.log.Error("re-ensuring the bridge failed", "err", err)
			}
		}
		r.saveKnownPeers()
		if err := r.ipam.Err(); err != nil {
			return err
		}
	}
}
