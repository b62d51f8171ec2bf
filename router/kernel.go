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
	// Teardown removes the bridge, its rules and the kernel IPIP device
	// (weft reset).
	Teardown(bridgeName string, log *slog.Logger) error
	// NewTunnel opens the data plane.
	NewTunnel(cfg tunnel.Config) (*tunnel.Device, error)
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
	// The TUN device went with the tunnel; a kernel IPIP device stays
	// across restarts and is removed here.
	return tunnel.RemoveKernelIPIP(tunnel.DefaultIPIPName)
}

func (HostKernel) NewTunnel(cfg tunnel.Config) (*tunnel.Device, error) { return tunnel.New(cfg) }
