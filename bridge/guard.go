package bridge

// The node's guard against its pods (issue 12): weft's routers run in the
// host network, so every pod reaches their ports. The guard is two parts
// of weft's nftables tables:
//
//   - table ip weft, chains guard-input and guard-forward: traffic from the
//     pod range to the gossip port (TCP and UDP) and the data port (UDP) of
//     this node or any host outside the pod range, and IP protocol 4 (IPIP)
//     from the pod range, is dropped, so that a pod's packet is never
//     masqueraded into this node's underlay identity towards a peer; and
//     IPIP from an address that is not a known peer's (set peers) is
//     dropped before the kernel IPIP device or the raw socket sees it.
//     With a kernel VXLAN device (Guard.VXLANDevice), what it decapsulates
//     may not come from outside the pod range, nor from this node's own
//     ranges of the ring (set own), nor open a connection to outside the
//     pod range, at input and forward alike.
//   - table ip weft, chains vxlan-notrack-prerouting and -output (with a
//     VXLAN port): the VXLAN packets between this node and its peers (set
//     peers) are not tracked by conntrack. VXLAN's flows are one-way (both
//     ends send to the same port from a source port hashed per inner flow),
//     so every outer flow would be a conntrack entry that is never replied
//     to: a lookup per packet at each end and a table filled with
//     UNREPLIED entries, for nothing a rule could use (Calico, OpenShift SDN
//     and Cilium do the same). Only packets to this node's own addresses
//     (fib daddr type local) and from its own sockets are untracked: VXLAN
//     that the node forwards for others is tracked as before.
//   - table bridge weft, chain prerouting: a frame that a pod sends into
//     its veth leaves it only with the pod's own IPv4 address (set pods:
//     host veth . address), as an IPv4 source or an ARP sender; any other
//     IPv4 source or ARP sender, and every frame of another protocol, is
//     dropped.
//
// Every drop rule counts; DropCounts reads the counts by reason.

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
)

// Names in weft's tables.
const (
	guardInputChain   = "guard-input"
	guardForwardChain = "guard-forward"
	notrackPreChain   = "vxlan-notrack-prerouting" // of table ip weft, with a VXLAN port
	notrackOutChain   = "vxlan-notrack-output"     // of table ip weft, with a VXLAN port
	podsChain         = "prerouting"               // of table bridge weft
	peersSet          = "peers"                    // of table ip weft
	ownSet            = "own"                      // of table ip weft: this node's ranges of the ring
	podsSet           = "pods"                     // of table bridge weft

	// PodVethPrefix starts the name of every host end of a pod veth
	// (cni.HostVethName): the bridge ports the anti-spoofing rules apply to.
	PodVethPrefix = "weft"
)

// Guard configures the guard. The zero value is off: no guard chains, no
// bridge table.
type Guard struct {
	// GossipPort and DataPort are the routers' ports (--gossip-port,
	// --data-port); both must be set for the guard to be on.
	GossipPort, DataPort uint16
	// IPIPPeersOnly drops IPIP from addresses that are not in the peers
	// set (SetPeerAddrs): set it where this node may receive ipip.
	IPIPPeersOnly bool
	// VXLANPort is the port of the kernel VXLAN device where the node
	// runs --encap vxlan (0: none): pods may not send to it, and VXLAN
	// is taken only from addresses in the peers set, as IPIP; VXLAN
	// between this node and the peers set is not tracked by conntrack.
	VXLANPort uint16
	// VXLANDevice is the name of that device ("" without one): what
	// arrives on it is dropped when its source is outside the pod range
	// or inside this node's own ranges (SetOwnRanges), or when it opens
	// a connection to an address outside the pod range (peers route only
	// this node's ranges to it: this node is no relay to elsewhere; the
	// replies of connections it NATs, whose destination is translated
	// back before the guard sees them, pass). The kernel loses
	// the outer source on decapsulation, so the source is not checked
	// against the sending peer's ranges: a peer may still send as
	// another peer's pod.
	VXLANDevice string
	// VXLANProbePort is the UDP port of the router's checksum probes
	// inside the VXLAN device (tunnel.ChecksumProbePort; 0: none): what
	// arrives on the device from and to that port, addressed to this
	// node, is dropped without an answer, as the router has read it off
	// the device before the IP stack.
	VXLANProbePort uint16
}

// On reports whether the guard is configured.
func (g Guard) On() bool { return g.GossipPort != 0 && g.DataPort != 0 }

// Drop reasons of the guard's rules, the labels of DropCounts.
const (
	DropPodToRouter   = "pod-to-router"      // a pod to a router's gossip or data port, or IPIP from a pod
	DropIPIPNonPeer   = "ipip-non-peer"      // IPIP from an address that is no known peer
	DropVXLANNonPeer  = "vxlan-non-peer"     // VXLAN from an address that is no known peer
	DropSpoofedSource = "pod-spoofed-source" // a pod's IPv4 packet with a source that is not its address
	DropSpoofedARP    = "pod-spoofed-arp"    // a pod's ARP with a sender address that is not its own
	DropPodProtocol   = "pod-protocol"       // a pod's frame that is neither IPv4 nor ARP
	// DropVXLANSpoofedSource: a packet out of the VXLAN device whose
	// inner source is outside the pod range or in this node's own ranges.
	DropVXLANSpoofedSource = "vxlan-spoofed-source"
	// DropVXLANNotToPods: a packet out of the VXLAN device that opens a
	// connection to an address outside the pod range.
	DropVXLANNotToPods = "vxlan-not-to-pods"
)

