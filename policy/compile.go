package policy

import (
	"cmp"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Interval is an inclusive range of IPv4 addresses: what an nftables
// interval set holds.
type Interval struct{ Lo, Hi netip.Addr }

func (iv Interval) contains(a netip.Addr) bool {
	return a.Is4() && iv.Lo.Compare(a) <= 0 && a.Compare(iv.Hi) <= 0
}

// PortRange is a protocol and an inclusive range of destination ports.
type PortRange struct {
	Protocol corev1.Protocol
	Lo, Hi   uint16
}

// Rule lets a connection pass when its peer (the source for ingress, the
// destination for egress) lies in Peers and its protocol and port in
// Ports. AnyPeer and AnyPort stand for "every": a rule without peers or
// without ports in the policy.
type Rule struct {
	AnyPeer bool
	Peers   []Interval // sorted, disjoint, not adjacent
	AnyPort bool
	Ports   []PortRange
	// From is the rule of a policy this rule comes from. The rules of
	// one node with the same From have the same Peers, whichever pod
	// they are for: an enforcer can keep one set of peers for all the
	// pods the policy selects, and change only its elements as pods
	// come and go. The zero Origin says nothing.
	From Origin
}

// Origin is where a Rule comes from: a rule of a policy, in one
// direction. A named port of an egress rule resolves against each
// destination pod: its rules are one per resolution, the ports the
// names resolve to (NamedPorts, e.g. "TCP/8080,UDP/53"), with the pods
// that resolve them so as peers.
type Origin struct {
	Policy     string // namespace/name
	Egress     bool
	Index      int // of the rule in the policy's ingress or egress rules
	NamedPorts string
}

// IsZero reports whether o says nothing.
func (o Origin) IsZero() bool { return o == Origin{} }

func (o Origin) String() string {
	if o.IsZero() {
		return ""
	}
	dir := "ingress"
	if o.Egress {
		dir = "egress"
	}
	s := fmt.Sprintf("%s %s rule %d", o.Policy, dir, o.Index)
	if o.NamedPorts != "" {
		s += " to " + o.NamedPorts
	}
	return s
}

// Direction is what one pod enforces in one direction. A pod that no
// policy isolates lets everything pass; an isolated one only what a rule
// lets pass.
type Direction struct {
	Isolated bool
	Rules    []Rule
	// Policies are the policies that isolate the pod in this direction
	// (namespace/name, in the World's order): what a blocked connection
	// is blocked by.
	Policies []string
}

// PodRules are the rules of one pod of the node.
type PodRules struct {
	Namespace, Name string
	IP              netip.Addr
	Ingress, Egress Direction
}

// NodeRules are the rules a node enforces for its pods, by pod address.
type NodeRules struct {
	Node string
	Pods map[netip.Addr]*PodRules
	// Problems lists what could not be translated (an invalid selector
	// or CIDR, which the API server refuses): such a peer matches nothing.
	Problems []string
}

// Compile translates the policies into the rules that node enforces for
// its pods: the ingress of each pod on it, and the egress of each.
func Compile(w *World, node string) *NodeRules {
	ix := newIndex(w)
	nr := &NodeRules{Node: node, Pods: map[netip.Addr]*PodRules{}}
	ix.check(nr)
	for i := range w.Pods {
		x := &w.Pods[i]
		if x.Node != node || !x.IP.Is4() {
			continue
		}
		pr := &PodRules{Namespace: x.Namespace, Name: x.Name, IP: x.IP}
		for j := range w.Policies {
			p := &w.Policies[j]
			if !ix.selects(p, x) {
				continue
			}
			in, eg := Types(p)
			if in {
				pr.Ingress.Isolated = true
				pr.Ingress.Policies = append(pr.Ingress.Policies, p.Namespace+"/"+p.Name)
				for k, r := range p.Spec.Ingress {
					pr.Ingress.Rules = append(pr.Ingress.Rules, ix.ingressRule(p, k, r.From, r.Ports, x)...)
				}
			}
			if eg {
				pr.Egress.Isolated = true
				pr.Egress.Policies = append(pr.Egress.Policies, p.Namespace+"/"+p.Name)
				for k, r := range p.Spec.Egress {
					pr.Egress.Rules = append(pr.Egress.Rules, ix.egressRules(p, k, r.To, r.Ports)...)
				}
			}
		}
		nr.Pods[x.IP] = pr
	}
	return nr
}

// check reports the selectors and CIDRs that match nothing because they
// are invalid.
func (ix *index) check(nr *NodeRules) {
	for i := range ix.w.Policies {
		p := &ix.w.Policies[i]
		name := p.Namespace + "/" + p.Name
		peers := func(ps []networkingv1.NetworkPolicyPeer) {
			for _, peer := range ps {
				if peer.IPBlock != nil {
					if _, err := netip.ParsePrefix(peer.IPBlock.CIDR); err != nil {
						nr.Problems = append(nr.Problems, fmt.Sprintf("policy %s: ipBlock %q: %v: it matches nothing", name, peer.IPBlock.CIDR, err))
					}
					for _, e := range peer.IPBlock.Except {
						if _, err := netip.ParsePrefix(e); err != nil {
							nr.Problems = append(nr.Problems, fmt.Sprintf("policy %s: ipBlock except %q: %v: it excludes nothing", name, e, err))
						}
					}
				}
				if _, err := selector(peer.PodSelector); err != nil {
					nr.Problems = append(nr.Problems, fmt.Sprintf("policy %s: podSelector: %v: it matches nothing", name, err))
				}
				if _, err := selector(peer.NamespaceSelector); err != nil {
					nr.Problems = append(nr.Problems, fmt.Sprintf("policy %s: namespaceSelector: %v: it matches nothing", name, err))
				}
			}
		}
		for _, r := range p.Spec.Ingress {
			peers(r.From)
		}
		for _, r := range p.Spec.Egress {
			peers(r.To)
		}
	}
}

// peerSet is the addresses the peers of a rule match (any, if none).
func (ix *index) peerSet(p *networkingv1.NetworkPolicy, peers []networkingv1.NetworkPolicyPeer) (any bool, set []Interval) {
	if len(peers) == 0 {
		return true, nil
	}
	if set, ok := ix.peers[&peers[0]]; ok {
		return false, set // the rules of all pods share it: read only
	}
	defer func() { ix.peers[&peers[0]] = set }()
	for _, peer := range peers {
		if peer.IPBlock != nil {
			set = append(set, blockIntervals(peer.IPBlock)...)
			continue
		}
		set = append(set, ix.podPeers(p, peer)...)
	}
	return false, normalize(set)
}

// podPeers is the addresses of the pods that peer (a pod or namespace
// selector of a rule of p) matches, found once per distinct peer: the
// rules of many policies often name the same selectors.
func (ix *index) podPeers(p *networkingv1.NetworkPolicy, peer networkingv1.NetworkPolicyPeer) []Interval {
	key := ix.peerKey(p, peer)
	if set, ok := ix.byPeer[key]; ok {
		return set
	}
	var set []Interval
	for i := range ix.w.Pods {
		x := &ix.w.Pods[i]
		if x.IP.Is4() && ix.peerMatches(p, peer, x.IP, x) {
			set = append(set, Interval{x.IP, x.IP})
		}
	}
	ix.byPeer[key] = set
	return set
}

// peerKey says what a pod or namespace selector peer of p matches: its
// selectors in canonical form (sorted requirements; label keys and
// values cannot hold the brackets), and p's namespace where the peer has
// no namespace selector; "-" for no selector, "!" for an invalid one.
func (ix *index) peerKey(p *networkingv1.NetworkPolicy, peer networkingv1.NetworkPolicyPeer) string {
	sel := func(s *metav1.LabelSelector) string {
		if s == nil {
			return "-"
		}
		parsed, err := ix.selector(s)
		if err != nil {
			return "!"
		}
		return "(" + parsed.String() + ")"
	}
	k := sel(peer.NamespaceSelector) + sel(peer.PodSelector)
	if peer.NamespaceSelector == nil {
		k = p.Namespace + "/" + k
	}
	return k
}

// ingressRule translates ingress rule k of p for pod x: its named ports
// resolve against x's ports; its peers do not depend on x.
func (ix *index) ingressRule(p *networkingv1.NetworkPolicy, k int, from []networkingv1.NetworkPolicyPeer, ports []networkingv1.NetworkPolicyPort, x *Pod) []Rule {
	anyPort, prs := portRanges(ports, x)
	if !anyPort && len(prs) == 0 {
		return nil // only named ports that x does not have
	}
	// Kept when its peers match nothing now: a pod that matches later
	// changes the rule's peers, not the pod's list of rules.
	anyPeer, peers := ix.peerSet(p, from)
	return []Rule{{AnyPeer: anyPeer, Peers: peers, AnyPort: anyPort, Ports: prs, From: Origin{Policy: p.Namespace + "/" + p.Name, Index: k}}}
}

// egressRules translates egress rule k of p. A named port depends on the
// destination pod: the pods that the peers match and that resolve the
// named ports to the same ports get one rule, one per such resolution.
func (ix *index) egressRules(p *networkingv1.NetworkPolicy, k int, to []networkingv1.NetworkPolicyPeer, ports []networkingv1.NetworkPolicyPort) []Rule {
	var numeric, named []networkingv1.NetworkPolicyPort
	for _, pp := range ports {
		if pp.Port != nil && pp.Port.Type != 0 {
			named = append(named, pp)
		} else {
			numeric = append(numeric, pp)
		}
	}
	from := Origin{Policy: p.Namespace + "/" + p.Name, Egress: true, Index: k}
	anyPeer, peers := ix.peerSet(p, to)
	var out []Rule
	if len(ports) == 0 || len(numeric) > 0 {
		anyPort, prs := portRanges(numeric, nil)
		if anyPort || len(prs) > 0 { // kept when its peers match nothing, as in ingressRule
			out = append(out, Rule{AnyPeer: anyPeer, Peers: peers, AnyPort: anyPort, Ports: prs, From: from})
		}
	}
	if len(named) == 0 {
		return out
	}
	byPorts := map[string]*Rule{}
	for i := range ix.w.Pods {
		d := &ix.w.Pods[i]
		if !d.IP.Is4() || !(anyPeer || slices.ContainsFunc(peers, func(iv Interval) bool { return iv.contains(d.IP) })) {
			continue
		}
		_, prs := portRanges(named, d)
		if len(prs) == 0 {
			continue
		}
		prs = normalizePorts(prs)
		key := portsKey(prs)
		r := byPorts[key]
		if r == nil {
			f := from
			f.NamedPorts = key
			r = &Rule{Ports: prs, From: f}
			byPorts[key] = r
		}
		r.Peers = append(r.Peers, Interval{d.IP, d.IP})
	}
	for _, key := range slices.Sorted(maps.Keys(byPorts)) {
		r := byPorts[key]
		r.Peers = normalize(r.Peers)
		out = append(out, *r)
	}
	return out
}

// normalizePorts sorts ports and drops duplicates.
func normalizePorts(ps []PortRange) []PortRange {
	slices.SortFunc(ps, func(a, b PortRange) int {
		return cmp.Or(cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Lo, b.Lo), cmp.Compare(a.Hi, b.Hi))
	})
	return slices.Compact(ps)
}

