// Package policy computes what Kubernetes NetworkPolicies allow: a naive
// model that answers for one connection straight from the API's rules
// (Allowed), and the translation of the policies into the per-pod rules a
// node enforces (Compile), made of address intervals and port ranges that
// map one to one onto nftables interval sets and verdicts. The two are
// kept apart on purpose: the tests check, for random pods, namespaces and
// policies, that the compiled rules allow exactly what the model allows.
//
// Semantics, as networking.k8s.io/v1 defines them (and the upstream e2e
// suite tests them):
//
//   - A policy selects the pods of its own namespace that match its
//     podSelector (empty: all of them).
//   - policyTypes: as listed; if empty, Ingress, plus Egress when the
//     policy has egress rules.
//   - A pod selected by no policy of a type is not isolated for that
//     direction: everything is allowed. A pod selected by one or more is
//     isolated: only what some rule of some selecting policy allows passes.
//     Policies add up; none denies what another allows.
//   - A rule with no peers matches every peer; a rule with no ports
//     matches every port. A peer is an ipBlock (CIDR minus its excepts,
//     matched against any address, pods' too), or pods: podSelector alone
//     in the policy's namespace, namespaceSelector alone (all pods of the
//     matching namespaces), or both (matching pods in matching
//     namespaces).
//   - A port: protocol (TCP if not given), a number with an optional
//     endPort, a name (resolved against the destination pod's container
//     ports), or no port (every port of that protocol).
//   - A connection passes if the source's egress allows it and the
//     destination's ingress allows it. Traffic from the destination pod's
//     own node (kubelet probes) always passes ingress.
//
// Only IPv4 is modelled: weft's pod range is IPv4; an IPv6 ipBlock matches
// no address.
package policy