// DropReasons lists the reasons, in a fixed order.
var DropReasons = []string{DropPodToRouter, DropIPIPNonPeer, DropSpoofedSource, DropSpoofedARP, DropPodProtocol, DropVXLANNonPeer, DropVXLANSpoofedSource, DropVXLANNotToPods}

// PodSource is one pod attachment's right to send: frames from the host
// veth Veth may carry the source Addr.
type PodSource struct {
	Veth string
	Addr netip.Addr
}

func (p PodSource) String() string { return p.Veth + " " + p.Addr.String() }

func comparePodSources(a, b PodSource) int {
	return cmp.Or(cmp.Compare(a.Veth, b.Veth), a.Addr.Compare(b.Addr))
}

// validatePodSource checks an element before it reaches the kernel.
func validatePodSource(p PodSource) error {
	if err := validateName(p.Veth); err != nil {
		return fmt.Errorf("pod source %s: %w", p, err)
	}
	if !p.Addr.Is4() {
		return fmt.Errorf("pod source %s: want an IPv4 address", p)
	}
	return nil
}

// diffSet is the pure part of reconciling a set: what to add and what to
// delete so that have becomes want. Both come sorted, without duplicates.
func diffSet[T comparable](want, have []T, compare func(a, b T) int) (add, del []T) {
	w := slices.Clone(want)
	slices.SortFunc(w, compare)
	w = slices.Compact(w)
	h := slices.Clone(have)
	slices.SortFunc(h, compare)
	h = slices.Compact(h)
	i, j := 0, 0
	for i < len(w) || j < len(h) {
		switch {
		case j == len(h) || (i < len(w) && compare(w[i], h[j]) < 0):
			add = append(add, w[i])
			i++
		case i == len(w) || compare(w[i], h[j]) > 0:
			del = append(del, h[j])
			j++
		default:
			i, j = i+1, j+1
		}
	}
	return add, del
}

// AddrRange is the IPv4 addresses First to Last, both included: one of
// this node's ranges of the ring (SetOwnRanges).
type AddrRange struct {
	First, Last netip.Addr
}

func (r AddrRange) String() string { return r.First.String() + "-" + r.Last.String() }

// mergeRanges checks rs (IPv4, First <= Last) and returns them sorted,
// with overlapping and adjacent ranges merged into one.
func mergeRanges(rs []AddrRange) ([]AddrRange, error) {
	for _, r := range rs {
		if !r.First.Is4() || !r.Last.Is4() || r.Last.Less(r.First) {
			return nil, fmt.Errorf("address range %s: want IPv4 with the first address not after the last", r)
		}
	}
	s := slices.Clone(rs)
	slices.SortFunc(s, func(a, b AddrRange) int { return cmp.Or(a.First.Compare(b.First), a.Last.Compare(b.Last)) })
	var out []AddrRange
	for _, r := range s {
		if n := len(out); n > 0 {
			last := &out[n-1]
			if next := last.Last.Next(); !next.IsValid() || !next.Less(r.First) { // overlaps or touches
				if last.Last.Less(r.Last) {
					last.Last = r.Last
				}
				continue
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// bound is one element of an nftables interval set: an interval starts
// at addr, or (end) the interval before ends just before addr.
type bound struct {
	addr netip.Addr
	end  bool
}

// intervalBounds are the elements of an interval set holding rs: for each
// merged range its first address, and the address after its last as an
// end, but none after 255.255.255.255 (an interval open at the top goes
// to the end of the address space).
func intervalBounds(rs []AddrRange) ([]bound, error) {
	m, err := mergeRanges(rs)
	if err != nil {
		return nil, err
	}
	var out []bound
	for _, r := range m {
		out = append(out, bound{addr: r.First})
		if next := r.Last.Next(); next.IsValid() {
			out = append(out, bound{addr: next, end: true})
		}
	}
	return out, nil
}

// rangesOfBounds reads an interval set's elements back (in any order)
// into merged ranges. An end without a start before it (nft's own
// 0.0.0.0 end element) is no range.
func rangesOfBounds(bs []bound) []AddrRange {
	s := slices.Clone(bs)
	slices.SortFunc(s, func(a, b bound) int {
		if c := a.addr.Compare(b.addr); c != 0 {
			return c
		}
		switch {
		case a.end == b.end:
			return 0
		case a.end:
			return -1 // an interval ends before the next starts at the same address
		}
		return 1
	})
	var out []AddrRange
	var open *netip.Addr
	for _, b := range s {
		switch {
		case !b.end && open == nil:
			a := b.addr
			open = &a
		case b.end && open != nil && open.Less(b.addr):
			out = append(out, AddrRange{First: *open, Last: b.addr.Prev()})
			open = nil
		case b.end:
			open = nil
		}
	}
	if open != nil {
		out = append(out, AddrRange{First: *open, Last: netip.AddrFrom4([4]byte{255, 255, 255, 255})})
	}
	m, _ := mergeRanges(out) // IPv4 and ordered by construction
	return m
}
