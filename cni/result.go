package cni

import (
	"fmt"
	"io"
	"net"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/weft-net/weft/api"
)

// MTU bounds for the pod interface: IPv4's minimum and the largest a link takes.
const (
	minMTU = 68
	maxMTU = 65535
)

// podNet is a router's allocation, parsed and checked: how to wire one pod.
type podNet struct {
	Address net.IPNet // the pod's address with the pod network's prefix length
	Gateway net.IP    // the bridge's address, the pod's default gateway
	Bridge  string    // the bridge the host end joins
	MTU     int       // the MTU of both veth ends
}

// parseAllocation checks the router's answer before anything is built from it.
func parseAllocation(a *api.Allocation) (podNet, error) {
	ip, ipNet, err := net.ParseCIDR(a.Address)
	if err != nil {
		return podNet{}, fmt.Errorf("weft router gave address %q, not an address with a prefix length: %w", a.Address, err)
	}
	gw := net.ParseIP(a.Gateway)
	if gw == nil {
		return podNet{}, fmt.Errorf("weft router gave gateway %q, not an IP address", a.Gateway)
	}
	if v4 := ip.To4(); v4 != nil {
		ip = v4
		if gw = gw.To4(); gw == nil {
			return podNet{}, fmt.Errorf("weft router gave IPv6 gateway %q for IPv4 address %q", a.Gateway, a.Address)
		}
	} else if gw.To4() != nil {
		return podNet{}, fmt.Errorf("weft router gave IPv4 gateway %q for IPv6 address %q", a.Gateway, a.Address)
	}
	if !ipNet.Contains(gw) || gw.Equal(ip) {
		return podNet{}, fmt.Errorf("weft router gave gateway %q, which is not another address in the pod network %s", a.Gateway, a.Address)
	}
	if err := api.ValidateIfName(a.Bridge); err != nil {
		return podNet{}, fmt.Errorf("weft router gave a bad bridge name: %w", err)
	}
	if a.MTU < minMTU || a.MTU > maxMTU {
		return podNet{}, fmt.Errorf("weft router gave MTU %d, outside %d..%d", a.MTU, minMTU, maxMTU)
	}
	return podNet{Address: net.IPNet{IP: ip, Mask: ipNet.Mask}, Gateway: gw, Bridge: a.Bridge, MTU: a.MTU}, nil
}

// defaultRoute is 0.0.0.0/0 or ::/0, of the family of ip.
func defaultRoute(ip net.IP) net.IPNet {
	if ip.To4() != nil {
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
			Address:   pn.Address,
			Gateway:   pn.Gateway,
			Interface: current.Int(1),
		}},
		Routes: []*types.Route{{Dst: defaultRoute(pn.Gateway), GW: pn.Gateway}},
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

// sameIPNet reports whether a and b are the same address with the same
// prefix length, however their IP and mask are stored (4 or 16 bytes).
func sameIPNet(a, b net.IPNet) bool {
	return a.IP.Equal(b.IP) && prefixLen(a) == prefixLen(b)
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
