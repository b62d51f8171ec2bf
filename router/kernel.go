package router

import (
	"fmt"
	"log/slog"
	"net/netip"

	"github.com/weft-net/weft/bridge"
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
	// SetPodSources makes the guard's set of (host veth, pod address)
	// pairs want, keeping entries that keep says to (bridge.SetPodSources).
	SetPodSources(want []bridge.PodSource, keep func(bridge.PodSource) bool) (added, removed []bridge.PodSource, err error)
	// GuardDrops reads the guard's drop counters by reason.
	GuardDrops() (map[string]uint64, error)
}

// HostKernel is the Kernel of the namespace the router runs in.
type HostKernel struct{}

func (HostKernel) DefaultRoute() (string, int, netip.Addr, error) { return bridge.DefaultRouteMTU("") }

func (HostKernel) EnsureBridge(cfg bridge.Config, log *slog.Logger) error {
	_, err := bridge.Ensure("", cfg, log)
	return err
}

func (HostKernel) Teardown(name string, log *slog.Logger) error {
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

func (HostKernel) NewTunnel(cfg tunnel.Config) (*tunnel.Device, error) { return tunnel.New(cfg) }

func (HostKernel) SetGuardPeers(addrs []netip.Addr) (int, int, error) {
	return bridge.SetPeerAddrs("", addrs)
}

func (HostKernel) SetPodSources(want []bridge.PodSource, keep func(bridge.PodSource) bool) ([]bridge.PodSource, []bridge.PodSource, error) {
	return bridge.SetPodSources("", want, keep)
}

func (HostKernel) GuardDrops() (map[string]uint64, error) { return bridge.DropCounts("") }