// portsKey names normalized ports, e.g. "TCP/80,UDP/50-60".
func portsKey(ps []PortRange) string {
	var b strings.Builder
	for i, p := range ps {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s/%d", p.Protocol, p.Lo)
		if p.Hi != p.Lo {
			fmt.Fprintf(&b, "-%d", p.Hi)
		}
	}
	return b.String()
}

// portRanges translates ports; named ones resolve against pod x (none
// when x is nil).
func portRanges(ports []networkingv1.NetworkPolicyPort, x *Pod) (any bool, out []PortRange) {
	if len(ports) == 0 {
		return true, nil
	}
	for _, pp := range ports {
		proto := corev1.ProtocolTCP
		if pp.Protocol != nil {
			proto = *pp.Protocol
		}
		switch {
		case pp.Port == nil:
			out = append(out, PortRange{proto, 0, 65535})
		case pp.Port.Type == 0:
			lo, hi := pp.Port.IntVal, pp.Port.IntVal
			if pp.EndPort != nil && *pp.EndPort >= lo {
				hi = *pp.EndPort
			}
			lo, hi = max(lo, 0), min(hi, 65535)
			if lo <= hi {
				out = append(out, PortRange{proto, uint16(lo), uint16(hi)})
			}
		case x != nil:
			for _, cp := range x.Ports {
				if cp.Name == pp.Port.StrVal && protoOf(cp.Protocol) == proto {
					out = append(out, PortRange{proto, cp.Number, cp.Number})
				}
			}
		}
	}
	return false, out
}

