package policy

import (
	"fmt"
	"net/netip"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

func ptr[T any](v T) *T { return &v }

func tcp() *corev1.Protocol { return ptr(corev1.ProtocolTCP) }
func udp() *corev1.Protocol { return ptr(corev1.ProtocolUDP) }

func pol(ns, name string, spec networkingv1.NetworkPolicySpec) networkingv1.NetworkPolicy {
	return networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: spec}
}

func sel(kv ...string) *metav1.LabelSelector {
	s := &metav1.LabelSelector{MatchLabels: map[string]string{}}
	for i := 0; i+1 < len(kv); i += 2 {
		s.MatchLabels[kv[i]] = kv[i+1]
	}
	return s
}

func ip(s string) netip.Addr { return netip.MustParseAddr(s) }

// exampleWorld: namespaces prod (team=a) and dev (team=b); pods web and db
// in prod, tool in dev, on two nodes.
func exampleWorld(policies ...networkingv1.NetworkPolicy) *World {
	return &World{
		Namespaces: []Namespace{{"prod", map[string]string{"team": "a"}}, {"dev", map[string]string{"team": "b"}}},
		Pods: []Pod{
			{Namespace: "prod", Name: "web", Labels: map[string]string{"app": "web"}, IP: ip("10.32.0.2"), Node: "n1",
				Ports: []Port{{"http", corev1.ProtocolTCP, 8080}}},
			{Namespace: "prod", Name: "db", Labels: map[string]string{"app": "db"}, IP: ip("10.32.0.3"), Node: "n1",
				Ports: []Port{{"pg", corev1.ProtocolTCP, 5432}}},
			{Namespace: "dev", Name: "tool", Labels: map[string]string{"app": "web"}, IP: ip("10.40.0.2"), Node: "n2"},
		},
		Policies: policies,
	}
}

// check compares the model and the compiled rules of every node for c,
// and the model with want.
func check(t *testing.T, w *World, c Conn, want bool) {
	t.Helper()
	if got := Allowed(w, c); got != want {
		t.Errorf("model: %s allowed=%v, want %v", c, got, want)
	}
	if got := compiledAllowed(w, c); got != want {
		t.Errorf("compiled: %s allowed=%v, want %v", c, got, want)
	}
}

// compiledAllowed evaluates c as the nodes would: egress on the source's
// node, ingress on the destination's.
func compiledAllowed(w *World, c Conn) bool { return compiledAllowedIn(w, map[string]*NodeRules{}, c) }

// compiledAllowedIn is compiledAllowed with the nodes' rules cached.
func compiledAllowedIn(w *World, nodes map[string]*NodeRules, c Conn) bool {
	rules := func(n string) *NodeRules {
		if nodes[n] == nil {
			nodes[n] = Compile(w, n)
		}
		return nodes[n]
	}
	ok := true
	for _, x := range w.Pods {
		if x.IP == c.Src {
			ok = ok && rules(x.Node).Egress(c)
		}
		if x.IP == c.Dst {
			ok = ok && rules(x.Node).Ingress(c)
		}
	}
	return ok
}