import (
	"fmt"
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// Port is a container port of a pod (for named ports).
type Port struct {
	Name     string
	Protocol corev1.Protocol
	Number   uint16
}

// Pod is what the policies need to know of a pod.
type Pod struct {
	Namespace string
	Name      string
	Labels    map[string]string
	IP        netip.Addr
	Node      string
	Ports     []Port
}

// Namespace is a namespace and its labels.
type Namespace struct {
	Name   string
	Labels map[string]string
}

// World is the cluster as the policies see it.
type World struct {
	Namespaces []Namespace
	Pods       []Pod
	Policies   []networkingv1.NetworkPolicy
}

// Conn is one connection attempt: from Src to Dst, protocol and
// destination port. FromNode is set when Src is the address of Dst's own
// node (a kubelet probe, hostNetwork).
type Conn struct {
	Src, Dst netip.Addr
	Protocol corev1.Protocol
	Port     uint16
	FromNode bool
}

func (c Conn) String() string {
	return fmt.Sprintf("%s %s -> %s:%d", c.Protocol, c.Src, c.Dst, c.Port)
}

// index gives fast lookups of pods by address and namespaces by name,
// and keeps what a compile would otherwise compute again for every pod:
// the selectors parsed (a LabelSelector's conversion validates every key
// and value with regular expressions) and the peers of each rule. One
// compile or one model check uses it, from one goroutine.
type index struct {
	w      *World
	byIP   map[netip.Addr]*Pod
	nsLab  map[string]labels.Set
	sels   map[*metav1.LabelSelector]parsedSelector
	peers  map[*networkingv1.NetworkPolicyPeer][]Interval // by the rule's first peer
	byPeer map[string][]Interval                          // by peerKey
}

type parsedSelector struct {
	sel labels.Selector
	err error
}

func newIndex(w *World) *index {
	ix := &index{w: w, byIP: map[netip.Addr]*Pod{}, nsLab: map[string]labels.Set{},
		sels: map[*metav1.LabelSelector]parsedSelector{}, peers: map[*networkingv1.NetworkPolicyPeer][]Interval{}, byPeer: map[string][]Interval{}}
	for i := range w.Pods {
		ix.byIP[w.Pods[i].IP] = &w.Pods[i]
	}
	for _, ns := range w.Namespaces {
		ix.nsLab[ns.Name] = labels.Set(ns.Labels)
	}
	return ix
}

// selector converts a label selector; an invalid one matches nothing (the
// API server refuses it; a watch could still deliver it from an older
// server) and is reported by Compile.
func selector(s *metav1.LabelSelector) (labels.Selector, error) {
	if s == nil {
		return labels.Nothing(), nil
	}
	sel, err := metav1.LabelSelectorAsSelector(s)
	if err != nil {
		return labels.Nothing(), err
	}
	return sel, nil
}

// Types returns the directions a policy applies to.
func Types(p *networkingv1.NetworkPolicy) (ingress, egress bool) {
	if len(p.Spec.PolicyTypes) == 0 {
		return true, len(p.Spec.Egress) > 0
	}
	for _, t := range p.Spec.PolicyTypes {
		switch t {
		case networkingv1.PolicyTypeIngress:
			ingress = true
		case networkingv1.PolicyTypeEgress:
			egress = true
		}
	}
	return ingress, egress
}

// selector is selector(s), parsed once per index.
func (ix *index) selector(s *metav1.LabelSelector) (labels.Selector, error) {
	if s == nil {
		return labels.Nothing(), nil
	}
	if ps, ok := ix.sels[s]; ok {
		return ps.sel, ps.err
	}
	sel, err := selector(s)
	ix.sels[s] = parsedSelector{sel, err}
	return sel, err
}

// selects reports whether policy p selects pod x.
func (ix *index) selects(p *networkingv1.NetworkPolicy, x *Pod) bool {
	if x.Namespace != p.Namespace {
		return false
	}
	sel, err := ix.selector(&p.Spec.PodSelector)
	return err == nil && sel.Matches(labels.Set(x.Labels))
}

// peerMatches reports whether peer (of a rule of policy p) matches the
// address a, which is pod x if x is not nil.
func (ix *index) peerMatches(p *networkingv1.NetworkPolicy, peer networkingv1.NetworkPolicyPeer, a netip.Addr, x *Pod) bool {
	if peer.IPBlock != nil {
		return inBlock(peer.IPBlock, a)
	}
	if x == nil || (peer.PodSelector == nil && peer.NamespaceSelector == nil) {
		return false
	}
	if peer.NamespaceSelector == nil {
		if x.Namespace != p.Namespace {
			return false
		}
	} else {
		nsSel, err := ix.selector(peer.NamespaceSelector)
		if err != nil || !nsSel.Matches(ix.nsLab[x.Namespace]) {
			return false
		}
	}
	if peer.PodSelector == nil {
		return true
	}
	podSel, err := ix.selector(peer.PodSelector)
	return err == nil && podSel.Matches(labels.Set(x.Labels))
}

// inBlock reports whether a lies in b's CIDR and in none of its excepts.
func inBlock(b *networkingv1.IPBlock, a netip.Addr) bool {
	cidr, err := netip.ParsePrefix(b.CIDR)
	if err != nil || !cidr.Masked().Contains(a) {
		return false
	}
	for _, e := range b.Except {
		ex, err := netip.ParsePrefix(e)
		if err == nil && ex.Masked().Contains(a) {
			return false
		}
	}
	return true
}

// portMatches reports whether ports (of a rule) match the connection's
// protocol and port at destination dst (nil: not a pod).
func portMatches(ports []networkingv1.NetworkPolicyPort, proto corev1.Protocol, port uint16, dst *Pod) bool {
	if len(ports) == 0 {
		return true
	}
	for _, pp := range ports {
		want := corev1.ProtocolTCP
		if pp.Protocol != nil {
			want = *pp.Protocol
		}
		if want != proto {
			continue
		}
		if pp.Port == nil {
			return true
		}
		if pp.Port.Type == 0 { // a number
			lo := pp.Port.IntVal
			hi := lo
			if pp.EndPort != nil && *pp.EndPort >= lo {
				hi = *pp.EndPort
			}
			if int32(port) >= lo && int32(port) <= hi {
				return true
			}
			continue
		}
		if dst == nil {
			continue
		}
		for _, cp := range dst.Ports {
			if cp.Name == pp.Port.StrVal && protoOf(cp.Protocol) == proto && cp.Number == port {
				return true
			}
		}
	}
	return false
}

func protoOf(p corev1.Protocol) corev1.Protocol {
	if p == "" {
		return corev1.ProtocolTCP
	}
	return p
}

// Allowed answers, straight from the rules, whether the policies let c
// pass. It is the model the compiled rules are checked against: slow and
// plain on purpose.
func Allowed(w *World, c Conn) bool {
	ix := newIndex(w)
	src, dst := ix.byIP[c.Src], ix.byIP[c.Dst]
	if dst != nil && !c.FromNode && !ix.allows(dst, false, c.Src, src, c, dst) {
		return false
	}
	return src == nil || ix.allows(src, true, c.Dst, dst, c, dst)
}

// allows reports whether the policies that select pod x in one direction
// (egress: x sends; ingress: x receives) let c pass, its peer being the
// address peer (pod peerPod, if it is one) and its destination pod dst
// (for named ports). A pod no such policy selects is not isolated.
func (ix *index) allows(x *Pod, egress bool, peer netip.Addr, peerPod *Pod, c Conn, dst *Pod) bool {
	isolated := false
	for i := range ix.w.Policies {
		p := &ix.w.Policies[i]
		in, eg := Types(p)
		if (egress && !eg) || (!egress && !in) || !ix.selects(p, x) {
			continue
		}
		isolated = true
		rules := len(p.Spec.Ingress)
		if egress {
			rules = len(p.Spec.Egress)
		}
		for j := range rules {
			peers, ports := ruleOf(p, egress, j)
			if !portMatches(ports, c.Protocol, c.Port, dst) {
				continue
			}
			if len(peers) == 0 {
				return true
			}
			for _, pe := range peers {
				if ix.peerMatches(p, pe, peer, peerPod) {
					return true
				}
			}
		}
	}
	return !isolated
}

// ruleOf returns the peers and ports of p's j-th rule in one direction.
func ruleOf(p *networkingv1.NetworkPolicy, egress bool, j int) ([]networkingv1.NetworkPolicyPeer, []networkingv1.NetworkPolicyPort) {
	if egress {
		return p.Spec.Egress[j].To, p.Spec.Egress[j].Ports
	}
	return p.Spec.Ingress[j].From, p.Spec.Ingress[j].Ports
}
