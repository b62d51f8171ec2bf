// This file holds the portable side of the vxlan mode: the kernel's VXLAN
// device carries pod traffic, and weft only keeps its per-peer entries in
// step (vxlan_linux.go). As flannel's vxlan backend, every peer gets
//
//	a route      <its range> via <its VTEP address> dev weft-vx onlink
//	a neighbour  <its VTEP address> lladdr <its VTEP MAC> permanent
//	an FDB entry <its VTEP MAC> dst <its underlay address> self permanent
//
// with no multicast group and learning off: the kernel never floods,
// never learns, and sends only to the peers weft lists.

package tunnel

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
)

// Defaults of the vxlan mode.
const (
	DefaultVXLANName = "weft-vx"
	// DefaultVXLANPort is the IANA port of VXLAN (RFC 7348), the one
	// NICs' VXLAN offloads and firewall rules expect. It is the UDP
	// destination port of every node: all nodes must use the same.
	DefaultVXLANPort = 4789
	// DefaultVNI is weft's VXLAN network identifier: not flannel's 1 nor
	// Calico's 4096, so that weft's device never claims their traffic on
	// a node that runs one of them on the same port (a migration).
	DefaultVNI = 6784
	// MaxVNI is the largest VNI (24 bits).
	MaxVNI = 1<<24 - 1
)

// VTEP is one end of the vxlan overlay, as a peer advertises it in its
// mesh metadata: the MAC of its VXLAN device, the address that the routes
// to its ranges go via (and its neighbour entry is for), which is its
// underlay address, where the encapsulated packets go, and the UDP port
// and VNI its device receives on.
type VTEP struct {
	MAC  [6]byte
	Addr netip.Addr
	Port uint16
	VNI  uint32
}

func (v VTEP) String() string {
	return fmt.Sprintf("%s@%s:%d vni %d", net.HardwareAddr(v.MAC[:]), v.Addr, v.Port, v.VNI)
}

// Validate checks a VTEP from a peer: a unicast MAC, an IPv4 unicast
// address, a port and a VNI in range.
func (v VTEP) Validate() error {
	switch {
	case v.MAC == [6]byte{}:
		return errors.New("vxlan VTEP: the MAC is all zeros")
	case v.MAC[0]&1 != 0:
		return fmt.Errorf("vxlan VTEP: MAC %s is a multicast address", net.HardwareAddr(v.MAC[:]))
	case !v.Addr.Is4() || v.Addr.IsUnspecified() || v.Addr.IsMulticast() || v.Addr.IsLoopback() || v.Addr == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return fmt.Errorf("vxlan VTEP: address %v is no IPv4 unicast address", v.Addr)
	case v.Port == 0:
		return errors.New("vxlan VTEP: port 0")
	case v.VNI == 0 || v.VNI > MaxVNI:
		return fmt.Errorf("vxlan VTEP: VNI %d out of range 1..%d", v.VNI, MaxVNI)
	}
	return nil
}

// VTEPMAC is the MAC of a peer's VXLAN device: derived from its name, so
// that a device made again (after a repair, or by a new router) keeps the
// MAC its peers' neighbour entries name. Unicast and locally administered.
func VTEPMAC(peer string) [6]byte {
	h := sha256.Sum256([]byte("weft-vxlan-vtep\x00" + peer))
	var mac [6]byte
	copy(mac[:], h[:6])
	mac[0] = mac[0]&^1 | 2
	return mac
}

// VTEPEntry is the kernel state one vxlan peer needs on the VXLAN device:
// the neighbour Addr -> MAC and the FDB entry MAC -> Dst (on the device's
// own VNI and port, which every peer must share).
type VTEPEntry struct {
	Addr netip.Addr // the neighbour's address: the routes' gateway
	MAC  [6]byte
	Dst  netip.Addr // the FDB entry's destination: the peer's underlay
}