func TestSemantics(t *testing.T) {
	web, db, tool := ip("10.32.0.2"), ip("10.32.0.3"), ip("10.40.0.2")
	outside := ip("192.0.2.7")
	conn := func(src, dst netip.Addr, port uint16) Conn {
		return Conn{Src: src, Dst: dst, Protocol: corev1.ProtocolTCP, Port: port}
	}
	t.Run("no policy: everything", func(t *testing.T) {
		w := exampleWorld()
		check(t, w, conn(tool, db, 5432), true)
		check(t, w, conn(outside, web, 1), true)
	})
	denyAll := pol("prod", "deny", networkingv1.NetworkPolicySpec{PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}})
	t.Run("default deny ingress", func(t *testing.T) {
		w := exampleWorld(denyAll)
		check(t, w, conn(web, db, 5432), false)
		check(t, w, conn(tool, web, 8080), false)
		check(t, w, conn(web, tool, 80), true) // dev is not isolated; prod's egress is not
		c := conn(ip("10.32.255.254"), db, 5432)
		c.FromNode = true
		check(t, w, c, true) // the node's own probes
	})
	t.Run("podSelector in own namespace", func(t *testing.T) {
		w := exampleWorld(denyAll, pol("prod", "db-from-web", networkingv1.NetworkPolicySpec{
			PodSelector: *sel("app", "db"),
			Ingress: []networkingv1.NetworkPolicyIngressRule{{
				From:  []networkingv1.NetworkPolicyPeer{{PodSelector: sel("app", "web")}},
				Ports: []networkingv1.NetworkPolicyPort{{Protocol: tcp(), Port: ptr(intstr.FromInt32(5432))}},
			}},
		}))
		check(t, w, conn(web, db, 5432), true)
		check(t, w, conn(web, db, 5433), false)
		check(t, w, conn(tool, db, 5432), false) // app=web, but in dev
		check(t, w, Conn{Src: web, Dst: db, Protocol: corev1.ProtocolUDP, Port: 5432}, false)
	})
	t.Run("namespaceSelector and both", func(t *testing.T) {
		nsOnly := pol("prod", "from-dev", networkingv1.NetworkPolicySpec{
			PodSelector: *sel("app", "web"),
			Ingress:     []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{NamespaceSelector: sel("team", "b")}}}},
		})
		w := exampleWorld(nsOnly)
		check(t, w, conn(tool, web, 8080), true)
		check(t, w, conn(db, web, 8080), false)
		both := pol("prod", "from-dev-db", networkingv1.NetworkPolicySpec{
			PodSelector: *sel("app", "web"),
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{
				{NamespaceSelector: sel("team", "b"), PodSelector: sel("app", "db")}}}},
		})
		w = exampleWorld(both)
		check(t, w, conn(tool, web, 8080), false) // tool is app=web
	})
	t.Run("ipBlock with except", func(t *testing.T) {
		w := exampleWorld(pol("prod", "ext", networkingv1.NetworkPolicySpec{
			PodSelector: *sel("app", "web"),
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{
				{IPBlock: &networkingv1.IPBlock{CIDR: "192.0.2.0/24", Except: []string{"192.0.2.0/30"}}}}}},
		}))
		check(t, w, conn(outside, web, 8080), true)
		check(t, w, conn(ip("192.0.2.2"), web, 8080), false)
		check(t, w, conn(tool, web, 8080), false)
	})
	t.Run("named port and endPort", func(t *testing.T) {
		w := exampleWorld(pol("prod", "named", networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{Ports: []networkingv1.NetworkPolicyPort{
				{Port: ptr(intstr.FromString("http"))},
				{Protocol: udp(), Port: ptr(intstr.FromInt32(53)), EndPort: ptr(int32(60))},
			}}},
		}))
		check(t, w, conn(tool, web, 8080), true)
		check(t, w, conn(tool, db, 8080), false) // db has no port named http
		check(t, w, Conn{Src: tool, Dst: db, Protocol: corev1.ProtocolUDP, Port: 57}, true)
		check(t, w, Conn{Src: tool, Dst: db, Protocol: corev1.ProtocolUDP, Port: 61}, false)
	})
	t.Run("egress", func(t *testing.T) {
		w := exampleWorld(pol("prod", "egress", networkingv1.NetworkPolicySpec{
			PodSelector: *sel("app", "web"),
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress},
			Egress: []networkingv1.NetworkPolicyEgressRule{{
				To:    []networkingv1.NetworkPolicyPeer{{PodSelector: sel("app", "db")}},
				Ports: []networkingv1.NetworkPolicyPort{{Port: ptr(intstr.FromString("pg"))}},
			}},
		}))
		check(t, w, conn(web, db, 5432), true)
		check(t, w, conn(web, db, 5433), false)
		check(t, w, conn(web, tool, 80), false)
		check(t, w, conn(web, outside, 443), false)
		check(t, w, conn(db, web, 8080), true) // web's ingress is not isolated
	})
	t.Run("policies add up", func(t *testing.T) {
		a := pol("prod", "a", networkingv1.NetworkPolicySpec{PodSelector: *sel("app", "db"),
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{PodSelector: sel("app", "web")}}}}})
		b := pol("prod", "b", networkingv1.NetworkPolicySpec{PodSelector: *sel("app", "db"),
			Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{{NamespaceSelector: sel("team", "b")}}}}})
		w := exampleWorld(denyAll, a, b)
		check(t, w, conn(web, db, 1), true)
		check(t, w, conn(tool, db, 1), true)
		check(t, w, conn(outside, db, 1), false)
	})
}

