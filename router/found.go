package router

import (
	"net/netip"

	"github.com/weft-net/weft/ipalloc"
)

// bridgeSeen is what the kernel shows of the pod bridge: the input of
// foundAddrs.
type bridgeSeen struct {
	Ports     int            // links attached to it; 0 when it does not exist
	Addrs     []netip.Prefix // its IPv4 addresses
	Neighbors []netip.Addr   // IPv4 neighbour entries that are (or were lately) answered
	// Live are the Neighbors whose MAC the bridge has learnt on one of its
	// ports: a pod that is there now. A deleted pod's neighbour entry
	// outlives its veth (and so its forwarding entries) for minutes.
	Live []netip.Addr
}

// foundAddrs picks the addresses in use on the bridge, in the pod range,
// each with the key to hold it by: the bridge's address as the gateway,
// the neighbours as ReclaimedKey. A bridge without ports has no pods, and
// yields nothing; so do the range's network and broadcast addresses.
func foundAddrs(bridge string, pods netip.Prefix, seen bridgeSeen) map[ipalloc.Key]netip.Addr {
	found := map[ipalloc.Key]netip.Addr{}
	if seen.Ports == 0 {
		return found
	}
	usable := func(a netip.Addr) bool {
		a = a.Unmap()
		return a.Is4() && pods.Contains(a) && a != pods.Masked().Addr() && a != lastAddr(pods)
	}
	gw := netip.Addr{}
	for _, p := range seen.Addrs {
		if usable(p.Addr()) {
			gw = p.Addr().Unmap()
			found[ipalloc.GatewayKey(bridge)] = gw
			break
		}
	}
	for _, n := range seen.Neighbors {
		n = n.Unmap()
		if !usable(n) || n == gw {
			continue
		}
		a, err := ipalloc.AddressFrom(n)
		if err != nil {
			continue
		}
		found[ipalloc.ReclaimedKey(bridge, a)] = n
	}
	return found
}

// lastAddr is the broadcast address of the IPv4 prefix p.
func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().As4()
	host := uint32(1)<<(32-p.Bits()) - 1
	v := (uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])) | host
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}