func (e VTEPEntry) String() string {
	return fmt.Sprintf("neigh %s lladdr %s, fdb %s dst %s", e.Addr, net.HardwareAddr(e.MAC[:]), net.HardwareAddr(e.MAC[:]), e.Dst)
}

func compareVTEPEntries(a, b VTEPEntry) int {
	if c := a.Addr.Compare(b.Addr); c != 0 {
		return c
	}
	if c := slices.Compare(a.MAC[:], b.MAC[:]); c != 0 {
		return c
	}
	return a.Dst.Compare(b.Dst)
}

// VTEPApplier keeps the VXLAN device's neighbours and FDB entries.
type VTEPApplier interface {
	// Apply makes the device's entries want: it adds or replaces what
	// is missing and, unless keep, removes the entries that are not
	// wanted. It returns what it changed.
	Apply(want []VTEPEntry, keep bool) (added, removed []VTEPEntry, err error)
	Close() error
}

// DiffVTEPs compares the wanted entries with those the device has, by
// neighbour address and by MAC: an entry is added (replaced) unless the
// device has exactly it, and a present entry is removed unless it is
// wanted, or its neighbour address or MAC is taken by a wanted entry
// (the replace moves it). Both come sorted, without duplicates.
func DiffVTEPs(want, have []VTEPEntry) (add, del []VTEPEntry) {
	w := slices.Clone(want)
	slices.SortFunc(w, compareVTEPEntries)
	w = slices.Compact(w)
	present := map[VTEPEntry]bool{}
	for _, e := range have {
		present[e] = true
	}
	wanted := map[VTEPEntry]bool{}
	addrs, macs := map[netip.Addr]bool{}, map[[6]byte]bool{}
	for _, e := range w {
		wanted[e] = true
		addrs[e.Addr], macs[e.MAC] = true, true
		if !present[e] {
			add = append(add, e)
		}
	}
	for e := range present {
		if !wanted[e] && !addrs[e.Addr] && !macs[e.MAC] {
			del = append(del, e)
		}
	}
	slices.SortFunc(del, compareVTEPEntries)
	return add, del
}

// checkVTEPs rejects wanted entries that give one neighbour address or
// one MAC two meanings: the kernel holds one of each.
func checkVTEPs(want []VTEPEntry) error {
	addrs, macs := map[netip.Addr]VTEPEntry{}, map[[6]byte]VTEPEntry{}
	for _, e := range want {
		if o, ok := addrs[e.Addr]; ok && o != e {
			return fmt.Errorf("vxlan entries %s and %s have the same address", o, e)
		}
		if o, ok := macs[e.MAC]; ok && o != e {
			return fmt.Errorf("vxlan entries %s and %s have the same MAC", o, e)
		}
		addrs[e.Addr], macs[e.MAC] = e, e
	}
	return nil
}

// ErrVXLANUnencrypted is why vxlan is refused with a password set for a
// peer outside the trusted subnets.
var ErrVXLANUnencrypted = errors.New("vxlan cannot be encrypted: with a password set, use --encap udp (sealed), or list the peers' underlay subnets in --trusted-subnets")

// autoVXLANBlocked says why auto may not have the VXLAN device on this
// node, or "": VXLAN cannot be encrypted, so with a password it is used
// only between nodes inside --trusted-subnets, and this node must be one
// of them (the peers check their side: a peer outside them gets udp).
func (d *Device) autoVXLANBlocked() string {
	switch {
	case d.crypto == nil:
		return ""
	case len(d.trusted) == 0:
		return "a password is set and no --trusted-subnets are given: vxlan cannot be encrypted"
	case !inPrefixes(d.trusted, d.cfg.Underlay):
		return fmt.Sprintf("a password is set and this node's address %v is outside --trusted-subnets: vxlan cannot be encrypted", d.cfg.Underlay)
	}
	return ""
}

func inPrefixes(ps []netip.Prefix, a netip.Addr) bool {
	return slices.ContainsFunc(ps, func(p netip.Prefix) bool { return p.Contains(a) })
}