func TestIntervals(t *testing.T) {
	b := &networkingv1.IPBlock{CIDR: "10.0.0.0/24", Except: []string{"10.0.0.0/30", "10.0.0.128/25", "10.0.0.10/32"}}
	got := blockIntervals(b)
	want := []Interval{{ip("10.0.0.4"), ip("10.0.0.9")}, {ip("10.0.0.11"), ip("10.0.0.127")}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	all := blockIntervals(&networkingv1.IPBlock{CIDR: "0.0.0.0/0"})
	if len(all) != 1 || all[0].Lo != ip("0.0.0.0") || all[0].Hi != ip("255.255.255.255") {
		t.Fatalf("0.0.0.0/0: %v", all)
	}
	n := normalize([]Interval{{ip("10.0.0.5"), ip("10.0.0.9")}, {ip("10.0.0.1"), ip("10.0.0.4")}, {ip("10.0.0.7"), ip("10.0.0.20")}, {ip("10.0.1.0"), ip("10.0.1.0")}})
	if fmt.Sprint(n) != fmt.Sprint([]Interval{{ip("10.0.0.1"), ip("10.0.0.20")}, {ip("10.0.1.0"), ip("10.0.1.0")}}) {
		t.Fatalf("normalize: %v", n)
	}
	if bad := blockIntervals(&networkingv1.IPBlock{CIDR: "not a cidr"}); bad != nil {
		t.Fatalf("an invalid CIDR gave %v", bad)
	}
}

func TestProblemsReported(t *testing.T) {
	w := exampleWorld(pol("prod", "bad", networkingv1.NetworkPolicySpec{
		Ingress: []networkingv1.NetworkPolicyIngressRule{{From: []networkingv1.NetworkPolicyPeer{
			{IPBlock: &networkingv1.IPBlock{CIDR: "10.0.0.0/33"}},
			{PodSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "a", Operator: "Bogus"}}}},
		}}},
	}))
	nr := Compile(w, "n1")
	if len(nr.Problems) != 2 {
		t.Fatalf("problems: %q, want the CIDR and the selector", nr.Problems)
	}
	check(t, w, Conn{Src: ip("10.0.0.1"), Dst: ip("10.32.0.2"), Protocol: corev1.ProtocolTCP, Port: 80}, false)
}

// TestEgressNamedPortsByResolution: the destination pods of an egress
// rule with a named port get one rule per port the name resolves to,
// with all those pods as its peers.
func TestEgressNamedPortsByResolution(t *testing.T) {
	w := exampleWorld(pol("prod", "to-http", networkingv1.NetworkPolicySpec{
		PodSelector: *sel("app", "db"),
		PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress},
		Egress:      []networkingv1.NetworkPolicyEgressRule{{Ports: []networkingv1.NetworkPolicyPort{{Port: ptr(intstr.FromString("http"))}}}},
	}))
	w.Pods = append(w.Pods,
		Pod{Namespace: "dev", Name: "web2", IP: ip("10.40.0.3"), Node: "n2", Ports: []Port{{"http", corev1.ProtocolTCP, 8080}}},
		Pod{Namespace: "dev", Name: "web3", IP: ip("10.40.0.4"), Node: "n2", Ports: []Port{{"http", "", 80}}})
	rules := Compile(w, "n1").Pods[ip("10.32.0.3")].Egress.Rules
	want := []Rule{
		{Peers: []Interval{{ip("10.40.0.4"), ip("10.40.0.4")}}, Ports: []PortRange{{corev1.ProtocolTCP, 80, 80}},
			From: Origin{Policy: "prod/to-http", Egress: true, NamedPorts: "TCP/80"}},
		{Peers: []Interval{{ip("10.32.0.2"), ip("10.32.0.2")}, {ip("10.40.0.3"), ip("10.40.0.3")}}, Ports: []PortRange{{corev1.ProtocolTCP, 8080, 8080}},
			From: Origin{Policy: "prod/to-http", Egress: true, NamedPorts: "TCP/8080"}},
	}
	if fmt.Sprint(rules) != fmt.Sprint(want) {
		t.Fatalf("rules %+v\nwant  %+v", rules, want)
	}
	check(t, w, Conn{Src: ip("10.32.0.3"), Dst: ip("10.40.0.3"), Protocol: corev1.ProtocolTCP, Port: 8080}, true)
	check(t, w, Conn{Src: ip("10.32.0.3"), Dst: ip("10.40.0.3"), Protocol: corev1.ProtocolTCP, Port: 80}, false)
	check(t, w, Conn{Src: ip("10.32.0.3"), Dst: ip("10.40.0.4"), Protocol: corev1.ProtocolTCP, Port: 80}, true)
}