// blockIntervals is b's CIDR minus its excepts, as intervals (IPv4 only).
func blockIntervals(b *networkingv1.IPBlock) []Interval {
	cidr, err := netip.ParsePrefix(b.CIDR)
	if err != nil || !cidr.Addr().Is4() {
		return nil
	}
	set := []Interval{prefixInterval(cidr)}
	for _, e := range b.Except {
		ex, err := netip.ParsePrefix(e)
		if err != nil || !ex.Addr().Is4() {
			continue
		}
		set = subtract(set, prefixInterval(ex))
	}
	return set
}

func prefixInterval(p netip.Prefix) Interval {
	p = p.Masked()
	lo := u32(p.Addr())
	hi := lo | (uint32(1)<<(32-p.Bits()) - 1)
	if p.Bits() == 0 {
		hi = ^uint32(0)
	}
	return Interval{addr(lo), addr(hi)}
}

func u32(a netip.Addr) uint32 {
	b := a.As4()
	return uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
}

func addr(v uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// subtract removes cut from every interval of set.
func subtract(set []Interval, cut Interval) []Interval {
	var out []Interval
	c0, c1 := u32(cut.Lo), u32(cut.Hi)
	for _, iv := range set {
		lo, hi := u32(iv.Lo), u32(iv.Hi)
		if c1 < lo || c0 > hi {
			out = append(out, iv)
			continue
		}
		if c0 > lo {
			out = append(out, Interval{iv.Lo, addr(c0 - 1)})
		}
		if c1 < hi {
			out = append(out, Interval{addr(c1 + 1), iv.Hi})
		}
	}
	return out
}

// normalize sorts and merges overlapping and adjacent intervals (an
// nftables interval set refuses overlapping elements).
func normalize(set []Interval) []Interval {
	if len(set) == 0 {
		return nil
	}
	slices.SortFunc(set, func(a, b Interval) int { return cmp.Compare(u32(a.Lo), u32(b.Lo)) })
	out := []Interval{set[0]}
	for _, iv := range set[1:] {
		last := &out[len(out)-1]
		if u32(last.Hi) == ^uint32(0) || u32(iv.Lo) <= u32(last.Hi)+1 {
			if u32(iv.Hi) > u32(last.Hi) {
				last.Hi = iv.Hi
			}
			continue
		}
		out = append(out, iv)
	}
	return out
}

// allows reports whether d lets a connection with peer address a,
// protocol and port pass.
func (d *Direction) allows(a netip.Addr, proto corev1.Protocol, port uint16) bool {
	if !d.Isolated {
		return true
	}
	for _, r := range d.Rules {
		if !r.AnyPeer && !inIntervals(r.Peers, a) {
			continue
		}
		if r.AnyPort || slices.ContainsFunc(r.Ports, func(pr PortRange) bool {
			return pr.Protocol == proto && pr.Lo <= port && port <= pr.Hi
		}) {
			return true
		}
	}
	return false
}

// inIntervals searches the sorted, disjoint set (as the kernel's interval
// set does).
func inIntervals(set []Interval, a netip.Addr) bool {
	if !a.Is4() {
		return false
	}
	v := u32(a)
	i, _ := slices.BinarySearchFunc(set, v, func(iv Interval, v uint32) int {
		switch {
		case u32(iv.Hi) < v:
			return -1
		case u32(iv.Lo) > v:
			return 1
		}
		return 0
	})
	return i < len(set) && set[i].contains(a)
}

// Ingress reports whether the node lets c into its pod c.Dst (a pod not
// on this node, or not a pod: nothing to enforce here).
func (nr *NodeRules) Ingress(c Conn) bool {
	pr, ok := nr.Pods[c.Dst]
	if !ok || c.FromNode {
		return true
	}
	return pr.Ingress.allows(c.Src, c.Protocol, c.Port)
}

// Egress reports whether the node lets c out of its pod c.Src.
func (nr *NodeRules) Egress(c Conn) bool {
	pr, ok := nr.Pods[c.Src]
	if !ok {
		return true
	}
	return pr.Egress.allows(c.Dst, c.Protocol, c.Port)
}
