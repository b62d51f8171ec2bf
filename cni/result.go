package cni

import (
	"fmt"
	"io"
	"net"
	"net/netip"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/weft-net/weft/api"
)

// MTU bounds for the pod interface: IPv4's minimum and the largest a link takes.
const (
	minMTU = 68
	maxMTU = 65535
)

// podNet is a router's allocation, checked: how to wire one pod. It keeps
// the ADD path's one address type (netip); ipNet and netIP make the
// net.IPNet and net.IP of the CNI result and of netlink, at that edge.
type podNet struct {
	Address netip.Prefix // the pod's address with the pod network's prefix length
	Gateway netip.Addr   // the bridge's address, the pod's default gateway
	Bridge  string       // the bridge the host end joins
	MTU     int          // the MTU of both veth ends
}

// parseAllocation checks the router's answer before anything is built from it.
func parseAllocation(a *api.Allocation) (podNet, error) {
	addr, gw := a.Address, a.Gateway
	if !addr.IsValid() {
		return podNet{}, fmt.Errorf("weft router gave address %q, not an address with a prefix length", addr)
	}
	if !gw.IsValid() {
		return podNet{}, fmt.Errorf("weft router gave no gateway for address %s", addr)
	}
	if addr.Addr().Is4In6() || gw.Is4In6() || gw.Zone() != "" || addr.Addr().Zone() != "" {
		return podNet{}, fmt.Errorf("weft router gave address %s and gateway %s: want plain IPv4 or IPv6 addresses", addr, gw)
	}
	switch {
	case addr.Addr().Is4() && !gw.Is4():
		return podNet{}, fmt.Errorf("weft router gave IPv6 gateway %q for IPv4 address %q", gw, addr)
	case addr.Addr().Is6() && !gw.Is6():
		return podNet{}, fmt.Errorf("weft router gave IPv4 gateway %q for IPv6 address %q", gw, addr)
	}
	if !addr.Contains(gw) || gw == addr.Addr() {
		return podNet{}, fmt.Errorf("weft router gave gateway %q, which is not another address in the pod network %s", gw, addr)
	}
	if err := api.ValidateIfName(a.Bridge); err != nil {
		return podNet{}, fmt.Errorf("weft router gave a bad bridge name: %w", err)
	}
	if a.MTU < minMTU || a.MTU > maxMTU {
		return podNet{}, fmt.Errorf("weft router gave MTU %d, outside %d..%d", a.MTU, minMTU, maxMTU)
	}
	return podNet{Address: addr, Gateway: gw, Bridge: a.Bridge, MTU: a.MTU}, nil
}

// ipNet is p as the CNI types and netlink take it (4 bytes for IPv4).
func ipNet(p netip.Prefix) net.IPNet {
	return net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// netIP is a as the CNI types and netlink take it (4 bytes for IPv4).
func netIP(a netip.Addr) net.IP { return a.AsSlice() }

// prefixOf is a net.IPNet of a CNI result or of netlink in the ADD path's
// type; false if it is not an address with a prefix length.
func prefixOf(n net.IPNet) (netip.Prefix, bool) {
	a, ok := netip.AddrFromSlice(n.IP)
	bits := prefixLen(n)
	if !ok || bits < 0 {
		return netip.Prefix{}, false
	}
	a = a.Unmap()
	p := netip.PrefixFrom(a, bits)
	return p, p.IsValid()
}

// defaultRoute is 0.0.0.0/0 or ::/0, of the family of ip.
func defaultRoute(ip netip.Addr) net.IPNet {
	if ip.Is4() {
		return net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
	}
	return net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
}

// linkInfo is what the result says about one interface.
type linkInfo struct {
	Name string
	Mac  string
}

// buildResult is the ADD result: the host end and the pod interface (in the
// sandbox netns), the pod's address on the pod interface, and its default route.
func buildResult(pn podNet, netns string, host, pod linkInfo) *current.Result {
	return &current.Result{
		CNIVersion: current.ImplementedSpecVersion,
		Interfaces: []*current.Interface{
			{Name: host.Name, Mac: host.Mac},
			{Name: pod.Name, Mac: pod.Mac, Sandbox: netns},
		},
		IPs: []*current.IPConfig{{
			Address:   ipNet(pn.Address),
			Gateway:   netIP(pn.Gateway),
			Interface: current.Int(1),
		}},
		Routes: []*types.Route{{Dst: defaultRoute(pn.Gateway), GW: netIP(pn.Gateway)}},
	}
}

// printResult writes result converted to the config's cniVersion, as
// types.PrintResult does for stdout.
func printResult(w io.Writer, result types.Result, cniVersion string) error {
	r, err := result.GetAsVersion(cniVersion)
	if err != nil {
		return fmt.Errorf("converting the result to CNI %s: %w", cniVersion, err)
	}
	return r.PrintTo(w)
}

// podIPs picks from a prevResult the addresses of the pod interface ifName in
// netns, the ones CHECK verifies.
func podIPs(prev *current.Result, ifName, netns string) []*current.IPConfig {
	var out []*current.IPConfig
	for _, ipc := range prev.IPs {
		if ipc.Interface == nil {
			continue
		}
		i := *ipc.Interface
		if i < 0 || i >= len(prev.Interfaces) {
			continue
		}
		if iface := prev.Interfaces[i]; iface.Name == ifName && iface.Sandbox == netns {
			out = append(out, ipc)
		}
	}
	return out
}

// prefixLen is n's prefix length in the family of its IP; -1 for a mask
// that is not a prefix.
func prefixLen(n net.IPNet) int {
	ones, bits := n.Mask.Size()
	switch {
	case bits == 0:
		return -1
	case bits == 8*net.IPv6len && n.IP.To4() != nil:
		return ones - 96
	}
	return ones
}
