package router

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"

	"github.com/weft-net/weft/bridge"
	"github.com/weft-net/weft/policy"
	"github.com/weft-net/weft/tunnel"
)

// Kernel is the node's network as the router changes it: the underlay's
// default route, the pod bridge with its nftables rules, and the tunnel.
// HostKernel is the real one, in the router's own network namespace; a
// test above this seam gives a fake (tunnel.Config has TUN and bind seams
// of its own for that).
type Kernel interface {
	// DefaultRoute is the interface, MTU and address of the default route.
	DefaultRoute() (ifName string, mtu int, addr netip.Addr, err error)
	// EnsureBridge makes the pod bridge and its rules as cfg says,
	// changing only what differs (and logging each change).
	EnsureBridge(cfg bridge.Config, log *slog.Logger) error
	// Teardown removes the bridge, its rules and the kernel IPIP and
	// VXLAN devices (weft reset).
	Teardown(bridgeName string, log *slog.Logger) error
	// NewTunnel opens the data plane.
	NewTunnel(cfg tunnel.Config) (*tunnel.Device, error)

	// SetGuardPeers makes the guard's set of peers' underlay addresses
	// (IPIP is accepted from them only) exactly addrs; bridge.ErrNoGuard
	// before EnsureBridge made the guard.
	SetGuardPeers(addrs []netip.Addr) (added, removed int, err error)
	// SetGuardOwnRanges makes the guard's set of this node's ranges of
	// the ring (what the VXLAN device may not bring in as a source)
	// exactly ranges, in one batch, and says whether it changed;
	// bridge.ErrNoGuard before EnsureBridge made the guard.
	SetGuardOwnRanges(ranges []bridge.AddrRange) (changed bool, err error)
	// SetPodSources makes the guard's set of (host veth, pod address)
	// pairs want, keeping entries that keep says to (bridge.SetPodSources).
	SetPodSources(want []bridge.PodSource, keep func(bridge.PodSource) bool) (added, removed []bridge.PodSource, err error)
	// AddPodSources puts ps into that set and removes nothing, without
	// reading the set (an ADD's entry): when it returns nil, every one of
	// ps is in it.
	AddPodSources(ps []bridge.PodSource) error
	// RemovePodSource takes p out of that set, and nothing else (a DEL's
	// entry), and says whether p was there.
	RemovePodSource(p bridge.PodSource) (removed bool, err error)
	// GuardDrops reads the guard's drop counters by reason.
	GuardDrops() (map[string]uint64, error)
	// PolicyTable is the NetworkPolicy rules' enforcer in this
	// namespace (made once; the router calls it for its whole life).
	PolicyTable() (PolicyEnforcer, error)
}

// HostKernel is the Kernel of the namespace the router runs in. It keeps
// one nftables connection to the guard's sets for its life
// (bridge.GuardConn: every pod ADD and DEL changes them); Close closes it.
// The zero value is ready to use.
type HostKernel struct {
	// Log is where the policy table logs (a rebuilt table, a failed
	// write); nil: nowhere.
	Log *slog.Logger

	once  sync.Once
	guard *bridge.GuardConn

	policyOnce sync.Once
	policy     *hostPolicy
}

// guardConn is the guard's connection, made on first use.
func (k *HostKernel) guardConn() *bridge.GuardConn {
	k.once.Do(func() { k.guard = bridge.NewGuardConn("") })
	return k.guard
}

// Close closes the guard's connection and the policy table's; the rules
// stay in the kernel.
func (k *HostKernel) Close() error {
	err := k.guardConn().Close()
	if k.policy != nil {
		err = errors.Join(err, k.policy.close())
	}
	return err
}

func (*HostKernel) DefaultRoute() (string, int, netip.Addr, error) { return bridge.DefaultRouteMTU("") }

func (*HostKernel) EnsureBridge(cfg bridge.Config, log *slog.Logger) error {
	_, err := bridge.Ensure("", cfg, log)
	return err
}

func (*HostKernel) Teardown(name string, log *slog.Logger) error {
	if err := bridge.Teardown("", name, log); err != nil {
		return fmt.Errorf("removing bridge %s: %w", name, err)
	}
	// The TUN device went with the tunnel; the kernel IPIP and VXLAN
	// devices stay across restarts and are removed here.
	if err := tunnel.RemoveKernelVXLAN(tunnel.DefaultVXLANName); err != nil {
		return err
	}
	return tunnel.RemoveKernelIPIP(tunnel.DefaultIPIPName)
}

func (*HostKernel) NewTunnel(cfg tunnel.Config) (*tunnel.Device, error) { return tunnel.New(cfg) }

func (k *HostKernel) SetGuardPeers(addrs []netip.Addr) (int, int, error) {
	return k.guardConn().SetPeerAddrs(addrs)
}

func (k *HostKernel) SetGuardOwnRanges(ranges []bridge.AddrRange) (bool, error) {
	return k.guardConn().SetOwnRanges(ranges)
}

func (k *HostKernel) SetPodSources(want []bridge.PodSource, keep func(bridge.PodSource) bool) ([]bridge.PodSource, []bridge.PodSource, error) {
	return k.guardConn().SetPodSources(want, keep)
}

func (k *HostKernel) AddPodSources(ps []bridge.PodSource) error {
	return k.guardConn().AddPodSources(ps)
}

func (k *HostKernel) RemovePodSource(p bridge.PodSource) (bool, error) {
	return k.guardConn().RemovePodSource(p)
}

// PolicyTable is the enforcer of the NetworkPolicy rules: bridge.PolicyTable
// in this namespace, one for the router's life.
func (k *HostKernel) PolicyTable() (PolicyEnforcer, error) {
	k.policyOnce.Do(func() { k.policy = &hostPolicy{log: k.Log} })
	return k.policy, nil
}

// hostPolicy makes its bridge.PolicyTable on first use by Sync or Blocked
// (that turns on br_netfilter in the namespace, and fails, saying so,
// where the kernel has none); Teardown needs no table, so a router with
// --network-policy=false removes a previous run's rules without touching
// br_netfilter. The policy watch never calls it concurrently; the lock is
// for Close at the router's stop.
type hostPolicy struct {
	log *slog.Logger
	mu  sync.Mutex
	t   *bridge.PolicyTable
}

func (h *hostPolicy) table() (*bridge.PolicyTable, error) {
	if h.t == nil {
		t, err := bridge.NewPolicyTable(bridge.PolicyConfig{Log: h.log})
		if err != nil {
			return nil, fmt.Errorf("%w (or run weft with --network-policy=false and another policy controller)", err)
		}
		h.t = t
	}
	return h.t, nil
}

func (h *hostPolicy) Sync(nr *policy.NodeRules) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	t, err := h.table()
	if err != nil {
		return err
	}
	return t.Sync(nr)
}

func (h *hostPolicy) Blocked() (ingress, egress uint64, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	t, err := h.table()
	if err != nil {
		return 0, 0, err
	}
	return t.Blocked()
}

func (h *hostPolicy) Teardown() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.t != nil {
		return h.t.Teardown()
	}
	return bridge.RemovePolicyTable("")
}

func (h *hostPolicy) close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.t == nil {
		return nil
	}
	err := h.t.Close()
	h.t = nil
	return err
}

// GuardDrops reads the counters on a connection of its own: a metrics
// scrape never holds up an ADD's batch on the guard's connection.
func (k *HostKernel) GuardDrops() (map[string]uint64, error) { return bridge.DropCounts("") }