// vxlanPeerError says why a peer that advertises vxlan cannot be sent to
// with it from this node's VTEP, or nil.
func vxlanPeerError(self VTEP, p Peer) error {
	switch {
	case p.VTEP == nil:
		return fmt.Errorf("peer %s advertises vxlan without its VTEP (MAC, address) in its metadata", p.Name)
	case p.VTEP.Port != self.Port:
		return fmt.Errorf("peer %s receives vxlan on port %d, this node on %d: give every node the same --vxlan-port", p.Name, p.VTEP.Port, self.Port)
	case p.VTEP.VNI != self.VNI:
		return fmt.Errorf("peer %s uses VNI %d, this node %d: give every node the same --vxlan-vni", p.Name, p.VTEP.VNI, self.VNI)
	case p.VTEP.MAC == self.MAC:
		return fmt.Errorf("peer %s has this node's VTEP MAC %s", p.Name, net.HardwareAddr(self.MAC[:]))
	case p.VTEP.Addr == self.Addr:
		return fmt.Errorf("peer %s has this node's VTEP address %s", p.Name, self.Addr)
	}
	return nil
}

// vtepEntries is the entries of the peers vxlan may be used with (sent
// to with vxlan, or probed while auto sends them udp), and the
// names of those left out because another peer claims the same address or
// MAC (both are left out: which one is right cannot be told).
func vtepEntries(peers map[string]*peerPath) ([]VTEPEntry, map[string]error) {
	byAddr, byMAC := map[netip.Addr][]string{}, map[[6]byte][]string{}
	for name, p := range peers {
		if p.vxlan != nil {
			byAddr[p.vxlan.Addr] = append(byAddr[p.vxlan.Addr], name)
			byMAC[p.vxlan.MAC] = append(byMAC[p.vxlan.MAC], name)
		}
	}
	var out []VTEPEntry
	clash := map[string]error{}
	for name, p := range peers {
		if p.vxlan == nil {
			continue
		}
		if o := byAddr[p.vxlan.Addr]; len(o) > 1 {
			slices.Sort(o)
			clash[name] = fmt.Errorf("peers %v advertise the same VTEP address %s", o, p.vxlan.Addr)
			continue
		}
		if o := byMAC[p.vxlan.MAC]; len(o) > 1 {
			slices.Sort(o)
			clash[name] = fmt.Errorf("peers %v advertise the same VTEP MAC %s", o, net.HardwareAddr(p.vxlan.MAC[:]))
			continue
		}
		out = append(out, VTEPEntry{Addr: p.vxlan.Addr, MAC: p.vxlan.MAC, Dst: p.Underlay})
	}
	slices.SortFunc(out, compareVTEPEntries)
	return out, clash
}

// keptVia is, while the device holds what it found (before the mesh
// settled), the gateway of the kernel's routes on the VXLAN device that
// together cover every range of peer: a peer not heard of yet keeps its
// routes as a router before this one left them. False if some address of
// its ranges has none, or the routes have two gateways.
func keptVia(kept []Route, dev string, ranges []OwnedRange, peer string) (netip.Addr, bool) {
	var via netip.Addr
	for _, r := range ranges {
		if r.Peer != peer {
			continue
		}
		cur := uint64(u32(r.First))
		for cur <= uint64(u32(r.Last)) {
			found := false
			for _, k := range kept {
				if k.Dev != dev || !k.Via.IsValid() || !k.Dst.Addr().Is4() {
					continue
				}
				lo := uint64(u32(k.Dst.Masked().Addr()))
				hi := lo + 1<<(32-k.Dst.Bits()) - 1
				if lo <= cur && cur <= hi {
					if via.IsValid() && via != k.Via {
						return netip.Addr{}, false
					}
					via, found, cur = k.Via, true, hi+1
					break
				}
			}
			if !found {
				return netip.Addr{}, false
			}
		}
	}
	return via, via.IsValid()
}
