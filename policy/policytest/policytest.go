// Package policytest makes random clusters and NetworkPolicies for the
// tests that check the policy translation against its model (package
// policy) and the kernel's enforcement against the translation (package
// bridge): both draw their worlds from here, so a world that breaks one
// can be replayed in the other.
package policytest

import (
	"fmt"
	"math/rand/v2"
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/weft-net/weft/policy"
)

// Spot is where a pod of a random world is: its address and its node.
type Spot struct {
	IP   netip.Addr
	Node string
}

// World makes a random cluster with a pod at each spot (its namespace,
// labels and named container ports drawn), three namespaces over few
// labels, and up to maxPolicies-1 policies with podSelectors,
// namespaceSelectors, both, ipBlocks with excepts, numbered, ranged and
// named ports, and every policyTypes: few enough labels and values that
// selectors often match and often do not.
func World(r *rand.Rand, spots []Spot, maxPolicies int) *policy.World {
	pick := func(xs ...string) string { return xs[r.IntN(len(xs))] }
	labelsOf := func() map[string]string {
		m := map[string]string{}
		for _, k := range []string{"app", "tier"} {
			if r.IntN(3) > 0 {
				m[k] = pick("x", "y", "z")
			}
		}
		return m
	}
	selOf := func() *metav1.LabelSelector {
		s := &metav1.LabelSelector{}
		switch r.IntN(4) {
		case 0: // empty: matches all
		case 1:
			s.MatchLabels = map[string]string{"app": pick("x", "y", "z")}
		case 2:
			s.MatchExpressions = []metav1.LabelSelectorRequirement{{Key: "tier", Operator: metav1.LabelSelectorOpIn, Values: []string{pick("x", "y", "z"), "y"}}}
		case 3:
			s.MatchExpressions = []metav1.LabelSelectorRequirement{{Key: "app", Operator: metav1.LabelSelectorOpDoesNotExist}}
		}
		return s
	}
	w := &policy.World{}
	nss := []string{"a", "b", "c"}
	for _, n := range nss {
		w.Namespaces = append(w.Namespaces, policy.Namespace{Name: n, Labels: labelsOf()})
	}
	for i, s := range spots {
		x := policy.Pod{Namespace: pick(nss...), Name: fmt.Sprintf("p%d", i), Labels: labelsOf(), IP: s.IP, Node: s.Node}
		for _, pn := range []policy.Port{{Name: "http", Protocol: corev1.ProtocolTCP, Number: 80}, {Name: "http", Protocol: corev1.ProtocolTCP, Number: 8080},
			{Name: "dns", Protocol: corev1.ProtocolUDP, Number: 53}, {Name: "dns", Number: 53}} {
			if r.IntN(3) == 0 {
				x.Ports = append(x.Ports, pn)
			}
		}
		w.Pods = append(w.Pods, x)
	}
	peerOf := func() networkingv1.NetworkPolicyPeer {
		switch r.IntN(4) {
		case 0:
			b := &networkingv1.IPBlock{CIDR: pick("10.32.0.0/16", "10.32.1.0/24", "10.32.0.4/30", "0.0.0.0/0", "192.0.2.0/24", "198.51.100.7/32")}
			if r.IntN(2) == 0 {
				b.Except = append(b.Except, pick("10.32.0.0/29", "10.32.1.4/31", "10.32.0.5/32", "192.0.2.8/30"))
			}
			return networkingv1.NetworkPolicyPeer{IPBlock: b}
		case 1:
			return networkingv1.NetworkPolicyPeer{PodSelector: selOf()}
		case 2:
			return networkingv1.NetworkPolicyPeer{NamespaceSelector: selOf()}
		}
		return networkingv1.NetworkPolicyPeer{PodSelector: selOf(), NamespaceSelector: selOf()}
	}
	proto := func(p corev1.Protocol) *corev1.Protocol { return &p }
	portsOf := func() []networkingv1.NetworkPolicyPort {
		var out []networkingv1.NetworkPolicyPort
		for range r.IntN(3) {
			pp := networkingv1.NetworkPolicyPort{}
			switch r.IntN(3) {
			case 1:
				pp.Protocol = proto(corev1.ProtocolUDP)
			case 2:
				pp.Protocol = proto(corev1.ProtocolTCP)
			}
			switch r.IntN(4) {
			case 0:
				v := intstr.FromInt32([]int32{53, 80, 8080}[r.IntN(3)])
				pp.Port = &v
			case 1:
				v := intstr.FromString(pick("http", "dns", "none"))
				pp.Port = &v
			case 2:
				v := intstr.FromInt32(50)
				end := []int32{60, 90, 40}[r.IntN(3)]
				pp.Port, pp.EndPort = &v, &end
			}
			out = append(out, pp)
		}
		return out
	}
	for i := range r.IntN(maxPolicies) {
		spec := networkingv1.NetworkPolicySpec{PodSelector: *selOf()}
		switch r.IntN(4) {
		case 1:
			spec.PolicyTypes = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}
		case 2:
			spec.PolicyTypes = []networkingv1.PolicyType{networkingv1.PolicyTypeEgress}
		case 3:
			spec.PolicyTypes = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress}
		}
		for range r.IntN(3) {
			rule := networkingv1.NetworkPolicyIngressRule{Ports: portsOf()}
			for range r.IntN(3) {
				rule.From = append(rule.From, peerOf())
			}
			spec.Ingress = append(spec.Ingress, rule)
		}
		for range r.IntN(3) {
			rule := networkingv1.NetworkPolicyEgressRule{Ports: portsOf()}
			for range r.IntN(3) {
				rule.To = append(rule.To, peerOf())
			}
			spec.Egress = append(spec.Egress, rule)
		}
		w.Policies = append(w.Policies, networkingv1.NetworkPolicy{
			ObjectMeta: metav1.ObjectMeta{Namespace: pick(nss...), Name: fmt.Sprintf("np%d", i)}, Spec: spec})
	}
	return w
}
